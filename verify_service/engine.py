"""The verify service's domain object: sessions, the scheduler and their rules, without any gRPC.

The servicer translates protobuf to the objects here and back; everything a request can get wrong is
checked here and raised as a specmesh.errors exception (mapped to a status code by the servicer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field, replace
from typing import AsyncIterator

import torch

from specmesh.models import eos_token_ids
from specmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from specmesh.loop import Proposal
from specmesh.models import load_model
from specmesh.runtime.hf import ModelRunner
from specmesh.sampling import SamplingParams, StopChecker, check_token_ids, make_generator
from specmesh.telemetry import tracer, wall_ns
from specmesh.rejection import MAX_SPEC_LEN, DraftBlock, RejectionSampler, validate_block
from verify_service.scheduler import Scheduler, StepResult
from verify_service.sessions import Session, SessionStore, kv_bytes_per_token

log = logging.getLogger("specmesh.verify")

END_OF_STREAM = object()  # put in a stream's inbox when the client half-closes


@dataclass(frozen=True)
class VerifyConfig:
    model_path: str = ""
    host: str = "127.0.0.1"
    port: int = 50061
    device: str | None = None  # default: cuda if available, else cpu
    max_batch_size: int = 32  # blocks per scheduler tick
    max_sessions: int = 64  # concurrent streams + generate calls; more get RESOURCE_EXHAUSTED
    kv_cache_budget_mb: float = 2048.0
    session_ttl_s: float = 600.0
    draft_deadline_ms: float = 250.0  # 0 = wait for the draft forever
    batch_wait_ms: float = 3.0  # a tick waits this long for the other attached sessions' steps
    max_spec_len: int = 16  # most draft tokens per block
    sampler_backend: str = "auto"
    seed: int | None = None  # the shared random stream of unseeded requests
    grace_period_s: float = 10.0
    prefill_chunk_tokens: int = 512  # prompt tokens prefilled per model-thread turn (0 = all at once)
    attached_wait_s: float = 5.0  # a new turn waits this long for the session's previous stream to end
    metrics_port: int = -1  # Prometheus /metrics over HTTP; -1 = not served (the CLI defaults to 9464)

    def __post_init__(self):
        if not 1 <= self.max_spec_len <= MAX_SPEC_LEN:
            raise ValueError(f"max_spec_len must be in [1, {MAX_SPEC_LEN}]")
        if self.max_batch_size < 1 or self.max_sessions < 1:
            raise ValueError("max_batch_size and max_sessions must be >= 1")


@dataclass
class BlockIn:
    """A draft block as it arrives on a session's stream (the domain side of specmesh.v1.DraftBlock)."""

    session_id: str
    epoch: int
    base_position: int
    proposal: Proposal


@dataclass
class Verdict(StepResult):
    stale: bool = False
    deadline: bool = False


@dataclass
class Opened:
    session: Session
    cached_prompt_tokens: int
    prefill_seconds: float


@dataclass
class Counters:
    deadline_steps: int = 0
    stale_blocks: int = 0
    prefill_chunks: int = 0
    requests: dict[str, int] = field(default_factory=dict)


class VerifyEngine:
    def __init__(self, config: VerifyConfig, model, tokenizer=None):
        self.config = config
        self.runner = ModelRunner(model)
        self.tokenizer = tokenizer
        self.vocab_size = self.runner.vocab_size
        self.eos_token_ids = eos_token_ids(model)
        self.max_context = int(getattr(model.config, "max_position_embeddings", 0) or 2**31 - 1)
        self.sampler = RejectionSampler(config.sampler_backend, seed=config.seed, device=self.runner.device)
        dtype = next(model.parameters()).dtype
        self.sessions = SessionStore(self.runner, int(config.kv_cache_budget_mb * 2**20), config.session_ttl_s,
                                     kv_bytes_per_token(model.config, dtype))
        self.scheduler = Scheduler(self.runner, self.sampler, config.max_batch_size,
                                   batch_wait_s=config.batch_wait_ms / 1000, expected=lambda: self.sessions.attached)
        self.tracer = tracer("verify")
        self.counters = Counters()
        self.shutting_down = False
        self._reaper: asyncio.Task | None = None

    @classmethod
    def from_config(cls, config: VerifyConfig) -> "VerifyEngine":
        model, tokenizer = load_model(config.model_path, config.device)
        return cls(config, model, tokenizer)

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
        period = max(0.5, min(30.0, self.config.session_ttl_s / 4))
        while True:
            await asyncio.sleep(period)
            n = self.sessions.evict_expired()
            if n:
                log.info("evicted %d idle sessions (ttl %.0f s)", n, self.config.session_ttl_s)

    # requests -------------------------------------------------------------------------------------
    def check_prompt(self, prompt_ids: list[int], params: SamplingParams) -> None:
        check_token_ids(prompt_ids, self.vocab_size)
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise InvalidArgument(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                                  f"the model's context length {self.max_context}")
        if params.stop and self.tokenizer is None:
            raise InvalidArgument("stop strings need a tokenizer, and this model directory has none")

    async def open(self, session_id: str, prompt_ids: list[int], params: SamplingParams) -> Opened:
        """Start a turn: create or continue the session and prefill what its cache lacks."""
        if self.shutting_down:
            raise Unavailable("the verify service is shutting down")
        try:
            params.validate(self.vocab_size)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        self.check_prompt(prompt_ids, params)
        if self.sessions.attached >= self.config.max_sessions:
            raise ResourceExhausted(f"the verify service is at its limit of {self.config.max_sessions} "
                                    f"concurrent sessions; retry later")
        await self._wait_detached(session_id)
        session = self.sessions.open(session_id, prompt_ids)
        decode = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)) if self.tokenizer else None
        session.params = params
        session.stop = StopChecker(params, self.eos_token_ids, decode)
        session.generator = make_generator(params.seed, self.runner.device)
        session.prompt_len = len(prompt_ids)
        session.epoch = 0
        before = self.runner.prefix_tokens_reused
        t0 = time.perf_counter()
        # Chunked prefill: other sessions' batches run between chunks, so a long prompt does not stall them.
        first = True
        while True:
            left = await self.scheduler.run_on_model(self._prefill, session, first)
            reused = self.runner.prefix_tokens_reused - before if first else reused
            first = False
            self.counters.prefill_chunks += 1
            if not left:
                break
        return Opened(session, reused, time.perf_counter() - t0)

    async def _wait_detached(self, session_id: str) -> None:
        """A failover retry can arrive before the stream its caller abandoned has been torn down here
        (a draft service that died mid-stream): give that stream a moment to end before refusing."""
        session = self.sessions.peek(session_id) if session_id else None
        loop = asyncio.get_running_loop()
        end = loop.time() + self.config.attached_wait_s
        while session is not None and session.attached and loop.time() < end:
            await asyncio.sleep(0.02)

    def _prefill(self, session: Session, first: bool) -> int:
        with torch.inference_mode():
            return self.runner.prefill(session.seq, self.config.prefill_chunk_tokens or None, count_reuse=first)

    def _attach(self, session: Session) -> None:
        if session.attached:
            raise FailedPrecondition(f"session {session.session_id!r} is in use by another stream")
        if session.stop is None:
            raise FailedPrecondition(f"session {session.session_id!r} has no open turn: call OpenSession first")
        session.attached = True

    def _detach(self, session: Session) -> None:
        session.attached = False
        if session.ephemeral:
            self.sessions.release(session.session_id)

    def _block(self, session: Session, proposal: Proposal) -> DraftBlock:
        block = DraftBlock(proposal.token_ids, session.params, proposal.q_ids, proposal.q_probs, session.generator)
        try:
            validate_block(block, self.vocab_size, self.config.max_spec_len)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        # Drafting past max_tokens is wasted work: verify only the prefix that can still be emitted (a
        # prefix of a draft is itself a valid draft, so this keeps the output distribution).
        room = max(0, session.params.max_tokens - len(session.stop.token_ids) - 1)
        if block.k > room:
            block = replace(block, token_ids=block.token_ids[:room],
                            q_ids=None if block.q_ids is None else block.q_ids[:room],
                            q_probs=None if block.q_probs is None else block.q_probs[:room])
        return block

    async def session_stream(self, inbox: asyncio.Queue) -> AsyncIterator[Verdict]:
        """Serve one session's Verify stream: `inbox` yields BlockIn, END_OF_STREAM, or an exception to raise."""
        first = await inbox.get()
        if first is END_OF_STREAM:
            return
        if isinstance(first, BaseException):
            raise first
        if not first.session_id:
            raise InvalidArgument("the first block of a Verify stream must name its session_id")
        session = self.sessions.get(first.session_id)
        self._attach(session)
        deadline = self.config.draft_deadline_ms / 1000 or None
        try:
            msg = first
            while not session.finished:
                if msg is None:
                    try:
                        msg = await asyncio.wait_for(inbox.get(), deadline)
                    except asyncio.TimeoutError:
                        # The draft is late: take a target-only step rather than stall this session.
                        self.counters.deadline_steps += 1
                        result = await self.scheduler.submit(session, DraftBlock([], session.params,
                                                                                 generator=session.generator))
                        self._trace_round(result, deadline=True)
                        yield Verdict(**vars(result), deadline=True)
                        continue
                if msg is END_OF_STREAM:
                    return
                if isinstance(msg, BaseException):
                    raise msg
                block_in, msg = msg, None
                if block_in.epoch < session.epoch:
                    self.counters.stale_blocks += 1  # crossed a verdict on the wire, or sent twice
                    yield Verdict(block_in.epoch, [], 0, 0, None, 0.0, 0.0, 0, stale=True)
                    continue
                if block_in.epoch > session.epoch:
                    raise FailedPrecondition(f"block epoch {block_in.epoch} is ahead of the session's epoch "
                                             f"{session.epoch}")
                if block_in.base_position != session.position:
                    raise FailedPrecondition(f"block base_position {block_in.base_position} does not match the "
                                             f"session's {session.position} committed tokens")
                result = await self.scheduler.submit(session, self._block(session, block_in.proposal))
                self._trace_round(result)
                yield Verdict(**vars(result))
        finally:
            self._detach(session)

    def _trace_round(self, r: StepResult, deadline: bool = False) -> None:
        """A span per verified round, under the session's stream span, with its queue and batch times."""
        now = time.perf_counter()  # the round's batch has just ended
        span = self.tracer.start_span("verify.round", start_time=wall_ns(now - r.batch_seconds - r.queue_seconds, now),
                                      attributes={"specmesh.epoch": r.epoch, "specmesh.k": r.num_drafted,
                                                  "specmesh.accepted": r.num_accepted,
                                                  "specmesh.batch_size": r.batch_size,
                                                  "specmesh.queue_seconds": r.queue_seconds,
                                                  "specmesh.batch_seconds": r.batch_seconds,
                                                  "specmesh.deadline": deadline})
        span.end()

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams):
        """Target-only decoding: yields the Opened turn first, then one StepResult per token."""
        opened = await self.open(session_id, prompt_ids, params)
        session = opened.session
        self._attach(session)
        try:
            yield opened
            while not session.finished:
                yield await self.scheduler.submit(session, DraftBlock([], params, generator=session.generator))
        finally:
            self._detach(session)

    def release(self, session_id: str) -> bool:
        session = self.sessions.peek(session_id)
        if session is not None and session.attached:
            raise FailedPrecondition(f"session {session_id!r} is in use by a stream; it is released when the "
                                     f"stream ends if it was opened without an id")
        return self.sessions.release(session_id)

    def info(self) -> dict:
        st = self.scheduler.stats
        return dict(
            model_path=str(self.config.model_path), model_type=str(getattr(self.runner.config, "model_type", "")),
            vocab_size=self.vocab_size, max_context_length=min(self.max_context, 2**32 - 1),
            max_spec_len=self.config.max_spec_len, max_batch_size=self.config.max_batch_size,
            max_sessions=self.config.max_sessions, eos_token_ids=sorted(self.eos_token_ids),
            sampler_backend=self.sampler.backend, sessions=len(self.sessions), active_sessions=self.sessions.attached,
            kv_cache_bytes=self.sessions.kv_bytes(), batches=st.batches, batched_blocks=st.batched_blocks,
            max_batch_size_seen=st.max_batch_size_seen, deadline_steps=self.counters.deadline_steps,
            stale_blocks=self.counters.stale_blocks, prefix_tokens_reused=self.runner.prefix_tokens_reused,
            evicted_sessions=self.sessions.evicted,
        )
