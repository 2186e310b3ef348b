"""POST /v1/completions: one prompt (text or token ids) in, its completion out, whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.core import Chunk, Outcome
from gateway.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    SpecmeshStats,
    Usage,
    parse_request,
)
from gateway.openai.serving import Front, Head, respond


class Completions:
    """The completion shape of an answer (see `serving.Api`)."""

    id_prefix = "cmpl-"
    span_name = "gateway.completions"

    def response(self, head: Head, text: str, finish: str | None, outcome: Outcome) -> CompletionResponse:
        return CompletionResponse(
            **head._asdict(),
            choices=[CompletionChoice(text=text, finish_reason=finish)],
            usage=Usage.of(outcome),
            specmesh=SpecmeshStats.of(outcome),
        )

    def stream_chunks(self, head: Head, chunk: Chunk, first: bool) -> list[CompletionStreamResponse]:
        choices = []
        if chunk.text:
            choices.append(CompletionChoice(text=chunk.text, finish_reason=None))
        if chunk.finish_reason is not None:
            choices.append(CompletionChoice(text="", finish_reason=chunk.finish_reason))
        return [CompletionStreamResponse(**head._asdict(), choices=[c]) for c in choices]

    def usage_chunk(self, head: Head, outcome: Outcome) -> CompletionStreamResponse:
        return CompletionStreamResponse(
            **head._asdict(), choices=[], usage=Usage.of(outcome), specmesh=SpecmeshStats.of(outcome)
        )


def router(front: Front) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(CompletionRequest, await front.read_body(request))
        ids = front.gateway.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        return await respond(front, request, front.gen_request(request, body, ids), body, Completions())

    return api
