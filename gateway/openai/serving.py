"""What the completions and chat routes share (each is an `Api`: its route, request and answer types): a
request's way in (API key, body size, JSON, the model asked for, the caller's tenant and session) and its
way out (one generation answered as one JSON body or as server-sent events, traced, with a request id). A
client that goes away, streaming or not, cancels the work downstream.

Whatever a client sends, the answer is in OpenAI's shape, never a 500: the body is read and parsed as
`gateway.openai.body` says, and a value that is refused is quoted only in part (`gateway.core.shown`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from opentelemetry import propagate, trace
from pydantic import BaseModel

from gateway.core import Chunk, Gateway, GenRequest, Outcome, shown, speculative_decoding
from gateway.openai import sse
from gateway.openai.body import read_json_object
from gateway.openai.protocol import (
    SESSION_ID_MAX,
    APIError,
    GenerationRequest,
    LogprobEntry,
    ResponseBase,
    ResponseMetrics,
    SpecmeshStats,
    SpeculativeDecoding,
    StreamResponseBase,
    Usage,
    parse_request,
    stream_payload,
)
from gateway.tenancy import downstream_session_id, prefix_scope, tenant_of
from specmesh import telemetry
from specmesh.domain import TokenLogprob
from specmesh.errors import SpecmeshError, Unavailable
from specmesh.sampling import SamplingParams


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
        the id sent downstream and the prefix-cache scope are scoped to the caller's tenant and cache_salt
        (gateway.tenancy)."""
        session_id = body.session_id or request.headers.get("x-session-id", "")
        if len(session_id) > SESSION_ID_MAX:
            raise APIError(
                400, f"'session_id' must be at most {SESSION_ID_MAX} characters", "session_id", "invalid_value"
            )
        tenant, salt = self.tenant(request), body.cache_salt or ""
        scoped = downstream_session_id(tenant, salt, session_id)
        scope = prefix_scope(tenant, salt)
        return GenRequest(prompt_ids, body.to_sampling_params(), scoped, body.num_speculative_tokens, cache_scope=scope)


class Head(NamedTuple):
    """The fields every response and chunk of one request starts with."""

    id: str
    created: int
    model: str


class Api(Protocol):
    """What one route family (completions, chat) has of its own: its route, its request, the prompts it
    makes of it, and the types and choices of its answer. Its types are read-only here (properties), and
    `opening` a Sequence, so that a route's own subclasses match."""

    path: str
    name: str  # the route's name (and OpenAPI operation)
    id_prefix: str
    span_name: str

    @property
    def request_type(self) -> type[GenerationRequest]: ...

    @property
    def response_type(self) -> type[ResponseBase[Any]]: ...

    @property
    def chunk_type(self) -> type[StreamResponseBase[Any]]: ...

    async def prompts(self, gateway: Gateway, body: Any) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids (tokenized off the event loop) and its text when it came as text."""
        ...

    def choice(self, index: int, text: str, finish: str | None, logprobs: list[LogprobEntry] | None) -> BaseModel:
        """One choice of a whole answer."""
        ...

    def opening(self, index: int) -> Sequence[BaseModel]:
        """The choices of a stream's first chunks for choice `index`, before any text."""
        ...

    def delta(self, index: int, text: str | None, finish: str | None, logprobs: list[LogprobEntry] | None) -> BaseModel:
        """A stream chunk's choice: new text (and its tokens' log-probabilities), or the finish reason."""
        ...


def router(front: Front, api: Api) -> APIRouter:
    routes = APIRouter()

    @routes.post(api.path, name=api.name)
    async def generate(request: Request) -> Response:
        body = parse_request(api.request_type, await front.read_body(request))
        body.check()
        # A route may answer one request its own way (chat with tools parses tool calls out of the reply).
        this = api.for_request(body, front.gateway) if hasattr(api, "for_request") else api
        prompts = await this.prompts(front.gateway, body)
        bad_words = await bad_word_ids(front.gateway, body.bad_words)
        return await respond(front, request, body, this, prompts, bad_words)

    return routes


async def bad_word_ids(gateway: Gateway, words: list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as it is and after a space (a word inside text is
    usually tokenized with its leading space), without duplicates."""
    out: list[tuple[int, ...]] = []
    for i, word in enumerate(words):
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(await gateway.tokenize(text, f"bad_words[{i}]")) if text.strip() else ()
            if ids and ids not in out:
                out.append(ids)
    return tuple(out)


AnswerT = TypeVar("AnswerT", bound=ResponseBase[Any] | StreamResponseBase[Any])


def _with_totals(
    model: type[AnswerT], head: Head, choices: list, outcome: Outcome, metrics: ResponseMetrics | None
) -> AnswerT:
    """A whole answer, or a stream's last chunk: the choices with the generation's usage and speculation."""
    usage, specmesh = Usage.of(outcome), SpecmeshStats.of(outcome)
    return model(**head._asdict(), choices=choices, usage=usage, specmesh=specmesh, metrics=metrics)


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
                "specmesh.handed_off": o.handed_off,
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


@dataclass
class Run:
    """One choice: a sample of one prompt, its generation and its totals."""

    index: int  # prompt-major: prompt p's sample j is choice p * n + j
    prompt_ids: list[int]
    req: GenRequest | None  # None: echo with max_tokens 0, nothing to generate
    outcome: Outcome
    echo: str = ""  # the prompt's text, when it is echoed
    echo_logprobs: list[tuple[int, TokenLogprob | None]] | None = None
    chunks: AsyncGenerator[Chunk, None] | None = None
    first: Chunk | None = None
    offset: int = 0  # characters of the choice's token texts so far (completions' text_offset)


class LogprobText:
    """Turns token ids and their log-probabilities into what the answer shows (each token's own text, as
    vLLM decodes it: one id at a time, special tokens kept)."""

    def __init__(self, gateway: Gateway):
        tokenizer = gateway.tokenizer
        self.decode = (lambda t: tokenizer.decode([t], skip_special_tokens=False)) if tokenizer is not None else None

    def text(self, token_id: int) -> str:
        return self.decode(token_id) if self.decode is not None else f"token_id:{token_id}"

    def entries(self, run: Run, tokens: list[tuple[int, TokenLogprob | None]]) -> list[LogprobEntry]:
        out = []
        for token_id, lp in tokens:
            token = self.text(token_id)
            top = [(self.text(t), v) for t, v in lp.top] if lp is not None else []
            out.append(LogprobEntry(token, lp.logprob if lp is not None else None, top, run.offset))
            run.offset += len(token)
        return out


def _choice_tokens(chunk: Chunk) -> list[tuple[int, TokenLogprob | None]]:
    lps: Sequence[TokenLogprob | None] = chunk.logprobs or [None] * len(chunk.token_ids)
    return list(zip(chunk.token_ids, lps, strict=True))


def _total(runs: list[Run], n: int) -> Outcome:
    """The request's totals: every prompt's tokens once, every choice's output, all the speculation."""
    total = Outcome(prompt_tokens=sum(len(r.prompt_ids) for r in runs if r.index % n == 0))
    for r in runs:
        o = r.outcome
        total.completion_tokens += o.completion_tokens
        total.cached_prompt_tokens += o.cached_prompt_tokens if r.index % n == 0 else 0
        total.stats.merge(o.stats)
        total.failovers += o.failovers
        total.target_only = total.target_only or o.target_only
        total.handed_off = total.handed_off or o.handed_off
        total.verify_replica = total.verify_replica or o.verify_replica
    return total


# The Outcome fields a request's totals carry over from its choices' (`_total`)
_TOTALLED = ("completion_tokens", "cached_prompt_tokens", "failovers", "target_only", "handed_off", "verify_replica")


async def _close(runs: list[Run]) -> None:
    for r in runs:
        if r.chunks is not None:
            await r.chunks.aclose()


async def respond(
    front: Front,
    request: Request,
    body: GenerationRequest,
    api: Api,
    prompts: list[tuple[list[int], str | None]],
    bad_words: tuple[tuple[int, ...], ...] = (),
) -> Response:
    """Run the n generations of every prompt (independent samples, each its own session) and answer with
    them: one JSON body, or server-sent events when `body.stream`."""
    generation = await begin(front, request, body, api, prompts, bad_words)
    if isinstance(generation, Response):
        return generation
    if body.stream:
        return generation.stream(Head(generation.rid, int(time.time()), front.model_name), body.include_usage)
    return await generation.complete(request, front.model_name)


async def begin(
    front: Front,
    request: Request,
    body: GenerationRequest,
    api: Api,
    prompts: list[tuple[list[int], str | None]],
    bad_words: tuple[tuple[int, ...], ...] = (),
    rid: str | None = None,
    span_name: str | None = None,
) -> Generation | Response:
    """Start the n generations of every prompt, each up to its first chunk: the Generation to answer with,
    or the error response when one failed before any output. `rid` and `span_name`: a route's own request id
    and span (for an answer in another shape than `api`'s, from its choices)."""
    rid = rid or api.id_prefix + uuid.uuid4().hex
    outcome = Outcome(prompt_tokens=sum(len(ids) for ids, _ in prompts))
    telemetry.REQUEST_ID.set(rid)
    span = RequestSpan(
        front.tracer,
        span_name or api.span_name,
        request,
        outcome,
        {
            "specmesh.request_id": rid,
            "specmesh.stream": body.stream,
            "specmesh.prompt_tokens": outcome.prompt_tokens,
            "specmesh.choices": len(prompts) * body.n,
            "specmesh.session_id": body.session_id or request.headers.get("x-session-id", ""),
        },
    )
    metadata = span.outgoing_metadata()
    params = body.to_sampling_params(bad_words)
    runs: list[Run] = []
    try:
        runs = await _runs(front, request, body, prompts, params, metadata)
        await _start(front.gateway, runs)
    except SpecmeshError as e:
        await _close(runs)
        return _failed(span, e)
    except BaseException:
        await _close(runs)
        span.end("failed")
        raise
    config = front.gateway.config
    return Generation(
        api,
        outcome,
        span,
        runs,
        body.n,
        LogprobText(front.gateway),
        params.logprobs is not None,
        rid,
        config.per_request_spec_decode_metrics,
        bool(config.draft),
    )


async def _runs(
    front: Front,
    request: Request,
    body: GenerationRequest,
    prompts: list[tuple[list[int], str | None]],
    params: SamplingParams,
    metadata: tuple,
) -> list[Run]:
    """A Run per choice, prompt-major; with `echo`, each with its prompt's text (and log-probabilities)."""
    echo = bool(getattr(body, "echo", False))
    runs: list[Run] = []
    for p, (ids, text) in enumerate(prompts):
        for j in range(body.n):
            index = p * body.n + j
            req = None
            if params.max_tokens > 0:
                req = front.gen_request(request, body, ids)
                # Independent samples: a session (and a seed) of their own, as vLLM's n does.
                seed = None if params.seed is None else (params.seed + j) % 2**63
                session = f"{req.session_id}#{index}" if req.session_id and index else req.session_id
                req = dataclasses.replace(req, params=dataclasses.replace(params, seed=seed), session_id=session)
                req.metadata = metadata
            run = Run(index, ids, req, Outcome(prompt_tokens=len(ids)))
            if echo:
                run.echo = text if text is not None else await front.gateway.off_loop(_decode, front.gateway, ids)
                if params.logprobs is not None:
                    scored = await front.gateway.prompt_logprobs(ids, params.logprobs, metadata)
                    run.echo_logprobs = [(ids[0], None), *zip(ids[1:], scored, strict=True)]
            runs.append(run)
    return runs


async def _start(gateway: Gateway, runs: list[Run]) -> None:
    """Start every run's generation and run it up to its first chunk before answering, so that errors found
    before any output (bad input, overload, no replica) are real HTTP statuses rather than stream events."""
    for r in runs:
        if r.req is not None:
            r.chunks = gateway.generate(r.req, r.outcome)
    started = [(r, r.chunks) for r in runs if r.chunks is not None]
    firsts = await asyncio.gather(*(anext(chunks, None) for _, chunks in started), return_exceptions=True)
    for (r, _), first in zip(started, firsts, strict=True):
        if isinstance(first, BaseException):
            raise first
        r.first = first


def _decode(gateway: Gateway, ids: list[int]) -> str:
    return gateway.tokenizer.decode(ids, skip_special_tokens=True) if gateway.tokenizer is not None else ""


@dataclass
class Generation:
    """The generations of one request being answered (their first chunks already there), totals, span."""

    api: Api
    outcome: Outcome  # the request's totals, filled in once every choice has finished
    span: RequestSpan
    runs: list[Run]
    n: int
    texts: LogprobText
    logprobs: bool  # the request asked for log-probabilities
    rid: str = ""  # the request's id
    spec_metrics: str = "none"  # the gateway's --per-request-spec-decode-metrics
    speculation: bool = True  # the gateway has draft replicas

    def finish_totals(self) -> None:
        total = _total(self.runs, self.n)
        for name in _TOTALLED:
            setattr(self.outcome, name, getattr(total, name))
        self.outcome.stats = total.stats

    def metrics(self) -> ResponseMetrics | None:
        """vLLM's `metrics` object of the finished request; None (left out) when the gateway reports none.
        Its speculative decoding describes one generation: null for several choices, as vLLM's."""
        if self.spec_metrics == "none":
            return None
        if len(self.runs) != 1 or not self.speculation:
            return ResponseMetrics(speculative_decoding=None)
        spec = speculative_decoding(self.outcome.stats, self.spec_metrics == "detailed")
        return ResponseMetrics(speculative_decoding=SpeculativeDecoding(**spec))

    async def complete(self, request: Request, model: str) -> Response:
        """The whole answer as one JSON body; 499 (and the work stopped) if the client goes away first."""
        choices = await self.collect(request)
        if isinstance(choices, Response):
            return choices
        head = Head(self.rid, int(time.time()), model)
        answer = _with_totals(self.api.response_type, head, choices, self.outcome, self.metrics())
        return JSONResponse(answer.payload(), headers={"x-request-id": self.rid})

    async def collect(self, request: Request) -> list[BaseModel] | Response:
        """Every choice, whole (`api.choice`), once all have finished and the totals are in; the error
        response when one failed, 499 (and the work stopped) if the client goes away first."""
        tasks = [asyncio.ensure_future(self._collect(r)) for r in self.runs]
        try:
            while True:
                done, pending = await asyncio.wait(tasks, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
                if not pending or any(t.exception() is not None for t in done):
                    break
                if await request.is_disconnected():
                    self.span.end("client disconnected")
                    return Response(status_code=499)
            choices = [t.result() for t in tasks]  # the first failure, if one failed
        except SpecmeshError as e:
            return _failed(self.span, e)
        finally:
            # Every collector stops before its generation is closed (a generator being iterated cannot be).
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await _close(self.runs)
            self.finish_totals()
            self.span.end()
        return list(choices)

    async def _collect(self, run: Run) -> BaseModel:
        pieces, finish, chunk = [run.echo], None, run.first
        tokens = list(run.echo_logprobs or [])
        while chunk is not None:
            pieces.append(chunk.text)
            tokens += _choice_tokens(chunk)
            finish = chunk.finish_reason or finish
            assert run.chunks is not None
            chunk = await run.chunks.__anext__() if chunk.finish_reason is None else None
        if run.req is None:
            finish = "length"  # echo with max_tokens 0: the (empty) completion ended at its length
        entries = self.texts.entries(run, tokens) if self.logprobs else None
        return self.api.choice(run.index, "".join(pieces), finish, entries)

    def stream(self, head: Head, include_usage: bool) -> StreamingResponse:
        return self.sse(self._payloads(head, include_usage))

    def sse(self, payloads: AsyncGenerator[dict, None], typed: sse.ErrorEvents | None = None) -> StreamingResponse:
        """`payloads` as server-sent events (`typed`: as `sse.event_stream` takes it); the generations are
        closed and the span ended however the stream ends."""

        async def close() -> None:
            await _close(self.runs)  # also when the client went away: cancels the work downstream
            self.span.end()

        events = sse.event_stream(payloads, self.span.end, close, typed)
        return StreamingResponse(
            events,
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no", "x-request-id": self.rid},
        )

    async def choices(self, run: Run) -> AsyncGenerator[BaseModel, None]:
        """The stream choices of one run, in order (`api.opening`, then `api.delta`s)."""
        for choice in self.api.opening(run.index):
            yield choice
        if run.echo or run.echo_logprobs:
            entries = self.texts.entries(run, run.echo_logprobs) if self.logprobs and run.echo_logprobs else None
            yield self.api.delta(run.index, run.echo, None, entries)
        if run.req is None:
            yield self.api.delta(run.index, None, "length", None)
            return
        chunk = run.first
        while chunk is not None:
            tokens = _choice_tokens(chunk)
            if chunk.text or (self.logprobs and tokens):
                entries = self.texts.entries(run, tokens) if self.logprobs else None
                yield self.api.delta(run.index, chunk.text, None, entries)
            if chunk.finish_reason is not None:
                yield self.api.delta(run.index, None, chunk.finish_reason, None)
                return
            assert run.chunks is not None
            chunk = await run.chunks.__anext__()

    async def _payloads(self, head: Head, include_usage: bool) -> AsyncGenerator[dict, None]:
        """One choice per event; several choices' events interleave as their generations produce them."""
        choices = self.choices(self.runs[0]) if len(self.runs) == 1 else _merged([self.choices(r) for r in self.runs])
        async with contextlib.aclosing(choices):
            async for choice in choices:
                yield stream_payload(self.api.chunk_type(**head._asdict(), choices=[choice]), include_usage)
        self.finish_totals()
        if include_usage:
            last = _with_totals(self.api.chunk_type, head, [], self.outcome, self.metrics())
            yield stream_payload(last, include_usage)


async def _merged(sources: list[AsyncGenerator[BaseModel, None]]) -> AsyncGenerator[BaseModel, None]:
    """The items of every source as they come; the first error ends it all (and stops the other sources)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(source: AsyncGenerator[BaseModel, None]) -> None:
        try:
            async for item in source:
                await queue.put(item)
            await queue.put(done)
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put(e)

    tasks = [asyncio.ensure_future(pump(s)) for s in sources]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is done:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for s in sources:
            await s.aclose()
