"""POST /v1/completions: one prompt (text or token ids) in, its completion out, whole or streamed."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.core import Gateway
from gateway.openai import serving
from gateway.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
)


class Completions:
    """The completions route and the shape of its answers (see `serving.Api`)."""

    path, name = "/v1/completions", "completions"
    request_type = CompletionRequest
    response_type, chunk_type = CompletionResponse, CompletionStreamResponse
    id_prefix = "cmpl-"
    span_name = "gateway.completions"

    async def prompt_ids(self, gateway: Gateway, body: CompletionRequest) -> list[int]:
        return await gateway.tokenize(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)

    def choice(self, text: str, finish: str | None) -> CompletionChoice:
        return CompletionChoice(text=text, finish_reason=finish)

    def opening(self) -> list[CompletionChoice]:
        return []

    def delta(self, text: str | None, finish: str | None) -> CompletionChoice:
        return CompletionChoice(text=text or "", finish_reason=finish)


def router(front: serving.Front) -> APIRouter:
    return serving.router(front, Completions())
