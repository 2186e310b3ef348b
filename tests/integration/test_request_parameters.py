"""Every request parameter is honoured or refused with a 400 naming it, never silently ignored.

The walk takes OpenAI's full parameter lists from the official client's own types (so a parameter a newer
client adds is walked too) plus vLLM's extras, sends each with a non-default value, and demands either a
400 whose message names the parameter or a 200 that a check for that parameter confirms honoured. A 200
for a parameter without such a check fails: that would be a parameter silently ignored."""

import json
import re

import openai.types.chat.completion_create_params as chat_params
import openai.types.completion_create_params as completion_params
import pytest

from tests.integration.test_tools import WEATHER
from tests.support.rest import http
from tests.support.structured import stack, target  # noqa: F401


def names(typed_dict) -> list[str]:
    out: dict = {}
    for base in reversed(typed_dict.__mro__):
        out.update(getattr(base, "__annotations__", {}))
    return [n for n in out if n not in ("model", "prompt", "messages", "stream")]


VLLM_EXTRAS = [
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "bad_words", "ignore_eos",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
    "guided_whitespace_pattern", "structured_outputs", "use_beam_search", "length_penalty",
    "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
    "prompt_logprobs", "allowed_token_ids", "add_generation_prompt", "continue_final_message", "chat_template",
    "chat_template_kwargs", "documents", "priority", "request_id", "return_tokens_as_token_ids",
    "session_id", "cache_salt", "num_speculative_tokens",
]  # fmt: skip

# A non-default value per parameter (with what it needs beside it); anything else is sent as True.
VALUES: dict = {
    "best_of": {"best_of": 2},
    "echo": {"echo": True},
    # A bias makes token 42 repeat; each penalty then changes the output against the same bias without it.
    "frequency_penalty": {"frequency_penalty": 2.0, "logit_bias": {"42": 10.0}},
    "presence_penalty": {"presence_penalty": 2.0, "logit_bias": {"42": 10.0}},
    "repetition_penalty": {"repetition_penalty": 3.0, "logit_bias": {"42": 10.0}},
    "logit_bias": {"logit_bias": {"42": 100}},
    "logprobs": {"logprobs": 2},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "max_tokens": {"max_tokens": 3},
    "max_completion_tokens": {"max_completion_tokens": 3},
    "n": {"n": 2},
    "seed": {"seed": 5, "temperature": 1.0},
    "temperature": {"temperature": 1.5, "seed": 1},
    "top_p": {"top_p": 1e-6, "temperature": 1.0},
    "top_k": {"top_k": 1, "temperature": 1.0},
    "min_p": {"min_p": 1.0, "temperature": 1.0},
    "stop": "STOP",  # filled from the baseline
    "stop_token_ids": {"stop_token_ids": [42], "logit_bias": {"42": 100}},
    "bad_words": "BAD_WORDS",
    "min_tokens": {"min_tokens": 12, "logit_bias": {"0": 100}},
    "ignore_eos": {"ignore_eos": True, "logit_bias": {"0": 100}},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "user": {"user": "user-1"},
    "suffix": {"suffix": "x"},
    "response_format": {"response_format": {"type": "json_object"}, "max_tokens": 40},
    "guided_json": {
        "guided_json": {
            "type": "object",
            "properties": {"a": {"type": "boolean"}},
            "required": ["a"],
            "additionalProperties": False,
        }
    },
    "guided_regex": {"guided_regex": "[0-9]{3}"},
    "guided_choice": {"guided_choice": ["yes", "no"]},
    "tools": {"tools": [WEATHER]},
    "tool_choice": {"tools": [WEATHER], "tool_choice": "required", "max_tokens": 60},
    "parallel_tool_calls": {
        "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False, "max_tokens": 60
    },
    "session_id": {"session_id": "walk-1"},
    "cache_salt": {"session_id": "walk-2", "cache_salt": "salt"},
    "num_speculative_tokens": {"num_speculative_tokens": 0},
}  # fmt: skip


def text_of(r: dict) -> str:
    c = r["choices"][0]
    return c["text"] if "text" in c else (c["message"]["content"] or "")


def tokens_of(r: dict) -> int:
    return r["usage"]["completion_tokens"]


def streamed(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


# For each parameter, a check that a 200 honoured it: (response, baseline response, context) -> bool.
CHECKS = {
    "echo": lambda r, b, c: r["choices"][0]["text"].startswith(c["prompt"]),
    "frequency_penalty": lambda r, b, c: text_of(r) != text_of(c["again"](frequency_penalty=0.0)),
    "presence_penalty": lambda r, b, c: text_of(r) != text_of(c["again"](presence_penalty=0.0)),
    "repetition_penalty": lambda r, b, c: text_of(r) != text_of(c["again"](repetition_penalty=1.0)),
    "logit_bias": lambda r, b, c: set(c["ids"](text_of(r))) <= {42},
    "logprobs": lambda r, b, c: (
        len(r["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
        if "text" in r["choices"][0]
        else r["choices"][0]["logprobs"] is not None
    ),
    "top_logprobs": lambda r, b, c: len(r["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 2,
    "max_tokens": lambda r, b, c: tokens_of(r) == 3,
    "max_completion_tokens": lambda r, b, c: tokens_of(r) == 3,
    "n": lambda r, b, c: len(r["choices"]) == 2,
    "seed": lambda r, b, c: text_of(r) == text_of(c["again"]()),
    "temperature": lambda r, b, c: text_of(r) != text_of(b),
    "top_p": lambda r, b, c: text_of(r) == text_of(b),  # only the top token is left: greedy
    "top_k": lambda r, b, c: text_of(r) == text_of(b),
    "min_p": lambda r, b, c: text_of(r) == text_of(b),
    "stop": lambda r, b, c: r["choices"][0]["finish_reason"] == "stop" and len(text_of(r)) < len(text_of(b)),
    "stop_token_ids": lambda r, b, c: r["choices"][0]["finish_reason"] == "stop" and tokens_of(r) == 1,
    "bad_words": lambda r, b, c: text_of(r) != text_of(c["again"](bad_words=[])),
    "min_tokens": lambda r, b, c: tokens_of(r) >= 12,  # EOS is forced by the bias, held back until 12
    "ignore_eos": lambda r, b, c: tokens_of(r) == tokens_of(b),  # EOS forced, yet it runs to max_tokens
    "stream_options": lambda r, b, c: r["stream"][-1]["usage"]["completion_tokens"] > 0,
    "response_format": lambda r, b, c: text_of(r).startswith("{"),
    "guided_json": lambda r, b, c: json.loads(text_of(r))["a"] in (True, False),
    "guided_regex": lambda r, b, c: re.fullmatch("[0-9]{3}", text_of(r)) is not None,
    "guided_choice": lambda r, b, c: text_of(r) in ("yes", "no"),
    "tools": lambda r, b, c: r["usage"]["prompt_tokens"] > b["usage"]["prompt_tokens"],  # the tools are prompted
    "tool_choice": lambda r, b, c: r["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather",
    "parallel_tool_calls": lambda r, b, c: len(r["choices"][0]["message"]["tool_calls"]) == 1,
    "session_id": lambda r, b, c: c["again"]()["specmesh"]["cached_prompt_tokens"] > 0,
    # Another salt is another cache: the same session id under it starts cold.
    "cache_salt": lambda r, b, c: c["again"](cache_salt="other")["specmesh"]["cached_prompt_tokens"] == 0,
    "num_speculative_tokens": lambda r, b, c: r["specmesh"]["drafted"] == 0,
    # OpenAI's end-user id changes nothing in the output by definition (vLLM takes it too): honoured as a
    # label only, accepted when it is a string.
    "user": lambda r, b, c: text_of(r) == text_of(b),
}

ROUTES = {
    "completions": ("/v1/completions", {"prompt": "def main():"}, names(completion_params.CompletionCreateParamsBase)),
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "def main():"}]},
        names(chat_params.CompletionCreateParamsBase),
    ),
}


@pytest.mark.parametrize("route", ROUTES)
def test_every_parameter_is_honoured_or_refused(stack, tokenizer, route):  # noqa: F811
    path, prompt, openai_names = ROUTES[route]
    url = stack.base_url + path
    base = {"model": "demo", "max_tokens": 16, "temperature": 0} | prompt
    baseline = http("POST", url, json_body=base).json()
    fills = {
        "STOP": {"stop": [text_of(baseline)[4:7]]},
        "BAD_WORDS": {"bad_words": [tokenizer.decode([42])], "logit_bias": {"42": 10.0}},
    }
    seen = []
    for name in dict.fromkeys(openai_names + VLLM_EXTRAS):
        extra = VALUES.get(name, {name: True})
        extra = fills.get(extra, extra) if isinstance(extra, str) else extra
        body = base | extra
        r = http("POST", url, json_body=body)
        if r.status_code == 400:
            err = r.json()["error"]
            assert name in err["message"] or err["param"] == name, (name, err)
            seen.append((name, 400))
            continue
        assert r.status_code == 200, (name, r.status_code, r._body[:300])
        assert name in CHECKS, f"{route}: '{name}' was answered 200 without a check that it is honoured"
        reply = {"stream": streamed(r._body)} if body.get("stream") else r.json()
        context = {
            "prompt": prompt.get("prompt"),
            "ids": lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
            "again": lambda **more: http("POST", url, json_body=body | more).json(),
        }
        assert CHECKS[name](reply, baseline, context), (route, name, reply)
        seen.append((name, 200))
    assert {n for n, s in seen if s == 200} >= {"temperature", "n", "logit_bias", "seed", "stop"}
    assert {n for n, s in seen if s == 400} >= {"best_of" if route == "completions" else "audio", "use_beam_search"}
