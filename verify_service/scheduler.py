"""The batching tick: every waiting block of every session, one target forward, one sampler launch.

Sessions submit one step at a time (a draft block, or K = 0 for a target-only step) and await its
result. The tick loop waits a short window (`batch_wait_s`) for the other attached sessions' steps,
takes everything waiting (up to `max_batch_size`, oldest first), runs one forward over it on the model
thread, samples and commits (`specmesh.verifier.sample_and_commit`) and resolves each step; sessions
join and leave between ticks (continuous batching), and draft lengths are ragged. All model work runs
on one thread, so the event loop never blocks on torch and the runner is never used concurrently.

Prefill (a turn opening) rides in the same forward as the decode blocks where the runner's step takes
prefill chunks into its pass (`Runner.chunked_prefill`), as vLLM's chunked prefill does: each tick's pass
holds the waiting blocks and, under a token budget (`max_batch_tokens`, blocks first), chunks of the
sessions being opened, so a long prompt neither stalls the decoding sessions nor gets a forward of its
own. With any other runner (each chunk a pass of its own anyway) prefill chunks run on the model thread
between ticks.

Isolation: blocks are validated before they are submitted; if a pass still fails, each step and each
chunk is rerun alone so one bad step cannot fail the others (the caches are untouched by a failed forward).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from specmesh.domain import BatchLoad, SpecStats, Verdict
from specmesh.errors import Unavailable
from specmesh.futures import within
from specmesh.rejection import RejectionInput, RejectionSampler
from specmesh.runtime import PrefillChunk, Runner, RunnerSequence
from specmesh.runtime.blocks import OutOfBlocks
from specmesh.telemetry import tracer, wall_ns
from specmesh.verifier import sample_and_commit
from verify_service.sessions import Session

log = logging.getLogger("specmesh.verify.scheduler")


@dataclass
class _Step:
    session: Session
    block: RejectionInput
    arrived: float
    future: asyncio.Future
    span_context: Any = None  # the submitting stream's span: the batch span links to it


@dataclass
class _Prefill:
    """A session being opened, or a preempted one being recomputed (`future` None): its committed tokens
    are cached chunk by chunk, inside the ticks' passes."""

    session: Session
    future: asyncio.Future | None  # -> (cached prefix reused, chunks run); None for a resume
    left: int  # tokens still to prefill
    reused: int = 0
    chunks: int = 0
    found: int = 0  # the cached prefix its first chunk's planning found (KV blocks)

    @property
    def gone(self) -> bool:
        """Nobody waits for it any more: its open was cancelled, or a preempted session's stream ended."""
        return self.future.done() if self.future is not None else not self.session.attached


class _Retry:
    """A pass that found fewer free blocks than planned (a session opened meanwhile took cached ones):
    nothing was written, and its steps go back to the queue's front for the next tick."""


@dataclass
class _ChunkDone:
    """What one prefill chunk did (a result of `_execute`, beside the steps' verdicts)."""

    left: int
    reused: int


@dataclass
class SchedulerStats:
    batches: int = 0  # forwards that verified blocks
    batched_blocks: int = 0
    max_batch_size_seen: int = 0
    batch_size_hist: dict[int, int] = field(default_factory=dict)
    steps: int = 0  # every verified step, target-only ones included
    tokens: int = 0  # tokens committed and emitted
    spec: SpecStats = field(default_factory=SpecStats)  # steps that carried a draft block (vLLM's drafts)
    forwards: int = 0  # every target forward the scheduler ran (blocks, prefill chunks or both)
    prefill_chunks: int = 0
    prefill_tokens: int = 0  # positions prefilled
    mixed_batches: int = 0  # forwards that verified blocks and prefilled chunks together
    # Where verified steps' time went, summed over steps (`specmesh profile` splits a round with them).
    queue_wait_seconds: float = 0.0  # a block's arrival to the start of its batch
    step_forward_seconds: float = 0.0  # its batch's target forward
    step_sample_seconds: float = 0.0  # its batch's rejection sampling and commit
    batch_tokens: int = 0  # positions the batches verified (K + 1 per step)
    busy_seconds: float = 0.0  # the model thread's time in passes (prefill-only passes too)
    preemptions: int = 0  # sessions whose KV blocks were taken back for older sessions (vLLM's num_preemptions)
    recomputed_tokens: int = 0  # positions prefilled again for preempted sessions
    folded_prefills: int = 0  # openings whose short uncached tail went to their first step (FOLD_TOKENS)


# An opening whose prompt the cache holds but for at most this many tokens is answered at once, and its first
# step computes the tail with its block (a step feeds whatever its session's cache lacks): a turn of a cached
# conversation, or a prompt sent again, costs one pass to its first token rather than a pass of its own for
# the tail and then one for the block (~4.5 ms a pass on the demo target at one stream).
FOLD_TOKENS = 32


def _rank(session: Session) -> float:
    """Admission order (a session not yet admitted ranks after every admitted one)."""
    return session.admitted or math.inf


def uncached(seq: RunnerSequence) -> int:
    """Committed tokens a prefill would still compute (all but the last, beyond the cached prefix)."""
    ids, cached = seq.token_ids, seq.cached_ids
    n = min(len(ids) - 1, len(cached))
    i = 0
    while i < n and ids[i] == cached[i]:
        i += 1
    return len(ids) - 1 - i


class Scheduler:
    """`max_batch_tokens`: positions a tick's pass may compute, decode blocks first, prefill chunks in what
    is left (never less than a quarter of it while a session waits to open, so that openings progress under
    full decode load). `prefill_chunk_tokens`: most tokens one session prefills per pass (0 = no own limit)."""

    def __init__(
        self,
        runner: Runner[Any],
        sampler: RejectionSampler,
        max_batch_size: int,
        on_batch=None,
        batch_wait_s: float = 0.0,
        expected: Callable[[], int] | None = None,
        batch_wait_fraction: float = 0.0,
        max_batch_tokens: int = 512,
        prefill_chunk_tokens: int = 0,
        model_thread: ThreadPoolExecutor | None = None,
        running: Callable[[], Iterable[Session]] | None = None,
        reclaim: Callable[[int], int] | None = None,
        watermark: float = 0.01,
    ):
        if max_batch_size < 1 or max_batch_tokens < 1:
            raise ValueError("max_batch_size and max_batch_tokens must be >= 1")
        self.runner = runner
        self.sampler = sampler
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.chunked_prefill = runner.chunked_prefill  # prefill chunks join the ticks' passes
        self.model_thread = model_thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self.stats = SchedulerStats()
        self.on_batch = on_batch  # (batch size, seconds) -> None, for metrics
        # Sessions answered by one tick need a moment (the verdict's trip, the next block's) before they
        # can join the next: without a window, a tick starts with whoever is back first and the sessions
        # split into groups that take turns. `expected()` = sessions that may submit (attached ones).
        # Under speculation a session's next block comes only after its draft drafted it, which takes
        # longer than any fixed few ms: the window also grows with the forward it fills (a fraction of the
        # recent batch time), since one pass over all sessions costs far less than two over halves.
        self.batch_wait_s = batch_wait_s
        self.batch_wait_fraction = batch_wait_fraction
        self.recent_batch_s = 0.0  # moving average of a pass's seconds
        self.expected = expected
        self.tracer = tracer("verify")
        self._waiting: deque[_Step] = deque()
        self._opening: deque[_Prefill] = deque()
        # Sessions whose KV the model thread may be writing right now, and what waits for that to end: a
        # session released mid-pass (its stream failed or was cancelled) must not lose its slot or cache
        # to another session until the pass is done with it.
        self._in_pass: dict[int, int] = {}  # id(session) -> passes queued or running on the model thread
        self._after_pass: list[tuple[int, Callable[[], None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        # KV in blocks (`Runner.blocks`): each pass takes only what its blocks cover (see `_fit_blocks`).
        # `running()`: the sessions that may hold blocks (busy ones; idle ones are `reclaim(n)`'s, which
        # evicts them LRU until n blocks are free and returns how many it freed). A new session is admitted
        # while its prompt plus `watermark` of the pool is free (vLLM's watermark: room for the running
        # sessions to grow before anyone is preempted).
        self.blocks = runner.blocks
        self.running = running or (lambda: ())
        self.reclaim = reclaim
        self.watermark = 0 if self.blocks is None else max(1, int(watermark * self.blocks.num_blocks))
        self._admissions = 0
        self._free = 0  # blocks the pass being planned leaves free (_fit_blocks, then each chunk planned)
        self._resuming: dict[int, _Prefill] = {}  # id(session) -> its recompute, for preempted sessions
        self._parked: dict[int, _Step] = {}  # id(session) -> its step, waiting for its recompute

    @property
    def queue_depth(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="verify-scheduler")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        parked = [s.future for s in self._parked.values()]
        for future in [*(s.future for s in self._waiting), *(p.future for p in self._opening), *parked]:
            if future is not None and not future.done():
                future.set_exception(Unavailable("the verify service is shutting down"))
        self._waiting.clear()
        self._opening.clear()
        self._parked.clear()
        self._resuming.clear()
        # Joined off the event loop: queued model work may wait on something the loop has yet to do.
        await asyncio.to_thread(self.model_thread.shutdown, wait=True)

    async def run_on_model(self, fn, *args):
        """Run model work on the model thread, between ticks."""
        return await asyncio.get_running_loop().run_in_executor(self.model_thread, fn, *args)

    async def submit(self, session: Session, block: RejectionInput) -> Verdict:
        from opentelemetry import trace

        future = asyncio.get_running_loop().create_future()
        step = _Step(session, block, time.perf_counter(), future, trace.get_current_span().get_span_context())
        if id(session) in self._resuming:  # preempted: its step waits for its cache to be recomputed
            self._parked[id(session)] = step
        else:
            self._waiting.append(step)
        self._wake.set()
        return await future

    def kick(self) -> None:
        """Something the ticks may wait for changed (KV blocks were given back): plan again."""
        self._wake.set()

    async def prefill(self, session: Session) -> tuple[int, int]:
        """Cache the session's committed tokens but the last, reusing its cached prefix; returns (prefix
        tokens found cached, chunks run). Resolves when the whole prefill is done."""
        if not self.chunked_prefill:
            return await self._prefill_between_ticks(session)
        future = asyncio.get_running_loop().create_future()
        self._opening.append(_Prefill(session, future, uncached(session.seq)))
        self._wake.set()
        return await future

    def after_pass(self, session: Session, fn: Callable[[], None]) -> None:
        """Run `fn` once no forward in flight touches `session` (at once if none does)."""
        if id(session) in self._in_pass:
            self._after_pass.append((id(session), fn))
        else:
            fn()

    def _pass_begins(self, sessions: list[Session]) -> list[int]:
        ids = [id(s) for s in sessions]
        for i in ids:
            self._in_pass[i] = self._in_pass.get(i, 0) + 1
        return ids

    def _pass_done(self, ids: list[int]) -> None:
        for i in ids:
            self._in_pass[i] -= 1
            if not self._in_pass[i]:
                del self._in_pass[i]
        ready = [fn for i, fn in self._after_pass if i not in self._in_pass]
        self._after_pass = [(i, fn) for i, fn in self._after_pass if i in self._in_pass]
        for fn in ready:
            fn()

    def _after_chunk(self, ids: list[int], _: object) -> None:
        self._pass_done(ids)

    async def _prefill_between_ticks(self, session: Session) -> tuple[int, int]:
        reused, chunks, left = 0, 0, 1
        while left:
            ids = self._pass_begins([session])
            chunk = asyncio.get_running_loop().run_in_executor(
                self.model_thread, self._prefill_alone, session.seq, chunks == 0
            )
            # Shielded: a cancelled open leaves the chunk running, and its session is released after it.
            chunk.add_done_callback(functools.partial(self._after_chunk, ids))
            done = await asyncio.shield(chunk)
            left, reused, chunks = done.left, reused + done.reused, chunks + 1
        return reused, chunks

    def _prefill_alone(self, seq: Any, first: bool) -> _ChunkDone:
        with torch.inference_mode():
            out = self.runner.step([], prefill=[PrefillChunk(seq, self.prefill_chunk_tokens or None, first)])
        self.stats.prefill_chunks += 1
        self.stats.prefill_tokens += out.tokens
        return _ChunkDone(out.prefill_left[0], out.prefill_reused[0])

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while self._waiting or self._opening:
                await self._gather_window()
                batch = self._take_steps()
                if self.blocks is not None:
                    batch = self._fit_blocks(batch)
                plan = self._plan_prefill(batch)
                if not batch and not plan:
                    break  # what waits needs KV blocks that are in use: a release or a new step wakes us
                ids = self._pass_begins([s.session for s in batch] + [p.session for p, _ in plan])
                self._open_early(plan)
                try:
                    results = await loop.run_in_executor(
                        self.model_thread, self._execute, batch, plan, len(self._waiting)
                    )
                except Exception:  # a bug after the forward must fail this pass, never the scheduler
                    log.exception("a pass of %d blocks and %d prefill chunks failed", len(batch), len(plan))
                    results = [RuntimeError("verification failed on the target model")] * (len(batch) + len(plan))
                finally:
                    self._pass_done(ids)
                self._resolve(batch, plan, results)

    def _take_steps(self) -> list[_Step]:
        batch: list[_Step] = []
        while self._waiting and len(batch) < self.max_batch_size:
            step = self._waiting.popleft()
            if not step.future.cancelled():  # its stream went away while it waited
                batch.append(step)
        return batch

    def _plan_prefill(self, batch: list[_Step]) -> list[tuple[_Prefill, int]]:
        """The chunks that join this tick's pass: (opening session, most tokens it may prefill), oldest
        opening first (preempted sessions' recomputes before them), in what the decode blocks leave of the
        token budget and, with KV blocks, of the free blocks."""
        for p in [p for p in self._opening if p.gone]:
            self._drop_prefill(p)
        if not self._opening:
            return []
        decode = sum(s.block.k + 1 for s in batch)
        budget = max(self.max_batch_tokens - decode, max(1, self.max_batch_tokens // 4))
        plan = []
        kept = {id(s.session) for s in batch}
        # Admitted sessions (recomputes of preempted ones among them) in admission order, then new ones in
        # arrival order (a stable sort: the latter all rank last).
        for p in sorted(self._opening, key=lambda p: _rank(p.session)):
            if budget <= 0:
                break
            n = min(budget, self.prefill_chunk_tokens or budget)
            if self.blocks is not None:
                fit = self._fit_chunk(p, n, kept)
                if fit is None and p.session.admitted:
                    continue  # it waits for older sessions' blocks; the next may need fewer
                if fit is None:
                    break  # first come, first served: no new session overtakes one that waits for blocks
                n = fit
                kept.add(id(p.session))
                if p.future is not None and p.chunks == 0 and p.found > 0 and p.left <= FOLD_TOKENS:
                    p.future.set_result((p.found, 0))
                    self._opening.remove(p)
                    self.stats.folded_prefills += 1
                    continue
            plan.append((p, n))
            budget -= min(n, p.left)
        return plan

    def _open_early(self, plan: list[tuple[_Prefill, int]]) -> None:
        """Answer the openings whose last chunk this pass computes now, not after it: the first block then
        reaches the queue while the pass runs and joins the next one (answered after the pass, it arrives
        once the next pass has begun and waits a whole pass more: under load the time to first token was
        the prefill's pass plus two). Safe whatever the pass does: a step feeds everything its session's
        cache lacks, so a chunk that fails or is retried is computed by the session's first step instead.
        Only with KV blocks, where planning saw the cached prefix the chunk reuses."""
        if self.blocks is None:
            return
        for p, n in plan:
            if p.future is None or p.future.done() or n < p.left:
                continue
            p.future.set_result((p.reused + (p.found if p.chunks == 0 else 0), p.chunks + 1))

    def _drop_prefill(self, p: _Prefill) -> None:
        self._opening.remove(p)
        if p.future is None:  # a preempted session whose stream ended: its step went with it
            self._resuming.pop(id(p.session), None)
            self._parked.pop(id(p.session), None)

    # KV blocks -------------------------------------------------------------------------------------
    # A pass takes only what the free blocks cover. Steps go first, oldest session first; one that does not
    # fit takes blocks from idle sessions (evicted LRU), then from the newest running sessions (preempted:
    # their blocks go back, their steps wait, and their caches are recomputed by prefill chunks before
    # their next step, vLLM's recompute preemption). A session never takes blocks from an older one, so the
    # oldest always progresses: it fits alone, since no session is admitted past the pool. An opening
    # session is admitted once its whole prompt and the watermark fit, and never preempts anyone for it.

    def _fit_blocks(self, batch: list[_Step]) -> list[_Step]:
        """The steps of `batch` whose blocks this pass can have (the rest parked behind their session's
        recompute, or back at the queue's front), preempting newer sessions where an older one needs it."""
        blocks = self.blocks
        assert blocks is not None
        need = {}
        for s in batch:
            seq = s.session.seq
            blocks.cached(seq)  # rolls back rejected drafts first: their blocks go back
            need[id(s)] = blocks.needed(seq, len(seq.token_ids) + s.block.k)
        short = sum(need.values()) - blocks.free_blocks()
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)
        free = blocks.free_blocks()
        kept: list[_Step] = []
        taken: set[int] = set()
        for s in sorted(batch, key=lambda s: s.session.admitted):
            if id(s.session) in self._resuming:  # preempted for an older step of this tick
                self._parked[id(s.session)] = s
                continue
            free = self._make_room(need[id(s)], free, s.session, taken)
            if need[id(s)] <= free and id(s.session) not in self._resuming:
                kept.append(s)
                taken.add(id(s.session))
                free -= need[id(s)]
            else:  # it was the newest: it preempted itself
                self._parked[id(s.session)] = s
        self._free = free
        order = {id(s): i for i, s in enumerate(batch)}
        return sorted(kept, key=lambda s: order[id(s)])

    def _make_room(self, need: int, free: int, session: Session, taken: set[int]) -> int:
        """Preempt running sessions newer than `session` (newest first; `session` itself when it is the
        newest) until `need` blocks are free; returns the blocks free then."""
        blocks = self.blocks
        assert blocks is not None
        if need > free and self.reclaim is not None:  # idle sessions' blocks first
            free += self.reclaim(need - free)
        while need > free:
            # Anyone newer holding blocks, a session being recomputed too (it starts over).
            victims = [v for v in self.running() if id(v) not in taken and blocks.held(v.seq)]
            if not victims:
                return free
            victim = max(victims, key=_rank)
            if _rank(victim) < _rank(session):
                return free  # only older sessions hold what it needs: it waits for them
            free += self._preempt(victim)
            if victim is session:
                return free
        return free

    def _preempt(self, session: Session) -> int:
        """Take `session`'s blocks back; its cache is recomputed before its next step."""
        assert self.blocks is not None
        freed = self.blocks.preempt(session.seq)
        self.stats.preemptions += 1
        log.info("preempted session %s (%d blocks): out of KV blocks", session.session_id, freed)
        opening = next((p for p in self._opening if p.session is session), None)
        if opening is not None:  # still being opened: its chunks start over
            opening.left = uncached(session.seq)
            return freed
        resume = _Prefill(session, None, uncached(session.seq))
        self._resuming[id(session)] = resume
        self._opening.appendleft(resume)
        for step in [s for s in self._waiting if s.session is session]:
            self._waiting.remove(step)
            self._parked[id(session)] = step
        return freed

    def _fit_chunk(self, p: _Prefill, n: int, taken: set[int]) -> int | None:
        """How many tokens (at most `n`) of `p` this pass may prefill given the free blocks; None: it
        waits, and so does every opening behind it (first come, first served)."""
        blocks = self.blocks
        assert blocks is not None
        seq, session = p.session.seq, p.session
        before = blocks.free_blocks()
        valid = blocks.cached(seq)
        self._free += blocks.free_blocks() - before  # cached blocks it took (its prompt's), or rolled back
        if self._free < 0:
            # Those cached blocks are what this pass's steps count on: give them back (they stay cached).
            self._free += blocks.preempt(seq)
            p.left = uncached(seq)
            return None
        p.left = len(seq.token_ids) - 1 - valid
        if p.chunks == 0:
            p.found = valid
        if p.future is not None and p.chunks == 0 and not session.admitted and not self._admit(session):
            return None
        if p.left <= 0:
            return 1  # nothing to compute (its whole prompt was cached): the chunk only reports it done
        n = min(n, p.left)
        bs = blocks.block_size
        if n < p.left and (valid + n) // bs * bs > valid:
            # A chunk that ends on a block boundary keeps the table extendable: a prompt prefix that an
            # older session is computing right now is found in the cache by the next chunk instead.
            n = (valid + n) // bs * bs - valid
        held = blocks.held(seq)
        self._free = self._make_room(blocks.needed(seq, valid + n), self._free, session, taken)
        if blocks.held(seq) < held:
            return None  # it was the newest, and preempted itself: it starts over once blocks are free
        if blocks.needed(seq, valid + n) > self._free:
            n = min(n, (held + self._free) * bs - valid)
            if n <= 0:
                return None
        self._free -= blocks.needed(seq, valid + n)
        if p.future is None:
            self.stats.recomputed_tokens += n
        return n

    def _admit(self, session: Session) -> bool:
        """Admit an opening session if its whole prompt and the watermark fit in the free blocks (idle
        sessions evicted for it); with nobody else holding blocks, the prompt alone must fit."""
        blocks = self.blocks
        assert blocks is not None
        seq = session.seq
        whole = blocks.needed(seq, len(seq.token_ids))
        alone = not any(blocks.held(v.seq) for v in self.running() if v is not session)
        want = whole + (0 if alone else self.watermark)
        if want > self._free and self.reclaim is not None:
            self._free += self.reclaim(want - self._free)
        if want > self._free:
            return False
        self._admissions += 1
        session.admitted = self._admissions
        return True

    def _resolve(self, batch: list[_Step], plan: list[tuple[_Prefill, int]], results: Sequence[Any]) -> None:
        retry = [step for step, r in zip(batch, results, strict=False) if isinstance(r, _Retry)]
        self._waiting.extendleft(reversed(retry))  # back to the front, in their order
        for step, result in zip(batch, results[: len(batch)], strict=True):
            if step.future.done() or isinstance(result, _Retry):
                continue
            if isinstance(result, BaseException):
                step.future.set_exception(result)
            else:
                step.future.set_result(result)
        for (p, _n), done in zip(plan, results[len(batch) :], strict=True):
            if isinstance(done, _Retry) or p not in self._opening:
                continue
            if isinstance(done, BaseException) or p.gone or done.left == 0:
                self._opening.remove(p)
            if p.future is None:
                self._resumed(p, done)
                continue
            if p.future.done():
                continue
            if isinstance(done, BaseException):
                p.future.set_exception(done)
                continue
            p.left, p.reused, p.chunks = done.left, p.reused + done.reused, p.chunks + 1
            if done.left == 0:
                p.future.set_result((p.reused, p.chunks))

    def _resumed(self, p: _Prefill, done: _ChunkDone | BaseException) -> None:
        """A chunk of a preempted session's recompute ran: once it is whole (or failed), the session's
        parked step goes on (or fails)."""
        key = id(p.session)
        if not isinstance(done, BaseException) and done.left and not p.gone:
            p.left, p.chunks = done.left, p.chunks + 1
            return
        self._resuming.pop(key, None)
        step = self._parked.pop(key, None)
        if step is None or step.future.done():
            return
        if isinstance(done, BaseException):
            step.future.set_exception(done)
        else:
            self._waiting.appendleft(step)

    async def _gather_window(self) -> None:
        """Wait up to the window for the other attached sessions' steps (never when all are here)."""
        window = max(self.batch_wait_s, self.batch_wait_fraction * self.recent_batch_s)
        if window <= 0 or self.expected is None:
            return
        loop = asyncio.get_running_loop()
        end = loop.time() + window
        while len(self._waiting) < min(self.expected() - len(self._resuming), self.max_batch_size):
            remaining = end - loop.time()
            if remaining <= 0:
                return
            self._wake.clear()
            try:
                await within(self._wake.wait(), remaining)
            except TimeoutError:
                return

    def _forward(
        self, batch: list[_Step], plan: list[tuple[_Prefill, int]]
    ) -> tuple[list[torch.Tensor], list[_ChunkDone], int]:
        """One pass over the blocks and the prefill chunks: (logits per block, chunk results, positions)."""
        seqs = [s.session.seq for s in batch]
        extra = [s.block.token_ids for s in batch]
        # Without chunked prefill the plan is empty: those runners prefill between ticks.
        chunks = [PrefillChunk(p.session.seq, n, count_reuse=p.chunks == 0) for p, n in plan]
        out = self.runner.step(seqs, extra, prefill=chunks)
        done = [_ChunkDone(left, reused) for left, reused in zip(out.prefill_left, out.prefill_reused, strict=True)]
        return out.logits, done, out.tokens

    def _execute(
        self, batch: list[_Step], plan: list[tuple[_Prefill, int]], queue_depth: int = 0
    ) -> list[Verdict | _ChunkDone | _Retry | BaseException]:
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                logits, done, tokens = self._forward(batch, plan)
                forwarded = time.perf_counter()
                verdicts = sample_and_commit(
                    self.sampler, logits, [s.session.seq for s in batch], [s.block for s in batch]
                )
        except OutOfBlocks:
            # Raised before anything was written (the runner reserves first): plan again next tick.
            return [_Retry()] * (len(batch) + len(plan))
        except Exception:  # isolate: rerun each step and each chunk alone
            if len(batch) + len(plan) == 1:
                log.exception("verify step failed" if batch else "prefill chunk failed")
                return [
                    RuntimeError(
                        "verification failed on the target model" if batch else "prefill failed on the target model"
                    )
                ]
            log.exception(
                "a pass of %d blocks and %d prefill chunks failed; rerunning them one by one", len(batch), len(plan)
            )
            return [r for s in batch for r in self._execute([s], [], queue_depth)] + [
                r for p in plan for r in self._execute([], [p], queue_depth)
            ]
        end = time.perf_counter()
        self._account(batch, plan, done, end - start)
        self._time_steps(batch, start, forwarded, end)
        self._trace_batch(batch, start, end)
        load = dict(batch_seconds=end - start, batch_size=len(batch), batch_tokens=tokens, queue_depth=queue_depth)
        results: list[Verdict | _ChunkDone | _Retry | BaseException] = [
            self._commit(step, v, start, load) for step, v in zip(batch, verdicts, strict=True)
        ]
        for step, r in zip(batch, results, strict=True):
            assert isinstance(r, Verdict)
            self.stats.tokens += len(r.tokens)
            if step.block.k:
                self.stats.spec.record(step.block.k, r.num_accepted)
        return results + list(done)

    def _account(
        self, batch: list[_Step], plan: list[tuple[_Prefill, int]], done: list[_ChunkDone], seconds: float
    ) -> None:
        st = self.stats
        st.forwards += 1
        st.prefill_chunks += len(plan)
        st.prefill_tokens += sum(p.left - d.left for (p, _n), d in zip(plan, done, strict=True))
        if not batch:
            return
        st.batches += 1
        st.mixed_batches += bool(plan)
        st.batched_blocks += len(batch)
        st.steps += len(batch)
        st.max_batch_size_seen = max(st.max_batch_size_seen, len(batch))
        st.batch_size_hist[len(batch)] = st.batch_size_hist.get(len(batch), 0) + 1
        self.recent_batch_s = seconds if not self.recent_batch_s else 0.8 * self.recent_batch_s + 0.2 * seconds
        if self.on_batch is not None:
            self.on_batch(len(batch), seconds)

    def _time_steps(self, batch: list[_Step], start: float, forwarded: float, end: float) -> None:
        st = self.stats
        st.busy_seconds += end - start
        st.queue_wait_seconds += sum(start - s.arrived for s in batch)
        st.step_forward_seconds += len(batch) * (forwarded - start)
        st.step_sample_seconds += len(batch) * (end - forwarded)
        st.batch_tokens += sum(s.block.k + 1 for s in batch)

    def _trace_batch(self, batch: list[_Step], start: float, end: float) -> None:
        """One span per batch (its own trace, linked to every session stream it served)."""
        from opentelemetry import trace

        links = [trace.Link(s.span_context) for s in batch if s.span_context is not None and s.span_context.is_valid]
        if not links:
            return
        now = time.perf_counter()
        span = self.tracer.start_span(
            "verify.batch",
            context=trace.set_span_in_context(trace.INVALID_SPAN),
            links=links,
            start_time=wall_ns(start, now),
            attributes={"specmesh.batch_size": len(batch), "specmesh.draft_tokens": sum(s.block.k for s in batch)},
        )
        span.end(end_time=wall_ns(end, now))

    @staticmethod
    def _commit(step: _Step, sampled: Verdict, start: float, load: dict) -> Verdict:
        session, tokens = step.session, sampled.tokens
        assert session.stop is not None  # a session takes steps only within an open turn
        kept = session.stop.extend(tokens)
        if kept < len(tokens):  # the session holds exactly what was emitted
            del session.seq.token_ids[len(session.seq.token_ids) - (len(tokens) - kept) :]
        epoch = session.epoch
        session.epoch += 1
        return Verdict(
            tokens[:kept],
            sampled.num_accepted,
            step.block.k,
            session.stop.finish_reason,
            epoch=epoch,
            load=BatchLoad(queue_seconds=start - step.arrived, **load),
            logprobs=sampled.logprobs[:kept] if sampled.logprobs is not None else None,
        )
