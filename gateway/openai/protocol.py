"""The OpenAI-compatible API's messages as pydantic v2 models: requests (validated here), responses, errors.

Requests are validated strictly (no coercion: `"1"` is not a number, `true` is not 1); a field sent as
null takes its default, and fields this API does not know are ignored, as OpenAI's clients expect. A
validation failure becomes an OpenAI error (HTTP 400) naming the parameter, with the code `invalid_type`,
`invalid_value`, `missing_required_parameter` or `unsupported`; a message quotes at most a few dozen
characters of the value it refuses. Extensions: `top_k`, `ignore_eos`, `session_id`, `cache_salt` (as
vLLM's) and `num_speculative_tokens` in a request; a `specmesh` object with the speculation stats in a
response.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Generic, Literal, TypeVar, get_args

from fastapi.responses import JSONResponse
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import PydanticCustomError

from gateway.core import Outcome, shown
from gateway.openai import tools
from gateway.openai.tools import ToolPlan  # by name: in ChatCompletionRequest's body, `tools` is the field
from specmesh import structured
from specmesh.errors import InvalidArgument, SpecmeshError
from specmesh.rejection.limits import MAX_SPEC_LEN
from specmesh.sampling import (
    DEFAULT_MAX_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_STRINGS,
    SamplingParams,
    StructuredSpec,
)

# errors -------------------------------------------------------------------------------------------------
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
}


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# An error message is cut to this many characters: whatever a message quotes, no large input goes back.
MAX_MESSAGE_CHARS = 1000


class APIError(Exception):
    """An error answered in OpenAI's shape with an HTTP status. `close`: the connection cannot carry another
    request (the request's body was not read to its end)."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, close: bool = False
    ):
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.close = status, message, param, code, close

    @classmethod
    def from_domain(cls, e: SpecmeshError) -> APIError:
        return cls(e.http_status, str(e), param=getattr(e, "param", None), code=e.openai_code)

    def body(self) -> dict:
        info = ErrorInfo(
            message=self.message, type=ERROR_TYPES.get(self.status, "server_error"), param=self.param, code=self.code
        )
        return ErrorResponse(error=info).model_dump()

    def response(self, retried: bool = False) -> JSONResponse:
        """`retried`: the gateway has already tried other replicas, so the client should not."""
        headers = {"x-should-retry": "false"} if retried else {}
        if self.close:
            headers["connection"] = "close"
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


# Error types our own validators raise: the pydantic error type is the OpenAI error code.
_OWN_CODES = frozenset({"invalid_type", "invalid_value", "unsupported"})


def _param(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_in(annotation) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for arg in get_args(annotation) if (m := _model_in(arg)) is not None), None)


def _description(model: type[BaseModel] | None, loc: tuple) -> str | None:
    """The `description` of the field at `loc`: what a valid value is, in words."""
    info = None
    for part in loc:
        if isinstance(part, int):
            continue
        if model is None or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = _model_in(info.annotation)
    return info.description if info is not None else None


def request_error(exc: ValidationError, model: type[BaseModel]) -> APIError:
    """The first validation error of a request as an OpenAI 400: "'<param>' must be <what>, got <value>"."""
    err = exc.errors(include_url=False)[0]
    param, kind, value = _param(err["loc"]), err["type"], err.get("input")
    if kind in _OWN_CODES:
        return APIError(400, f"'{param}' {err['msg']}", param, kind)
    if kind == "missing":
        return APIError(400, f"'{param}' is required", param, "missing_required_parameter")
    if kind == "extra_forbidden":
        return APIError(400, f"'{param}' is not supported by specmesh", param, "unsupported")
    code = "invalid_type" if kind.endswith("_type") else "invalid_value"
    what = "an object" if kind == "model_type" else _description(model, err["loc"])
    if what is None:
        return APIError(400, f"'{param}': {err['msg']}", param, code)
    got = shown(value) if code == "invalid_value" or isinstance(value, bool) else type(value).__name__
    return APIError(400, f"'{param}' must be {what}, got {got}", param, code)


RequestT = TypeVar("RequestT", bound=BaseModel)


def parse_request(model: type[RequestT], body: dict) -> RequestT:
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise request_error(e, model) from None


# requests -----------------------------------------------------------------------------------------------
SESSION_ID_MAX = 256  # characters of a session_id or cache_salt


class OpenAIRequestModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        # OpenAI's clients send null for "not set": such a field takes its default.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


def must_be(field: str, kind: type, message: str):
    """A before-validator of `field` that refuses a value other than a `kind` (a missing one too, with
    validate_default) as invalid_type, with `message` saying what the field must be."""

    def check(cls, value: Any) -> Any:
        if not isinstance(value, kind):
            raise PydanticCustomError("invalid_type", message)
        return value

    return field_validator(field, mode="before")(check)


def _refuse_unsupported(value: Any) -> Any:
    # An empty or false value asks for nothing this API lacks (0 == False counts as false, as before).
    if value not in (None, False, {}, []):
        raise PydanticCustomError("unsupported", "is not supported by specmesh")
    return value


Unsupported = Annotated[Any, AfterValidator(_refuse_unsupported)]
Penalty = Annotated[float, Field(ge=-2, le=2, description="a number in [-2, 2]")]
MAX_N = 16  # most choices per prompt
MAX_PROMPTS = 64  # most prompts in one completions request
TokenId = Annotated[int, Field(ge=0, lt=2**31, description="a token id")]


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: an object of token id (as a string) -> bias in [-100, 100]."""
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_type", "must be an object of token id -> bias")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isdigit() and len(key) < 10):
            raise PydanticCustomError("invalid_value", "keys must be token ids (as strings)")
        number = isinstance(bias, (int, float)) and not isinstance(bias, bool)
        if not (number and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
            bound = f"{MAX_LOGIT_BIAS:g}"
            raise PydanticCustomError("invalid_value", f"values must be numbers in [-{bound}, {bound}]")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


class StreamOptions(OpenAIRequestModel):
    include_usage: bool = Field(False, description="a boolean")


REFUSE_UNKNOWN = ConfigDict(strict=True, extra="forbid", frozen=True)


class GenerationRequest(OpenAIRequestModel):
    """The fields completions and chat share: sampling, limits, session and streaming. A parameter that is not
    a field here is refused (a 400 naming it), never ignored: a request gets what it asks for or an error."""

    model_config = REFUSE_UNKNOWN

    model: str
    temperature: float = Field(1.0, ge=0, le=2, description="a number in [0, 2]")
    top_p: float = Field(1.0, gt=0, le=1, description="a number in (0, 1]")
    top_k: int = Field(0, ge=-1, lt=2**31, description="an integer in [-1, 2**31) (-1 or 0 = off)")
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, lt=2**31, description="an integer in [1, 2**31)")
    seed: int | None = Field(None, ge=0, lt=2**63, description="an integer in [0, 2**63)")
    n: int = Field(1, ge=1, le=MAX_N, description=f"an integer in [1, {MAX_N}]")
    stop: tuple[str, ...] = Field((), description="a string or a list of strings")
    logit_bias: Annotated[tuple[tuple[int, float], ...], BeforeValidator(_logit_bias)] = ()
    # vLLM's extra sampling parameters (every one applied by the target exactly; see specmesh.sampling).
    repetition_penalty: float = Field(1.0, gt=0, le=100, description="a number in (0, 100]")
    min_p: float = Field(0.0, ge=0, le=1, description="a number in [0, 1]")
    min_tokens: int = Field(0, ge=0, lt=2**31, description="an integer >= 0")
    stop_token_ids: list[TokenId] = Field([], max_length=64, description="a list of at most 64 token ids")
    bad_words: list[str] = Field(
        [], max_length=MAX_BAD_WORDS // 2, description=f"a list of at most {MAX_BAD_WORDS // 2} strings"
    )
    # Structured output: OpenAI's response_format, vLLM's guided_* (at most one; specmesh.structured).
    response_format: dict | None = Field(None, description="an object with a type")
    guided_json: dict | str | None = Field(None, description="a JSON schema (an object or its JSON text)")
    guided_regex: str | None = Field(None, description="a regular expression")
    guided_choice: list[str] | None = Field(None, description="a list of strings")
    guided_grammar: Unsupported = None
    # OpenAI's end-user id: for the caller's own records, it changes nothing in the output (vLLM takes it too).
    user: str | None = Field(None, max_length=256, description="a string of at most 256 characters")
    suffix: Unsupported = None
    tools: Unsupported = None
    functions: Unsupported = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    ignore_eos: bool = Field(False, description="a boolean")
    session_id: str | None = Field(
        None, min_length=1, max_length=SESSION_ID_MAX, description=f"a string of 1-{SESSION_ID_MAX} characters"
    )
    # Requests share a session's cached prompt only with the same salt (and API key).
    cache_salt: str | None = Field(
        None, min_length=1, max_length=SESSION_ID_MAX, description=f"a string of 1-{SESSION_ID_MAX} characters"
    )
    # Absent or null: the service's choice; 0: target-only decoding; else the most draft tokens per block.
    num_speculative_tokens: int | None = Field(
        None, ge=0, le=MAX_SPEC_LEN, description=f"an integer in [0, {MAX_SPEC_LEN}] (0 = target-only)"
    )
    stream: bool = Field(False, description="a boolean")
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _stream_options_only_when_streaming(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("stream") is not True:
            data = {k: v for k, v in data.items() if k != "stream_options"}
        return data

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str):
            value = (value,)
        elif isinstance(value, list) and all(isinstance(s, str) for s in value):
            value = tuple(value)
        else:
            raise PydanticCustomError("invalid_type", "must be a string or a list of strings")
        if len(value) > MAX_STOP_STRINGS or not all(value):
            raise PydanticCustomError("invalid_value", f"must hold at most {MAX_STOP_STRINGS} non-empty strings")
        return value

    @property
    def max_output_tokens(self) -> int:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream and self.stream_options is not None and self.stream_options.include_usage

    @property
    def num_logprobs(self) -> int | None:
        """Top log-probabilities per output token; None = no log-probabilities."""
        return None

    def check(self) -> None:
        """Raise an APIError (400) naming the parameter for what no field's own validation can see."""
        spec = self.structured_spec()
        if spec is not None:
            try:
                structured.validate(spec)
            except InvalidArgument as e:
                raise APIError(400, str(e), spec.field_name.split(".")[0], "invalid_value") from None

    def structured_spec(self) -> StructuredSpec | None:
        """The grammar the output must match, from response_format or guided_* (APIError 400 naming the
        field when malformed or when two of them are set)."""
        given = [
            name
            for name in ("response_format", "guided_json", "guided_regex", "guided_choice")
            if getattr(self, name) is not None
        ]
        if self.response_format is not None and self.response_format.get("type") == "text":
            given.remove("response_format")
        if len(given) > 1:
            raise APIError(400, f"'{given[0]}' and '{given[1]}' cannot both be set", given[1], "invalid_value")
        if not given:
            return None
        name = given[0]
        if name == "guided_regex":
            return StructuredSpec("regex", str(self.guided_regex), name)
        if name == "guided_choice":
            return StructuredSpec("choice", json.dumps(self.guided_choice), name)
        if name == "guided_json":
            schema = self.guided_json
            return StructuredSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema), name)
        fmt = self.response_format or {}
        kind = fmt.get("type")
        if kind == "json_object":
            return StructuredSpec("json_object", "", name)
        if kind == "json_schema":
            body = fmt.get("json_schema")
            schema = body.get("schema") if isinstance(body, dict) else None
            if not isinstance(schema, dict):
                raise APIError(
                    400, "'response_format.json_schema.schema' must be an object", "response_format", "invalid_value"
                )
            return StructuredSpec("json_schema", json.dumps(schema), name)
        raise APIError(
            400,
            f"'response_format.type' must be text, json_object or json_schema, got {shown(kind)}",
            "response_format",
            "invalid_value",
        )

    def to_sampling_params(self, bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        """`bad_words`: the request's bad_words as token sequences (the gateway tokenizes them)."""
        return SamplingParams(
            temperature=float(self.temperature),
            top_k=max(0, self.top_k),
            top_p=float(self.top_p),
            seed=self.seed,
            max_tokens=self.max_output_tokens,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            repetition_penalty=float(self.repetition_penalty),
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            min_p=float(self.min_p),
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens,
            stop_token_ids=tuple(self.stop_token_ids),
            bad_words=bad_words,
            logprobs=self.num_logprobs,
            structured=self.structured_spec(),
        )


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


class _PromptInput(OpenAIRequestModel):
    # One prompt (text or token ids) or a list of them (texts, or lists of token ids), as OpenAI takes them.
    prompt: list[str | list[int]] = Field(None, validate_default=True)

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, value: Any) -> list[str | list[int]]:
        if isinstance(value, str) or (_is_ids(value) and value):
            value = [value]
        if not (isinstance(value, list) and value and all(isinstance(p, str) or _is_ids(p) for p in value)):
            raise PydanticCustomError(
                "invalid_type", "must be a string, a list of token ids, or a list of strings or of token id lists"
            )
        if len(value) > MAX_PROMPTS:
            raise PydanticCustomError("invalid_value", f"must hold at most {MAX_PROMPTS} prompts")
        if not all(value):
            raise PydanticCustomError("invalid_value", "must not be empty")
        return value


# Bases are listed input last: pydantic orders fields base by base from the last, and the first field in
# that order that fails is the one reported, so an error in the prompt or messages comes first.
class CompletionRequest(GenerationRequest, _PromptInput):
    """POST /v1/completions: one prompt or a list of them, as text or token ids; choices are indexed
    prompt-major (prompt i's n samples are choices i*n .. i*n + n - 1), as OpenAI and vLLM index them.
    `logprobs` is an integer here (top log-probabilities per token); `echo` puts the prompt (and, with
    logprobs, its log-probabilities) before the completion, and allows max_tokens 0."""

    model_config = REFUSE_UNKNOWN  # the input base's config would otherwise win
    max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=0, lt=2**31, description="an integer in [0, 2**31)")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}]")
    echo: bool = Field(False, description="a boolean")
    top_logprobs: Unsupported = None

    def check(self) -> None:
        super().check()
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "'max_tokens' may be 0 only with echo", "max_tokens", "invalid_value")

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(OpenAIRequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"] = Field(
        None, validate_default=True, description="one of system, developer, user, assistant, tool"
    )
    content: str = Field(None, validate_default=True)
    # An assistant turn's tool calls ({id, type, function: {name, arguments}}) and a tool turn's answer to one.
    tool_calls: list[dict] | None = Field(None, max_length=128, description="a list of tool calls")
    tool_call_id: str | None = Field(None, max_length=256, description="a string")
    name: str | None = Field(None, max_length=256, description="a string")

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, value: Any) -> str:
        if value is None:  # an assistant turn that only calls tools
            return ""
        if isinstance(value, list):
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in value
            ):
                raise PydanticCustomError("invalid_type", "parts must be text parts")
            value = "".join(p["text"] for p in value)
        if not isinstance(value, str):
            raise PydanticCustomError("invalid_type", "must be a string")
        return value

    def to_prompt(self) -> dict:
        """The message as the chat template takes it ("developer" is OpenAI's newer name for "system")."""
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = self.tool_calls
        return out


class ChatInput(OpenAIRequestModel):
    """The messages of a chat request (also what /tokenize takes to count a chat prompt)."""

    messages: list[ChatMessage]

    @field_validator("messages", mode="before")
    @classmethod
    def _non_empty_list(cls, value: Any) -> Any:
        if not isinstance(value, list) or not value:
            raise PydanticCustomError("invalid_type", "must be a non-empty list")
        return value


class ChatCompletionRequest(GenerationRequest, ChatInput):
    """POST /v1/chat/completions. `max_completion_tokens` is OpenAI's newer name for `max_tokens`.
    `logprobs` is a boolean here, `top_logprobs` the number of top log-probabilities per token."""

    model_config = REFUSE_UNKNOWN
    logprobs: bool = Field(False, description="a boolean")
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description=f"an integer in [0, {MAX_LOGPROBS}]")
    echo: Unsupported = None
    tools: list | None = Field(None, description="a list of tools")
    tool_choice: str | dict | None = Field(None, description="none, auto, required or a named function")
    parallel_tool_calls: bool = Field(True, description="a boolean")

    def check(self) -> None:
        super().check()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs", "invalid_value")

    def tool_plan(self) -> ToolPlan | None:
        """What the tools ask for (None without tools); an APIError naming the parameter when malformed."""
        if not self.tools and not self.parallel_tool_calls:
            raise APIError(400, "'parallel_tool_calls' needs 'tools'", "parallel_tool_calls", "invalid_value")
        try:
            return tools.plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        except tools.ToolInputError as e:
            raise APIError(400, str(e), e.param, "invalid_value") from None

    def structured_spec(self) -> StructuredSpec | None:
        spec = super().structured_spec()
        plan = self.tool_plan()
        forced = plan.structured() if plan is not None else None
        if forced is not None and spec is not None:
            raise APIError(
                400,
                f"'tool_choice' {plan.choice if plan else ''} cannot be combined with '{spec.field_name}'",
                "tool_choice",
                "invalid_value",
            )
        return forced or spec

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    max_completion_tokens: int | None = Field(None, ge=1, lt=2**31, description="an integer in [1, 2**31)")

    @model_validator(mode="before")
    @classmethod
    def _newer_name_wins(cls, data: Any) -> Any:
        # With max_completion_tokens set, max_tokens is not looked at (not even validated).
        if isinstance(data, dict) and data.get("max_completion_tokens") is not None:
            data = {k: v for k, v in data.items() if k != "max_tokens"}
        return data

    @property
    def max_output_tokens(self) -> int:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# responses ----------------------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, outcome: Outcome) -> Usage:
        return cls(
            prompt_tokens=outcome.prompt_tokens,
            completion_tokens=outcome.completion_tokens,
            total_tokens=outcome.prompt_tokens + outcome.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=outcome.cached_prompt_tokens),
        )


class SpecmeshStats(BaseModel):
    """The speculation behind a response (vLLM's definitions of the rates), and where it ran."""

    rounds: int
    drafts: int
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_length: float
    acceptance_per_pos: list[float]
    # The rounds by the method that drafted their block ("model", "suffix", "ngram"): drafts, drafted, accepted.
    by_method: dict[str, dict[str, int]]
    cached_prompt_tokens: int
    failovers: int
    target_only: bool
    handed_off: bool  # a goodput probe: speculated, then decoded the rest target-only
    verify_replica: str

    @classmethod
    def of(cls, outcome: Outcome) -> SpecmeshStats:
        s = outcome.stats
        return cls(
            rounds=s.rounds,
            drafts=s.drafts,
            drafted=s.drafted,
            accepted=s.accepted,
            acceptance_rate=round(s.acceptance_rate, 4),
            mean_accepted_length=round(s.mean_accepted_length, 4),
            acceptance_per_pos=[round(a, 4) for a in s.acceptance_per_pos],
            by_method=s.method_dicts(),
            cached_prompt_tokens=outcome.cached_prompt_tokens,
            failovers=outcome.failovers,
            target_only=outcome.target_only,
            handed_off=outcome.handed_off,
            verify_replica=outcome.verify_replica,
        )


class SpeculativeDecoding(BaseModel):
    """vLLM's per-request speculative-decoding metrics (`gateway.core.speculative_decoding`); the per-step
    arrays only at the detailed level."""

    num_spec_tokens: int
    num_spec_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    mean_acceptance_length: float
    draft_acceptance_rate: float
    acceptance_histogram: list[int]
    acceptance_histogram_by_draft_length: dict[int, list[int]]  # JSON keys are strings, as vLLM's
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None

    @model_serializer(mode="wrap")
    def _steps_when_kept(self, handler) -> dict:
        out = handler(self)
        if "per_step_accepted" not in self.model_fields_set:
            out.pop("per_step_accepted", None)
            out.pop("per_step_drafted", None)
        return out


class ResponseMetrics(BaseModel):
    """vLLM's per-request `metrics` object: here its speculative decoding only (null for n > 1, as vLLM's, and
    on a gateway without draft replicas)."""

    speculative_decoding: SpeculativeDecoding | None


@dataclass(frozen=True)
class LogprobEntry:
    """One token of a choice as its log-probabilities are shown: its text, its raw log-probability (None for
    an echoed prompt's first token), the top tokens' texts and log-probabilities, and where its text starts
    in the choice's text."""

    token: str
    logprob: float | None
    top: list[tuple[str, float]]
    offset: int


# OpenAI's clients parse -inf badly: a log-probability is floored here, as vLLM does.
LOGPROB_FLOOR = -9999.0


def completion_logprobs(entries: list[LogprobEntry]) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[None if e.logprob is None else max(e.logprob, LOGPROB_FLOOR) for e in entries],
        top_logprobs=[None if e.logprob is None else {t: max(v, LOGPROB_FLOOR) for t, v in e.top} for e in entries],
        text_offset=[e.offset for e in entries],
    )


def chat_logprobs(entries: list[LogprobEntry]) -> ChatLogprobs:
    def top(token: str, logprob: float) -> ChatTopLogprob:
        return ChatTopLogprob(token=token, logprob=max(logprob, LOGPROB_FLOOR), bytes=list(token.encode()))

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(**top(e.token, e.logprob or 0.0).model_dump(), top_logprobs=[top(t, v) for t, v in e.top])
            for e in entries
        ]
    )


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions log-probabilities: one entry per token (echoed prompt tokens first, the
    first of them with no log-probability)."""

    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[tools.ToolCall] | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


class DeltaMessage(BaseModel):
    """What a chat chunk adds: the role once, first; then content. A field not sent is left out."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[tools.DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _only_what_is_sent(self, handler) -> dict:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class AnswerBase(BaseModel, Generic[ChoiceT]):
    """The fields a whole answer and a stream chunk start with, in the order they are sent; each kind fixes
    `object` (pydantic keeps a redefined field where the base put it). `usage` and `specmesh` follow."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceT]


class ResponseBase(AnswerBase[ChoiceT], Generic[ChoiceT]):
    """A whole answer: its choices, then the generation's usage and speculation (`metrics` left out when
    --per-request-spec-decode-metrics is none)."""

    usage: Usage
    specmesh: SpecmeshStats
    metrics: ResponseMetrics | None = None

    def payload(self) -> dict:
        return self.model_dump(exclude={"metrics"} if self.metrics is None else set())


class StreamResponseBase(AnswerBase[ChoiceT], Generic[ChoiceT]):
    """One server-sent event: `usage` is there (null but the last) only when asked for."""

    usage: Usage | None = None
    specmesh: SpecmeshStats | None = None
    metrics: ResponseMetrics | None = None


class CompletionResponse(ResponseBase[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class CompletionStreamResponse(StreamResponseBase[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ChatCompletionResponse(ResponseBase[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"


class ChatCompletionStreamResponse(StreamResponseBase[ChatStreamChoice]):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


def stream_payload(chunk: StreamResponseBase[Any], include_usage: bool) -> dict:
    """A stream chunk as its event's JSON object: `usage` only when asked for, `specmesh` and `metrics` only
    with the usage."""
    exclude = {name for name in ("specmesh", "metrics") if getattr(chunk, name) is None}
    if not include_usage:
        exclude.add("usage")
    return chunk.model_dump(exclude=exclude)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specmesh"


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    """Readiness: "ok" while a verify replica is healthy; `target_only` when no draft replica is."""

    status: Literal["ok", "unavailable"]
    verify_healthy: int
    draft_healthy: int
    target_only: bool
