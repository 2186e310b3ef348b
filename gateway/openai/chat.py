"""POST /v1/chat/completions: messages in (through the tokenizer's chat template), n replies out, whole or
streamed; a streamed reply starts with a chunk that carries the role; with `logprobs` the tokens'
log-probabilities in OpenAI's chat shape."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.core import Gateway
from gateway.openai import serving
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
        return [(await gateway.tokenize_chat([m.to_prompt() for m in body.messages]), None)]

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


def router(front: serving.Front) -> APIRouter:
    return serving.router(front, Chat())
