"""POST /v1/completions: one prompt or a list of them (text or token ids) in, n completions of each out,
whole or streamed; with `echo` the prompt first, with `logprobs` the tokens' log-probabilities."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.core import Gateway
from gateway.openai import serving
from gateway.openai.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    LogprobEntry,
    completion_logprobs,
)


class Completions:
    """The completions route and the shape of its answers (see `serving.Api`)."""

    path, name = "/v1/completions", "completions"
    request_type = CompletionRequest
    response_type, chunk_type = CompletionResponse, CompletionStreamResponse
    id_prefix = "cmpl-"
    span_name = "gateway.completions"

    async def prompts(self, gateway: Gateway, body: CompletionRequest) -> list[tuple[list[int], str | None]]:
        out = []
        for i, prompt in enumerate(body.prompt):
            param = "prompt" if len(body.prompt) == 1 else f"prompt[{i}]"
            ids = await gateway.tokenize(prompt, param) if isinstance(prompt, str) else list(prompt)
            out.append((ids, prompt if isinstance(prompt, str) else None))
        return out

    def choice(
        self, index: int, text: str, finish: str | None, logprobs: list[LogprobEntry] | None
    ) -> CompletionChoice:
        lp = completion_logprobs(logprobs) if logprobs is not None else None
        return CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish)

    def opening(self, index: int) -> list[CompletionChoice]:
        return []

    def delta(
        self, index: int, text: str | None, finish: str | None, logprobs: list[LogprobEntry] | None
    ) -> CompletionChoice:
        lp = completion_logprobs(logprobs) if logprobs is not None else None
        return CompletionChoice(index=index, text=text or "", logprobs=lp, finish_reason=finish)


def router(front: serving.Front) -> APIRouter:
    return serving.router(front, Completions())
