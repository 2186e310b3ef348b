"""POST /v1/chat/completions: messages in (through the tokenizer's chat template), n replies out, whole or
streamed; a streamed reply starts with a chunk that carries the role; with `logprobs` the tokens'
log-probabilities in OpenAI's chat shape."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter

from gateway.core import Gateway
from gateway.openai import serving, tools
from gateway.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    LogprobEntry,
    chat_logprobs,
)


class Chat:
    """The chat route and the shape of its answers (see `serving.Api`)."""

    path, name = "/v1/chat/completions", "chat"
    request_type = ChatCompletionRequest
    response_type, chunk_type = ChatCompletionResponse, ChatCompletionStreamResponse
    id_prefix = "chatcmpl-"
    span_name = "gateway.chat"

    async def prompts(self, gateway: Gateway, body: ChatCompletionRequest) -> list[tuple[list[int], str | None]]:
        messages = [m.to_prompt() for m in body.messages]
        plan = body.tool_plan()
        if plan is not None or any(m.role == "tool" or m.tool_calls for m in body.messages):
            messages = tools.render_messages(messages, plan)
        return [(await gateway.tokenize_chat(messages), None)]

    def for_request(self, body: ChatCompletionRequest, gateway: Gateway) -> Chat:
        plan = body.tool_plan()
        if plan is None or not plan.parses:
            return self
        return ChatWithTools(dataclasses.replace(plan, parser=gateway.config.tool_call_parser))

    def choice(self, index: int, text: str, finish: str | None, logprobs: list[LogprobEntry] | None) -> ChatChoice:
        lp = chat_logprobs(logprobs) if logprobs is not None else None
        return ChatChoice(index=index, message=ChatResponseMessage(content=text), logprobs=lp, finish_reason=finish)

    def opening(self, index: int) -> list[ChatStreamChoice]:
        return [ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""), finish_reason=None)]

    def delta(
        self, index: int, text: str | None, finish: str | None, logprobs: list[LogprobEntry] | None
    ) -> ChatStreamChoice:
        lp = chat_logprobs(logprobs) if logprobs is not None else None
        return ChatStreamChoice(index=index, delta=DeltaMessage(content=text), logprobs=lp, finish_reason=finish)


class ChatWithTools(Chat):
    """A chat request with tools: the reply's tool calls come back as `tool_calls` (finish_reason
    "tool_calls"). Streamed, the reply is held back until it ends (a tool call cannot be told from text
    before its block closes), then sent as one delta: the content, and each call with its index, id, name
    and arguments."""

    def __init__(self, plan: tools.ToolPlan):
        self.plan = plan
        self._held: dict[int, list[str]] = {}

    def _finish(self, calls: list, finish: str | None) -> str | None:
        return "tool_calls" if calls and finish == "stop" else finish

    def choice(self, index: int, text: str, finish: str | None, logprobs: list[LogprobEntry] | None) -> ChatChoice:
        content, calls = tools.parse_reply(text, self.plan)
        lp = chat_logprobs(logprobs) if logprobs is not None else None
        message = ChatResponseMessage(content=content, tool_calls=calls or None)
        return ChatChoice(index=index, message=message, logprobs=lp, finish_reason=self._finish(calls, finish))

    def delta(
        self, index: int, text: str | None, finish: str | None, logprobs: list[LogprobEntry] | None
    ) -> ChatStreamChoice:
        held = self._held.setdefault(index, [])
        if text:
            held.append(text)
        lp = chat_logprobs(logprobs) if logprobs is not None else None
        if finish is None:
            return ChatStreamChoice(index=index, delta=DeltaMessage(content=""), logprobs=lp, finish_reason=None)
        content, calls = tools.parse_reply("".join(self._held.pop(index)), self.plan)
        delta = DeltaMessage(content=content, tool_calls=tools.delta_calls(calls) or None)
        return ChatStreamChoice(index=index, delta=delta, logprobs=lp, finish_reason=self._finish(calls, finish))


def router(front: serving.Front) -> APIRouter:
    return serving.router(front, Chat())
