from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GatewayServiceGenerateRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_ids", "params", "session_id", "num_speculative_tokens", "cache_salt", "messages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    session_id: str
    num_speculative_tokens: int
    cache_salt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class GatewayServiceGenerateStreamRequest(_message.Message):
    __slots__ = ("model", "prompt", "prompt_ids", "params", "session_id", "num_speculative_tokens", "cache_salt", "messages")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    model: str
    prompt: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    session_id: str
    num_speculative_tokens: int
    cache_salt: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, model: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., session_id: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class GatewayServiceGenerateResponse(_message.Message):
    __slots__ = ("text", "token_ids", "finish_reason", "usage", "stats", "failovers", "target_only", "logprobs", "session_id", "speculative_decoding", "handed_off")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    FAILOVERS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_DECODING_FIELD_NUMBER: _ClassVar[int]
    HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    usage: Usage
    stats: _common_pb2.SpecStats
    failovers: int
    target_only: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    session_id: str
    speculative_decoding: SpeculativeDecodingMetrics
    handed_off: bool
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ..., failovers: _Optional[int] = ..., target_only: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., session_id: _Optional[str] = ..., speculative_decoding: _Optional[_Union[SpeculativeDecodingMetrics, _Mapping]] = ..., handed_off: _Optional[bool] = ...) -> None: ...

class SpeculativeDecodingMetrics(_message.Message):
    __slots__ = ("num_spec_tokens", "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "acceptance_histogram_by_draft_length", "per_step_accepted", "per_step_drafted")
    class AcceptanceHistogramByDraftLengthEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: _common_pb2.AcceptanceCounts
        def __init__(self, key: _Optional[int] = ..., value: _Optional[_Union[_common_pb2.AcceptanceCounts, _Mapping]] = ...) -> None: ...
    NUM_SPEC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPEC_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ACCEPTANCE_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DRAFT_ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_HISTOGRAM_FIELD_NUMBER: _ClassVar[int]
    ACCEPTANCE_HISTOGRAM_BY_DRAFT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PER_STEP_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PER_STEP_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    num_spec_tokens: int
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: _containers.RepeatedScalarFieldContainer[int]
    acceptance_histogram_by_draft_length: _containers.MessageMap[int, _common_pb2.AcceptanceCounts]
    per_step_accepted: _containers.RepeatedScalarFieldContainer[int]
    per_step_drafted: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_spec_tokens: _Optional[int] = ..., num_spec_steps: _Optional[int] = ..., num_draft_tokens: _Optional[int] = ..., num_accepted_draft_tokens: _Optional[int] = ..., mean_acceptance_length: _Optional[float] = ..., draft_acceptance_rate: _Optional[float] = ..., acceptance_histogram: _Optional[_Iterable[int]] = ..., acceptance_histogram_by_draft_length: _Optional[_Mapping[int, _common_pb2.AcceptanceCounts]] = ..., per_step_accepted: _Optional[_Iterable[int]] = ..., per_step_drafted: _Optional[_Iterable[int]] = ...) -> None: ...

class GatewayServiceGenerateStreamResponse(_message.Message):
    __slots__ = ("delta", "finished")
    class Delta(_message.Message):
        __slots__ = ("text", "token_ids", "logprobs")
        TEXT_FIELD_NUMBER: _ClassVar[int]
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        LOGPROBS_FIELD_NUMBER: _ClassVar[int]
        text: str
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
        def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...
    class Finished(_message.Message):
        __slots__ = ("text", "token_ids", "finish_reason", "usage", "stats", "failovers", "target_only", "logprobs", "session_id", "speculative_decoding", "handed_off")
        TEXT_FIELD_NUMBER: _ClassVar[int]
        TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
        FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
        USAGE_FIELD_NUMBER: _ClassVar[int]
        STATS_FIELD_NUMBER: _ClassVar[int]
        FAILOVERS_FIELD_NUMBER: _ClassVar[int]
        TARGET_ONLY_FIELD_NUMBER: _ClassVar[int]
        LOGPROBS_FIELD_NUMBER: _ClassVar[int]
        SESSION_ID_FIELD_NUMBER: _ClassVar[int]
        SPECULATIVE_DECODING_FIELD_NUMBER: _ClassVar[int]
        HANDED_OFF_FIELD_NUMBER: _ClassVar[int]
        text: str
        token_ids: _containers.RepeatedScalarFieldContainer[int]
        finish_reason: _common_pb2.FinishReason
        usage: Usage
        stats: _common_pb2.SpecStats
        failovers: int
        target_only: bool
        logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
        session_id: str
        speculative_decoding: SpeculativeDecodingMetrics
        handed_off: bool
        def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., stats: _Optional[_Union[_common_pb2.SpecStats, _Mapping]] = ..., failovers: _Optional[int] = ..., target_only: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., session_id: _Optional[str] = ..., speculative_decoding: _Optional[_Union[SpeculativeDecodingMetrics, _Mapping]] = ..., handed_off: _Optional[bool] = ...) -> None: ...
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    delta: GatewayServiceGenerateStreamResponse.Delta
    finished: GatewayServiceGenerateStreamResponse.Finished
    def __init__(self, delta: _Optional[_Union[GatewayServiceGenerateStreamResponse.Delta, _Mapping]] = ..., finished: _Optional[_Union[GatewayServiceGenerateStreamResponse.Finished, _Mapping]] = ...) -> None: ...
