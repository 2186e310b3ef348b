"""The Responses API (POST /v1/responses, GET /v1/responses/{id}) through the real services and the official
openai client: a plain text reply (chat's own reply to the same messages), the streamed events in order, a
function call and its output fed back, a json_schema reply that validates (`responses.parse` and
`responses.stream`), a conversation continued by previous_response_id in its session (the second turn
reuses the first's KV cache), stored responses, and a 400 naming each field specmesh does not honour (the
official client's whole list of them walked)."""

import json

import openai
import openai.types.responses.response_create_params as response_params
import pydantic
import pytest

from tests.integration.test_tools import WEATHER as CHAT_WEATHER
from tests.support.rest import http
from tests.support.structured import client, conforms, stack, target  # noqa: F401

# The chat tests' tool in the Responses API's flat shape: {"type": "function", "name", "parameters", ...}.
WEATHER = {"type": "function", **CHAT_WEATHER["function"]}


class Person(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=6)
    age: int = pydantic.Field(ge=0, le=99)


def test_plain_text_is_chats_reply(client):  # noqa: F811
    r = client.responses.create(
        model="demo", instructions="Be brief.", input="Write a loop.", max_output_tokens=16, temperature=0
    )
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Write a loop."}],
        max_tokens=16,
        temperature=0,
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "demo"
    assert r.output_text == chat.choices[0].message.content
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    finished = chat.choices[0].finish_reason
    assert r.status == ("incomplete" if finished == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.instructions == "Be brief." and r.max_output_tokens == 16 and r.temperature == 0

    # message items in the input, text parts too
    items = [
        {"role": "developer", "content": "Be brief."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Write a loop."}]},
    ]
    again = client.responses.create(model="demo", input=items, max_output_tokens=16, temperature=0)
    assert again.output_text == r.output_text


def test_streamed_events_in_order(client):  # noqa: F811
    events = list(client.responses.create(model="demo", input="Write a loop.", max_output_tokens=16, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 0
    ending = "response.completed" if kinds[-1] == "response.completed" else "response.incomplete"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        ending,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text  # the output_text.done event's
    assert final.usage.output_tokens > 0 and final.status in ("completed", "incomplete")
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


def test_a_function_call_and_its_output_fed_back(client):  # noqa: F811
    r = client.responses.create(
        model="demo",
        input="Weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=80,
        temperature=0,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and r.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id.startswith("call_")
        assert conforms(json.loads(call.arguments), WEATHER["parameters"]), call.arguments
    # the tool's answer goes back in the conversation, which continues in its session
    follow = client.responses.create(
        model="demo",
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temp": 21}'}],
        tools=[WEATHER],
        max_output_tokens=16,
        temperature=0,
    )
    assert follow.previous_response_id == r.id and follow.usage.input_tokens_details.cached_tokens > 0

    # streamed: the call's item, its arguments, in order
    events = list(
        client.responses.create(
            model="demo",
            input="Weather in Paris?",
            tools=[WEATHER],
            tool_choice={"type": "function", "name": "get_weather"},
            parallel_tool_calls=False,  # one call: sampled, a longer list could outrun max_output_tokens
            max_output_tokens=80,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    done = events[5].item
    assert done.type == "function_call" and done.name == "get_weather" and done.arguments == events[4].arguments
    assert events[-1].response.output[0].call_id == done.call_id


def test_json_schema_replies_validate(client):  # noqa: F811
    r = client.responses.parse(model="demo", input="A person, in JSON.", text_format=Person, max_output_tokens=60)
    assert r.status == "completed" and isinstance(r.output_parsed, Person), r.output_text
    schema = Person.model_json_schema()
    for kw in (dict(temperature=0), dict(temperature=1.0)):
        r = client.responses.create(
            model="demo",
            input="A person, in JSON.",
            text={"format": {"type": "json_schema", "name": "person", "schema": schema, "strict": True}},
            max_output_tokens=60,
            **kw,
        )
        assert r.status == "completed" and conforms(json.loads(r.output_text), schema), r.output_text
        assert r.text.format.type == "json_schema"
    with client.responses.stream(
        model="demo", input="A person, in JSON.", text_format=Person, max_output_tokens=60
    ) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Person)


def test_previous_response_id_continues_in_the_session_and_stored_ones_come_back(client):  # noqa: F811
    first = client.responses.create(model="demo", input="Write a loop.", max_output_tokens=12, temperature=0)
    second = client.responses.create(
        model="demo", input="Now a function.", previous_response_id=first.id, max_output_tokens=12, temperature=0
    )
    # the second turn's prompt is the first's, its reply, then the new input: the cached part is reused
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0
    streamed = list(
        client.responses.create(
            model="demo", input="And a class.", previous_response_id=second.id, max_output_tokens=8, stream=True
        )
    )
    assert streamed[-1].response.usage.input_tokens_details.cached_tokens > 0

    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(model="demo", input="Hi", previous_response_id="resp_unknown")
    assert e.value.body["param"] == "previous_response_id"
    unstored = client.responses.create(model="demo", input="Hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"background": True}, "background"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        (
            {
                "text": {
                    "format": {"type": "json_schema", "name": "x", "schema": {"type": "string", "format": "no-such"}}
                }
            },
            "text.format",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": "hi", "name": "bob"}]}, "input[0].name"),
        ({"input": ""}, "input"),
        ({"metadata": {"k": 1}}, "metadata.k"),
    ],
)
def test_bad_fields_are_400s_naming_them(stack, extra, param):  # noqa: F811
    body = {"model": "demo", "input": "Hi", "max_output_tokens": 4, **extra}
    r = http("POST", stack.base_url + "/v1/responses", json_body=body)
    assert r.status_code == 400, r.json()
    err = r.json()["error"]
    assert err["param"] == param and param.split("[")[0] in err["message"], err


HONOURED = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools", "tool_choice",
    "parallel_tool_calls", "text", "previous_response_id", "store", "metadata",
}  # fmt: skip


def test_every_other_field_of_the_official_clients_list_is_a_400_naming_it(stack):  # noqa: F811
    """The official client's own list of the request's fields (a field a newer client adds is walked too):
    each one specmesh does not honour, sent with a value, is refused, named."""
    fields: dict = {}
    for base in reversed(response_params.ResponseCreateParamsBase.__mro__):
        fields.update(getattr(base, "__annotations__", {}))
    refused = sorted(set(fields) - HONOURED)
    assert {"background", "include", "reasoning", "truncation", "conversation"} <= set(refused)
    for name in refused:
        body = {"model": "demo", "input": "Hi", "max_output_tokens": 2, name: True}
        r = http("POST", stack.base_url + "/v1/responses", json_body=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.json())
