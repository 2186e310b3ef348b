"""The draft-model drafter (torch, no gRPC).

`ModelDrafter` samples each draft token from a truncated support of its processed distribution: the
top `draft_topk` entries of `process_logits` output, renormalised. It sends exactly that sparse q, so
the verifier's acceptance test is exact. Greedy requests draft the argmax and send no probabilities.
Used in-process by the engine and, over gRPC, by draft_service.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from specmesh.domain import DraftBlock
from specmesh.runtime import Runner, RunnerSequence
from specmesh.sampling import BatchSamplingParams, SamplingParams, process_logits

DRAFT_SEED_SALT = 0x5EED_D4AF7  # the draft's stream must differ from the verifier's for the same seed


class ModelDrafter:
    def __init__(self, runner: Runner[Any], draft_topk: int = 16):
        if draft_topk < 1:
            raise ValueError("draft_topk must be >= 1")
        self.runner = runner
        self.draft_topk = draft_topk
        self.seq: RunnerSequence | None = None  # made by the first start(), then reused turn after turn
        self.tokens_drafted = 0  # including tokens drafted ahead and thrown away
        self.draft_seconds = 0.0

    def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.batch_params = BatchSamplingParams.from_params([params], [1], self.runner.device)
        self.generator = torch.Generator(device=self.runner.device)
        if params.seed is not None:
            self.generator.manual_seed(params.seed ^ DRAFT_SEED_SALT)
        else:
            self.generator.seed()
        if self.seq is None:
            self.seq = self.runner.new_sequence(prompt_ids)
        else:
            self.seq.reset_tokens(prompt_ids)  # a new turn: the cached common prefix is reused
        self.runner.prefill(self.seq)

    def propose(self, k: int, after: Sequence[int] = (), should_stop: Callable[[], bool] | None = None) -> DraftBlock:
        seq = self.seq
        assert seq is not None  # start() comes first
        committed = len(seq.token_ids)
        q_ids: list[torch.Tensor] = []
        q_probs: list[torch.Tensor] = []
        seq.token_ids.extend(after)
        start = len(seq.token_ids)
        t0 = time.perf_counter()
        try:
            for _ in range(k):
                if should_stop is not None and should_stop():
                    break
                logits = self.runner.forward([seq])[0][-1:]
                if self.params.greedy:
                    seq.token_ids.append(int(logits.argmax()))
                    continue
                probs = process_logits(logits, self.batch_params)[0]
                top_p, top_i = probs.topk(min(self.draft_topk, probs.numel()))
                top_p = top_p / top_p.sum()
                j = torch.multinomial(top_p, 1, generator=self.generator)
                seq.token_ids.append(int(top_i[j]))
                q_ids.append(top_i)
                q_probs.append(top_p)
            drafted = seq.token_ids[start:]
        finally:
            del seq.token_ids[committed:]  # drafts stay in the cache, not in the committed tokens
        self.tokens_drafted += len(drafted)
        self.draft_seconds += time.perf_counter() - t0
        if self.params.greedy or not drafted:
            return DraftBlock(drafted)
        return DraftBlock(drafted, torch.stack(q_ids).cpu(), torch.stack(q_probs).float().cpu())

    def commit(self, tokens: list[int]) -> None:
        assert self.seq is not None  # start() comes first
        self.seq.commit(tokens)
