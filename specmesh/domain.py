"""The domain objects every layer exchanges, each concept with one name: a draft block, a verdict, the
verifier's load, and the events of one generation stream. Services convert them to and from protobuf at
their boundary (`specmesh.wire`) and work with these inside.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class AcceptanceRates:
    """vLLM's definitions, for any record of speculation counts: acceptance rate = accepted / drafted; mean
    accepted length = 1 + accepted / drafts, where drafts counts the rounds that verified a draft block."""

    accepted: int
    drafted: int
    drafts: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0


@dataclass
class SpecStats(AcceptanceRates):
    """A generation's speculation counts (`AcceptanceRates` for the rates); rounds also counts K = 0 steps."""

    rounds: int = 0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0  # waiting for verdicts (network and queueing included)
    pipelined_used: int = 0  # blocks drafted ahead during verification and then sent
    pipelined_discarded: int = 0
    chained_used: int = 0  # blocks sent ahead of the verdict before them whose guess held (chained_after)
    chained_discarded: int = 0  # ... whose guess failed: answered stale
    num_spec_tokens: int = 0  # the K cap: the most draft tokens one round could hold (the largest, merged)
    # The rounds that verified a draft block, by its length k: [k + 1] counts, j = the rounds of that length
    # that accepted exactly j (vLLM's acceptance_histogram_by_draft_length); as many rows as lengths seen.
    accepted_by_draft_length: dict[int, list[int]] = field(default_factory=dict)
    # [rounds that verified a draft block] each one's draft length and accepted count, in order. None: not
    # kept, as in totals over many generations, where they would grow without bound (see `per_generation`).
    step_drafted: list[int] | None = None
    step_accepted: list[int] | None = None
    # method -> [drafts, drafted, accepted] of the rounds whose block it drafted (a hybrid chooses per round).
    by_method: dict[str, list[int]] = field(default_factory=dict)

    @classmethod
    def per_generation(cls, num_spec_tokens: int = 0) -> SpecStats:
        """The statistics of one generation: its rounds kept one by one too."""
        return cls(num_spec_tokens=num_spec_tokens, step_drafted=[], step_accepted=[])

    def _cover(self, positions: int) -> None:
        """Make the per-position counts at least `positions` long."""
        grow = positions - len(self.drafted_per_pos)
        if grow > 0:
            self.drafted_per_pos += [0] * grow
            self.accepted_per_pos += [0] * grow

    def record(self, k: int, num_accepted: int) -> None:
        self.rounds += 1
        self.drafts += k > 0
        self.drafted += k
        self.accepted += num_accepted
        self._cover(k)
        for i in range(k):
            self.drafted_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1
        if k > 0:
            self.accepted_by_draft_length.setdefault(k, [0] * (k + 1))[num_accepted] += 1
            if self.step_drafted is not None and self.step_accepted is not None:
                self.step_drafted.append(k)
                self.step_accepted.append(num_accepted)

    def merge(self, other: SpecStats) -> None:
        """Add another generation's statistics (totals across requests, or across a failover)."""
        for name in (
            "rounds",
            "drafts",
            "drafted",
            "accepted",
            "draft_seconds",
            "verify_seconds",
            "pipelined_used",
            "pipelined_discarded",
            "chained_used",
            "chained_discarded",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._cover(len(other.drafted_per_pos))
        # Not strict: `other` may come off the wire (wire.stats_from_pb), where a peer's two lists need not match.
        for i, (d, a) in enumerate(zip(other.drafted_per_pos, other.accepted_per_pos, strict=False)):
            self.drafted_per_pos[i] += d
            self.accepted_per_pos[i] += a
        self.num_spec_tokens = max(self.num_spec_tokens, other.num_spec_tokens)
        for k, counts in other.accepted_by_draft_length.items():
            row = self.accepted_by_draft_length.setdefault(k, [0] * (k + 1))
            for j, c in enumerate(counts[: k + 1]):  # a peer's row longer than k + 1 would be malformed
                row[j] += c
        if self.step_drafted is not None and self.step_accepted is not None:
            self.step_drafted += other.step_drafted or []
            self.step_accepted += other.step_accepted or []
        for method, counts in other.by_method.items():
            mine = self.by_method.setdefault(method, [0, 0, 0])
            for i, c in enumerate(counts[:3]):
                mine[i] += c

    def acceptance_histogram(self) -> list[int]:
        """[num_spec_tokens + 1] rounds that accepted exactly j draft tokens, whatever their length (vLLM's
        acceptance_histogram; it sums to `drafts`)."""
        cap = max([self.num_spec_tokens, *self.accepted_by_draft_length])
        out = [0] * (cap + 1)
        for counts in self.accepted_by_draft_length.values():
            for j, c in enumerate(counts):
                out[j] += c
        return out

    @property
    def acceptance_per_pos(self) -> list[float]:
        # Not strict, as in merge: stats read off the wire may carry lists of different lengths.
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=False)]

    def as_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "drafts": self.drafts,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "acceptance_per_pos": [round(a, 4) for a in self.acceptance_per_pos],
            "draft_seconds": round(self.draft_seconds, 4),
            "verify_seconds": round(self.verify_seconds, 4),
            "pipelined_used": self.pipelined_used,
            "pipelined_discarded": self.pipelined_discarded,
            "chained_used": self.chained_used,
            "chained_discarded": self.chained_discarded,
            "by_method": self.method_dicts(),
        }

    def method_dicts(self) -> dict[str, dict[str, int]]:
        """by_method as {method: {"drafts", "drafted", "accepted"}}."""
        return {m: dict(zip(("drafts", "drafted", "accepted"), c, strict=False)) for m, c in self.by_method.items()}


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's raw logits (the log-softmax before any processing, as
    vLLM returns by default), and the most likely tokens at its position."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


@dataclass
class DraftBlock:
    """A draft's proposal for one round: K tokens and, optionally, the sparse draft distribution each was
    sampled from (the support the draft really sampled from, renormalised)."""

    token_ids: list[int]  # x_1..x_K
    q_ids: torch.Tensor | None = None  # [K, S] int64; None = point masses (greedy / n-gram drafts); -1 pads
    q_probs: torch.Tensor | None = None  # [K, S] float32
    # What drafted its first token when the drafter says ("suffix" for the hybrid's trees); "" the drafter's own.
    method: str = ""

    @property
    def k(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, s: slice) -> DraftBlock:
        if self.q_ids is None:
            return DraftBlock(self.token_ids[s], method=self.method)
        assert self.q_probs is not None  # a block has both q_ids and q_probs or neither
        return DraftBlock(self.token_ids[s], self.q_ids[s], self.q_probs[s], self.method)

    def __add__(self, other: DraftBlock) -> DraftBlock:
        if not other.k:
            return self
        if not self.k:
            return other
        if self.q_ids is None and other.q_ids is None:
            return DraftBlock(self.token_ids + other.token_ids, method=self.method)
        if self.q_ids is None or other.q_ids is None:
            raise ValueError("cannot join a block with draft probabilities to one without")
        # a block has both q_ids and q_probs or neither
        assert self.q_probs is not None and other.q_probs is not None
        width = max(self.q_ids.size(1), other.q_ids.size(1))

        def pad(t: torch.Tensor, value: float) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, width - t.size(1)), value=value)

        return DraftBlock(
            self.token_ids + other.token_ids,
            torch.cat([pad(self.q_ids, -1), pad(other.q_ids, -1)]),
            torch.cat([pad(self.q_probs, 0.0), pad(other.q_probs, 0.0)]),
            self.method,
        )


@dataclass(frozen=True)
class BatchLoad:
    """How the verifier's batch that served a verdict went: what a draft needs to see the verifier's load."""

    queue_seconds: float = 0.0  # the block waited this long for its batch
    batch_seconds: float = 0.0  # the batched target forward + rejection sampling
    batch_size: int = 0  # blocks in that batch
    batch_tokens: int = 0  # positions the batch's forward computed (sum over its blocks of K + 1)
    queue_depth: int = 0  # blocks still waiting when that batch started


@dataclass
class Verdict:
    """The answer to one draft block: the tokens committed this round (accepted drafts, then one recovered
    or bonus token) and what the verifier knows about the round."""

    tokens: list[int]
    num_accepted: int
    num_drafted: int | None = None  # K actually verified (a remote verifier may take a target-only step)
    finish_reason: str | None = None  # set by a verifier that applies the stop rules itself
    epoch: int = 0  # the session epoch the round advanced from
    stale: bool = False  # answers a block for a past epoch: nothing was verified
    deadline: bool = False  # a target-only step taken because the draft was late
    load: BatchLoad = field(default_factory=BatchLoad)
    logprobs: list[TokenLogprob] | None = None  # one per token of `tokens`, when the request asks for them


# The events of one generation stream, in order: Opened, then Tokens (any number), then Finished.
@dataclass(frozen=True)
class Opened:
    session_id: str
    prompt_tokens: int
    cached_prompt_tokens: int  # prompt tokens whose KV was already cached (prefix reuse)
    prefill_seconds: float = 0.0
    epoch: int = 0
    base_position: int = 0  # committed tokens of the session when the turn opened


@dataclass(frozen=True)
class Tokens:
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asks for them


@dataclass(frozen=True)
class Finished:
    # "stop" | "length" | "cancelled"; a draft service's "handed_off": the caller decodes the rest target-only
    finish_reason: str
    stats: SpecStats = field(default_factory=SpecStats)
    # A draft service's goodput guard at the end of the generation: does speculation measure at least as
    # fast as target-only there (None: not measured)
    speculation_pays: bool | None = None


GenerationEvent = Opened | Tokens | Finished
