from specmesh.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftServiceGenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompt_ids", "params", "verify_address", "num_speculative_tokens", "goodput_probe", "cache_scope", "hand_off")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_PROBE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SCOPE_FIELD_NUMBER: _ClassVar[int]
    HAND_OFF_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompt_ids: _containers.RepeatedScalarFieldContainer[int]
    params: _common_pb2.SamplingParams
    verify_address: str
    num_speculative_tokens: int
    goodput_probe: bool
    cache_scope: str
    hand_off: bool
    def __init__(self, session_id: _Optional[str] = ..., prompt_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., verify_address: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., goodput_probe: _Optional[bool] = ..., cache_scope: _Optional[str] = ..., hand_off: _Optional[bool] = ...) -> None: ...

class DraftServiceGenerateResponse(_message.Message):
    __slots__ = ("opened", "tokens", "finished")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    opened: _common_pb2.GenerationOpened
    tokens: _common_pb2.GenerationTokens
    finished: _common_pb2.GenerationFinished
    def __init__(self, opened: _Optional[_Union[_common_pb2.GenerationOpened, _Mapping]] = ..., tokens: _Optional[_Union[_common_pb2.GenerationTokens, _Mapping]] = ..., finished: _Optional[_Union[_common_pb2.GenerationFinished, _Mapping]] = ...) -> None: ...

class DraftServiceInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DraftServiceInfoResponse(_message.Message):
    __slots__ = ("model_path", "algorithm", "vocab_size", "speculative_num_steps", "adaptive", "pipelined", "default_verify_address", "active_sessions", "rounds", "drafted", "accepted", "pipelined_blocks_used", "pipelined_blocks_discarded", "draft_seconds_per_token", "suffix_decoding")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_VERIFY_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    DRAFTED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    PIPELINED_BLOCKS_DISCARDED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SUFFIX_DECODING_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    algorithm: str
    vocab_size: int
    speculative_num_steps: int
    adaptive: bool
    pipelined: bool
    default_verify_address: str
    active_sessions: int
    rounds: int
    drafted: int
    accepted: int
    pipelined_blocks_used: int
    pipelined_blocks_discarded: int
    draft_seconds_per_token: float
    suffix_decoding: bool
    def __init__(self, model_path: _Optional[str] = ..., algorithm: _Optional[str] = ..., vocab_size: _Optional[int] = ..., speculative_num_steps: _Optional[int] = ..., adaptive: _Optional[bool] = ..., pipelined: _Optional[bool] = ..., default_verify_address: _Optional[str] = ..., active_sessions: _Optional[int] = ..., rounds: _Optional[int] = ..., drafted: _Optional[int] = ..., accepted: _Optional[int] = ..., pipelined_blocks_used: _Optional[int] = ..., pipelined_blocks_discarded: _Optional[int] = ..., draft_seconds_per_token: _Optional[float] = ..., suffix_decoding: _Optional[bool] = ...) -> None: ...
