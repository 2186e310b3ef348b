"""THE speculation loop, written once against two small interfaces.

A `Drafter` proposes blocks of draft tokens; a `Verifier` returns verdicts (the committed tokens of a
round: accepted drafts, then the recovered or bonus token). In-process generation plugs in a local
drafter and a local verifier; the draft service plugs in a remote verifier that speaks gRPC. K = 0 is
target-only decoding through the very same path, the baseline every speedup is measured against.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import torch

from specmesh.sampling import SamplingParams, StopChecker


@dataclass
class Proposal:
    """A draft block: K tokens and, optionally, the sparse draft distribution each was sampled from."""

    token_ids: list[int]  # x_1..x_K
    q_ids: torch.Tensor | None = None  # [K, S] int64; None = point masses (greedy / n-gram drafts)
    q_probs: torch.Tensor | None = None  # [K, S] float32

    @property
    def k(self) -> int:
        return len(self.token_ids)


@dataclass
class Verdict:
    tokens: list[int]  # committed this round: accepted drafts + one recovered or bonus token
    num_accepted: int


class Drafter(Protocol):
    def start(self, prompt_ids: list[int], params: SamplingParams) -> None: ...
    def propose(self, k: int) -> Proposal: ...
    def commit(self, tokens: list[int]) -> None: ...


class Verifier(Protocol):
    def start(self, prompt_ids: list[int], params: SamplingParams) -> None: ...
    def verify(self, proposal: Proposal) -> Verdict: ...


@dataclass
class SpecStats:
    """vLLM's definitions: acceptance rate = accepted / drafted; mean accepted length = 1 + accepted / rounds."""

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, k: int, num_accepted: int) -> None:
        self.rounds += 1
        self.drafted += k
        self.accepted += num_accepted
        grow = k - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow
        for i in range(k):
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_per_pos(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos)]

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_per_pos": [round(a, 4) for a in self.acceptance_per_pos],
            "draft_seconds": round(self.draft_seconds, 4), "verify_seconds": round(self.verify_seconds, 4),
        }


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    stats: SpecStats
    text: str | None = None


def speculative_generate(
    verifier: Verifier,
    drafter: Drafter | None,
    prompt_ids: list[int],
    params: SamplingParams,
    num_speculative_tokens: int,
    stop: StopChecker,
) -> GenerationResult:
    """Run rounds until `stop` says so. Tokens past a stop condition are dropped, never emitted."""
    k_max = num_speculative_tokens if drafter is not None else 0
    stats = SpecStats()
    verifier.start(prompt_ids, params)
    if k_max:
        drafter.start(prompt_ids, params)
    while not stop.finished:
        # One token is always emitted; drafting past the budget would be wasted work.
        k = min(k_max, params.max_tokens - len(stop.token_ids) - 1)
        t0 = time.perf_counter()
        proposal = drafter.propose(k) if k > 0 else Proposal([])
        t1 = time.perf_counter()
        verdict = verifier.verify(proposal)
        t2 = time.perf_counter()
        stats.draft_seconds += t1 - t0
        stats.verify_seconds += t2 - t1
        stats.record(proposal.k, verdict.num_accepted)
        stop.extend(verdict.tokens)
        if k_max and not stop.finished:
            drafter.commit(verdict.tokens)
    return GenerationResult(stop.token_ids, stop.finish_reason, stats)
