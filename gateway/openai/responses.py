"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API over the chat route's machinery.

A request becomes a chat-completions request (`ResponsesRequest.chat_body`: the input items and the
instructions as messages, function tools as chat tools, `text.format` as `response_format`) and is generated
as chat generates it: the chat template, tools rendered hermes-style and read out of the reply, structured
output, sessions. Only the answer has a shape of its own: output items (a message of output_text, then a
function_call item per call), whole, or streamed as the typed events OpenAI's clients read, each with its
sequence number (response.created, response.in_progress, the items' added / delta / done events,
response.completed or response.incomplete; an error after the first event is an `error` event and
response.failed).

Stored responses (`store`, true by default) are kept per tenant, at most --max-stored-responses of them, the
least recently used evicted first: GET /v1/responses/{id} returns one, and `previous_response_id` continues
its conversation. The conversation's messages come first, and the request runs in the conversation's
session, so the verify replica that holds the conversation's KV cache reuses it
(`usage.input_tokens_details.cached_tokens`). A session serves one generation at a time: a continuation
that starts while another generation of its conversation runs gets a session of its own.

Any other field of OpenAI's request is refused with a 400 naming it.
"""

from __future__ import annotations

import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from gateway.core import Outcome, shown
from gateway.openai import serving
from gateway.openai.chat import Chat
from gateway.openai.protocol import (
    REFUSE_UNKNOWN,
    APIError,
    ChatChoice,
    ChatCompletionRequest,
    ChatStreamChoice,
    OpenAIRequestModel,
    parse_request,
)

MAX_METADATA = 16  # OpenAI's bounds on a response's metadata
ID_MAX = 256  # characters of an id a request names (a call's, a previous response's)
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
# The fields of each input item taken (an item's id and status, as an earlier response's output carries
# them, are its own: they change nothing); any other one is refused, naming it.
ITEM_FIELDS = {
    "message": {"type", "role", "content", "id", "status"},
    "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
    "function_call_output": {"type", "call_id", "output", "id", "status"},
}
# The chat request's parameters under the names this API gives them, for the errors the chat request raises.
CHAT_PARAMS = {"messages": "input", "response_format": "text.format", "max_completion_tokens": "max_output_tokens"}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, message, param, "invalid_value")


class TextConfig(OpenAIRequestModel):
    model_config = REFUSE_UNKNOWN
    format: dict | None = Field(None, description="an object with a type")


class ResponsesRequest(OpenAIRequestModel):
    """POST /v1/responses: what specmesh honours of it (any other field is a 400 naming it)."""

    model_config = REFUSE_UNKNOWN

    model: str
    input: str | list = Field(None, validate_default=True)
    instructions: str | None = Field(None, description="a string")
    max_output_tokens: int | None = Field(None, ge=1, lt=2**31, description="an integer in [1, 2**31)")
    temperature: float = Field(1.0, ge=0, le=2, description="a number in [0, 2]")
    top_p: float = Field(1.0, gt=0, le=1, description="a number in (0, 1]")
    stream: bool = Field(False, description="a boolean")
    tools: list | None = Field(None, description="a list of tools")
    tool_choice: str | dict | None = Field(None, description="none, auto, required or a named function")
    parallel_tool_calls: bool = Field(True, description="a boolean")
    text: TextConfig | None = None
    previous_response_id: str | None = Field(
        None, min_length=1, max_length=ID_MAX, description=f"a string of 1-{ID_MAX} characters"
    )
    store: bool = Field(True, description="a boolean")
    metadata: dict[str, str] | None = Field(
        None, max_length=MAX_METADATA, description=f"an object of at most {MAX_METADATA} strings"
    )

    @field_validator("input", mode="before")
    @classmethod
    def _text_or_items(cls, value: Any) -> Any:
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            return value
        raise PydanticCustomError("invalid_type", "must be a non-empty string or a non-empty list of input items")

    def messages(self) -> list[dict]:
        """The input as chat messages (a function_call item joins the assistant turn before it: one reply)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            extra = sorted(k for k, v in item.items() if v is not None and k not in ITEM_FIELDS.get(kind, item))
            if extra:
                param = f"input[{i}].{extra[0]}"
                raise APIError(400, f"'{param}' is not supported by specmesh", param, "unsupported")
            if kind == "message":
                role = item.get("role")
                if role not in ROLES:
                    raise _bad(f"input[{i}].role", f"'input[{i}].role' must be one of {', '.join(ROLES)}")
                out.append({"role": role, "content": _text(item.get("content"), f"input[{i}].content")})
            elif kind == "function_call":
                call = {
                    "id": _string(item, "call_id", i),
                    "type": "function",
                    "function": {"name": _string(item, "name", i), "arguments": _string(item, "arguments", i)},
                }
                if out and out[-1]["role"] == "assistant":
                    out[-1].setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                output = _text(item.get("output"), f"input[{i}].output")
                out.append({"role": "tool", "tool_call_id": _string(item, "call_id", i), "content": output})
            else:
                raise APIError(
                    400,
                    f"input items of type {shown(kind)} are not supported by specmesh (message, function_call, "
                    "function_call_output)",
                    f"input[{i}].type",
                    "unsupported",
                )
        return out

    def chat_tools(self) -> list | None:
        """The function tools in chat's shape ({"type": "function", "function": {...}})."""
        if self.tools is None:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if not isinstance(tool, dict) or tool.get("type") != "function":
                kind = tool.get("type") if isinstance(tool, dict) else tool
                raise APIError(
                    400,
                    f"tools of type {shown(kind)} are not supported by specmesh (function tools only)",
                    f"tools[{i}].type",
                    "unsupported",
                )
            out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
        return out

    def chat_tool_choice(self) -> str | dict | None:
        choice = self.tool_choice
        if choice is None or isinstance(choice, str):
            return choice
        if choice.get("type") == "function" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}
        raise _bad("tool_choice", "'tool_choice' must be none, auto, required or {'type': 'function', 'name': ...}")

    def response_format(self) -> dict | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.get("type") == "text":
            return None
        if fmt.get("type") == "json_object":
            return {"type": "json_object"}
        if fmt.get("type") == "json_schema":
            if not isinstance(fmt.get("schema"), dict):
                raise _bad("text.format.schema", "'text.format.schema' must be a JSON schema object")
            return {"type": "json_schema", "json_schema": {"name": fmt.get("name", ""), "schema": fmt["schema"]}}
        raise _bad("text.format.type", f"'text.format.type' must be text, json_object or json_schema, got {shown(fmt)}")

    def chat_body(self, history: list[dict], session_id: str) -> dict:
        """The chat request this one is: the instructions as a system message, the conversation so far, the
        input; the parameters chat takes under their chat names (only those given)."""
        system = [{"role": "system", "content": self.instructions}] if self.instructions else []
        body: dict[str, Any] = {
            "model": self.model,
            "messages": system + history + self.messages(),
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "session_id": session_id,
        }
        given = {
            "max_completion_tokens": self.max_output_tokens,
            "tools": self.chat_tools(),
            "tool_choice": self.chat_tool_choice(),
            "response_format": self.response_format(),
        }
        body.update((k, v) for k, v in given.items() if v is not None)
        return body


def _string(item: dict, key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not 0 < len(value) <= ID_MAX):
        what = "a JSON string" if key == "arguments" else f"a string of 1-{ID_MAX} characters"
        raise APIError(400, f"'input[{i}].{key}' must be {what}", f"input[{i}].{key}", "invalid_type")
    return value


def _text(content: Any, param: str) -> str:
    """A message's content: a string, or a list of text parts (input_text, output_text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"'{param}' must be a string or a list of text parts", param, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise APIError(
                400,
                f"content parts of type {shown(kind)} are not supported by specmesh (input_text, output_text)",
                f"{param}[{j}].type",
                "unsupported",
            )
        texts.append(part["text"])
    return "".join(texts)


# stored responses ------------------------------------------------------------------------------------------
@dataclass
class Stored:
    """A response kept for GET and for continuing its conversation."""

    tenant: str
    answer: dict  # the response object, as GET returns it
    conversation: list[dict]  # chat messages up to this response's reply (without the instructions)
    session_id: str  # the session its conversation's KV cache lives in


@dataclass
class ResponseStore:
    """Stored responses, the least recently used evicted past `capacity`; and the sessions in use."""

    capacity: int
    _kept: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    busy: set[str] = field(default_factory=set)  # sessions a generation runs in now

    def get(self, tenant: str, response_id: str) -> Stored | None:
        stored = self._kept.get(response_id)
        if stored is None or stored.tenant != tenant:
            return None
        self._kept.move_to_end(response_id)
        return stored

    def put(self, response_id: str, stored: Stored) -> None:
        if self.capacity <= 0:
            return
        self._kept[response_id] = stored
        self._kept.move_to_end(response_id)
        while len(self._kept) > self.capacity:
            self._kept.popitem(last=False)

    def __len__(self) -> int:
        return len(self._kept)


# answers -----------------------------------------------------------------------------------------------------
class Usage(BaseModel):
    input_tokens: int
    input_tokens_details: dict
    output_tokens: int
    output_tokens_details: dict
    total_tokens: int


# A response's status by its reply's finish reason (a generation cancelled before its end, as when the server
# shuts down, did not end well: failed).
STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "cancelled": "failed"}
CANCELLED = {"code": "cancelled", "message": "the generation was cancelled before its end"}


@dataclass
class Answer:
    """One response being built: its id and request, its output items, and its events' sequence numbers."""

    rid: str
    body: ResponsesRequest
    model: str
    created: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0

    def event(self, kind: str, **fields: Any) -> dict:
        out = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def response(self, status: str, output: list[dict], usage: Usage | None = None, error: dict | None = None) -> dict:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.rid,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": error or (CANCELLED if status == "failed" else None),
            "incomplete_details": incomplete,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": b.parallel_tool_calls,
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "temperature": b.temperature,
            "text": {"format": (b.text.format if b.text is not None else None) or {"type": "text"}},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "tools": b.tools or [],
            "top_p": b.top_p,
            "truncation": "disabled",
            "usage": usage.model_dump() if usage is not None else None,
            "metadata": b.metadata or {},
        }


def _usage(outcome: Outcome) -> Usage:
    return Usage(
        input_tokens=outcome.prompt_tokens,
        input_tokens_details={"cached_tokens": outcome.cached_prompt_tokens},
        output_tokens=outcome.completion_tokens,
        output_tokens_details={"reasoning_tokens": 0},
        total_tokens=outcome.prompt_tokens + outcome.completion_tokens,
    )


def _message_item(item_id: str, text: str, status: str) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [part]}


def _call_item(call, status: str = "completed") -> dict:
    """A function_call output item of one chat tool call (`tools.ToolCall` or its stream delta)."""
    return {
        "type": "function_call",
        "id": "fc_" + uuid.uuid4().hex,
        "call_id": call.id,
        "name": call.function.name,
        "arguments": call.function.arguments,
        "status": status,
    }


def _reply(content: str | None, calls: list) -> dict:
    """The reply as the conversation's next assistant message (chat's shape)."""
    out: dict[str, Any] = {"role": "assistant", "content": content or ""}
    if calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
            for c in calls
        ]
    return out


def _output(content: str | None, calls: list, status: str) -> list[dict]:
    """The output items of a reply: its text as a message (also when it is empty and calls nothing), then
    one function_call item per call."""
    items = [_message_item("msg_" + uuid.uuid4().hex, content or "", status)] if content or not calls else []
    return items + [_call_item(c) for c in calls]


# the routes ----------------------------------------------------------------------------------------------------
@dataclass
class Turn:
    """One request's place in its conversation: the messages before its reply, the session it runs in (in
    use while it generates), and where its answer is kept."""

    store: ResponseStore
    tenant: str
    rid: str
    body: ResponsesRequest
    history: list[dict]  # the conversation before this request's input
    session_id: str

    def claim(self) -> None:
        self.store.busy.add(self.session_id)

    def release(self) -> None:
        self.store.busy.discard(self.session_id)

    def keep(self, reply: dict, response: dict) -> None:
        """Store the response (when asked to and it ended well) with its conversation, reply included."""
        if self.body.store and response["status"] in ("completed", "incomplete"):
            conversation = [*self.history, *self.body.messages(), reply]
            self.store.put(self.rid, Stored(self.tenant, response, conversation, self.session_id))


class ResponsesFront:
    """The routes of the Responses API on one REST front, and its stored responses."""

    def __init__(self, front: serving.Front):
        self.front = front
        self.store = ResponseStore(front.gateway.config.max_stored_responses)

    def turn(self, request: Request, body: ResponsesRequest) -> Turn:
        tenant, rid = self.front.tenant(request), "resp_" + uuid.uuid4().hex
        history: list[dict] = []
        session_id = ""
        if body.previous_response_id is not None:
            previous = self.store.get(tenant, body.previous_response_id)
            if previous is None:
                raise APIError(
                    404,
                    f"no stored response {shown(body.previous_response_id)} (never stored, or evicted)",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            history, session_id = previous.conversation, previous.session_id
        if not session_id or session_id in self.store.busy:
            session_id = rid  # a new conversation, or its session is generating now: a session of its own
        return Turn(self.store, tenant, rid, body, history, session_id)

    async def create(self, request: Request) -> Response:
        front = self.front
        body = parse_request(ResponsesRequest, await front.read_body(request))
        turn = self.turn(request, body)
        chat = _chat_request(body.chat_body(turn.history, turn.session_id))
        api = Chat().for_request(chat, front.gateway)
        prompts = await api.prompts(front.gateway, chat)
        turn.claim()
        try:
            generation = await serving.begin(
                front, request, chat, api, prompts, rid=turn.rid, span_name="gateway.responses"
            )
        except BaseException:
            turn.release()
            raise
        if isinstance(generation, Response):
            turn.release()
            return generation
        answer = Answer(turn.rid, body, front.model_name)
        if body.stream:
            return generation.sse(_events(generation, answer, turn), typed=partial(_failed, answer))
        try:
            choices = await generation.collect(request)
        finally:
            turn.release()
        if isinstance(choices, Response):
            return choices
        choice = choices[0]
        assert isinstance(choice, ChatChoice)
        status = STATUS.get(choice.finish_reason or "stop", "completed")
        calls = choice.message.tool_calls or []
        response = answer.response(status, _output(choice.message.content, calls, status), _usage(generation.outcome))
        turn.keep(_reply(choice.message.content, calls), response)
        return JSONResponse(response, headers={"x-request-id": turn.rid})

    async def retrieve(self, response_id: str, request: Request) -> Response:
        self.front.authorize(request)
        stored = self.store.get(self.front.tenant(request), response_id)
        if stored is None:
            raise APIError(404, f"no stored response {shown(response_id)} (never stored, or evicted)", None)
        return JSONResponse(stored.answer)


def router(front: serving.Front) -> APIRouter:
    responses = ResponsesFront(front)
    routes = APIRouter()
    routes.add_api_route("/v1/responses", responses.create, methods=["POST"], name="responses")
    routes.add_api_route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"], name="response")
    return routes


def _chat_request(body: dict) -> ChatCompletionRequest:
    """The chat request, checked as the chat route checks its own; errors name this API's parameters."""
    try:
        chat = parse_request(ChatCompletionRequest, body)
        chat.check()
        return chat
    except APIError as e:
        if e.param is not None:
            head, dot, rest = e.param.partition(".")
            name, bracket, _ = head.partition("[")
            if name in CHAT_PARAMS:
                # an index into the messages is not one into the input: the input as a whole is named
                e.param = CHAT_PARAMS[name] if bracket else CHAT_PARAMS[name] + dot + rest
                e.message = re.sub(rf"\b{name}\b", CHAT_PARAMS[name], e.message, count=1)
        raise


async def _events(generation: serving.Generation, answer: Answer, turn: Turn) -> AsyncGenerator[dict, None]:
    """The typed events of a streamed response, from the chat generation's stream choices (a reply with
    tools comes as one choice at its end: its text, its calls)."""
    item_id = "msg_" + uuid.uuid4().hex
    text: list[str] = []
    finish, calls = None, []
    try:
        yield answer.event("response.created", response=answer.response("in_progress", []))
        yield answer.event("response.in_progress", response=answer.response("in_progress", []))
        async for choice in generation.choices(generation.runs[0]):
            assert isinstance(choice, ChatStreamChoice)
            if choice.delta.content:
                if not text:
                    for event in _open_message(answer, item_id):
                        yield event
                text.append(choice.delta.content)
                where = {"item_id": item_id, "output_index": 0, "content_index": 0}
                yield answer.event("response.output_text.delta", **where, delta=choice.delta.content, logprobs=[])
            if choice.finish_reason is not None:
                finish, calls = choice.finish_reason, choice.delta.tool_calls or []
        generation.finish_totals()
        status = STATUS.get(finish or "stop", "completed")
        output: list[dict] = []
        async for event in _closing(answer, item_id, "".join(text), calls, status, output):
            yield event
        response = answer.response(status, output, _usage(generation.outcome))
        turn.keep(_reply("".join(text) or None, calls), response)
        yield answer.event("response.completed" if status == "completed" else f"response.{status}", response=response)
    finally:
        turn.release()


async def _closing(
    answer: Answer, item_id: str, content: str, calls: list, status: str, output: list[dict]
) -> AsyncGenerator[dict, None]:
    """The events that end a streamed reply's items (the message, whose opening events came with its first
    text, then each call's), each item appended to `output` as it is done. A reply without calls always has
    its message, empty or not."""
    if content or not calls:
        if not content:
            for event in _open_message(answer, item_id):
                yield event
        message = _message_item(item_id, content, status)
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        yield answer.event("response.output_text.done", **where, text=content, logprobs=[])
        yield answer.event("response.content_part.done", **where, part=message["content"][0])
        yield answer.event("response.output_item.done", output_index=0, item=message)
        output.append(message)
    for call in calls:
        index, item = len(output), _call_item(call, "in_progress")
        yield answer.event("response.output_item.added", output_index=index, item={**item, "arguments": ""})
        where = {"item_id": item["id"], "output_index": index}
        yield answer.event("response.function_call_arguments.delta", **where, delta=item["arguments"])
        yield answer.event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        item["status"] = "completed"
        yield answer.event("response.output_item.done", output_index=index, item=item)
        output.append(item)


def _failed(answer: Answer, error: APIError) -> list[dict]:
    """The events that end a stream that failed after it began: `error`, then response.failed."""
    info = {"code": error.code or "server_error", "message": error.message}
    return [
        answer.event("error", code=error.code, message=error.message, param=error.param),
        answer.event("response.failed", response=answer.response("failed", [], error=info)),
    ]


def _open_message(answer: Answer, item_id: str) -> list[dict]:
    """The events that open the message item and its text part."""
    item = {"type": "message", "id": item_id, "status": "in_progress", "role": "assistant", "content": []}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    return [
        answer.event("response.output_item.added", output_index=0, item=item),
        answer.event("response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=part),
    ]
