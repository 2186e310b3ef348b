"""Tools on chat through the real services and the REST gateway: tool_choice "required" and a named function
always give valid calls (structured output), tool calls come back in OpenAI's shape whole and streamed, tool
turns in the history reach the prompt, "auto" parses hermes-style <tool_call> blocks; the official openai
client and LangChain's bind_tools / with_structured_output(method="function_calling")."""

import json

import pydantic
import pytest

from gateway.openai import tools
from tests.support.rest import http
from tests.support.structured import client, conforms, stack, target  # noqa: F401

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def check_calls(calls, names=None):
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        assert c.function.name in (names or SCHEMAS)
        assert conforms(json.loads(c.function.arguments), SCHEMAS[c.function.name]), c.function.arguments


def test_required_and_named_give_valid_calls(client):  # noqa: F811
    for kw in (dict(temperature=0), dict(temperature=1.0, seed=5)):
        r = client.chat.completions.create(
            model="demo", messages=MESSAGES, tools=[WEATHER, TIME], tool_choice="required", max_tokens=80, **kw
        )
        assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
        check_calls(r.choices[0].message.tool_calls)
        r = client.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            tools=[WEATHER, TIME],
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            parallel_tool_calls=False,
            max_tokens=80,
            **kw,
        )
        calls = r.choices[0].message.tool_calls
        check_calls(calls, ["get_time"])
        assert len(calls) == 1


def test_streamed_tool_calls_in_openai_shape(client):  # noqa: F811
    chunks = list(
        client.chat.completions.create(
            model="demo",
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=200,
            temperature=0,
            stream=True,
        )
    )
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].id and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    assert conforms(json.loads(args), SCHEMAS["get_weather"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_reply_cut_by_max_tokens_keeps_the_calls_it_finished(client, stream):  # noqa: F811
    # Seed 7 makes the demo model write two calls (seeded sampling repeats itself); with room for about one
    # and a half, the first is a valid call, the half is dropped, and finish_reason says the reply was cut.
    kw = dict(model="demo", messages=MESSAGES, tools=[WEATHER], tool_choice="required", temperature=1.0, seed=7)
    whole = client.chat.completions.create(max_tokens=400, **kw).choices[0].message.tool_calls
    assert whole and len(whole) > 1, "pick a seed that gives more than one call"
    for budget in range(8, 120, 4):  # the first budget that finishes a call ends inside the next one
        r = client.chat.completions.create(max_tokens=budget, **kw)
        if r.choices[0].message.tool_calls:
            break
    else:
        pytest.fail("no budget up to 120 tokens finished a call")
    assert r.choices[0].finish_reason == "length"
    if stream:
        chunks = list(client.chat.completions.create(max_tokens=budget, stream=True, **kw))
        deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        calls = [(d.function.name, d.function.arguments) for d in deltas]
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        calls = [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert r.choices[0].message.content is None
    assert 0 < len(calls) < len(whole)
    assert calls == [(c.function.name, c.function.arguments) for c in whole][: len(calls)]
    for _, args in calls:
        assert conforms(json.loads(args), SCHEMAS["get_weather"])


def test_whole_items_of_a_cut_array():
    assert tools._whole_items('[{"a": 1}, {"b": [2, 3]}, {"c": "x') == [{"a": 1}, {"b": [2, 3]}]
    assert tools._whole_items('[{"a": 1') == [] and tools._whole_items("no array") == []
    assert tools._whole_items(' [ {"a": "]"} ,\n {') == [{"a": "]"}]


def test_tool_turns_in_the_history_reach_the_prompt(client, stack):  # noqa: F811
    history = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
    ]
    r = client.chat.completions.create(model="demo", messages=history, tools=[WEATHER], max_tokens=8, temperature=0)
    plain = [{"role": m["role"], "content": m.get("content") or ""} for m in history]
    rendered = tools.render_messages(
        plain[:1] + [dict(plain[1], tool_calls=history[1]["tool_calls"])] + plain[2:], None
    )
    assert "<tool_response>\n21 degrees\n</tool_response>" in rendered[-1]["content"]
    assert '"city": "Paris"' in rendered[1]["content"]
    with_tools = stack.gateway.chat_prompt(tools.render_messages(rendered, tools.plan([WEATHER], None, True)))
    assert r.usage.prompt_tokens == len(with_tools)
    assert r.choices[0].finish_reason in ("stop", "length")  # auto: a free reply (no call from a random model)


def test_auto_parses_hermes_blocks():
    plan = tools.plan([WEATHER, TIME], "auto", True)
    text = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    content, calls = tools.parse_reply(text, plan)
    assert content == "Let me check." and calls[0].function.name == "get_time"
    assert json.loads(calls[0].function.arguments) == {"zone": "utc"}
    assert tools.parse_reply("no calls here", plan) == ("no calls here", [])


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tools_are_400s_naming_the_field(stack, extra, param):  # noqa: F811
    body = {"model": "demo", "messages": MESSAGES, "max_tokens": 4} | extra
    r = http("POST", stack.base_url + "/v1/chat/completions", json_body=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.json()


class Weather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=8)
    unit: str = pydantic.Field(pattern="^(c|f)$")


def test_langchain_bind_tools_and_structured_output(stack):  # noqa: F811
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=stack.base_url + "/v1", api_key="unused", model="demo", max_tokens=80, temperature=0)
    # strict, one call: no more properties or calls (a random model would otherwise add them up to max_tokens)
    msg = llm.bind_tools([Weather], tool_choice="required", strict=True, parallel_tool_calls=False).invoke(
        "Weather in Paris?"
    )
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "Weather"
    assert isinstance(Weather(**msg.tool_calls[0]["args"]), Weather)
    out = llm.with_structured_output(Weather, method="function_calling", strict=True).invoke("Weather in Paris?")
    assert isinstance(out, Weather)


def test_tool_call_parser_flag():
    from gateway.__main__ import parse_args

    config, _ = parse_args(["--verify", "127.0.0.1:1", "--tool-call-parser", "hermes"])
    assert config.tool_call_parser == "hermes"
    with pytest.raises(SystemExit):
        parse_args(["--verify", "127.0.0.1:1", "--tool-call-parser", "nope"])
    # the flag offers exactly the parsers the chat route has
    from gateway.config import TOOL_CALL_PARSER_NAMES

    assert set(TOOL_CALL_PARSER_NAMES) == set(tools.TOOL_CALL_PARSERS)
