"""The Responses API's request as the chat request it becomes (input items, instructions, the conversation
so far, function tools, text.format), its stored responses (least recently used evicted, per tenant), and a
typed stream's error events."""

import asyncio

import pytest

from gateway.openai import sse
from gateway.openai.protocol import APIError, parse_request
from gateway.openai.responses import Answer, ResponsesRequest, ResponseStore, Stored, _failed
from specmesh.errors import Unavailable


def request(**kw) -> ResponsesRequest:
    return parse_request(ResponsesRequest, {"model": "demo", "input": "Hi", **kw})


def test_text_input_and_instructions_are_chat_messages():
    body = request(instructions="Be brief.", max_output_tokens=9, temperature=0.5).chat_body([], "s")
    assert body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert (body["max_completion_tokens"], body["temperature"], body["session_id"]) == (9, 0.5, "s")
    assert "tools" not in body and "response_format" not in body


def test_items_become_turns_and_a_call_joins_its_reply():
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
    ]
    history = [{"role": "user", "content": "Earlier"}, {"role": "assistant", "content": "Yes"}]
    messages = request(input=items, instructions="Sys").chat_body(history, "s")["messages"]
    assert messages == [
        {"role": "system", "content": "Sys"},
        *history,
        {"role": "user", "content": "Weather ?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
    ]


def test_function_tools_and_text_format_in_chats_shape():
    tool = {"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = request(
        tools=[tool],
        tool_choice={"type": "function", "name": "f"},
        text={"format": {"type": "json_schema", "name": "out", "schema": schema}},
    ).chat_body([], "s")
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["response_format"] == {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}
    assert "response_format" not in request(text={"format": {"type": "text"}}).chat_body([], "s")
    assert request(text={"format": {"type": "json_object"}}).chat_body([], "s")["response_format"] == {
        "type": "json_object"
    }


@pytest.mark.parametrize(
    "kw, param",
    [
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 3}]}, "input[0].output"),
        ({"input": [{"role": "user", "content": 7}]}, "input[0].content"),
        ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ],
)
def test_malformed_items_name_their_field(kw, param):
    with pytest.raises(APIError) as e:
        request(**kw).chat_body([], "s")
    assert e.value.status == 400 and e.value.param == param


def stored(tenant: str, rid: str) -> Stored:
    return Stored(tenant, {"id": rid}, [], rid)


def test_the_store_evicts_the_least_recently_used_and_keeps_tenants_apart():
    store = ResponseStore(capacity=2)
    store.put("a", stored("t1", "a"))
    store.put("b", stored("t1", "b"))
    assert store.get("t1", "a") is not None  # now the most recently used
    store.put("c", stored("t1", "c"))
    assert len(store) == 2 and store.get("t1", "b") is None and store.get("t1", "a") is not None
    assert store.get("t2", "a") is None  # another tenant's
    none = ResponseStore(capacity=0)
    none.put("a", stored("t1", "a"))
    assert len(none) == 0


def test_a_typed_stream_reports_a_late_error_as_its_events_and_ends_without_done():
    answer = Answer("resp_x", request(stream=True), "demo")

    async def payloads():
        yield answer.event("response.created", response=answer.response("in_progress", []))
        raise Unavailable("no replica")

    async def close():
        pass

    async def run():
        return [e async for e in sse.event_stream(payloads(), lambda _: None, close, lambda e: _failed(answer, e))]

    events = asyncio.run(run())
    assert [e.split("\n", 1)[0] for e in events] == [
        "event: response.created",
        "event: error",
        "event: response.failed",
    ]
    assert '"sequence_number": 2' in events[-1] and '"status": "failed"' in events[-1]
    assert '"message": "no replica"' in events[1]
