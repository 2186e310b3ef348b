"""POST /v1/chat/completions: messages in (through the tokenizer's chat template), the reply out, whole or
streamed; a streamed reply starts with a chunk that carries the role."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.core import Chunk, Outcome
from gateway.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    SpecmeshStats,
    Usage,
    parse_request,
)
from gateway.openai.serving import Front, Head, respond


class Chat:
    """The chat shape of an answer (see `serving.Api`)."""

    id_prefix = "chatcmpl-"
    span_name = "gateway.chat"

    def response(self, head: Head, text: str, finish: str | None, outcome: Outcome) -> ChatCompletionResponse:
        choice = ChatChoice(message=ChatResponseMessage(content=text), finish_reason=finish)
        return ChatCompletionResponse(
            **head._asdict(), choices=[choice], usage=Usage.of(outcome), specmesh=SpecmeshStats.of(outcome)
        )

    def stream_chunks(self, head: Head, chunk: Chunk, first: bool) -> list[ChatCompletionStreamResponse]:
        deltas = []
        if first:
            deltas.append((DeltaMessage(role="assistant", content=""), None))
        if chunk.text:
            deltas.append((DeltaMessage(content=chunk.text), None))
        if chunk.finish_reason is not None:
            deltas.append((DeltaMessage(), chunk.finish_reason))
        return [
            ChatCompletionStreamResponse(**head._asdict(), choices=[ChatStreamChoice(delta=d, finish_reason=f)])
            for d, f in deltas
        ]

    def usage_chunk(self, head: Head, outcome: Outcome) -> ChatCompletionStreamResponse:
        return ChatCompletionStreamResponse(
            **head._asdict(), choices=[], usage=Usage.of(outcome), specmesh=SpecmeshStats.of(outcome)
        )


def router(front: Front) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = parse_request(ChatCompletionRequest, await front.read_body(request))
        ids = front.gateway.chat_prompt([m.to_prompt() for m in body.messages])
        return await respond(front, request, front.gen_request(request, body, ids), body, Chat())

    return api
