"""The batching tick: every waiting block of every session, one target forward, one sampler launch.

Sessions submit one step at a time (a draft block, or K = 0 for a target-only step) and await its
result. The tick loop takes everything waiting (up to `max_batch_size`, oldest first), runs
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

from specmesh.models import ModelRunner
from verify_service.rejection import DraftBlock, RejectionSampler
from verify_service.sessions import Session
from verify_service.verifier import verify_batch

log = logging.getLogger("specmesh.verify.scheduler")


@dataclass
class StepResult:
    epoch: int  # the epoch the step advanced from
    tokens: list[int]  # committed and kept (cut after a stop condition)
    num_drafted: int
    num_accepted: int
    finish_reason: str | None
    queue_seconds: float
    batch_seconds: float
    batch_size: int


@dataclass
class _Step:
    session: Session
    block: DraftBlock
    arrived: float
    future: asyncio.Future


@dataclass
class SchedulerStats:
    batches: int = 0
    batched_blocks: int = 0
    max_batch_size_seen: int = 0
    batch_size_hist: dict[int, int] = field(default_factory=dict)


class Scheduler:
    def __init__(self, runner: ModelRunner, sampler: RejectionSampler, max_batch_size: int):
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.runner = runner
        self.sampler = sampler
        self.max_batch_size = max_batch_size
        self.model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.stats = SchedulerStats()
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

    async def submit(self, session: Session, block: DraftBlock) -> StepResult:
        future = asyncio.get_running_loop().create_future()
        self._waiting.append(_Step(session, block, time.perf_counter(), future))
        self._wake.set()
        return await future

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting:
                batch = []
                while self._waiting and len(batch) < self.max_batch_size:
                    step = self._waiting.popleft()
                    if not step.future.cancelled():  # its stream went away while it waited
                        batch.append(step)
                if not batch:
                    continue
                results = await loop.run_in_executor(self.model_thread, self._execute, batch)
                for step, result in zip(batch, results):
                    if step.future.done():
                        continue
                    if isinstance(result, BaseException):
                        step.future.set_exception(result)
                    else:
                        step.future.set_result(result)

    def _execute(self, batch: list[_Step]) -> list[StepResult | BaseException]:
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
            return [r for s in batch for r in self._execute([s])]
        seconds = time.perf_counter() - start
        st = self.stats
        st.batches += 1
        st.batched_blocks += len(batch)
        st.max_batch_size_seen = max(st.max_batch_size_seen, len(batch))
        st.batch_size_hist[len(batch)] = st.batch_size_hist.get(len(batch), 0) + 1
        return [self._commit(step, v.tokens, v.num_accepted, start, seconds, len(batch))
                for step, v in zip(batch, verdicts)]

    @staticmethod
    def _commit(step: _Step, tokens: list[int], num_accepted: int, start: float, seconds: float,
                batch_size: int) -> StepResult:
        session = step.session
        kept = session.stop.extend(tokens)
        if kept < len(tokens):  # the session holds exactly what was emitted
            del session.seq.token_ids[len(session.seq.token_ids) - (len(tokens) - kept):]
        epoch = session.epoch
        session.epoch += 1
        return StepResult(epoch, tokens[:kept], step.block.k, num_accepted, session.stop.finish_reason,
                          start - step.arrived, seconds, batch_size)
