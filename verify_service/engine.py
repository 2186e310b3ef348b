"""The verify service's domain object: sessions, the scheduler and their rules, without any gRPC.

The servicer translates protobuf to the objects here and back; everything a request can get wrong is
checked here and raised as a specmesh.errors exception (mapped to a status code by the servicer).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specmesh import config as flags
from specmesh.domain import DraftBlock, Finished, GenerationEvent, Opened, TokenLogprob, Tokens, Verdict
from specmesh.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from specmesh.futures import within
from specmesh.models import eos_token_ids, load_model
from specmesh.rejection import MAX_SPEC_LEN, RejectionInput, RejectionSampler, token_logprobs, validate_block
from specmesh.runtime.attention import ATTENTION_BACKENDS, check_attention_backend
from specmesh.runtime.blocks import MAX_BLOCK_SIZE, check_block_size
from specmesh.sampling import (
    MAX_LOGPROBS,
    LogitsContext,
    SamplingParams,
    StopChecker,
    check_token_ids,
    make_generator,
    output_start,
)
from specmesh.structured import Grammar, GrammarCompiler
from specmesh.telemetry import tracer, wall_ns
from verify_service.runner import MIN_AUTO_SLOT_TOKENS, RUNNERS, build_runner
from verify_service.scheduler import Scheduler
from verify_service.sessions import Session, SessionStore

log = logging.getLogger("specmesh.verify")

END_OF_STREAM = object()  # put in a stream's inbox when the client half-closes


class Superseded(Aborted):
    """Put in a silent stream's inbox when a newer turn of its session takes the session over."""


@dataclass(frozen=True)
class VerifyConfig:
    """The verify service's settings; each field declared with `option` is also its flag (`python -m
    verify_service --help`)."""

    model_path: str = flags.option(
        "", "local HF checkpoint directory of the target model", required=True, flag_default=None
    )
    host: str = flags.host_option()
    port: int = flags.grpc_port_option(50061)
    device: str | None = flags.device_option()
    dtype: str = flags.dtype_option()
    kv_cache_dtype: str = flags.kv_cache_dtype_option()
    max_batch_size: int = flags.option(32, "most draft blocks (sessions) verified in one batched target forward")
    max_sessions: int = flags.option(64, "concurrent session streams and generate calls; more get RESOURCE_EXHAUSTED")
    kv_cache_budget_mb: float = flags.option(
        2048.0,
        "KV cache memory for all sessions, allocated at start as blocks of --block-size tokens that sessions take "
        "as their tokens need them; when they run out, idle sessions are evicted (LRU), then running ones "
        "preempted and later resumed by recomputing",
    )
    block_size: int = flags.option(16, f"tokens per KV block (a power of two, at most {MAX_BLOCK_SIZE})")
    kv_cache_prefault: bool = flags.kv_cache_prefault_option()
    runner: str = flags.option(
        "auto",
        "target runtime: paged = one ragged forward, the KV in blocks shared by all sessions with prefix "
        "caching (Llama family); gguf = the forward on llama.cpp's CPU kernels, the KV in one pool of cells "
        "(Llama, CPU, llama-cpp-python installed); batched = the same forward over one KV slot per session; hf = "
        "the stock HF forward (any causal LM); auto = paged where the model allows it, else hf",
        choices=RUNNERS,
    )
    attention_backend: str = flags.attention_backend_option(ATTENTION_BACKENDS)
    cuda_graph_max_bs: int = flags.cuda_graph_max_bs_option()
    disable_cuda_graph: bool = flags.disable_cuda_graph_option()
    max_model_len: int = flags.option(
        0,
        "most tokens per session (prompt + max_tokens); 0 = the model's context (runner batched: capped so that "
        f"the budget holds --max-sessions slots, and refused below {MIN_AUTO_SLOT_TOKENS} tokens)",
    )
    max_batch_tokens: int = flags.option(  # vLLM's max_num_batched_tokens
        512,
        "positions one scheduler tick's forward may compute: its draft blocks first, then prefill chunks of "
        "sessions being opened (batched runner)",
    )
    session_ttl_s: float = flags.option(600.0, "idle sessions are evicted after this")
    draft_deadline_ms: float = flags.option(
        250.0, "past this wait for a draft block, take a target-only step instead (0 = never)"
    )
    batch_wait_ms: float = flags.option(
        3.0, "a batch waits up to this long for the other active sessions' blocks (0 = start at once) ..."
    )
    batch_wait_fraction: float = flags.option(
        0.5,
        "... or up to this fraction of a recent batch's time, if longer: under speculation the other sessions' "
        "blocks come only after their drafts, and one full batch costs less than two halves",
    )
    max_spec_len: int = flags.option(16, f"most draft tokens one block may carry (<= {MAX_SPEC_LEN})")
    sampler_backend: str = flags.option(
        "auto", "rejection sampler: triton on CUDA, torch on CPU when auto", choices=("auto", "torch", "triton")
    )
    seed: int | None = flags.option(None, "seed of the shared random stream (unseeded requests)", type=int)
    grace_period_s: float = flags.option(10.0, "on SIGTERM, in-flight sessions get this long to finish")
    prefill_chunk_tokens: int = flags.option(
        512,
        "most prompt tokens one session prefills per forward, so a long prompt does not stall the others' blocks "
        "(0 = no limit of its own: the tick's budget, or the whole prompt with hf)",
    )
    attached_wait_s: float = 5.0  # a new turn waits this long for the session's previous stream to end
    # Hard bounds against clients that open sessions and never stream, or stream and go silent.
    attach_timeout_s: float = flags.option(
        30.0, "an opened session that no Verify stream attaches to within this is released (0 = never)"
    )
    stream_idle_timeout_s: float = flags.option(
        60.0,
        "a Verify stream whose client sends nothing for this is closed with DEADLINE_EXCEEDED and its session "
        "released (0 = never); unlike --draft-deadline-ms, which only takes target-only steps",
    )
    max_cached_sessions: int = flags.option(
        0,
        "sessions held, idle cached ones included (LRU-evicted beyond it, RESOURCE_EXHAUSTED when all are in "
        "use); 0 = 4 x --max-sessions (runner batched: the KV slot count)",
    )
    metrics_port: int = flags.metrics_port_option(9464)

    def __post_init__(self):
        if not 1 <= self.max_spec_len <= MAX_SPEC_LEN:
            raise ValueError(f"max_spec_len must be in [1, {MAX_SPEC_LEN}]")
        if self.max_batch_size < 1 or self.max_sessions < 1 or self.max_batch_tokens < 1:
            raise ValueError("max_batch_size, max_sessions and max_batch_tokens must be >= 1")
        if self.runner not in RUNNERS:
            raise ValueError(f"runner must be one of {', '.join(RUNNERS)}")
        check_attention_backend(self.attention_backend)
        if self.cuda_graph_max_bs < 0:
            raise ValueError("cuda_graph_max_bs must be >= 0")
        try:
            check_block_size(self.block_size)
        except ValueError as e:
            raise ValueError(f"--block-size: {e}") from None
        if self.max_model_len < 0 or self.prefill_chunk_tokens < 0:
            raise ValueError("max_model_len and prefill_chunk_tokens must be >= 0")
        if min(self.attach_timeout_s, self.stream_idle_timeout_s, self.max_cached_sessions) < 0:
            raise ValueError("attach_timeout_s, stream_idle_timeout_s and max_cached_sessions must be >= 0")
        if self.max_cached_sessions and self.max_cached_sessions < self.max_sessions:
            raise ValueError("max_cached_sessions must be >= max_sessions (or 0)")

    @property
    def graph_max_bs(self) -> int:
        """The runner's CUDA graph bound (0: none)."""
        return 0 if self.disable_cuda_graph else self.cuda_graph_max_bs


@dataclass
class BlockIn:
    """A draft block as it arrives on a session's Verify stream, with where the draft believes it goes."""

    session_id: str
    epoch: int
    base_position: int
    block: DraftBlock
    target_only_steps: int = 0  # an empty block's run of target-only steps (0 and 1: one)
    chained_after: int | None = None  # a chained block's assumed last committed token (None: not chained)


@dataclass
class Counters:
    deadline_steps: int = 0
    run_steps: int = 0  # target-only steps of runs a client asked for
    stale_blocks: int = 0
    chained_blocks: int = 0  # blocks sent ahead of the verdict before them
    chained_stale: int = 0  # of which the guess failed: answered stale
    superseded_streams: int = 0  # silent streams whose session a newer turn took over
    prefill_chunks: int = 0
    requests: dict[str, int] = field(default_factory=dict)


class VerifyEngine:
    def __init__(
        self, config: VerifyConfig, model, tokenizer=None, on_batch=None, model_thread: ThreadPoolExecutor | None = None
    ):
        """`on_batch(size, seconds)` is told of every batch the scheduler runs (metrics). `model_thread`: the
        one thread that runs the model (default: a new one)."""
        self.config = config
        budget = int(config.kv_cache_budget_mb * 2**20)
        # The runner is built (its decoder checked by probe forwards) on the thread that will run it: on CPU
        # each thread that runs torch ops gets its own OpenMP team, and a second busy team on the same cores
        # made every batched forward ~40% slower on the 2-core dev machine.
        model_thread = model_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        args = (model, config.runner, budget, config.max_sessions, config.max_model_len, config.kv_cache_prefault)
        # CUDA graphs cover a verify step of up to --cuda-graph-max-bs blocks of the longest K.
        build = functools.partial(
            build_runner,
            attention_backend=config.attention_backend,
            block_size=config.block_size,
            cuda_graph_max_bs=config.graph_max_bs,
            graph_tokens_per_seq=config.max_spec_len + 1,
            kv_cache_dtype=config.kv_cache_dtype,
        )
        self.runner = model_thread.submit(build, *args).result()
        self.tokenizer = tokenizer
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = eos_token_ids(model)
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self.max_context = self.runner.context_limit(config.max_model_len)
        self.sampler = RejectionSampler(config.sampler_backend, seed=config.seed, device=self.runner.device)
        # A slot pool already caps the sessions; blocks and caches that grow token by token need a count.
        pooled = self.runner.kv_account().max_sequences is not None
        cap = config.max_cached_sessions or (None if pooled else 4 * config.max_sessions)
        self.sessions = SessionStore(self.runner, budget, config.session_ttl_s, max_count=cap)
        self.scheduler = Scheduler(
            self.runner,
            self.sampler,
            config.max_batch_size,
            on_batch=on_batch,
            batch_wait_s=config.batch_wait_ms / 1000,
            batch_wait_fraction=config.batch_wait_fraction,
            expected=lambda: self.sessions.attached,
            max_batch_tokens=config.max_batch_tokens,
            prefill_chunk_tokens=config.prefill_chunk_tokens,
            model_thread=model_thread,
            running=self.sessions.busy_sessions,
            reclaim=self.sessions.reclaim,
        )
        self.sessions.on_free = self.scheduler.kick
        self.sessions.after_pass = self.scheduler.after_pass
        self.tracer = tracer("verify")
        self.counters = Counters()
        self.shutting_down = False
        self._reaper: asyncio.Task | None = None

    @classmethod
    def from_config(cls, config: VerifyConfig, on_batch=None) -> VerifyEngine:
        model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        model, tokenizer = model_thread.submit(load_model, config.model_path, config.device, config.dtype).result()
        return cls(config, model, tokenizer, on_batch, model_thread)

    # lifecycle ------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.scheduler.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def close(self) -> None:
        self.shutting_down = True
        if self._reaper is not None:
            self._reaper.cancel()
        await self.scheduler.close()

    async def _reap(self) -> None:
        bounds = [b for b in (self.config.session_ttl_s, self.config.attach_timeout_s) if b > 0]
        period = max(0.05, min([30.0] + [b / 4 for b in bounds]))
        while True:
            await asyncio.sleep(period)
            n = self.sessions.evict_expired()
            if n:
                log.info("evicted %d idle sessions (ttl %.0f s)", n, self.config.session_ttl_s)
            n = self.sessions.release_unattached()
            if n:
                log.info("released %d opened sessions no stream attached to", n)

    # requests -------------------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The prompt and everything it may generate must fit the context (with a slot pool, a slot). No
        room is kept for a draft block: blocks are cut to fit instead (`_to_verify`)."""
        check_token_ids(prompt_ids, self.vocab_size)
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise InvalidArgument(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"this service's context length {self.max_context}"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer, and this model directory has none")
        if params.structured is not None and self.tokenizer is None:
            raise InvalidArgument(
                f"{params.structured.field_name}: structured output needs a tokenizer, and this model has none"
            )

    async def open(self, session_id: str, prompt_ids: list[int], params: SamplingParams, scope: str = "") -> Opened:
        """Start a turn: create or continue the session and prefill what its cache lacks. `scope`: the
        prefix-cache scope (sessions share cached prompt blocks only within one)."""
        if self.shutting_down:
            raise Unavailable("the verify service is shutting down")
        params.validate(self.vocab_size)
        self.check_prompt(prompt_ids, params)
        # Building a grammar (and, the first time, the tokenizer's grammar tables: about a second) runs off the
        # event loop, before the session is taken.
        grammar = None
        if params.structured is not None:
            grammar = await asyncio.get_running_loop().run_in_executor(None, self._grammar, params)
        await self._wait_detached(session_id)
        # Checked after the wait, with no await before the session is marked busy: concurrent opens cannot
        # all pass the check, so admitted sessions never outnumber the slots (num_slots >= max_sessions).
        if self.sessions.busy >= self.config.max_sessions:
            raise ResourceExhausted(
                f"the verify service is at its limit of {self.config.max_sessions} concurrent sessions; retry later"
            )
        session = self.sessions.open(session_id, prompt_ids, scope)
        session.opening = True
        t0 = time.perf_counter()
        try:
            self._begin_turn(session, prompt_ids, params)
            session.grammar = grammar
            # Chunked: in the ticks' forwards where the runner has chunked prefill, else between ticks.
            reused, chunks = await self.scheduler.prefill(session)
        except BaseException:
            if session.ephemeral:  # nobody can name it again: it would hold its cache until the TTL
                self.sessions.release(session.session_id)
            raise
        finally:
            session.opening = False
        self.counters.prefill_chunks += chunks
        if self.config.attach_timeout_s:
            session.attach_by = self.sessions.clock() + self.config.attach_timeout_s
        return Opened(
            session.session_id, len(prompt_ids), reused, time.perf_counter() - t0, session.epoch, session.position
        )

    def _begin_turn(self, session: Session, prompt_ids: list[int], params: SamplingParams) -> None:
        tokenizer = self.tokenizer
        decode = (lambda ids: tokenizer.decode(ids, skip_special_tokens=True)) if tokenizer is not None else None
        session.params = params
        session.stop = StopChecker(params, self.eos_token_ids, decode)
        session.generator = make_generator(params.seed, self.runner.device)
        session.prompt_len = len(prompt_ids)
        session.epoch = 0
        session.run_steps = 0

    async def _wait_detached(self, session_id: str) -> None:
        """A failover retry can arrive before the stream its caller abandoned has been torn down here
        (a draft service that died mid-stream): give that stream a moment to end before refusing. A stream
        whose client has gone silent (`_quiet`: a hung draft service) is superseded at once: it ends with
        ABORTED and this turn continues the session's cache, so the gateway's target-only continuation of a
        stalled stream re-prefills nothing."""
        session = self.sessions.peek(session_id) if session_id else None
        loop = asyncio.get_running_loop()
        end = loop.time() + self.config.attached_wait_s
        while session is not None and session.busy and loop.time() < end:
            if session.inbox is not None and self._quiet(session.heard):
                log.info("session %s: its silent stream is superseded by a new turn", session_id)
                self.counters.superseded_streams += 1
                session.inbox.put_nowait(Superseded(f"session {session_id!r} was taken over by a newer request"))
                session.inbox = None
            await asyncio.sleep(0.02)

    def _attach(self, session: Session) -> None:
        if session.attached:
            raise FailedPrecondition(f"session {session.session_id!r} is in use by another stream")
        if session.stop is None:
            raise FailedPrecondition(f"session {session.session_id!r} has no open turn: call OpenSession first")
        session.attached = True
        session.attach_by = None

    def _detach(self, session: Session, failed: bool = False, keep: bool = False) -> None:
        """A stream that failed or was abandoned is no conversation worth keeping, named or not: its KV goes
        back at once (once no forward in flight writes it) instead of waiting out the TTL. `keep`: a
        superseded stream, whose session the newer turn now holds."""
        session.attached = False
        session.inbox = None
        if not keep and (session.ephemeral or failed) and self.sessions.remove(session):
            self.sessions.free(session)

    def _to_verify(self, session: Session, block: DraftBlock) -> RejectionInput:
        validate_block(block, self.vocab_size, self.config.max_spec_len)
        params, stop = session.params, session.stop
        assert params is not None and stop is not None  # attached sessions have an open turn
        # Drafting past max_tokens is wasted work, and past the context it does not fit (a slot's length):
        # verify only the prefix that can still be emitted and fits. A prefix of a draft is itself a valid
        # draft, so this keeps the output distribution. (check_prompt already makes the first bound the
        # tighter one; the second says why no room for a block is kept at open.)
        room = min(params.draft_budget(len(stop.token_ids)), self.max_context - session.position)
        block = block[:room] if block.k > room else block
        return RejectionInput(block, params, session.generator, self._context(session))

    def _target_only(self, session: Session) -> RejectionInput:
        assert session.params is not None  # attached sessions have an open turn
        return RejectionInput(DraftBlock([]), session.params, session.generator, self._context(session))

    def _grammar(self, params: SamplingParams) -> Grammar:
        """A new generation's grammar state, with the model's grammar compiler built on first use."""
        assert params.structured is not None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return self._grammars.grammar(params.structured)

    def _context(self, session: Session) -> LogitsContext:
        """What context-dependent processing reads: the session's committed tokens (read when the batch is
        sampled, before this step commits), where this turn's output starts in them, and the EOS ids."""
        assert session.params is not None
        start = output_start(session.prompt_len, session.params)
        return LogitsContext(session.seq.token_ids, start, (), self.eos_token_ids, session.grammar)

    async def session_stream(self, inbox: asyncio.Queue) -> AsyncGenerator[Verdict, None]:
        """Serve one session's Verify stream: `inbox` yields BlockIn, END_OF_STREAM, or an exception to raise."""
        first = await self._receive(inbox, self._idle_s())
        if first is END_OF_STREAM:
            return
        if isinstance(first, BaseException):
            raise first
        if not first.session_id:
            raise InvalidArgument("the first block of a Verify stream must name its session_id")
        session = self.sessions.get(first.session_id)
        self._attach(session)
        session.inbox, session.heard = inbox, time.monotonic()
        failed, superseded = True, False
        try:
            msg = first
            while not session.finished:
                if msg is None:
                    msg = await self._next_block(session, inbox)
                    if not isinstance(msg, Verdict):
                        session.heard = time.monotonic()
                if msg is END_OF_STREAM:  # the client half-closed: a normal end
                    failed = False
                    return
                if isinstance(msg, Superseded):  # the session's newer turn holds it now, and its cache
                    superseded = True
                    raise msg
                if isinstance(msg, BaseException):
                    raise msg
                if isinstance(msg, Verdict):  # a step of a target-only run, or the draft was late
                    verdict, msg = msg, None
                else:
                    block_in, msg = msg, None
                    verdict = await self._verify_block(session, block_in)
                    # A run of target-only steps: the rest are taken without waiting for blocks (_next_block).
                    session.run_steps = 0 if verdict.stale else max(0, block_in.target_only_steps - 1)
                yield verdict
            failed = False
        finally:
            # Past a return or the loop's end the stream ended normally; an exception, a cancelled handler or
            # a closed generator (the client went away) leaves failed set.
            self._detach(session, failed, keep=superseded)

    def _idle_s(self) -> float | None:
        return self.config.stream_idle_timeout_s or None

    async def _receive(self, inbox: asyncio.Queue, timeout: float | None):
        try:
            return await within(inbox.get(), timeout)
        except TimeoutError:
            raise DeadlineExceeded(
                f"the Verify stream sent nothing for {self.config.stream_idle_timeout_s:g} s: closed"
            ) from None

    # A client silent for this many draft deadlines is hung or gone, not late: its session takes no more
    # target-only steps (their verdicts would go unread while they take batch rows from live sessions,
    # such as the gateway's target-only replays of the same streams) and waits for the idle timeout.
    QUIET_DEADLINES = 4

    def _quiet(self, heard: float) -> bool:
        """Whether a stream's client, last heard at `heard`, has been silent for QUIET_DEADLINES deadlines."""
        draft_s = self.config.draft_deadline_ms / 1000
        return draft_s > 0 and time.monotonic() - heard >= self.QUIET_DEADLINES * draft_s

    async def _next_block(self, session: Session, inbox: asyncio.Queue):
        """The stream's next message. During a run of target-only steps the client asked for, the next
        step's Verdict. Past the draft deadline, a target-only step's Verdict instead, so a late draft never
        stalls its session (unless the client has been silent for QUIET_DEADLINES
        deadlines). Past the idle timeout since the client last sent (`session.heard`, target-only steps
        do not count), DEADLINE_EXCEEDED."""
        if session.run_steps > 0:
            if not inbox.empty():  # a block (or the stream's end) ends the run
                session.run_steps = 0
                return inbox.get_nowait()
            session.run_steps -= 1
            self.counters.run_steps += 1
            # The client asked for these steps and waits for them: its silence is not a hang.
            session.heard = time.monotonic()
            verdict = await self.scheduler.submit(session, self._target_only(session))
            self._trace_round(verdict)
            return verdict
        heard = session.heard
        draft_s = self.config.draft_deadline_ms / 1000 or None
        idle_s = self._idle_s()
        left = None if idle_s is None else max(0.0, heard + idle_s - time.monotonic())
        if self._quiet(heard):
            draft_s = None
        if draft_s is None or (left is not None and left <= draft_s):
            return await self._receive(inbox, left)
        try:
            return await within(inbox.get(), draft_s)
        except TimeoutError:
            self.counters.deadline_steps += 1
            verdict = await self.scheduler.submit(session, self._target_only(session))
            verdict.deadline = True
            self._trace_round(verdict)
            return verdict

    async def _verify_block(self, session: Session, block_in: BlockIn) -> Verdict:
        if block_in.chained_after is not None:
            # Drafted on a guess about the verdict before it: verified only where the guess held. Any draft
            # of the committed tokens is a valid draft, so one that lands where it assumed is as good as one
            # sent after the verdict.
            self.counters.chained_blocks += 1
            if (
                block_in.epoch != session.epoch
                or block_in.base_position != session.position
                or session.seq.token_ids[-1] != block_in.chained_after
            ):
                self.counters.chained_stale += 1
                return Verdict([], 0, 0, epoch=block_in.epoch, stale=True)
        if block_in.epoch < session.epoch:
            self.counters.stale_blocks += 1  # crossed a verdict on the wire, or sent twice
            return Verdict([], 0, 0, epoch=block_in.epoch, stale=True)
        if block_in.epoch > session.epoch:
            raise FailedPrecondition(f"block epoch {block_in.epoch} is ahead of the session's epoch {session.epoch}")
        if block_in.base_position != session.position:
            raise FailedPrecondition(
                f"block base_position {block_in.base_position} does not match the "
                f"session's {session.position} committed tokens"
            )
        verdict = await self.scheduler.submit(session, self._to_verify(session, block_in.block))
        self._trace_round(verdict)
        return verdict

    def _trace_round(self, v: Verdict) -> None:
        """A span per verified round, under the session's stream span, with its queue and batch times."""
        now = time.perf_counter()  # the round's batch has just ended
        load = v.load
        span = self.tracer.start_span(
            "verify.round",
            start_time=wall_ns(now - load.batch_seconds - load.queue_seconds, now),
            attributes={
                "specmesh.epoch": v.epoch,
                "specmesh.k": v.num_drafted or 0,
                "specmesh.accepted": v.num_accepted,
                "specmesh.batch_size": load.batch_size,
                "specmesh.queue_seconds": load.queue_seconds,
                "specmesh.batch_seconds": load.batch_seconds,
                "specmesh.deadline": v.deadline,
            },
        )
        span.end()

    async def generate(
        self, session_id: str, prompt_ids: list[int], params: SamplingParams, scope: str = ""
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Target-only decoding: yields Opened, then Tokens per step, then Finished."""
        opened = await self.open(session_id, prompt_ids, params, scope)
        session = self.sessions.get(opened.session_id)
        self._attach(session)
        failed = True
        try:
            yield opened
            while not session.finished:
                verdict = await self.scheduler.submit(session, self._target_only(session))
                if verdict.tokens:
                    yield Tokens(verdict.tokens, verdict.logprobs)
            reason = session.stop.finish_reason if session.stop is not None else None
            yield Finished(reason or "stop")  # the loop ends only once the stop checker has set it
            failed = False
        finally:
            self._detach(session, failed)

    async def prompt_logprobs(self, prompt_ids: list[int], top: int) -> list[TokenLogprob | None]:
        """The target's raw log-probability of each prompt token given the ones before it (None for the first,
        which has no context), with its `top` most likely tokens: echo + logprobs on completions, the
        log-likelihood scoring of evaluation harnesses. One forward over the prompt, no session, on the model
        thread between ticks."""
        if self.shutting_down:
            raise Unavailable("the verify service is shutting down")
        check_token_ids(prompt_ids, self.vocab_size)
        if len(prompt_ids) > self.max_context:
            raise InvalidArgument(
                f"the prompt ({len(prompt_ids)} tokens) exceeds the context length {self.max_context}"
            )
        if not 0 <= top <= MAX_LOGPROBS:
            raise InvalidArgument(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}")
        model, device = self.runner.model, self.runner.device

        def score() -> list[TokenLogprob]:
            with torch.inference_mode():
                ids = torch.tensor([prompt_ids], device=device)
                logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
                return token_logprobs(logits, prompt_ids[1:], [top] * (len(prompt_ids) - 1))

        return [None, *await self.scheduler.run_on_model(score)]

    def release(self, session_id: str) -> bool:
        session = self.sessions.peek(session_id)
        if session is not None and session.busy:
            raise FailedPrecondition(
                f"session {session_id!r} is in use by a stream; it is released when the "
                f"stream ends if it was opened without an id"
            )
        return self.sessions.release(session_id)

    def info(self) -> dict:
        st = self.scheduler.stats
        return dict(
            model_path=str(self.config.model_path),
            model_type=str(getattr(self.runner.model.config, "model_type", "")),
            vocab_size=self.vocab_size,
            max_context_length=min(self.max_context, 2**32 - 1),
            max_spec_len=self.config.max_spec_len,
            max_batch_size=self.config.max_batch_size,
            max_sessions=self.config.max_sessions,
            eos_token_ids=sorted(self.eos_token_ids),
            sampler_backend=self.sampler.backend,
            sessions=len(self.sessions),
            active_sessions=self.sessions.attached,
            kv_cache_bytes=self.sessions.kv_bytes(),
            batches=st.batches,
            batched_blocks=st.batched_blocks,
            max_batch_size_seen=st.max_batch_size_seen,
            deadline_steps=self.counters.deadline_steps,
            stale_blocks=self.counters.stale_blocks,
            prefix_tokens_reused=self.runner.prefix_tokens_reused,
            evicted_sessions=self.sessions.evicted,
            run_steps=self.counters.run_steps,
        )
