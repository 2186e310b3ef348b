"""The draft-model drafter (torch, no gRPC): one session's handle on a `DraftBatcher`.

Each draft token comes from the batcher, which advances every drafting session by one token per forward
and samples each from a truncated support of its processed distribution: the top `draft_topk` entries of
`process_logits` output, renormalised. The block carries exactly that sparse q, so the verifier's
acceptance test is exact. Greedy requests draft the argmax and send no probabilities.
Used in-process by the engine (a batcher that runs forwards inline) and by the draft service (one batcher
for all sessions, forwards on its model thread).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence

import torch

from specmesh.domain import DraftBlock
from specmesh.drafters.batcher import DraftBatcher, DraftState, DraftToken
from specmesh.sampling import SamplingParams


class ModelDrafter:
    def __init__(self, batcher: DraftBatcher, scope: bytes = b""):
        self.batcher = batcher
        self.scope = scope  # the prefix-cache scope its sequence is opened in (`Runner.new_sequence`)
        self.state: DraftState | None = None  # made by the first start(), then reused turn after turn
        self._prefill: asyncio.Future | None = None  # begin()'s prefill, until ready() has seen it end
        self._pending: list[int] = []  # tokens committed while it ran, committed after it
        self._deferred = False  # begin() left the prefill to the first ready()

    @property
    def tokens_drafted(self) -> int:
        return self.state.tokens_drafted if self.state is not None else 0

    @property
    def draft_seconds(self) -> float:
        return self.state.draft_seconds if self.state is not None else 0.0

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        await self.begin(prompt_ids, params)
        await self.ready()

    async def begin(self, prompt_ids: list[int], params: SamplingParams, defer: bool = False) -> None:
        """Open the turn's sequence now (a full pool raises here) and prefill it in the background, for a
        caller that drafts by other means meanwhile (the suffix trees): `propose` waits for it, and tokens
        committed before it ends are committed after it (the model thread owns the ids while it runs).
        `defer`: the prefill waits for the first `ready` (or `propose`), and covers what was committed by then;
        a turn whose rounds never draft by the model never computes it."""
        await self.settle()  # the previous turn's prefill, if it still runs
        self.state = self.batcher.new_state(prompt_ids, params, reuse=self.state, scope=self.scope)
        self._pending = []
        self._deferred = defer
        if not defer:
            self._start_prefill()

    def _start_prefill(self) -> None:
        assert self.state is not None
        self._deferred = False
        self._prefill = asyncio.ensure_future(self.batcher.prefill(self.state))
        self._prefill.add_done_callback(_retrieved)

    async def ready(self) -> None:
        """Wait for begin()'s prefill (a deferred one starts now); a cancelled caller leaves it running (it
        owns the ids)."""
        if self._deferred and self.state is not None:
            self._start_prefill()
        prefill = self._prefill
        if prefill is None:
            return
        try:
            await asyncio.shield(prefill)
        finally:
            if prefill.done() and self._prefill is prefill:
                self._prefill = None
                pending, self._pending = self._pending, []
                if pending and self.state is not None:
                    self.state.seq.commit(pending)

    async def propose(
        self, k: int, after: Sequence[int] = (), should_stop: Callable[[], bool] | None = None
    ) -> DraftBlock:
        await self.ready()
        state = self.state
        assert state is not None  # start() comes first
        seq = state.seq
        committed = len(seq.token_ids)
        seq.token_ids.extend(after)
        start = len(seq.token_ids)
        tokens: list[DraftToken] = []
        try:
            if should_stop is None:  # the whole block in one run of forwards
                tokens = await self.batcher.draft(state, k) if k > 0 else []
            else:  # drafting ahead: a token at a time, until the verdict it races arrives
                while len(tokens) < k and not should_stop():
                    tokens += await self.batcher.draft(state, 1)
            drafted = seq.token_ids[start:]
        finally:
            del seq.token_ids[committed:]  # drafts stay in the cache, not in the committed tokens
        if state.params.greedy or not drafted:
            return DraftBlock(drafted)
        q = [(t.q_ids, t.q_probs) for t in tokens if t.q_ids is not None and t.q_probs is not None]
        return DraftBlock(drafted, torch.stack([i for i, _ in q]), torch.stack([p for _, p in q]))

    async def settle(self) -> None:
        """Wait for a prefill still running (its error was its turn's): after this `release` frees at once. A
        deferred one is not started."""
        if self._deferred:
            return
        with contextlib.suppress(Exception):
            await self.ready()

    def commit(self, tokens: list[int]) -> None:
        assert self.state is not None  # start() comes first
        if self._prefill is not None:
            self._pending += tokens
        else:
            self.state.seq.commit(tokens)

    def release(self) -> None:
        """Give the session's cache back to the runner now (a runner with a fixed pool needs it back), or
        when a prefill still running on the model thread ends."""
        prefill, self._prefill = self._prefill, None
        if prefill is not None and not prefill.done():
            prefill.add_done_callback(lambda _: self.release())
            return
        if self.state is not None:
            self.batcher.runner.free(self.state.seq)
        self.state = None
        self._deferred = False


def _retrieved(future: asyncio.Future) -> None:
    """A background prefill's error reaches whoever awaits it; one nobody awaits is not reported twice."""
    if not future.cancelled():
        future.exception()
