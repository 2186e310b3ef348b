"""SGLang's native HTTP API over the gateway: `POST /generate` and the few service routes SGLang's frontend
language (`sglang.RuntimeEndpoint`) and its tools call.

`/generate` answers as SGLang's server does: one object `{"text", "output_ids", "meta_info"}` per generation
(a list for a batch or n > 1); streamed, one server-sent event per step with the CUMULATIVE text and ids so
far and `meta_info` (a batch's events carry their generation's `index`), then `data: [DONE]`. `meta_info`
holds SGLang's fields (id, finish_reason {type, matched | length}, prompt_tokens, completion_tokens,
cached_tokens, e2e_latency), its speculative-decoding fields (spec_verify_ct = verify rounds,
spec_num_proposed_drafts, spec_num_correct_drafts, spec_accept_rate = correct / proposed, spec_accept_length =
completion tokens per round) and specmesh's own `specmesh` object (as the OpenAI routes return it).

Log-probabilities are the target's, in SGLang's shape: a list of [logprob, token id, text or null] per token,
and per position a list of such entries for the top ones. The prompt's (from `logprob_start_len`; the first
prompt token has none: null) come from one forward of the verify service over the prompt; the output's come
with the generated tokens. `max_new_tokens` 0 generates nothing: the answer is the prompt's token count and,
when asked, its log-probabilities (what the frontend's `select` scores choices with).

Errors before any output are HTTP statuses with `{"error": {"message", ...}}` (400 for any bad input, naming
the parameter); an error after a stream began is a `data: {"error": ...}` event, then [DONE].
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import replace
from functools import partial
from importlib.metadata import PackageNotFoundError, version

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from gateway.core import Chunk, GenRequest, Outcome, TextStream, shown
from gateway.openai import sse
from gateway.openai.models import model_limits
from gateway.openai.protocol import APIError, SpecmeshStats
from gateway.openai.serving import Front, RequestSpan
from gateway.sglang.protocol import GenerateRequest, Item, parse_generate
from gateway.tenancy import downstream_session_id, prefix_scope
from specmesh.domain import TokenLogprob
from specmesh.errors import SpecmeshError, Unavailable
from specmesh.sampling import SamplingParams
from specmesh.text import IncrementalDetokenizer

log = logging.getLogger("specmesh.gateway")


def _version() -> str:
    try:
        return version("specmesh")
    except PackageNotFoundError:
        return "unknown"


class Run:
    """One generation of a /generate request: its prompt, its output so far and the answer made of them."""

    def __init__(
        self,
        front: Front,
        item: Item,
        prompt_ids: list[int],
        prompt_lps: list[TokenLogprob | None] | None,
        rid: str,
        session_id: str,
        cache_scope: str,
        t0: float,
        request: Request,
        return_prompt_ids: bool = False,
    ):
        self.front, self.item, self.prompt_ids, self.rid = front, item, prompt_ids, rid
        self.return_prompt_ids = return_prompt_ids
        self.prompt_lps: list[TokenLogprob | None] | None = prompt_lps  # from logprob_start_len; None: not asked
        self.outcome = Outcome(prompt_tokens=len(prompt_ids))
        self.t0 = t0  # when the request arrived: e2e_latency counts from there
        self.text_parts: list[str] = []
        self.ids: list[int] = []
        # SGLang's log-probability entries, built as the tokens come (their texts decoded off the event loop).
        self.input_entries: list[list] = []
        self.input_top: list[list | None] = []
        self.output_entries: list[list] = []
        self.output_top: list[list | None] = []
        self.finish: dict | None = None
        self.latency: float | None = None
        # Each generation is traced as the OpenAI routes' are: a server span, parent of the downstream ones.
        attributes = {"specmesh.request_id": rid, "specmesh.prompt_tokens": len(prompt_ids)}
        self.span = RequestSpan(front.tracer, "gateway.sglang.generate", request, self.outcome, attributes)
        self.gen: AsyncGenerator[Chunk, None] | None = None
        if item.params.max_tokens > 0:
            params = item.params
            if item.logprobs is not None:
                params = replace(params, logprobs=item.logprobs.top)
            metadata = self.span.outgoing_metadata()
            req = GenRequest(prompt_ids, params, session_id, metadata=metadata, cache_scope=cache_scope)
            self.gen = front.gateway.generate(req, self.outcome)
        # skip_special_tokens false: the output's text is decoded again with its special tokens (the
        # gateway's own text leaves them out), stop strings applied to that text.
        self.special: TextStream | None = None
        self.stop_ids: set[int] = set()
        self.held: list[int] = []
        tokenizer = front.gateway.tokenizer
        if not item.skip_special_tokens and tokenizer is not None:
            self.special = TextStream(tokenizer, item.params.stop)
            self.special.detokenizer = IncrementalDetokenizer(partial(tokenizer.decode, skip_special_tokens=False))
            eos = getattr(tokenizer, "eos_token_id", None)
            self.stop_ids = set(item.params.stop_token_ids) | ({eos} if isinstance(eos, int) else set())
        self.stream = self.events()

    async def close(self) -> None:
        """Stop the work (if any is left) and end the span; safe to call more than once."""
        await self.stream.aclose()
        self.span.end("closed before it finished" if self.finish is None else None)

    async def events(self) -> AsyncGenerator[dict, None]:
        """The answer after each step of the generation (the last one is the whole answer)."""
        if self.item.logprobs is not None and self.prompt_lps:
            tail = self.prompt_ids[len(self.prompt_ids) - len(self.prompt_lps) :]
            self.input_entries, self.input_top = await self._off_loop(self._entries, self.prompt_lps, tail)
        if self.gen is None:
            self._finished({"type": "length", "length": 0})
            yield self.payload()
            return
        try:
            async for chunk in self.gen:
                self.text_parts.append(await self._text_of(chunk))
                self.ids += chunk.token_ids
                if self.item.logprobs is not None and chunk.logprobs:
                    ids = [e.token_id for e in chunk.logprobs]
                    entries, top = await self._off_loop(self._entries, chunk.logprobs, ids)
                    self.output_entries += entries
                    self.output_top += top
                if chunk.finish_reason is not None:
                    self._finished(await self._finish_reason(chunk.finish_reason))
                    yield self.payload()
                    return
                yield self.payload()
        except SpecmeshError as e:
            self.span.end(str(e))
            raise
        finally:
            await self.gen.aclose()  # a client gone, or an error elsewhere in the batch: the work stops

    async def _text_of(self, chunk: Chunk) -> str:
        if self.special is None:
            return chunk.text
        # As SGLang: the EOS or stop token that ended the output is not part of its text. The finish reason
        # may come in a chunk after the token's, so a trailing stop token waits for the next chunk.
        ids, self.held = self.held + chunk.token_ids, []
        final = chunk.finish_reason is not None
        if ids and ids[-1] in self.stop_ids:
            if not final:
                ids, self.held = ids[:-1], ids[-1:]
            elif chunk.finish_reason == "stop":
                ids = ids[:-1]
        return "" if self.special.stopped else await self.front.gateway.detokenize(self.special, ids, final)

    def _finished(self, reason: dict) -> None:
        self.finish, self.latency = reason, time.perf_counter() - self.t0

    async def _off_loop(self, fn, *args):
        return await self.front.gateway.off_loop(fn, *args)

    async def _finish_reason(self, finish: str) -> dict:
        """SGLang's finish_reason: {"type": "length", "length": n} or {"type": "stop", "matched": the stop
        string, or the token id (EOS or one of stop_token_ids) that ended the output}."""
        if finish == "length":
            return {"type": "length", "length": len(self.ids)}
        if finish != "stop":
            return {"type": finish}
        stop = self.item.params.stop
        tokenizer = self.front.gateway.tokenizer
        if stop and tokenizer is not None:
            # The text ends where the first stop string began: find which one is there.
            text = "".join(self.text_parts)
            if self.special is not None and self.special.detokenizer is not None:
                full = self.special.detokenizer.text
            else:
                full = await self._off_loop(partial(tokenizer.decode, skip_special_tokens=True), self.ids)
            found = [(i, s) for s in stop if (i := full.find(s, len(text))) >= 0]
            if found:
                return {"type": "stop", "matched": min(found)[1]}
        return {"type": "stop", "matched": self.ids[-1] if self.ids else None}

    # the answer ---------------------------------------------------------------------------------------------
    def payload(self) -> dict:
        out = {"text": "".join(self.text_parts), "output_ids": list(self.ids), "meta_info": self.meta_info()}
        if self.return_prompt_ids:
            out["prompt_token_ids"] = list(self.prompt_ids)
        return out

    def meta_info(self) -> dict:
        o, s = self.outcome, self.outcome.stats
        meta: dict = {
            "id": self.rid,
            "finish_reason": self.finish,
            "prompt_tokens": o.prompt_tokens,
            "completion_tokens": len(self.ids),
            "cached_tokens": o.cached_prompt_tokens,
        }
        if self.latency is not None:
            meta["e2e_latency"] = round(self.latency, 6)
        meta |= {
            "spec_verify_ct": s.rounds,
            "spec_num_proposed_drafts": s.drafted,
            "spec_num_correct_drafts": s.accepted,
            "spec_accept_rate": round(s.acceptance_rate, 6),
            "spec_accept_length": round(len(self.ids) / s.rounds, 6) if s.rounds else 0.0,
            "specmesh": SpecmeshStats.of(o).model_dump(),
        }
        lp = self.item.logprobs
        if lp is not None:
            meta["input_token_logprobs"] = list(self.input_entries)
            meta["output_token_logprobs"] = list(self.output_entries)
            if lp.top > 0:
                meta["input_top_logprobs"] = list(self.input_top)
                meta["output_top_logprobs"] = list(self.output_top)
        return meta

    def _entries(self, lps: list, token_ids: list[int]) -> tuple[list[list], list[list | None]]:
        """SGLang's entries of tokens: [logprob, token id, text or None] each (None for a position without a
        log-probability: the prompt's first token), and the [logprob, id, text] lists of the top ones."""
        lp = self.item.logprobs
        tokenizer = self.front.gateway.tokenizer
        with_text = lp is not None and lp.text and tokenizer is not None
        text = (lambda t: tokenizer.decode([t])) if with_text else (lambda t: None)
        top = lp.top if lp is not None else 0
        entries = [[e.logprob if e is not None else None, t, text(t)] for e, t in zip(lps, token_ids, strict=True)]
        tops = [None if e is None else [[v, t, text(t)] for t, v in e.top[:top]] for e in lps]
        return entries, tops


async def _prompt_ids(front: Front, item: Item) -> list[int]:
    if isinstance(item.prompt, str):
        return await front.gateway.tokenize(item.prompt, item.prompt_param)
    return list(item.prompt)


async def _prompt_logprobs(front: Front, item: Item, ids: list[int]) -> list[TokenLogprob | None] | None:
    """The prompt's log-probabilities from logprob_start_len on (None at position 0), or None if not asked."""
    lp = item.logprobs
    if lp is None:
        return None
    if lp.start is None or lp.start >= len(ids):
        if lp.start is not None and lp.start > len(ids):
            raise APIError(
                400,
                f"'logprob_start_len' is {lp.start}: more than the prompt's {len(ids)} tokens",
                "logprob_start_len",
                "invalid_value",
            )
        return []
    scored: list[TokenLogprob | None] = [None]
    if len(ids) > 1:
        scored += await front.gateway.prompt_logprobs(ids, lp.top)
    return scored[lp.start :]


async def _start(front: Front, request: Request, req: GenerateRequest, t0: float) -> list[Run]:
    """A Run per generation, each started up to its first answer, so that whatever fails before any output
    (bad input, overload, no replica) is an HTTP status rather than a stream event."""
    gateway = front.gateway
    tenant = front.tenant(request)
    session = downstream_session_id(tenant, "", req.session_id)
    scope = prefix_scope(tenant, "")  # SGLang's /generate has no cache_salt

    async def prepare(item: Item) -> tuple[list[int], list[TokenLogprob | None] | None]:
        ids = await _prompt_ids(front, item)
        if item.params.max_tokens == 0:  # nothing is generated, so the gateway's checks are made here
            gateway.check(GenRequest(ids, replace(item.params, max_tokens=1)))
        return ids, await _prompt_logprobs(front, item, ids)

    # Each prompt once (its n samples share its ids and log-probabilities), all prompts at once.
    first_of: dict[str, Item] = {}
    for item in req.items:
        first_of.setdefault(item.prompt_param, item)
    prepared = await asyncio.gather(*(prepare(item) for item in first_of.values()), return_exceptions=True)
    failed = next((p for p in prepared if isinstance(p, BaseException)), None)
    if failed is not None:
        raise failed
    prompts = {key: p for key, p in zip(first_of, prepared, strict=True) if not isinstance(p, BaseException)}
    runs: list[Run] = []
    base = uuid.uuid4().hex
    for item in req.items:
        ids, lps = prompts[item.prompt_param]
        rid = item.rid or (f"{base}-{item.index}" if req.batch else base)
        runs.append(Run(front, item, ids, lps, rid, session, scope, t0, request, req.return_prompt_token_ids))
    return runs


async def _first_answers(runs: list[Run]) -> list[dict]:
    firsts = await asyncio.gather(*(anext(r.stream) for r in runs), return_exceptions=True)
    failed = next((f for f in firsts if isinstance(f, BaseException)), None)
    if failed is not None:
        await _close(runs)
        raise failed
    return [f for f in firsts if isinstance(f, dict)]


async def _close(runs: list[Run]) -> None:
    for r in runs:
        await r.close()


def _failed(e: SpecmeshError) -> Response:
    # Unavailable means the gateway has tried the other replicas already: a client retry would not help.
    return APIError.from_domain(e).response(retried=isinstance(e, Unavailable))


async def _rest(stream: AsyncGenerator[dict, None], first: dict) -> dict:
    last = first
    async for payload in stream:
        last = payload
    return last


async def _complete(request: Request, runs: list[Run], firsts: list[dict], batch: bool) -> Response:
    """The whole answer; 499 (and the work stopped) if the client goes away first."""
    collector = asyncio.ensure_future(asyncio.gather(*(_rest(r.stream, f) for r, f in zip(runs, firsts, strict=True))))
    try:
        while not collector.done():
            await asyncio.wait({collector}, timeout=0.25)
            if not collector.done() and await request.is_disconnected():
                return Response(status_code=499)
        answers = collector.result()
    except SpecmeshError as e:
        return _failed(e)
    finally:
        if not collector.done():
            collector.cancel()
        await _close(runs)
    return JSONResponse(answers if batch else answers[0])


async def _merged(runs: list[Run], firsts: list[dict], batch: bool) -> AsyncGenerator[dict, None]:
    """Every step's answer of every generation as it comes; a batch's carry their generation's index."""

    def tagged(i: int, payload: dict) -> dict:
        return {**payload, "index": i} if batch else payload

    for i, first in enumerate(firsts):
        yield tagged(i, first)
    pending = {asyncio.ensure_future(anext(r.stream)): i for i, r in enumerate(runs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    payload = task.result()
                except StopAsyncIteration:
                    continue
                yield tagged(i, payload)
                pending[asyncio.ensure_future(anext(runs[i].stream))] = i
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def _stream(runs: list[Run], firsts: list[dict], batch: bool) -> StreamingResponse:
    async def close() -> None:
        await _close(runs)

    def on_error(description: str) -> None:
        log.warning("/generate stream failed: %s", description)

    events = sse.event_stream(_merged(runs, firsts, batch), on_error, close)
    return StreamingResponse(
        events, media_type="text/event-stream", headers={"cache-control": "no-cache", "x-accel-buffering": "no"}
    )


def _model_info(front: Front, max_model_len: int) -> dict:
    return {
        "model_path": front.model_name,
        # Not in SGLang's reply (its server args carry context_length): the longest prompt + output a request
        # may span here, as /v1/models' max_model_len.
        "max_model_len": max_model_len,
        "served_model_name": front.model_name,
        "tokenizer_path": None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
    }


def _server_info(front: Front) -> dict:
    gateway = front.gateway
    c, totals = gateway.config, gateway.totals
    return {
        "version": _version(),
        "frontend": "specmesh",
        "model_path": front.model_name,
        "served_model_name": front.model_name,
        "speculative_algorithm": "specmesh" if c.draft else None,
        "speculative_num_steps": c.speculative_num_steps or None,
        "max_prompt_tokens": c.max_prompt_tokens,
        "max_new_tokens_limit": c.max_tokens_limit,
        "max_running_requests": c.max_concurrency,
        "verify_replicas": [r.address for r in gateway.verify_pool.healthy],
        "draft_replicas": [r.address for r in gateway.draft_pool.healthy],
        # SGLang's benchmarks read the mean acceptance length here.
        "internal_states": [
            {
                "avg_spec_accept_length": round(totals.mean_accepted_length, 6),
                "spec_accept_rate": round(totals.acceptance_rate, 6),
                "running_requests": gateway.inflight,
                "waiting_requests": gateway.waiting,
            }
        ],
    }


def _flush_cache(request: Request) -> Response:
    timeout = request.query_params.get("timeout")  # SGLang's wait for running requests, in seconds
    if timeout is not None:
        try:
            ok = 0 <= float(timeout) < math.inf
        except ValueError:
            ok = False
        if not ok:
            raise APIError(
                400, f"'timeout' must be a number of seconds >= 0, got {shown(timeout)}", "timeout", "invalid_value"
            )
    # SGLang flushes its radix cache here. specmesh keeps no shared prefix cache to flush: KV caches
    # belong to sessions on the verify and draft replicas, one-off sessions are released when their
    # request ends and named ones when they expire. Answered as such rather than pretending to flush.
    return PlainTextResponse(
        "Nothing to flush: specmesh keeps KV caches per session on its verify and draft replicas; one-off "
        "sessions are released when their request ends, named sessions expire after the verify service's "
        "--session-ttl-s.\n"
    )


async def _health_generate(front: Front) -> Response:
    gateway = front.gateway
    tokenizer = gateway.tokenizer
    start = getattr(tokenizer, "bos_token_id", None) if tokenizer is not None else None
    req = GenRequest([start if isinstance(start, int) else 0], SamplingParams(temperature=0.0, max_tokens=1))
    try:
        async with contextlib.aclosing(gateway.generate(req, Outcome(prompt_tokens=1))) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is not None:
                    return Response(status_code=200)
    except SpecmeshError as e:
        log.warning("health_generate failed: %s", e)
    return Response(status_code=503)


def router(front: Front) -> APIRouter:
    routes = APIRouter()

    async def generate(request: Request) -> Response:
        t0 = time.perf_counter()
        req = parse_generate(await front.read_json(request), front.gateway.vocab_size)
        try:
            runs = await _start(front, request, req, t0)
            firsts = await _first_answers(runs)
        except SpecmeshError as e:
            return _failed(e)
        if req.stream:
            return _stream(runs, firsts, req.batch)
        return await _complete(request, runs, firsts, req.batch)

    # One route per method: a route with several would give OpenAPI one operation id for all of them.
    for method in ("POST", "PUT"):
        routes.add_api_route("/generate", generate, methods=[method], name=f"sglang_generate_{method.lower()}")

    @routes.get("/get_model_info")
    @routes.get("/model_info")
    async def model_info() -> dict:
        return _model_info(front, (await model_limits(front.gateway)).max_model_len)

    @routes.get("/get_server_info")
    @routes.get("/server_info")
    async def server_info() -> dict:
        return _server_info(front)

    async def flush_cache(request: Request) -> Response:
        return _flush_cache(request)

    for method in ("GET", "POST"):
        routes.add_api_route("/flush_cache", flush_cache, methods=[method], name=f"flush_cache_{method.lower()}")

    @routes.get("/health_generate")
    async def health_generate() -> Response:
        """Healthy when a one-token generation goes through the whole path, as SGLang checks."""
        return await _health_generate(front)

    return routes
