from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class OpenSessionRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "params", "cache_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    cache_scope: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class OpenSessionResponse(_message.Message):
    __slots__ = ("session_id", "epoch", "base_position", "cached_prompt_tokens", "prefill_seconds", "target_only_runs", "chained_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_POSITION_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_RUNS_FIELD_NUMBER: _ClassVar[int]
    CHAINED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    base_position: int
    cached_prompt_tokens: int
    prefill_seconds: float
    target_only_runs: bool
    chained_blocks: bool
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base_position: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ..., prefill_seconds: _Optional[float] = ..., target_only_runs: _Optional[bool] = ..., chained_blocks: _Optional[bool] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "epoch", "base_position", "draft_ids", "q_ids", "q_probs", "q_width", "target_only_steps", "chained_after")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    BASE_POSITION_FIELD_NUMBER: _ClassVar[int]
    DRAFT_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_IDS_FIELD_NUMBER: _ClassVar[int]
    Q_PROBS_FIELD_NUMBER: _ClassVar[int]
    Q_WIDTH_FIELD_NUMBER: _ClassVar[int]
    TARGET_ONLY_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHAINED_AFTER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    epoch: int
    base_position: int
    draft_ids: _containers.RepeatedScalarFieldContainer[int]
    q_ids: _containers.RepeatedScalarFieldContainer[int]
    q_probs: _containers.RepeatedScalarFieldContainer[float]
    q_width: int
    target_only_steps: int
    chained_after: int
    def __init__(self, session_id: _Optional[str] = ..., epoch: _Optional[int] = ..., base_position: _Optional[int] = ..., draft_ids: _Optional[_Iterable[int]] = ..., q_ids: _Optional[_Iterable[int]] = ..., q_probs: _Optional[_Iterable[float]] = ..., q_width: _Optional[int] = ..., target_only_steps: _Optional[int] = ..., chained_after: _Optional[int] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("epoch", "num_drafted", "num_accepted", "token_ids", "finish_reason", "stale", "deadline", "timings", "logprobs")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFTED_FIELD_NUMBER: _ClassVar[int]
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STALE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    num_drafted: int
    num_accepted: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: _common_pb2.FinishReason
    stale: bool
    deadline: bool
    timings: VerifyTimings
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, epoch: _Optional[int] = ..., num_drafted: _Optional[int] = ..., num_accepted: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[_common_pb2.FinishReason, str]] = ..., stale: _Optional[bool] = ..., deadline: _Optional[bool] = ..., timings: _Optional[_Union[VerifyTimings, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyTimings(_message.Message):
    __slots__ = ("queue_seconds", "batch_seconds", "batch_size", "batch_tokens", "queue_depth")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    batch_seconds: float
    batch_size: int
    batch_tokens: int
    queue_depth: int
    def __init__(self, queue_seconds: _Optional[float] = ..., batch_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., batch_tokens: _Optional[int] = ..., queue_depth: _Optional[int] = ...) -> None: ...

class VerifyServiceGenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "params", "cache_scope")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    cache_scope: str
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., cache_scope: _Optional[str] = ...) -> None: ...

class VerifyServiceGenerateResponse(_message.Message):
    __slots__ = ("opened", "tokens", "finished")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    opened: _common_pb2.GenerationOpened
    tokens: _common_pb2.GenerationTokens
    finished: _common_pb2.GenerationFinished
    def __init__(self, opened: _Optional[_Union[_common_pb2.GenerationOpened, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.GenerationTokens, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.GenerationFinished, _Mapping]] = ...) -> None: ...

class ReleaseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseSessionResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class PromptLogprobsRequest(_message.Message):
    __slots__ = ("prompt_ids", "top_logprobs")
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: int
    def __init__(self, prompt_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[int] = ...) -> None: ...

class PromptLogprobsResponse(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    def __init__(self, logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ...) -> None: ...

class VerifyServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class VerifyServiceInfoResponse(_message.Message):
    __slots__ = ("model_path", "model_type", "vocab_size", "max_context_length", "max_spec_len", "max_batch_size", "max_sessions", "eos_token_ids", "sampler_backend", "sessions", "active_sessions", "kv_cache_bytes", "batches", "batched_blocks", "max_batch_size_seen", "deadline_steps", "stale_blocks", "prefix_tokens_reused", "evicted_sessions", "run_steps")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_SPEC_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_BACKEND_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    BATCHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_SEEN_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_STEPS_FIELD_NUMBER: _ClassVar[int]
    STALE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_TOKENS_REUSED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    RUN_STEPS_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    model_type: str
    vocab_size: int
    max_context_length: int
    max_spec_len: int
    max_batch_size: int
    max_sessions: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampler_backend: str
    sessions: int
    active_sessions: int
    kv_cache_bytes: int
    batches: int
    batched_blocks: int
    max_batch_size_seen: int
    deadline_steps: int
    stale_blocks: int
    prefix_tokens_reused: int
    evicted_sessions: int
    run_steps: int
    def __init__(self, model_path: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., max_spec_len: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., max_sessions: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., sampler_backend: _Optional[str] = ..., sessions: _Optional[int] = ..., active_sessions: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., batches: _Optional[int] = ..., batched_blocks: _Optional[int] = ..., max_batch_size_seen: _Optional[int] = ..., deadline_steps: _Optional[int] = ..., stale_blocks: _Optional[int] = ..., prefix_tokens_reused: _Optional[int] = ..., evicted_sessions: _Optional[int] = ..., run_steps: _Optional[int] = ...) -> None: ...
