"""The batching tick: every waiting block of every session, one target forward, one sampler launch.

Sessions submit one step at a time (a draft block, or K = 0 for a target-only step) and await its
result. The tick loop waits a short window (`batch_wait_s`) for the other attached sessions' steps,
takes everything waiting (up to `max_batch_size`, oldest first), runs
`verify_batch` on the model thread, and resolves each step; sessions join and leave between ticks
(continuous batching), and draft lengths are ragged. All model work (these ticks and prefills) runs on
one thread, so the event loop never blocks on torch and the runner is never used concurrently.

Isolation: blocks are validated before they are submitted; if a batch still fails, each step is rerun
alone so one bad step cannot fail the others (the caches are untouched by a failed forward).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from specmesh.domain import BatchLoad, SpecStats, Verdict
from specmesh.runtime import Runner
from specmesh.telemetry import tracer, wall_ns
from specmesh.rejection import RejectionInput, RejectionSampler
from verify_service.sessions import Session
from specmesh.verifier import verify_batch

log = logging.getLogger("specmesh.verify.scheduler")


@dataclass
class _Step:
    session: Session
    block: RejectionInput
    arrived: float
    future: asyncio.Future
    span_context: object = None  # the submitting stream's span: the batch span links to it


@dataclass
class SchedulerStats:
    batches: int = 0
    batched_blocks: int = 0
    max_batch_size_seen: int = 0
    batch_size_hist: dict[int, int] = field(default_factory=dict)
    steps: int = 0  # every verified step, target-only ones included
    tokens: int = 0  # tokens committed and emitted
    spec: SpecStats = field(default_factory=SpecStats)  # steps that carried a draft block (vLLM's drafts)


class Scheduler:
    def __init__(self, runner: Runner, sampler: RejectionSampler, max_batch_size: int, on_batch=None,
                 batch_wait_s: float = 0.0, expected=None):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.runner = runner
        self.sampler = sampler
        self.max_batch_size = max_batch_size
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.stats = SchedulerStats()
        self.on_batch = on_batch  # (batch size, seconds) -> None, for metrics
        # Sessions answered by one tick need a moment (the verdict's trip, the next block's) before they
        # can join the next: without a window, a tick starts with whoever is back first and the sessions
        # split into groups that take turns. `expected()` = sessions that may submit (attached ones).
        self.batch_wait_s = batch_wait_s
        self.expected = expected
        self.tracer = tracer("verify")
        self._waiting: deque[_Step] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="verify-scheduler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self.model_thread.shutdown(wait=True)

    async def run_on_model(self, fn, *args):
        """Run model work (a prefill) on the model thread, between ticks."""
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn, *args)

    async def submit(self, session: Session, block: RejectionInput) -> Verdict:
        from opentelemetry import trace

        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Step(session, block, time.perf_counter(), future,
                                   trace.get_current_span().get_span_context()))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                await self._gather_window()
                batch = []
                while self._waiting and len(batch) < self.max_batch_size:
                    step = self._waiting.popleft()
                    if not step.future.cancelled():  # its stream went away while it waited
                        batch.append(step)
                if not batch:
                    continue
                try:
                    results = await loop.run_in_executor(self.model_thread, self._execute, batch, len(self._waiting))
                except Exception:  # a bug after the forward must fail this batch, never the scheduler
                    log.exception("a batch of %d failed after verification", len(batch))
                    results = [RuntimeError("verification failed on the target model")] * len(batch)
                for step, result in zip(batch, results):
                    if step.future.done():
                        continue
                    if isinstance(result, BaseException):
                        step.future.set_exception(result)
                    else:
                        step.future.set_result(result)

    async def _gather_window(self) -> None:
        """Wait up to batch_wait_s for the other attached sessions' steps (never when all are here)."""
        if self.batch_wait_s <= 0 or self.expected is None:
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + self.batch_wait_s
        while len(self._waiting) < min(self.expected(), self.max_batch_size):
            remaining = end - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), remaining)
            except asyncio.TimeoutError:
                return

    def _execute(self, batch: list[_Step], queue_depth: int = 0) -> list[Verdict | BaseException]:
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                verdicts = verify_batch(self.runner, self.sampler, [s.session.seq for s in batch],
                                        [s.block for s in batch])
        except Exception:  # noqa: BLE001 — isolate: rerun each step alone
            if len(batch) == 1:
                log.exception("verify step failed")
                return [RuntimeError("verification failed on the target model")]
            log.exception("batch of %d failed; rerunning its steps one by one", len(batch))
            return [r for s in batch for r in self._execute([s], queue_depth)]
        end = time.perf_counter()
        seconds = end - start
        st = self.stats
        st.batches += 1
        st.batched_blocks += len(batch)
        st.max_batch_size_seen = max(st.max_batch_size_seen, len(batch))
        st.batch_size_hist[len(batch)] = st.batch_size_hist.get(len(batch), 0) + 1
        if self.on_batch is not None:
            self.on_batch(len(batch), seconds)
        self._trace_batch(batch, start, end)
        load = dict(batch_seconds=seconds, batch_size=len(batch), batch_tokens=sum(s.block.k + 1 for s in batch),
                    queue_depth=queue_depth)
        results = [self._commit(step, v.tokens, v.num_accepted, start, load) for step, v in zip(batch, verdicts)]
        st.steps += len(batch)
        for step, r in zip(batch, results):
            st.tokens += len(r.tokens)
            if step.block.k:
                st.spec.record(step.block.k, r.num_accepted)
        return results

    def _trace_batch(self, batch: list[_Step], start: float, end: float) -> None:
        """One span per batch (its own trace, linked to every session stream it served)."""
        from opentelemetry import trace

        links = [trace.Link(s.span_context) for s in batch if s.span_context is not None and s.span_context.is_valid]
        if not links:
            return
        now = time.perf_counter()
        span = self.tracer.start_span("verify.batch", context=trace.set_span_in_context(trace.INVALID_SPAN),
                                      links=links, start_time=wall_ns(start, now),
                                      attributes={"specmesh.batch_size": len(batch),
                                                  "specmesh.draft_tokens": sum(s.block.k for s in batch)})
        span.end(end_time=wall_ns(end, now))

    @staticmethod
    def _commit(step: _Step, tokens: list[int], num_accepted: int, start: float, load: dict) -> Verdict:
        session = step.session
        kept = session.stop.extend(tokens)
        if kept < len(tokens):  # the session holds exactly what was emitted
            del session.seq.token_ids[len(session.seq.token_ids) - (len(tokens) - kept):]
        epoch = session.epoch
        session.epoch += 1
        return Verdict(tokens[:kept], num_accepted, step.block.k, session.stop.finish_reason, epoch=epoch,
                       load=BatchLoad(queue_seconds=start - step.arrived, **load))
