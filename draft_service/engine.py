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

import grpc
import torch
from opentelemetry import context as otel_context

from specmesh.drafters import ModelDrafter, NgramDrafter
from specmesh.errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unavailable
from specmesh.loop import AdaptiveK, FixedK, GenerationResult, RoundRecord, SpecStats, speculative_generate
from specmesh.runtime.static import StaticCacheRunner
from specmesh.models import load_model
from specmesh.runtime.hf import ModelRunner
from specmesh.sampling import SamplingParams, StopChecker, check_token_ids
from specmesh.telemetry import outgoing_metadata, tracer, wall_ns
from specmesh.v1 import verify_pb2, verify_pb2_grpc
from draft_service.remote import RemoteVerifier

log = logging.getLogger("specmesh.draft")
ALGORITHMS = ("standalone", "ngram")


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
    metrics_port: int = -1  # Prometheus /metrics over HTTP; -1 = not served (the CLI defaults to 9464)

    def __post_init__(self):
        if self.speculative_algorithm not in ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {ALGORITHMS}, got {self.speculative_algorithm!r}")
        if self.speculative_algorithm == "standalone" and not self.model_path:
            raise ValueError("the standalone algorithm needs --model-path (the draft model)")
        if self.draft_runner not in ("static", "hf"):
            raise ValueError(f"draft_runner must be static or hf, got {self.draft_runner!r}")
        if not 0 <= self.speculative_num_steps <= 32:
            raise ValueError("speculative_num_steps must be in [0, 32]")


@dataclass
class Opened:
    session_id: str
    prompt_tokens: int
    cached_prompt_tokens: int




class DraftEngine:
    def __init__(self, config: DraftConfig, model=None):
        self.config = config
        # The draft's numerics cannot affect the output distribution (the q it sends is the q it sampled
        # from), so the fastest runner is always safe to use here.
        runner_cls = StaticCacheRunner if config.draft_runner == "static" else ModelRunner
        self.runner = runner_cls(model) if model is not None else None
        self.vocab_size = self.runner.vocab_size if self.runner else 0
        self.pool = ThreadPoolExecutor(max_workers=config.max_sessions, thread_name_prefix="draft")
        self.totals = SpecStats()  # every finished generation's speculation statistics
        self.tracer = tracer("draft")
        self.stream_metrics = None  # StreamMetrics (TTFT, inter-token latency), set by the server
        self._drafters: OrderedDict[str, ModelDrafter] = OrderedDict()
        self._busy: set[str] = set()
        self._active = 0
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._checked: set[str] = set()
        self._retired_tokens = 0  # drafting totals of drafters no longer cached
        self._retired_seconds = 0.0
        self.shutting_down = False

    @classmethod
    def from_config(cls, config: DraftConfig) -> "DraftEngine":
        model = load_model(config.model_path, config.device)[0] if config.speculative_algorithm == "standalone" else None
        return cls(config, model)

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
        if self.config.speculative_algorithm == "ngram":
            return NgramDrafter()
        if not session_id:
            return ModelDrafter(self.runner, self.config.draft_topk)
        drafter = self._drafters.pop(session_id, None) or ModelDrafter(self.runner, self.config.draft_topk)
        self._drafters[session_id] = drafter  # most recently used last
        while len(self._drafters) > self.config.max_cached_sessions:
            sid, old = next(iter(self._drafters.items()))
            if sid in self._busy:
                break
            self._retire(self._drafters.pop(sid))
        return drafter

    def _retire(self, drafter) -> None:
        self._retired_tokens += getattr(drafter, "tokens_drafted", 0)
        self._retired_seconds += getattr(drafter, "draft_seconds", 0.0)

    def check(self, prompt_ids: list[int], params: SamplingParams, k: int) -> int:
        try:
            params.validate(self.vocab_size or None)
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        if not prompt_ids:
            raise InvalidArgument("prompt_ids must hold at least one token")
        if self.vocab_size:  # the n-gram drafter has no vocabulary: the verify service checks the ids
            check_token_ids(prompt_ids, self.vocab_size)
        if k > 32:
            raise InvalidArgument(f"num_speculative_tokens must be <= 32, got {k}")
        return k or self.config.speculative_num_steps

    async def generate(self, session_id: str, prompt_ids: list[int], params: SamplingParams, verify_address: str,
                       num_speculative_tokens: int = 0, metadata: tuple = ()):
        """Yields Opened, then lists of committed tokens, then the GenerationResult."""
        k_max = self.check(prompt_ids, params, num_speculative_tokens)
        if self.shutting_down:
            raise Unavailable("the draft service is shutting down")
        if self._active >= self.config.max_sessions:
            raise ResourceExhausted(f"the draft service is at its limit of {self.config.max_sessions} concurrent "
                                    f"generations; retry later")
        if session_id and session_id in self._busy:
            raise FailedPrecondition(f"session {session_id!r} is already generating")
        stub = await self._stub(verify_address or self.config.verify_address)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        put = lambda *item: loop.call_soon_threadsafe(events.put_nowait, item)  # noqa: E731
        remote = RemoteVerifier(loop, stub, session_id, self.config.verify_timeout_s,
                                metadata=metadata or outgoing_metadata(),
                                on_open=lambda r: events.put_nowait(("open", Opened(r.session_id, len(prompt_ids),
                                                                                    r.cached_prompt_tokens))))
        drafter = self._drafter(session_id)
        # A seeded request must replay exactly: its random draws may not depend on timing, so it gets a
        # fixed K and no drafting ahead (both adapt to how fast verdicts come back).
        seeded = params.seed is not None
        policy = AdaptiveK(k_max) if self.config.adaptive and not seeded else FixedK(k_max)
        pipeline = self.config.pipeline and not seeded
        cancelled = threading.Event()
        parent = otel_context.get_current()  # the Generate server span: rounds are its children
        timer = self.stream_metrics.timer() if self.stream_metrics is not None else None

        def on_round(r: RoundRecord) -> None:
            now = time.perf_counter()
            span = self.tracer.start_span("draft.round", context=parent, start_time=wall_ns(r.t_start, now),
                                          attributes={"specmesh.k": r.k, "specmesh.drafted": r.num_drafted,
                                                      "specmesh.accepted": r.num_accepted,
                                                      "specmesh.committed": r.num_committed,
                                                      "specmesh.draft_seconds": r.t_sent - r.t_start,
                                                      "specmesh.verify_wait_seconds": r.t_verdict - r.t_sent,
                                                      "specmesh.from_pipeline": r.from_pipeline})
            span.end(end_time=wall_ns(r.t_verdict, now))

        def work():
            # EOS and stop strings are the verifier's to apply (its verdicts carry the finish reason).
            stop = StopChecker(replace(params, stop=()), frozenset())
            try:
                with torch.inference_mode():
                    result = speculative_generate(remote, drafter, prompt_ids, params, policy, stop,
                                                  on_tokens=lambda toks: put("tokens", toks),
                                                  pipeline=pipeline, cancelled=cancelled.is_set,
                                                  on_round=on_round)
                put("done", result)
            except BaseException as e:  # noqa: BLE001 — delivered to the caller as a status
                put("error", e)

        self._active += 1
        if session_id:
            self._busy.add(session_id)
        job = loop.run_in_executor(self.pool, work)
        cleaned = False

        async def cleanup(finished: bool) -> None:
            # Before the final chunk goes out: a caller's next turn must find the session free here and
            # on the verify service (aclose waits for the verify stream's status).
            nonlocal cleaned
            if cleaned:
                return
            cleaned = True
            cancelled.set()
            await remote.aclose(finished)
            await asyncio.shield(job)  # the worker ends at its next round
            self._active -= 1
            self._busy.discard(session_id)
            if not session_id:
                self._retire(drafter)

        try:
            while True:
                kind, value = await events.get()
                if kind == "error":
                    if isinstance(value, asyncio.TimeoutError):
                        raise Unavailable(f"the verify service did not answer within {self.config.verify_timeout_s} s")
                    raise value
                if kind == "tokens" and timer is not None:
                    timer.tokens(len(value))
                if kind == "done":
                    self._count(value)
                    await cleanup(value.finish_reason != "cancelled")
                    yield value
                    return
                yield value
        finally:
            await cleanup(False)

    def _count(self, result: GenerationResult) -> None:
        self.totals.merge(result.stats)

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
