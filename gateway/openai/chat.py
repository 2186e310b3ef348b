"""POST /v1/chat/completions: messages in (through the tokenizer's chat template), the reply out, whole or
streamed; a streamed reply starts with a chunk that carries the role."""

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
)


class Chat:
    """The chat route and the shape of its answers (see `serving.Api`)."""

    path, name = "/v1/chat/completions", "chat"
    request_type = ChatCompletionRequest
    response_type, chunk_type = ChatCompletionResponse, ChatCompletionStreamResponse
    id_prefix = "chatcmpl-"
    span_name = "gateway.chat"

    async def prompt_ids(self, gateway: Gateway, body: ChatCompletionRequest) -> list[int]:
        return await gateway.tokenize_chat([m.to_prompt() for m in body.messages])

    def choice(self, text: str, finish: str | None) -> ChatChoice:
        return ChatChoice(message=ChatResponseMessage(content=text), finish_reason=finish)

    def opening(self) -> list[ChatStreamChoice]:
        return [ChatStreamChoice(delta=DeltaMessage(role="assistant", content=""), finish_reason=None)]

    def delta(self, text: str | None, finish: str | None) -> ChatStreamChoice:
        return ChatStreamChoice(delta=DeltaMessage(content=text), finish_reason=finish)


def router(front: serving.Front) -> APIRouter:
    return serving.router(front, Chat())
