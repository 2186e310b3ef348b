"""The draft-model drafter (torch, no gRPC): one session's handle on a `DraftBatcher`.

Each draft token comes from the batcher, which advances every drafting session by one token per forward
and samples each from a truncated support of its processed distribution: the top `draft_topk` entries of
`process_logits` output, renormalised. The block carries exactly that sparse q, so the verifier's
acceptance test is exact. Greedy requests draft the argmax and send no probabilities.
Used in-process by the engine (a batcher that runs forwards inline) and by the draft service (one batcher
for all sessions, forwards on its model thread).
"""

from __future__ import annotations

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

    @property
    def tokens_drafted(self) -> int:
        return self.state.tokens_drafted if self.state is not None else 0

    @property
    def draft_seconds(self) -> float:
        return self.state.draft_seconds if self.state is not None else 0.0

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.state = self.batcher.new_state(prompt_ids, params, reuse=self.state, scope=self.scope)
        await self.batcher.prefill(self.state)

    async def propose(
        self, k: int, after: Sequence[int] = (), should_stop: Callable[[], bool] | None = None
    ) -> DraftBlock:
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

    def commit(self, tokens: list[int]) -> None:
        assert self.state is not None  # start() comes first
        self.state.seq.commit(tokens)

    def release(self) -> None:
        """Give the session's cache back to the runner now (a runner with a fixed pool needs it back)."""
        if self.state is not None:
            self.batcher.runner.free(self.state.seq)
        self.state = None
