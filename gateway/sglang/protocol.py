"""SGLang's `POST /generate` request, checked and turned into specmesh's terms (one `Item` per generation).

A request holds one prompt or a batch (`text`: a string or a list of strings; `input_ids`: a list of ids or a
list of lists), `sampling_params` (one object for all, or one per prompt) and the log-probability options
(`return_logprob`, `logprob_start_len`, `top_logprobs_num`: one value or one per prompt). With
`sampling_params.n` > 1 every prompt is generated n times, and the answer is a list in SGLang's order (prompt
by prompt, its n samples together).

Each parameter specmesh honours is mapped to `SamplingParams`; a parameter specmesh does not implement is
accepted only at its neutral value (the value that asks for nothing: null, 0, false, an empty list), so a
request is never answered as if a constraint it asked for had been applied. Anything else, unknown names
included, is refused with a 400 that names the parameter, as `sampling_params.ebnf` or `text[2]`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from gateway.core import shown
from gateway.openai.protocol import APIError
from specmesh.errors import InvalidArgument
from specmesh.sampling import MAX_LOGPROBS, MAX_STOP_STRINGS, SamplingParams, StructuredSpec

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
MAX_N = 16  # most samples per prompt
MAX_ITEMS = 64  # most generations (prompts x n) one request may ask for


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(400, f"'{param}' {message}", param, code)


def unsupported(param: str, value: Any, neutral: str) -> APIError:
    return bad(param, f"is not supported by specmesh: only {neutral} is accepted, got {shown(value)}", "unsupported")


# Checked values -------------------------------------------------------------------------------------------
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    if _is_int(value):
        return abs(value) < 2**53  # a larger integer is no parameter's value, and may not even fit a float
    return isinstance(value, float) and math.isfinite(value)


def integer(param: str, value: Any, lo: int, hi: int) -> int:
    if not _is_int(value) or not lo <= value <= hi:
        raise bad(param, f"must be an integer in [{lo}, {hi}], got {shown(value)}", _code(value, _is_int))
    return value


def number(param: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> float:
    if not _is_number(value) or not (lo < value if lo_open else lo <= value) or value > hi:
        what = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
        raise bad(param, f"must be a number in {what}, got {shown(value)}", _code(value, _is_number))
    return float(value)


def boolean(param: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise bad(param, f"must be a boolean, got {shown(value)}", "invalid_type")
    return value


def _code(value: Any, right_type) -> str:
    return "invalid_value" if right_type(value) else "invalid_type"


def _stop(param: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value] if value else []
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad(param, f"must be a string or a list of strings, got {shown(value)}", "invalid_type")
    if len(value) > MAX_STOP_STRINGS or not all(value):
        raise bad(param, f"must hold at most {MAX_STOP_STRINGS} non-empty strings")
    return tuple(value)


def _token_ids(param: str, value: Any, vocab_size: int, allow_empty: bool = True) -> list[int]:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise bad(param, f"must be a list of token ids, got {shown(value)}", "invalid_type")
    if not value and not allow_empty:
        raise bad(param, "must hold at least one token id")
    out = next((i for i, t in enumerate(value) if not 0 <= t < vocab_size), None)
    if out is not None:
        raise bad(f"{param}[{out}]", f"must be a token id in [0, {vocab_size}), got {shown(value[out])}")
    return value


def _logit_bias(param: str, value: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not isinstance(value, dict):
        raise bad(param, f"must be an object of token id -> bias, got {shown(value)}", "invalid_type")
    out = []
    for key, bias in value.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocab_size):
            raise bad(param, f"keys must be token ids in [0, {vocab_size}), got {shown(key)}")
        out.append((int(key), number(f"{param}.{key}", bias, -100, 100)))
    return tuple(out)


# Sampling parameters ---------------------------------------------------------------------------------------
# Parameters specmesh does not implement, and the values that ask for nothing (checked with `in`, so 0 also
# matches 0.0 and False).
NEUTRAL: dict[str, tuple[tuple, str]] = {
    "ebnf": ((None,), "null"),
    "structural_tag": ((None,), "null"),
    "stop_regex": ((None, "", []), "null or an empty list"),
    "no_stop_trim": ((None, False), "false"),
    "stream_interval": ((None,), "null"),
    "beam_width": ((None, 1), "null or 1"),
    "custom_params": ((None, {}), "null"),
    "watermark": ((None,), "null"),
}

# Honoured here; each maps to a SamplingParams field (or is read by the route: n, skip_special_tokens,
# spaces_between_special_tokens).
KNOWN = frozenset(
    {
        "max_new_tokens",
        "min_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "n",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "logit_bias",
        "sampling_seed",
        "regex",
        "json_schema",
    }
)


def _grammar(param: str, get) -> StructuredSpec | None:
    """The grammar the output must match: SGLang's `regex` or `json_schema` (JSON text), at most one."""
    given = [name for name in ("regex", "json_schema") if get(name) is not None]
    if len(given) > 1:
        raise bad(f"{param}.{given[1]}", f"cannot be combined with '{given[0]}': one grammar per generation")
    if not given:
        return None
    where, value = f"{param}.{given[0]}", get(given[0])
    if not isinstance(value, str) or not value:
        raise bad(where, f"must be a non-empty string, got {shown(value)}", "invalid_type")
    return StructuredSpec(given[0], value, field_name=where)


def _neutral(value: Any, accepted: tuple) -> bool:
    return any(value is None if a is None else type(value) is type(a) and value == a for a in accepted)


def _check_names(raw: dict, neutral: dict[str, tuple[tuple, str]], known: frozenset, prefix: str, unknown: str) -> None:
    """Refuse a parameter of `raw` that specmesh neither honours (`known`) nor takes at its neutral value
    (`neutral`); each is named `prefix` + its key, and `unknown` says what an unknown one is not."""
    for key, value in raw.items():
        where = f"{prefix}{key}"
        if key in neutral:
            accepted, words = neutral[key]
            if not _neutral(value, accepted):
                raise unsupported(where, value, words)
        elif key not in known:
            raise bad(where, unknown, "unsupported")


@dataclass(frozen=True)
class Sampling:
    """One object of `sampling_params`, checked: what the generation takes, and the samples per prompt."""

    params: SamplingParams  # max_tokens 0 stands for max_new_tokens 0 (no generation: the prompt only)
    n: int = 1
    skip_special_tokens: bool = True


def sampling(raw: Any, param: str, vocab_size: int) -> Sampling:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise bad(param, f"must be an object, got {shown(raw)}", "invalid_type")
    _check_names(raw, NEUTRAL, KNOWN, f"{param}.", "is not a sampling parameter specmesh knows")
    get = {k: v for k, v in raw.items() if v is not None}.get
    kw: dict[str, Any] = {}
    max_new = integer(f"{param}.max_new_tokens", get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS), 0, 2**31 - 1)
    kw["max_tokens"] = max_new
    min_new = integer(f"{param}.min_new_tokens", get("min_new_tokens", 0), 0, max(max_new, 0))
    kw["min_tokens"] = min_new
    kw["temperature"] = number(f"{param}.temperature", get("temperature", 1.0), 0, 100)
    kw["top_p"] = number(f"{param}.top_p", get("top_p", 1.0), 0, 1, lo_open=True)
    top_k = integer(f"{param}.top_k", get("top_k", -1), -1, 2**31 - 1)
    kw["top_k"] = max(0, top_k)  # SGLang's -1 (and 0) is the whole vocabulary
    kw["min_p"] = number(f"{param}.min_p", get("min_p", 0.0), 0, 1)
    kw["stop"] = _stop(f"{param}.stop", get("stop", []))
    kw["stop_token_ids"] = tuple(_token_ids(f"{param}.stop_token_ids", get("stop_token_ids", []), vocab_size))
    kw["ignore_eos"] = boolean(f"{param}.ignore_eos", get("ignore_eos", False))
    kw["frequency_penalty"] = number(f"{param}.frequency_penalty", get("frequency_penalty", 0.0), -2, 2)
    kw["presence_penalty"] = number(f"{param}.presence_penalty", get("presence_penalty", 0.0), -2, 2)
    kw["repetition_penalty"] = number(f"{param}.repetition_penalty", get("repetition_penalty", 1.0), 0, 2, lo_open=True)
    kw["logit_bias"] = _logit_bias(f"{param}.logit_bias", get("logit_bias", {}), vocab_size)
    kw["structured"] = _grammar(param, get)
    seed = get("sampling_seed")
    kw["seed"] = None if seed is None else integer(f"{param}.sampling_seed", seed, 0, 2**63 - 1)
    skip_special = boolean(f"{param}.skip_special_tokens", get("skip_special_tokens", True))
    # Checked but without effect: HF's fast tokenizers never put spaces between special tokens.
    boolean(f"{param}.spaces_between_special_tokens", get("spaces_between_special_tokens", True))
    n = integer(f"{param}.n", get("n", 1), 1, MAX_N)
    params = SamplingParams(**kw)
    try:  # what is left to check is SamplingParams' own (its messages name its fields, as the rules are)
        SamplingParams(**{**kw, "max_tokens": max(1, max_new)}).validate(vocab_size)
    except InvalidArgument as e:
        raise bad(param, str(e)) from None
    return Sampling(params, n, skip_special)


# The request -------------------------------------------------------------------------------------------------
# Top-level fields of SGLang's GenerateReqInput that specmesh does not implement, and their neutral values.
NEUTRAL_TOP: dict[str, tuple[tuple, str]] = (
    {
        name: ((None,), "null")
        for name in (
            "input_embeds",
            "image_data",
            "video_data",
            "audio_data",
            "mm_hashes",
            "mm_content_hashes",
            "video_config",
            "token_ids_logprob",
            "sampling_logprobs_mode",
            "modalities",
            "session_params",
            "lora_path",
            "lora_id",
            "custom_logit_processor",
            "positional_embed_overrides",
            "bootstrap_host",
            "bootstrap_port",
            "bootstrap_room",
            "bootstrap_pair_key",
            "decode_tp_size",
            "routed_dp_rank",
            "data_parallel_rank",
            "disagg_prefill_dp_rank",
            "routing_key",
            "watermark",
        )
    }
    | {
        name: ((None, False), "false")
        for name in (
            "return_hidden_states",
            "return_routed_experts",
            "return_indexer_topk",
            "return_sampling_mask",
            "return_flat_raw_top_logprobs",
            "return_flat_raw_output_top_logprobs",
            "return_flat_raw_top_logprobs_b64",
            "use_audio_in_video",
            "background",
            "require_reasoning",
        )
    }
    | {"routed_experts_start_len": ((None, 0), "0")}
)

KNOWN_TOP = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "session_id",
        "conversation_id",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "stream",
        "log_metrics",
        "return_prompt_token_ids",
    }
)


@dataclass(frozen=True)
class Logprobs:
    """What log-probabilities one prompt's answer carries (`start` None: none of the prompt's)."""

    start: int | None  # first prompt position whose log-probability is returned (-1 in SGLang: none)
    top: int  # top log-probabilities per position
    text: bool  # each entry with its token's text


@dataclass(frozen=True)
class Item:
    """One generation of a request: its prompt (text or ids), what to sample, what to return."""

    index: int  # its place in the answer
    prompt: str | list[int]
    prompt_param: str  # the parameter the prompt came from (`text[1]`), for errors about it
    params: SamplingParams
    logprobs: Logprobs | None  # None: return_logprob false
    rid: str | None
    skip_special_tokens: bool = True


@dataclass(frozen=True)
class GenerateRequest:
    items: list[Item]
    batch: bool  # answered as a list (a batch input, or n > 1)
    stream: bool
    session_id: str
    return_prompt_token_ids: bool


def _per_prompt(body: dict, name: str, count: int, default: Any) -> list[tuple[str, Any]]:
    """(parameter name, value) per prompt of a field given once for every prompt or as a list of one value per
    prompt (`rid`, and every field of a batch, may be a list)."""
    value = body.get(name)
    if not isinstance(value, list):
        return [(name, default if value is None else value)] * count
    if len(value) != count:
        raise bad(name, f"must be one value for every prompt or a list of one per prompt ({count}), got {len(value)}")
    return [(f"{name}[{i}]", default if v is None else v) for i, v in enumerate(value)]


def _get(body: dict, name: str, default: Any) -> Any:
    """A field's value; null is the default, as in SGLang's request dataclass."""
    value = body.get(name)
    return default if value is None else value


def _prompts(body: dict, vocab_size: int) -> tuple[list[str | list[int]], list[str], bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise bad("text", "or 'input_ids' is required (exactly one of them)", "missing_required_parameter")
    if text is not None:
        if isinstance(text, str):
            if not text:
                raise bad("text", "must not be empty")
            return [text], ["text"], False
        if not isinstance(text, list) or not text or not all(isinstance(t, str) for t in text):
            raise bad("text", f"must be a string or a non-empty list of strings, got {shown(text)}", "invalid_type")
        empty = next((i for i, t in enumerate(text) if not t), None)
        if empty is not None:
            raise bad(f"text[{empty}]", "must not be empty")
        return list(text), [f"text[{i}]" for i in range(len(text))], True
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        lists = [_token_ids(f"input_ids[{i}]", p, vocab_size, allow_empty=False) for i, p in enumerate(ids)]
        return list(lists), [f"input_ids[{i}]" for i in range(len(ids))], True
    return [_token_ids("input_ids", ids, vocab_size, allow_empty=False)], ["input_ids"], False


def parse_generate(body: dict, vocab_size: int) -> GenerateRequest:
    """The request's generations, or an APIError (400) naming the first parameter that is wrong."""
    _check_names(body, NEUTRAL_TOP, KNOWN_TOP, "", "is not a parameter of /generate that specmesh knows")
    prompts, params_of, batch = _prompts(body, vocab_size)
    count = len(prompts)
    samplings = [sampling(raw, where, vocab_size) for where, raw in _per_prompt(body, "sampling_params", count, None)]
    ns = {s.n for s in samplings}
    if len(ns) > 1:
        raise bad("sampling_params", "must ask for the same n for every prompt")
    n = ns.pop()
    if count * n > MAX_ITEMS:
        raise bad(
            params_of[0].split("[")[0], f"asks for {count * n} generations (prompts x n); the limit is {MAX_ITEMS}"
        )
    wants = [boolean(w, v) for w, v in _per_prompt(body, "return_logprob", count, False)]
    starts = [integer(w, v, -1, 2**31 - 1) for w, v in _per_prompt(body, "logprob_start_len", count, -1)]
    tops = [integer(w, v, 0, MAX_LOGPROBS) for w, v in _per_prompt(body, "top_logprobs_num", count, 0)]
    with_text = boolean("return_text_in_logprobs", _get(body, "return_text_in_logprobs", False))
    rids = []
    for where, rid in _per_prompt(body, "rid", count, None):
        if rid is not None and not (isinstance(rid, str) and 0 < len(rid) <= 256):
            raise bad(where, f"must be a string of 1-256 characters, got {shown(rid)}", "invalid_type")
        rids.append(rid)
    session_id = _get(body, "session_id", "")
    if not isinstance(session_id, str) or len(session_id) > 256:
        raise bad("session_id", f"must be a string of at most 256 characters, got {shown(session_id)}", "invalid_type")
    if session_id and (batch or n > 1):
        raise bad("session_id", "names one conversation: it cannot be used with a batch or n > 1")
    stream = boolean("stream", _get(body, "stream", False))
    boolean("log_metrics", _get(body, "log_metrics", True))
    prompt_ids = boolean("return_prompt_token_ids", _get(body, "return_prompt_token_ids", False))
    items: list[Item] = []
    for i in range(count):
        logprobs = None
        if wants[i]:
            start = starts[i] if starts[i] >= 0 else None
            if start is not None and isinstance(prompts[i], list) and start > len(prompts[i]):
                where = _per_prompt(body, "logprob_start_len", count, -1)[i][0]
                raise bad(where, f"is {start}: more than the prompt's {len(prompts[i])} tokens")
            logprobs = Logprobs(start, tops[i], with_text)
        for j in range(n):
            rid = rids[i] if n == 1 or rids[i] is None else f"{rids[i]}-{j}"
            sp = samplings[i]
            items.append(Item(len(items), prompts[i], params_of[i], sp.params, logprobs, rid, sp.skip_special_tokens))
    return GenerateRequest(items, batch or n > 1, stream, session_id, prompt_ids)
