"""The draft service's domain object: per-session drafters, the speculation loop on worker threads, and
the remote verifiers they talk to. No servicer code here (see servicer.py).

Each Generate runs `specmesh.loop.speculative_generate` — the same loop as in-process generation — on a
worker thread, with a `RemoteVerifier` for the named verify replica, pipelined drafting and adaptive K.
The verify service is authoritative for stop conditions (EOS, stop strings): its verdicts carry the
finish reason, and the loop here applies only the rules both sides compute identically (max_tokens, stop
token ids).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import AsyncIterator

import grpc
import torch
from opentelemetry import context as otel_context

from draft_service.remote import RemoteVerifier
from specmesh.domain import Finished, GenerationEvent, Opened, SpecStats, Tokens
from specmesh.drafters import ALGORITHMS, Algorithm, ModelDrafter, make_drafter
from specmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from specmesh.loop import AdaptiveK, FixedK, RoundRecord, speculative_generate
from specmesh.models import load_model
from specmesh.rejection import MAX_SPEC_LEN
from specmesh.runtime.hf import ModelRunner
from specmesh.runtime.static import StaticCacheRunner
from specmesh.sampling import SamplingParams, StopChecker, check_token_ids
from specmesh.telemetry import StreamMetrics, outgoing_metadata, tracer, wall_ns
from specmesh.v1 import verify_pb2, verify_pb2_grpc

log = logging.getLogger("specmesh.draft")


@dataclass(frozen=True)
class DraftConfig:
    model_path: str = ""  # required for the standalone algorithm
    host: str = "127.0.0.1"
    port: int = 50062
    device: str | None = None
    verify_address: str = ""  # default verify replica (host:port)
    speculative_algorithm: str = "standalone"
    speculative_num_steps: int = 4  # most draft tokens per block (K max)
    adaptive: bool = True
    pipeline: bool = True
    draft_topk: int = 16  # support of the sparse q sent with sampled drafts
    draft_runner: str = "static"  # "static": preallocated cache + fast decode loop; "hf": ModelRunner
    max_sessions: int = 64  # concurrent generations; more get RESOURCE_EXHAUSTED
    max_cached_sessions: int = 256  # per-session draft KV caches kept for later turns (LRU)
    verify_timeout_s: float = 60.0  # per verify call / round
    grace_period_s: float = 10.0
    metrics_port: int = -1  # Prometheus /metrics over HTTP; -1 = not served (the CLI defaults to 9465)

    def __post_init__(self):
        if self.speculative_algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS}, got {self.speculative_algorithm!r}")
        if self.algorithm.needs_model and not self.model_path:
            raise ValueError("the standalone algorithm needs --model-path (the draft model)")
        if self.draft_runner not in ("static", "hf"):
            raise ValueError(f"draft_runner must be static or hf, got {self.draft_runner!r}")
        if not 0 <= self.speculative_num_steps <= MAX_SPEC_LEN:
            raise ValueError(f"speculative_num_steps must be in [0, {MAX_SPEC_LEN}]")

    @property
    def algorithm(self) -> Algorithm:
        return Algorithm(self.speculative_algorithm)


@dataclass(frozen=True)
class _Failed:
    """The worker thread's error, handed to the event loop that answers the caller."""

    error: BaseException


class DraftEngine:
    def __init__(self, config: DraftConfig, model=None, stream_metrics: StreamMetrics | None = None):
        self.config = config
        # The draft's numerics cannot affect the output distribution (the q it sends is the q it sampled
        # from), so the fastest runner is always safe to use here.
        runner_cls = StaticCacheRunner if config.draft_runner == "static" else ModelRunner
        self.runner = runner_cls(model) if model is not None else None
        self.vocab_size = self.runner.vocab_size if self.runner else 0
        self.pool = ThreadPoolExecutor(max_workers=config.max_sessions, thread_name_prefix="draft")
        self.totals = SpecStats()  # every finished generation's speculation statistics
        self.tracer = tracer("draft")
        self.stream_metrics = stream_metrics  # TTFT and inter-token latency of Generate streams
        self._drafters: OrderedDict[str, ModelDrafter] = OrderedDict()
        self._busy: set[str] = set()
        self._active = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._checked: set[str] = set()
        self._retired_tokens = 0  # drafting totals of drafters no longer cached
        self._retired_seconds = 0.0
        self.shutting_down = False

    @classmethod
    def from_config(cls, config: DraftConfig, stream_metrics: StreamMetrics | None = None) -> "DraftEngine":
        model = load_model(config.model_path, config.device)[0] if config.algorithm.needs_model else None
        return cls(config, model, stream_metrics)

    async def close(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _stub(self, address: str) -> verify_pb2_grpc.VerifyServiceStub:
        if not address:
            raise InvalidArgument("no verify_address in the request and no --verify-address default")
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        stub = verify_pb2_grpc.VerifyServiceStub(ch)
        if self.runner is not None and address not in self._checked:
            info = await stub.Info(verify_pb2.VerifyServiceInfoRequest(), timeout=self.config.verify_timeout_s)
            if info.vocab_size != self.vocab_size:
                raise FailedPrecondition(f"the draft's vocabulary ({self.vocab_size}) differs from the target's "
                                         f"({info.vocab_size}) at {address}")
            self._checked.add(address)
        return stub

    def _drafter(self, session_id: str):
        """The session's drafter: a cached one keeps its draft KV cache for the session's next turn."""
        algorithm = self.config.algorithm
        if not algorithm.needs_model or not session_id:
            return make_drafter(algorithm, self.runner, self.config.draft_topk)
        drafter = self._drafters.pop(session_id, None) or make_drafter(algorithm, self.runner, self.config.draft_topk)
        self._drafters[session_id] = drafter  # most recently used last
        while len(self._drafters) > self.config.max_cached_sessions:
            sid = next(iter(self._drafters))
            if sid in self._busy:
                break
            self._retire(self._drafters.pop(sid))
        return drafter

    def _retire(self, drafter) -> None:
        self._retired_tokens += getattr(drafter, "tokens_drafted", 0)
        self._retired_seconds += getattr(drafter, "draft_seconds", 0.0)

    def check(self, prompt_ids: list[int], params: SamplingParams, k: int) -> int:
        """Validate a request; returns its K max (0 asks for the service's default)."""
        params.validate(self.vocab_size or None)
        if not prompt_ids:
            raise InvalidArgument("prompt_ids must hold at least one token")
        if self.vocab_size:  # the n-gram drafter has no vocabulary: the verify service checks the ids
            check_token_ids(prompt_ids, self.vocab_size)
        if k > MAX_SPEC_LEN:
            raise InvalidArgument(f"num_speculative_tokens must be <= {MAX_SPEC_LEN}, got {k}")
        return k or self.config.speculative_num_steps

    def _admit(self, session_id: str) -> None:
        if self.shutting_down:
            raise Unavailable("the draft service is shutting down")
        if self._active >= self.config.max_sessions:
            raise ResourceExhausted(f"the draft service is at its limit of {self.config.max_sessions} concurrent "
                                    f"generations; retry later")
        if session_id and session_id in self._busy:
            raise FailedPrecondition(f"session {session_id!r} is already generating")

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams, verify_address: str,
                       num_speculative_tokens: int = 0, metadata: tuple = ()) -> AsyncIterator[GenerationEvent]:
        """Yields Opened, then Tokens as rounds commit them, then Finished."""
        k_max = self.check(prompt_ids, params, num_speculative_tokens)
        self._admit(session_id)
        stub = await self._stub(verify_address or self.config.verify_address)
        gen = _Generation(self, stub, session_id, prompt_ids, params, k_max, metadata or outgoing_metadata())
        self._active += 1
        if session_id:
            self._busy.add(session_id)
        gen.start()
        try:
            async for event in gen.events():
                if isinstance(event, Finished):
                    self.totals.merge(event.stats)
                    # Before the final event goes out: a caller's next turn must find the session free here
                    # and on the verify service.
                    await self._end(gen, event.finish_reason != "cancelled")
                yield event
        finally:
            await self._end(gen, False)

    async def _end(self, gen: "_Generation", finished: bool) -> None:
        if await gen.stop(finished):
            self._active -= 1
            self._busy.discard(gen.session_id)
            if not gen.session_id:
                self._retire(gen.drafter)

    @property
    def cached_sessions(self) -> int:
        return len(self._drafters)

    @property
    def active(self) -> int:
        return self._active

    def draft_seconds_per_token(self) -> float:
        tokens = self._retired_tokens + sum(d.tokens_drafted for d in self._drafters.values())
        seconds = self._retired_seconds + sum(d.draft_seconds for d in self._drafters.values())
        return seconds / tokens if tokens else 0.0

    def info(self) -> dict:
        c = self.totals
        return dict(model_path=self.config.model_path if self.runner else "",
                    algorithm=self.config.speculative_algorithm, vocab_size=self.vocab_size,
                    speculative_num_steps=self.config.speculative_num_steps, adaptive=self.config.adaptive,
                    pipelined=self.config.pipeline, default_verify_address=self.config.verify_address,
                    active_sessions=self._active, rounds=c.rounds, drafted=c.drafted, accepted=c.accepted,
                    pipelined_blocks_used=c.pipelined_used,
                    pipelined_blocks_discarded=c.pipelined_discarded,
                    draft_seconds_per_token=self.draft_seconds_per_token())


class _Generation:
    """One Generate call: the speculation loop on a worker thread, its events handed to the event loop."""

    def __init__(self, engine: DraftEngine, stub, session_id: str, prompt_ids: list[int], params: SamplingParams,
                 k_max: int, metadata: tuple):
        self.engine, self.session_id, self.prompt_ids, self.params = engine, session_id, prompt_ids, params
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[GenerationEvent | _Failed] = asyncio.Queue()
        self.remote = RemoteVerifier(self.loop, stub, session_id, engine.config.verify_timeout_s, metadata=metadata,
                                     on_open=self._opened)
        self.drafter = engine._drafter(session_id)
        # A seeded request must replay exactly: its random draws may not depend on timing, so it gets a
        # fixed K and no drafting ahead (both adapt to how fast verdicts come back).
        seeded = params.seed is not None
        self.policy = AdaptiveK(k_max) if engine.config.adaptive and not seeded else FixedK(k_max)
        self.pipeline = engine.config.pipeline and not seeded
        self.cancelled = threading.Event()
        self.parent = otel_context.get_current()  # the Generate server span: rounds are its children
        self.timer = engine.stream_metrics.timer() if engine.stream_metrics is not None else None
        self.job: asyncio.Future | None = None
        self.stopped = False

    def _opened(self, resp) -> None:
        self.queue.put_nowait(Opened(resp.session_id, len(self.prompt_ids), resp.cached_prompt_tokens))

    def _put(self, item) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)

    def start(self) -> None:
        self.job = self.loop.run_in_executor(self.engine.pool, self._work)

    def _work(self) -> None:
        # EOS and stop strings are the verifier's to apply (its verdicts carry the finish reason).
        stop = StopChecker(replace(self.params, stop=()), frozenset())
        try:
            with torch.inference_mode():
                result = speculative_generate(self.remote, self.drafter, self.prompt_ids, self.params, self.policy,
                                              stop, on_tokens=lambda toks: self._put(Tokens(toks)),
                                              pipeline=self.pipeline, cancelled=self.cancelled.is_set,
                                              on_round=self._trace_round)
            self._put(Finished(result.finish_reason, result.stats))
        except BaseException as e:  # noqa: BLE001 - delivered to the caller as a status
            self._put(_Failed(e))

    def _trace_round(self, r: RoundRecord) -> None:
        now = time.perf_counter()
        span = self.engine.tracer.start_span(
            "draft.round", context=self.parent, start_time=wall_ns(r.t_start, now),
            attributes={"specmesh.k": r.k, "specmesh.drafted": r.num_drafted, "specmesh.accepted": r.num_accepted,
                        "specmesh.committed": r.num_committed, "specmesh.draft_seconds": r.t_sent - r.t_start,
                        "specmesh.verify_wait_seconds": r.t_verdict - r.t_sent,
                        "specmesh.from_pipeline": r.from_pipeline})
        span.end(end_time=wall_ns(r.t_verdict, now))

    async def events(self) -> AsyncIterator[GenerationEvent]:
        while True:
            event = await self.queue.get()
            if isinstance(event, _Failed):
                if isinstance(event.error, asyncio.TimeoutError):
                    raise Unavailable(f"the verify service did not answer within "
                                      f"{self.engine.config.verify_timeout_s} s")
                raise event.error
            if isinstance(event, Tokens) and self.timer is not None:
                self.timer.tokens(len(event.token_ids))
            yield event
            if isinstance(event, Finished):
                return

    async def stop(self, finished: bool) -> bool:
        """End the verify stream and the worker; True the first time (the caller releases its slot)."""
        if self.stopped:
            return False
        self.stopped = True
        self.cancelled.set()
        await self.remote.aclose(finished)
        if self.job is not None:
            await asyncio.shield(self.job)  # the worker ends at its next round
        return True
