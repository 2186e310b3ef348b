"""What the completions and chat routes share (each is an `Api`: its route, request and answer types): a
request's way in (API key, body size, JSON, the model asked for, the caller's tenant and session) and its
way out (one generation answered as one JSON body or as server-sent events, traced, with a request id). A
client that goes away, streaming or not, cancels the work downstream.

Whatever a client sends, the answer is in OpenAI's shape, never a 500: the body is read and parsed as
`gateway.openai.body` says, and a value that is refused is quoted only in part (`gateway.core.shown`).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from pydantic import BaseModel

from gateway.core import Chunk, Gateway, GenRequest, Outcome, shown
from gateway.openai import sse
from gateway.openai.body import read_json_object
from gateway.openai.protocol import (
    SESSION_ID_MAX,
    APIError,
    GenerationRequest,
    ResponseBase,
    SpecmeshStats,
    StreamResponseBase,
    Usage,
    parse_request,
    stream_payload,
)
from gateway.tenancy import downstream_session_id, tenant_of
from specmesh import telemetry
from specmesh.errors import SpecmeshError, Unavailable

# Bodies are no longer drained to many times the limit (gateway.openai.body); kept at 1 for code that still
# reads bodies itself until it uses Front.read_json.
DRAIN_FACTOR = 1


@dataclass(frozen=True)
class Front:
    """The REST front's settings and the gateway behind it."""

    gateway: Gateway
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 1 << 20
    keyed_tenants: bool = False  # API keys are checked, so each key is a tenant of its own (gateway.tenancy)
    created: int = field(default_factory=lambda: int(time.time()))
    tracer: trace.Tracer = field(default_factory=lambda: telemetry.tracer("gateway"))

    @property
    def model_name(self) -> str:
        return self.gateway.config.model_name

    def authorize(self, request: Request) -> None:
        if not self.api_keys:
            return
        auth = request.headers.get("authorization", "")
        if not auth.startswith("Bearer ") or auth[7:].strip() not in self.api_keys:
            raise APIError(401, "invalid or missing API key (Authorization: Bearer <key>)", None, "invalid_api_key")

    def tenant(self, request: Request) -> str:
        """The caller's tenant, from the API key the gateway's authentication accepted (one shared tenant
        when the gateway checks no keys)."""
        return tenant_of(request.headers.get("authorization"), self.keyed_tenants)

    async def read_body(self, request: Request) -> dict:
        """The request's JSON object (`read_json`), once the model it names is checked."""
        body = await self.read_json(request)
        self._check_model(body.get("model"))
        return body

    async def read_json(self, request: Request) -> dict:
        """The request's JSON object, once the API key and its size are checked (gateway.openai.body: the
        size is enforced as the body arrives, and whatever the JSON holds, a bad one is a 400)."""
        self.authorize(request)
        return await read_json_object(request, self.max_body_bytes, self.gateway.off_loop)

    def _check_model(self, model) -> None:
        if model is None:
            raise APIError(400, "'model' is required", "model", "missing_required_parameter")
        if not isinstance(model, str):
            raise APIError(400, f"'model' must be a string, got {shown(model)}", "model", "invalid_type")
        if model != self.model_name:
            raise APIError(
                404,
                f"the model {shown(model)} does not exist; this gateway serves {shown(self.model_name)}",
                "model",
                "model_not_found",
            )

    def gen_request(self, request: Request, body: GenerationRequest, prompt_ids: list[int]) -> GenRequest:
        """The generation a validated request asks for. The session comes from the body or X-Session-Id;
        the id sent downstream is scoped to the caller's tenant and cache_salt (gateway.tenancy)."""
        session_id = body.session_id or request.headers.get("x-session-id", "")
        if len(session_id) > SESSION_ID_MAX:
            raise APIError(
                400, f"'session_id' must be at most {SESSION_ID_MAX} characters", "session_id", "invalid_value"
            )
        scoped = downstream_session_id(self.tenant(request), body.cache_salt or "", session_id)
        return GenRequest(prompt_ids, body.to_sampling_params(), scoped, body.num_speculative_tokens)


class Head(NamedTuple):
    """The fields every response and chunk of one request starts with."""

    id: str
    created: int
    model: str


class Api(Protocol):
    """What one route family (completions, chat) has of its own: its route, its request, the prompt it
    makes of it, and the types and choices of its answer."""

    path: str
    name: str  # the route's name (and OpenAPI operation)
    request_type: type[GenerationRequest]
    response_type: type[ResponseBase]
    chunk_type: type[StreamResponseBase]
    id_prefix: str
    span_name: str

    async def prompt_ids(self, gateway: Gateway, body: Any) -> list[int]:
        """The prompt's token ids (tokenized off the event loop)."""
        ...

    def choice(self, text: str, finish: str | None) -> BaseModel:
        """The one choice of a whole answer."""
        ...

    def opening(self) -> list[BaseModel]:
        """The choices of a stream's first chunks, before any text."""
        ...

    def delta(self, text: str | None, finish: str | None) -> BaseModel:
        """A stream chunk's choice: new text, or the finish reason."""
        ...


def router(front: Front, api: Api) -> APIRouter:
    routes = APIRouter()

    @routes.post(api.path, name=api.name)
    async def generate(request: Request) -> Response:
        body = parse_request(api.request_type, await front.read_body(request))
        ids = await api.prompt_ids(front.gateway, body)
        return await respond(front, request, front.gen_request(request, body, ids), body, api)

    return routes


def _with_totals(model: type[ResponseBase], head: Head, choices: list, outcome: Outcome) -> ResponseBase:
    """A whole answer, or a stream's last chunk: the choices with the generation's usage and speculation."""
    return model(**head._asdict(), choices=choices, usage=Usage.of(outcome), specmesh=SpecmeshStats.of(outcome))


class RequestSpan:
    """The gateway's server span of one request (the parent of every downstream span), ended once."""

    def __init__(self, tracer: trace.Tracer, name: str, request: Request, outcome: Outcome, attributes: dict):
        self.span = tracer.start_span(
            name, kind=trace.SpanKind.SERVER, context=propagate.extract(dict(request.headers)), attributes=attributes
        )
        self.outcome = outcome
        self.ended = False

    def outgoing_metadata(self) -> tuple:
        with trace.use_span(self.span, end_on_exit=False):
            return telemetry.outgoing_metadata()

    def end(self, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        o = self.outcome
        self.span.set_attributes(
            {
                "specmesh.completion_tokens": o.completion_tokens,
                "specmesh.failovers": o.failovers,
                "specmesh.target_only": o.target_only,
                "specmesh.verify_replica": o.verify_replica,
                "specmesh.accepted": o.stats.accepted,
                "specmesh.drafted": o.stats.drafted,
            }
        )
        if error:
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, error))
        self.span.end()


def _failed(span: RequestSpan, e: SpecmeshError) -> Response:
    span.end(str(e))
    # Unavailable means the gateway has tried the other replicas already: a client retry would not help.
    return APIError.from_domain(e).response(retried=isinstance(e, Unavailable))


async def respond(front: Front, request: Request, req: GenRequest, body: GenerationRequest, api: Api) -> Response:
    """Run the generation and answer with it: one JSON body, or server-sent events when `body.stream`."""
    rid = api.id_prefix + uuid.uuid4().hex
    outcome = Outcome(prompt_tokens=len(req.prompt_ids))
    telemetry.REQUEST_ID.set(rid)
    span = RequestSpan(
        front.tracer,
        api.span_name,
        request,
        outcome,
        {
            "specmesh.request_id": rid,
            "specmesh.stream": body.stream,
            "specmesh.prompt_tokens": len(req.prompt_ids),
            "specmesh.session_id": req.session_id,
        },
    )
    req.metadata = span.outgoing_metadata()
    gen = front.gateway.generate(req, outcome)
    # Run up to the first chunk before answering, so errors found before any output (bad input,
    # overload, no replica) are real HTTP statuses rather than stream events.
    try:
        first = await anext(gen, None)
    except SpecmeshError as e:
        await gen.aclose()
        return _failed(span, e)
    generation = Generation(api, outcome, span, gen, first)
    if body.stream:
        return generation.stream(Head(rid, int(time.time()), front.model_name), body.include_usage)
    return await generation.complete(request, front.model_name, rid)


@dataclass
class Generation:
    """One generation being answered: the gateway's chunks (the first already there), its totals, its span."""

    api: Api
    outcome: Outcome
    span: RequestSpan
    chunks: AsyncGenerator[Chunk, None]
    first: Chunk | None

    async def complete(self, request: Request, model: str, rid: str) -> Response:
        """The whole answer as one JSON body; 499 (and the work stopped) if the client goes away first."""
        collector = asyncio.ensure_future(self._collect())
        try:
            while not collector.done():
                await asyncio.wait({collector}, timeout=0.25)
                if not collector.done() and await request.is_disconnected():
                    collector.cancel()
                    self.span.end("client disconnected")
                    return Response(status_code=499)
            text, finish = collector.result()
        except SpecmeshError as e:
            return _failed(self.span, e)
        finally:
            if not collector.done():
                collector.cancel()
            await self.chunks.aclose()
            self.span.end()
        head = Head(rid, int(time.time()), model)
        answer = _with_totals(self.api.response_type, head, [self.api.choice(text, finish)], self.outcome)
        return JSONResponse(answer.model_dump(), headers={"x-request-id": rid})

    async def _collect(self) -> tuple[str, str | None]:
        pieces, finish, chunk = [], None, self.first
        while chunk is not None:
            pieces.append(chunk.text)
            finish = chunk.finish_reason or finish
            chunk = await self.chunks.__anext__() if chunk.finish_reason is None else None
        return "".join(pieces), finish

    def stream(self, head: Head, include_usage: bool) -> StreamingResponse:
        async def close() -> None:
            await self.chunks.aclose()  # also when the client went away: cancels the work downstream
            self.span.end()

        events = sse.event_stream(self._payloads(head, include_usage), self.span.end, close)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", "x-request-id": head.id},
        )

    async def _payloads(self, head: Head, include_usage: bool) -> AsyncGenerator[dict, None]:
        chunk, choices = self.first, self.api.opening()
        while chunk is not None:
            if chunk.text:
                choices.append(self.api.delta(chunk.text, None))
            if chunk.finish_reason is not None:
                choices.append(self.api.delta(None, chunk.finish_reason))
            for choice in choices:  # one choice per event
                yield stream_payload(self.api.chunk_type(**head._asdict(), choices=[choice]), include_usage)
            if chunk.finish_reason is not None:
                break
            chunk, choices = await self.chunks.__anext__(), []
        if include_usage:
            yield stream_payload(_with_totals(self.api.chunk_type, head, [], self.outcome), include_usage)
