"""The gateway's domain object: one generation across the replica pools, with failover, in text and ids.

`Gateway.generate` checks and admits a request, asks the router (`gateway.router`) for a route (a verify
replica by session affinity or prefix, a draft replica or none) and streams the draft service's committed
tokens. `Inputs` is the way in: prompts tokenized off the event loop, requests checked against the
gateway's limits.

If a replica fails mid-stream (UNAVAILABLE, a deadline, an internal error), the replicas are probed, dead
ones leave the pool, and the generation is replayed on healthy ones from prompt + the tokens already
emitted, with max_tokens reduced: the client sees one stream with nothing lost and nothing repeated
(under greedy decoding, the same tokens). With no healthy draft replica the verify service decodes
target-only: slower, same output distribution. A request may ask for that itself
(`num_speculative_tokens` 0): it then goes to the verify replica alone. Errors that are the caller's
(INVALID_ARGUMENT, ...) are never retried, nor is overload (429): the status of a downstream error comes
from the one table in `specmesh.errors`.

Stalls: a replica that hangs (a stopped process, a black-holed connection) fails no call, so every stream
is watched. A stream stalls when no token arrives within `stall_gap_multiple` times its mean gap between
tokens so far, never more than `stall_timeout_s` nor less than half of it (three times that cap for the
first token, which includes queueing and the prefill). A stalled speculative stream is cancelled and
replayed target-only on the same verify replica, in the session the stalled stream held there (the replica
hands a session whose stream went silent to its newer turn, so nothing is prefilled again), and its draft
replica leaves the pool until its health checks answer again. A stalled target-only stream waits on while
its verify replica answers a health check, and fails over once it does not.

Text: `TextStream` detokenizes incrementally (`specmesh.text`), applies stop strings to the whole output
text (so a stop string spanning a failover is still found) and holds back text that could be the start
of one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial

import grpc
import jinja2

from gateway.config import GatewayConfig
from gateway.router import Route, Router, RouteRequest
from gateway.routing import Pool, Replica
from specmesh import wire
from specmesh.domain import TokenLogprob
from specmesh.errors import CALLER_ERRORS, InvalidArgument, ResourceExhausted, Unavailable, from_grpc_code
from specmesh.loop import SpecStats
from specmesh.rejection.limits import MAX_SPEC_LEN
from specmesh.sampling import SamplingParams
from specmesh.telemetry import StreamMetrics, outgoing_metadata
from specmesh.text import IncrementalDetokenizer, find_stop
from specmesh.v1 import draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

log = logging.getLogger("specmesh.gateway")


class BadInput(InvalidArgument):
    """An InvalidArgument about one request parameter, which the REST front names as OpenAI's `param`."""

    openai_code = "invalid_value"

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def shown(value, limit: int = 64) -> str:
    """A value as an error message quotes it: JSON (ASCII, so a lone surrogate cannot break the answer), cut
    to `limit` characters: no large input is ever echoed back."""
    try:
        text = json.dumps(value)
    except (ValueError, TypeError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


# Bounds a token's text: no vocabulary entry, byte-level or not, is longer than this many characters when
# the tokenizer does not say otherwise.
DEFAULT_CHARS_PER_TOKEN = 64


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of `tokenizer` stands for: its longest vocabulary entry (byte-level
    entries hold one character per byte, and a byte is at most one character of text)."""
    try:
        return max(8, max(map(len, tokenizer.get_vocab())))
    except (AttributeError, TypeError, ValueError):
        return DEFAULT_CHARS_PER_TOKEN


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    session_id: str = ""
    # None: the service's choice (the draft service's default K); 0: target-only; else the most draft
    # tokens per block.
    num_speculative_tokens: int | None = None
    metadata: tuple = ()  # gRPC metadata for downstream calls (trace context, request id)
    # The verify service shares cached prompt blocks only among requests of one scope (gateway.tenancy's
    # prefix_scope): "" is the shared scope.
    cache_scope: str = ""


@dataclass
class Chunk:
    token_ids: list[int]
    text: str  # the text delta
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asks for them


@dataclass
class Outcome:
    """Totals of a finished generation (usage and speculation stats)."""

    prompt_tokens: int
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    stats: SpecStats = field(default_factory=SpecStats.per_generation)  # its rounds one by one too
    failovers: int = 0
    stalls: int = 0  # replays after a stream made no progress (counted in failovers too)
    verify_session: str = ""  # the verify replica's name for the generation's session (its Opened chunk)
    verify_session_replica: str = ""  # ... and that replica's address
    target_only: bool = False
    # A goodput probe's draft replica measured speculation losing and handed the rest back: decoded target-only
    handed_off: bool = False
    verify_replica: str = ""
    # "direct", "probe" or "draft": where the draft replicas' goodput reports sent the request (gateway.router)
    goodput_route: str = ""


async def _judged(gw: Gateway, req: GenRequest, outcome: Outcome):
    """The generation's chunks; a sampled one that finished without a failover, routed by the goodput
    decision, adds its tokens per second from admission to its end to its path's side of the router's
    `PathRates`, at the load it met (the generations in flight as it was routed)."""
    load, started, finished = gw.inflight, time.monotonic(), False
    try:
        async with contextlib.aclosing(gw._generate(req, outcome)) as chunks:
            async for chunk in chunks:
                finished = finished or chunk.finish_reason is not None
                yield chunk
    finally:
        # A probe handed back after its measured rounds ran mostly direct: no measure of either path.
        judged = outcome.goodput_route and not outcome.handed_off
        if finished and not req.params.greedy and not outcome.failovers and judged:
            side = "direct" if outcome.goodput_route == "direct" else "draft"  # probes go through a draft
            gw.router.path_rates.observe(load, side, outcome.completion_tokens, time.monotonic() - started)


def speculative_decoding(stats: SpecStats, detailed: bool) -> dict:
    """vLLM's per-request speculative-decoding metrics of one generation (its names and definitions): a step
    is a round that verified a draft block, so `num_spec_steps` is our `drafts` and the mean acceptance
    length is our mean accepted length. `detailed` adds each step's accepted and drafted tokens, when the
    generation's statistics kept them for every step."""
    out: dict = {
        "num_spec_tokens": max([stats.num_spec_tokens, *stats.accepted_by_draft_length]),
        "num_spec_steps": stats.drafts,
        "num_draft_tokens": stats.drafted,
        "num_accepted_draft_tokens": stats.accepted,
        "mean_acceptance_length": stats.mean_accepted_length,
        "draft_acceptance_rate": stats.acceptance_rate,
        "acceptance_histogram": stats.acceptance_histogram(),
        "acceptance_histogram_by_draft_length": {k: list(c) for k, c in sorted(stats.accepted_by_draft_length.items())},
    }
    if detailed:
        drafted, accepted = stats.step_drafted or [], stats.step_accepted or []
        # A peer that kept no steps sends none: arrays that would not add up to the steps are left out.
        whole = len(drafted) == len(accepted) == stats.drafts
        out["per_step_accepted"] = list(accepted) if whole else None
        out["per_step_drafted"] = list(drafted) if whole else None
    return out


class Stalled(Exception):
    """A watched stream made no progress within its bound."""


class _Pace:
    """A stream's expected gap between tokens, and from it how long it may go without one before it counts
    as stalled (see the module docstring)."""

    FIRST_TOKEN = 3.0  # a generation's first token waits this many caps: it includes queueing and the prefill
    MIN_SAMPLES = 4  # gaps seen before the mean says anything (the first ones follow the prefill's burst)

    def __init__(self, cap: float, multiple: float, first: bool):
        self.cap, self.multiple = cap, multiple
        self.first = first  # the generation's first stream (not a replay, which has tokens to go on from)
        self.mean: float | None = None  # mean gap between token chunks so far (exponentially weighted)
        self.samples = 0
        self.last: float | None = None

    def bound(self) -> float:
        if self.last is None and self.first:
            return self.FIRST_TOKEN * self.cap
        if self.mean is None or self.samples < self.MIN_SAMPLES:
            return self.cap
        # Never under half the cap: a loaded replica's gaps vary, and a false stall costs the speculation.
        return min(self.cap, max(self.cap / 2, self.multiple * self.mean))

    def tick(self) -> None:
        now = time.monotonic()
        if self.last is not None:
            gap = now - self.last
            self.mean = gap if self.mean is None else 0.8 * self.mean + 0.2 * gap
            self.samples += 1
        self.last = now


class TextStream:
    """The text of one generation, across failovers, as deltas: decoded incrementally, ended at the first
    stop string, and holding back its last len(longest stop) - 1 characters (they could begin one) until
    the generation ends."""

    def __init__(self, tokenizer, stop: tuple[str, ...]):
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.detokenizer = (
            IncrementalDetokenizer(partial(tokenizer.decode, skip_special_tokens=True))
            if tokenizer is not None
            else None
        )
        self.sent = 0  # characters of text already emitted
        self.stopped = False

    def add(self, ids: list[int], final: bool = False) -> str:
        if self.detokenizer is None:
            return ""
        searched = len(self.detokenizer.text)
        self.detokenizer.add(ids)
        if final:
            self.detokenizer.flush()
        text = self.detokenizer.text
        cut = find_stop(text, self.stop, searched)
        if cut >= 0:
            self.stopped = True
            end = max(self.sent, cut)
        else:
            end = len(text) if final else max(self.sent, len(text) - self.hold)
        delta, self.sent = text[self.sent : end], end
        return delta


class Inputs:
    """What the gateway takes in: text tokenized on threads of its own, and each generation request checked
    against the gateway's limits before it is admitted (vLLM's input processor, in short).

    Tokenizing runs on those threads, never on the event loop: a long prompt takes a fast tokenizer a second
    or more (it releases the GIL meanwhile), and every stream and health check waits on the loop."""

    def __init__(self, config: GatewayConfig, tokenizer=None):
        self.config = config
        self.tokenizer = tokenizer
        self._tokenizing = ThreadPoolExecutor(max(1, config.tokenizer_threads), thread_name_prefix="tokenize")
        # Token ids a prompt may hold: the tokenizer's, else whatever fits the wire's int32.
        self.vocab_size = len(tokenizer) if tokenizer is not None else 2**31
        # A text longer than this cannot fit max_prompt_tokens tokens: refused before it is tokenized.
        self.max_prompt_chars = config.max_prompt_tokens * (
            longest_token_chars(tokenizer) if tokenizer is not None else DEFAULT_CHARS_PER_TOKEN
        )

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidArgument("this gateway has no tokenizer: send token ids")
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """The tokenizer's chat template when it has one; otherwise the plain template of the README:
        each message as "<role>: <content>\\n", then "assistant:" to prompt the reply."""
        if self.tokenizer is not None and getattr(self.tokenizer, "chat_template", None):
            try:
                ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            except jinja2.TemplateError as e:  # a template may refuse a conversation (roles that do not alternate)
                raise BadInput(
                    "messages", f"the model's chat template refused the messages: {shown(str(e), 200)}"
                ) from None
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return self.encode(text)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a text too long to fit max_prompt_tokens tokens."""
        if chars > self.max_prompt_chars:
            raise BadInput(
                param,
                f"'{param}' has {chars} characters: more than {self.config.max_prompt_tokens} tokens "
                f"(max_prompt_tokens) can hold, {self.max_prompt_chars}",
            )

    async def off_loop(self, fn, *args):
        """fn(*args) on the tokenizer's threads: for work too long for the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, partial(fn, *args))

    async def tokenize(self, text: str, param: str = "prompt") -> list[int]:
        """`encode` on the tokenizer's threads, once the text's length is checked."""
        self.check_prompt_chars(len(text), param)
        return await self.off_loop(self.encode, text)

    async def tokenize_chat(self, messages: list[dict]) -> list[int]:
        """`chat_prompt` on the tokenizer's threads, once the messages' length is checked."""
        self.check_prompt_chars(sum(len(m["content"]) for m in messages), "messages")
        return await self.off_loop(self.chat_prompt, messages)

    def check(self, req: GenRequest) -> None:
        if not req.prompt_ids:
            raise InvalidArgument("the prompt is empty")
        if len(req.prompt_ids) > self.config.max_prompt_tokens:
            raise InvalidArgument(
                f"the prompt has {len(req.prompt_ids)} tokens; the limit is {self.config.max_prompt_tokens}"
            )
        bad = next((i for i, t in enumerate(req.prompt_ids) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise BadInput(
                "prompt",
                f"token id {shown(req.prompt_ids[bad])} at position {bad} of the prompt is out of range "
                f"[0, {self.vocab_size})",
            )
        if req.params.max_tokens > self.config.max_tokens_limit:
            raise InvalidArgument(f"max_tokens must be <= {self.config.max_tokens_limit}, got {req.params.max_tokens}")
        try:
            req.params.validate()
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if req.params.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer and this gateway has none")
        k = req.num_speculative_tokens
        if k is not None and not 0 <= k <= MAX_SPEC_LEN:
            raise InvalidArgument(f"num_speculative_tokens must be in [0, {MAX_SPEC_LEN}], got {k}")


def draft_full(e: grpc.aio.AioRpcError, route: Route, req: GenRequest, pool: Pool) -> bool:
    """RESOURCE_EXHAUSTED through a draft replica, for a request whose path the gateway may change (K and the
    seed left unset): a full draft replica (a hybrid one takes every greedy request, past the batch limit too)
    hands it to the verify replica target-only, and only a full verify replica makes it a 429. Counted in
    `pool`'s decisions."""
    free = req.num_speculative_tokens is None and req.params.seed is None
    full = route.draft is not None and free and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    if full:
        pool.count("target_only_draft_full")
    return full


class Gateway:
    """One generation's lifecycle, for every front: admission, the stream of the route the router chose,
    its text, the stall watch, failover and replay (see the module docstring)."""

    def __init__(self, config: GatewayConfig, tokenizer=None, stream_metrics: StreamMetrics | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.inputs = Inputs(config, tokenizer)
        self.vocab_size, self.max_prompt_chars = self.inputs.vocab_size, self.inputs.max_prompt_chars
        self.router = Router.from_config(config)
        self.verify_pool, self.draft_pool = self.router.pools
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self.waiting = 0
        self.inflight = 0
        self.failovers = 0
        self.handoffs = 0  # goodput probes their draft replica handed back to decode target-only
        self.stalls = 0  # streams replayed because they made no progress
        self.totals = SpecStats()  # speculation statistics of every finished generation
        self.stream_metrics = stream_metrics  # TTFT and inter-token latency of every generation
        # Detokenizing large chunks has threads of its own, so that streams never queue behind long prompts
        # being tokenized (small chunks stay on the loop: see `detokenize`).
        self._detokenizing = ThreadPoolExecutor(max(1, config.tokenizer_threads), thread_name_prefix="detokenize")

    @property
    def target_only_fallbacks(self) -> int:
        return self.router.target_only_fallbacks

    async def start(self) -> None:
        await self.router.start(self.config.health_interval_s)

    async def close(self) -> None:
        await self.router.close()
        self.inputs.close()
        self._detokenizing.shutdown(wait=False, cancel_futures=True)

    # the fronts' way in: `Inputs` -------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self.inputs.encode(text)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        return self.inputs.chat_prompt(messages)

    def check_prompt_chars(self, chars: int, param: str) -> None:
        self.inputs.check_prompt_chars(chars, param)

    async def off_loop(self, fn, *args):
        return await self.inputs.off_loop(fn, *args)

    async def tokenize(self, text: str, param: str = "prompt") -> list[int]:
        return await self.inputs.tokenize(text, param)

    async def tokenize_chat(self, messages: list[dict]) -> list[int]:
        return await self.inputs.tokenize_chat(messages)

    def check(self, req: GenRequest) -> None:
        self.inputs.check(req)

    # A chunk whose decode covers up to this many tokens (its own and the detokenizer's window), with stop
    # strings no longer than INLINE_STOP_CHARS, is detokenized on the event loop: that costs ~10-15 us,
    # while a hop to a thread and back costs the loop hundreds (the woken thread takes the GIL), and a
    # stream pays it on every chunk. Larger work goes to the threads.
    INLINE_IDS = 32
    INLINE_STOP_CHARS = 256

    async def detokenize(self, text: TextStream, ids: list[int], final: bool) -> str:
        """`text.add`, on the event loop when it is small, else on the detokenizer's threads (nothing to do
        without a tokenizer)."""
        if text.detokenizer is None:
            return ""
        if len(ids) + text.detokenizer.window_tokens <= self.INLINE_IDS and text.hold < self.INLINE_STOP_CHARS:
            return text.add(ids, final)
        return await asyncio.get_running_loop().run_in_executor(self._detokenizing, text.add, ids, final)

    # generation -------------------------------------------------------------------------------------
    async def admit(self):
        """Concurrency limit with a bounded queue: RESOURCE_EXHAUSTED (429) past it."""
        if self._slots.locked() and self.waiting >= self.config.max_queue:
            raise ResourceExhausted(
                f"the gateway is at capacity ({self.config.max_concurrency} running, "
                f"{self.waiting} queued); retry later"
            )
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1

    async def generate(self, req: GenRequest, outcome: Outcome):
        """Yield Chunks; the last has a finish_reason. `outcome` is filled in as it goes."""
        self.check(req)
        if not req.metadata:
            req.metadata = outgoing_metadata()  # the caller's span is current here
        await self.admit()
        self.inflight += 1
        timer = self.stream_metrics.timer(len(req.prompt_ids)) if self.stream_metrics is not None else None
        try:
            # Closed before this generator's own cleanup (below) says the request is over: the replicas'
            # load and the call downstream are released in there.
            async with contextlib.aclosing(_judged(self, req, outcome)) as chunks:
                async for chunk in chunks:
                    if timer is not None:
                        timer.tokens(len(chunk.token_ids), chunk.finish_reason)
                    yield chunk
        finally:
            if timer is not None:
                timer.end()
            self.inflight -= 1
            self._slots.release()
            self.totals.merge(outcome.stats)

    async def _generate(self, req: GenRequest, outcome: Outcome):
        text = TextStream(self.tokenizer, req.params.stop)
        emitted: list[int] = []
        excluded: set[str] = set()
        deadline = time.monotonic() + self.config.request_timeout_s
        drafting = True  # False once a speculative stream stalled or a probe was handed back (the rest: target-only)
        while True:
            route = self._route(req, emitted, excluded, outcome, drafting)
            stream = self._watched(self._stream(route, req, emitted, deadline, outcome), route, first=not emitted)
            failed: Replica | None = None
            try:
                async for ids, finish, logprobs in stream:
                    if finish == "handed_off":  # the probe's rounds are measured: the rest goes direct
                        break
                    emitted += ids
                    outcome.completion_tokens = len(emitted)
                    chunk = await to_chunk(self.detokenize, text, req.params.stop_token_ids, ids, finish, logprobs)
                    if chunk is not None:
                        yield chunk
                        if chunk.finish_reason is not None:
                            return
                else:
                    raise Unavailable("the generation stream ended without a finish reason")
                outcome.handed_off, drafting = True, False
                self.handoffs += 1
                continue
            except Stalled:
                outcome.stalls += 1
                self.stalls += 1
                failed = route.verify if route.draft is None else None
                drafting = False
            except grpc.aio.AioRpcError as e:
                if draft_full(e, route, req, self.draft_pool):  # the verify replica decodes the rest alone
                    drafting = False
                    continue
                failed = await self._on_failure(e, route)
            finally:
                await stream.aclose()  # now, not when collected: it holds the replicas' load and the call
            if outcome.failovers >= self.config.max_failovers or time.monotonic() > deadline:
                raise Unavailable(f"generation failed after {outcome.failovers} failovers")
            outcome.failovers += 1
            self.failovers += 1
            if failed is not None:
                excluded.add(failed.address)
            await asyncio.sleep(0.05 * outcome.failovers)

    def _route(
        self, req: GenRequest, emitted: list[int], excluded: set[str], outcome: Outcome, drafting: bool = True
    ) -> Route:
        """The router's choice for the generation's next stream, recorded in its outcome."""
        ask = RouteRequest(
            req.session_id,
            req.prompt_ids + emitted,
            req.num_speculative_tokens,
            seeded=req.params.seed is not None,
            sampled=not req.params.greedy,
            excluded=excluded,
            drafting=drafting,
            goodput=outcome.goodput_route,
            handed_off=outcome.handed_off,
            stalled_session=(outcome.verify_session_replica, outcome.verify_session) if outcome.stalls else None,
        )
        route = self.router.route(ask, self.inflight)
        outcome.verify_replica = route.verify.address
        outcome.target_only = route.target_only and not outcome.handed_off  # a probe handed back speculated
        outcome.goodput_route = route.goodput
        return route

    async def prompt_logprobs(self, prompt_ids: list[int], top: int, metadata: tuple = ()) -> list[TokenLogprob]:
        """The target's log-probability of each prompt token after the first (echo + logprobs), from the verify
        replica the prompt would be routed to (its prefix is likely generated there next)."""
        if len(prompt_ids) > self.config.max_prompt_tokens:
            limit = self.config.max_prompt_tokens
            raise InvalidArgument(f"the prompt has {len(prompt_ids)} tokens; the limit is {limit}")
        verify = self.router.for_prompt(prompt_ids)
        stub = verify_pb2_grpc.VerifyServiceStub(self.verify_pool.channel(verify))
        with verify.track():
            try:
                resp = await stub.PromptLogprobs(
                    verify_pb2.PromptLogprobsRequest(prompt_ids=prompt_ids, top_logprobs=top),
                    timeout=self.config.request_timeout_s,
                    metadata=metadata or outgoing_metadata(),
                )
            except grpc.aio.AioRpcError as e:
                raise from_grpc_code(e.code().name, e.details() or "prompt log-probabilities failed") from None
        return wire.logprobs_from_pb(resp.logprobs, len(prompt_ids) - 1) or []

    async def _on_failure(self, e: grpc.aio.AioRpcError, route: Route) -> Replica | None:
        """Raise an error that another replica would give too; otherwise probe both replicas and return the
        verify replica if it is down (the retry must avoid it)."""
        name = e.code().name
        if name in CALLER_ERRORS:
            raise from_grpc_code(name, e.details()) from None
        if name == ResourceExhausted.code:  # overload: the caller backs off rather than loading another replica
            raise ResourceExhausted(e.details() or "a replica is overloaded") from None
        verify, draft = route.verify, route.draft
        log.warning(
            "generation failed on verify %s / draft %s: %s %s",
            verify.address,
            draft.address if draft else "-",
            name,
            e.details(),
        )
        ok_v = await self.verify_pool.suspect(verify)
        if draft is not None:
            await self.draft_pool.suspect(draft)
        return verify if not ok_v else None

    async def _stalled(self, route: Route) -> bool:
        """A stream went past its bound without a token: whether to give it up. A speculative stream is given
        up at once (the caller goes on target-only on the same verify replica, and the draft replica leaves
        the pool until its health checks answer again): that costs only speed, while a probe of a hung draft
        would add its timeout to the gap. A target-only stream is given up only if its verify replica fails
        a probe too: a replica that answers is slow (loaded, prefilling), not hung."""
        verify, draft = route.verify, route.draft
        if draft is not None:
            log.warning("stream stalled on draft %s: continuing target-only on %s", draft.address, verify.address)
            self.draft_pool.stalled(draft)
            return True
        if await self.verify_pool.suspect(verify):
            return False
        log.warning("stream stalled on verify %s, which fails its health check: failing over", verify.address)
        return True

    async def _watched(self, stream, route: Route, first: bool):
        """`stream`'s items; past the stream's pace without one, `_stalled` decides: wait on, or raise Stalled
        (the stream is closed on the way out, which cancels its call)."""
        cap = self.config.stall_timeout_s
        pace = _Pace(cap, self.config.stall_gap_multiple, first)
        pending: asyncio.Future | None = None
        try:
            while True:
                pending = asyncio.ensure_future(anext(stream))
                while cap > 0 and not (await asyncio.wait({pending}, timeout=pace.bound()))[0]:
                    if await self._stalled(route):
                        raise Stalled(f"no token for {pace.bound():.2f} s")
                try:
                    item = await pending
                except StopAsyncIteration:
                    return
                if item[0]:
                    pace.tick()
                yield item
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
                await asyncio.gather(pending, return_exceptions=True)
            await stream.aclose()

    async def _stream(self, route: Route, req: GenRequest, emitted: list[int], deadline: float, outcome: Outcome):
        """The items of one Generate stream on `route`, which replays the prompt and the tokens emitted so far."""
        verify, draft = route.verify, route.draft
        first = not emitted
        prompt = req.prompt_ids + emitted
        # A replay continues the same output: the rules over output tokens must count what came before.
        params = replace(req.params, max_tokens=req.params.max_tokens - len(emitted), prior_output_tokens=len(emitted))
        timeout = max(1.0, deadline - time.monotonic())
        pb_params = wire.params_to_pb(params)
        with verify.track(), draft.track() if draft is not None else contextlib.nullcontext():
            if draft is not None:
                call = draft_pb2_grpc.DraftServiceStub(self.draft_pool.channel(draft)).Generate(
                    draft_pb2.DraftServiceGenerateRequest(
                        session_id=route.session_id,
                        prompt_ids=prompt,
                        params=pb_params,
                        verify_address=verify.address,
                        num_speculative_tokens=route.k,
                        goodput_probe=route.goodput_probe,
                        cache_scope=req.cache_scope,
                        hand_off=route.goodput_probe,
                    ),
                    timeout=timeout,
                    metadata=req.metadata,
                )
            else:
                call = verify_pb2_grpc.VerifyServiceStub(self.verify_pool.channel(verify)).Generate(
                    verify_pb2.VerifyServiceGenerateRequest(
                        session_id=route.session_id, prompt_ids=prompt, params=pb_params, cache_scope=req.cache_scope
                    ),
                    timeout=timeout,
                    metadata=req.metadata,
                )
            async with contextlib.aclosing(_items(call, outcome, first, route)) as items:
                async for item in items:
                    yield item


async def to_chunk(detokenize, text: TextStream, stop_token_ids, ids: list[int], finish, logprobs) -> Chunk | None:
    """A stream item as the client's Chunk, None when it has nothing to send; a Chunk with a finish reason ends
    the generation (a stop string found in the text ends it too). `detokenize`: the gateway's."""
    # As vLLM: a stop token id ends the output (the verifier stops after it, and min_tokens bans it before then)
    # but its text is not part of the output's text.
    stop_id = bool(ids) and ids[-1] in stop_token_ids
    final = finish is not None or stop_id
    delta = await detokenize(text, ids[:-1] if stop_id else ids, final=final)
    if text.stopped:
        return Chunk(ids, delta, "stop", logprobs)
    if finish is not None or ids:
        return Chunk(ids, delta, finish, logprobs)
    return None


async def _items(call, outcome: Outcome, first: bool, route: Route):
    """A Generate stream's items (token ids, finish reason, log-probabilities), its other chunks recorded in
    `outcome`; the route's draft replica, if any, learns its goodput report for requests of the route's kind
    (sampled or greedy) from the finished chunk."""
    replica, draft = route.verify.address, route.draft
    finished = False
    try:
        async for resp in call:
            kind = resp.WhichOneof("chunk")
            if kind == "opened":
                outcome.verify_session, outcome.verify_session_replica = resp.opened.session_id, replica
                if first:
                    outcome.cached_prompt_tokens = resp.opened.cached_prompt_tokens
            elif kind == "tokens" and resp.tokens.token_ids:
                ids = list(resp.tokens.token_ids)
                yield ids, None, wire.logprobs_from_pb(resp.tokens.logprobs, len(ids))
            elif kind == "finished":
                if resp.finished.HasField("stats"):
                    outcome.stats.merge(wire.stats_from_pb(resp.finished.stats))
                if draft is not None:
                    f = resp.finished
                    draft.report(route.sampled, f.speculation_pays if f.HasField("speculation_pays") else None)
                finish = wire.finish_from_pb(resp.finished.finish_reason)
                finished = finish is not None
                if finished:
                    yield [], finish, None
    finally:
        if not finished:
            call.cancel()  # a client that went away, or a stop string found here: stop the work downstream
