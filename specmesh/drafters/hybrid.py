"""The draft chosen per round (Arctic Inference's hybrid of suffix decoding and a draft model): each round
takes the suffix trees' proposal or the draft model's, whichever promises more committed tokens per second
of the round, and a round the suffix wins runs no draft forward.

The goodput model, per round of k draft tokens:
* suffix: 1 + c * score tokens for one verify round, `score` the trees' own estimate of the tokens it gets
  accepted (the sum of each token's path probability), `c` the measured ratio of accepted tokens to score
  (pooled over the replica's rounds by match length: the trees' frequencies overrate a short match);
* model: 1 + a + a^2 + ... + a^k tokens for a verify round plus k draft forwards, `a` the model's measured
  per-token acceptance (accepted / (accepted + rejections), the geometric model's estimate);
* costs: the verify round's and one draft forward's seconds, both measured (the draft's on the rounds it
  drafted without racing a verification).
Lossless either way: a suffix proposal is a point mass (the n-gram rule); in a sampled request it carries its
point masses explicitly, so a block may join a model block drafted ahead (the verifier reads q as given).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specmesh.domain import DraftBlock, SpecStats
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.suffix import SuffixDrafter
from specmesh.sampling import SamplingParams

# A round's seconds by the positions each session of the batch verifies and the draft forwards before it
# (GoodputK.round_seconds); None while it cannot tell.
RoundSeconds = Callable[[int, int], "float | None"]

MATCH_BUCKETS = (1, 2, 4, 8, 16)  # match lengths by the bucket of calibration they share


def _bucket(match_len: int) -> int:
    for i, edge in enumerate(MATCH_BUCKETS):
        if match_len <= edge:
            return i
    return len(MATCH_BUCKETS)


@dataclass
class _Ewma:
    value: float
    weight: float = 0.05  # about the last 20 rounds

    def add(self, x: float) -> None:
        self.value += self.weight * (x - self.value)


@dataclass
class HybridChooser:
    """A replica's measured inputs to the choice, shared by every generation it drafts (a new session
    starts from what earlier ones measured). The priors only order the first few rounds."""

    suffix_calibration: list[_Ewma] = field(default_factory=lambda: [_Ewma(1.0) for _ in range(len(MATCH_BUCKETS) + 1)])
    model_accepted: float = 6.0  # accepted and rejections of model drafts, decayed: a = 0.75 at first
    model_rejected: float = 2.0
    verify_seconds: _Ewma = field(default_factory=lambda: _Ewma(0.0))  # 0 = not measured yet
    draft_seconds: _Ewma = field(default_factory=lambda: _Ewma(0.0))  # per model draft token
    chosen: dict[str, int] = field(default_factory=lambda: {"suffix": 0, "model": 0})

    @property
    def model_acceptance(self) -> float:
        return self.model_accepted / (self.model_accepted + self.model_rejected)

    def expected_suffix(self, match_len: int, score: float) -> float:
        return 1.0 + self.suffix_calibration[_bucket(match_len)].value * score

    def expected_model(self, k: int) -> float:
        a = self.model_acceptance
        return sum(a**i for i in range(k + 1))

    def prefers_suffix(
        self, k: int, match_len: int, score: float, length: int = 0, round_s: RoundSeconds | None = None
    ) -> bool:
        """Whether a suffix proposal (`length` tokens, this match and score) beats k model draft tokens (k = 0:
        a target-only step), by committed tokens per second. With `round_s`, the caller's model of a round's
        time by positions verified and draft forwards, a longer block pays for the wider verify batch it makes
        (on a compute-bound verifier a long block must promise that many more tokens); without, a round's
        verification is taken to cost the same at any length."""
        if score <= 0.0:
            return False
        suffix, model = self.expected_suffix(match_len, score), self.expected_model(k)
        if round_s is not None:
            t_suffix, t_model = round_s(length + 1, 0), round_s(k + 1, k)
            if t_suffix and t_model:
                return suffix / t_suffix >= model / t_model
        verify = self.verify_seconds.value
        draft = self.draft_seconds.value
        if verify <= 0.0 or draft <= 0.0:  # not measured yet: a proposal the trees rate at one token or more
            return score >= 1.0
        return suffix / verify >= model / (verify + k * draft)

    def observe_suffix(self, match_len: int, score: float, accepted: int) -> None:
        if score > 0.0:
            self.suffix_calibration[_bucket(match_len)].add(min(accepted / score, 4.0))

    def observe_model(self, drafted: int, accepted: int) -> None:
        decay = 0.97  # about the last 30 rounds
        self.model_accepted = self.model_accepted * decay + accepted
        self.model_rejected = self.model_rejected * decay + (accepted < drafted)

    def observe_verify(self, seconds: float) -> None:
        if self.verify_seconds.value <= 0.0:
            self.verify_seconds.value = seconds
        else:
            self.verify_seconds.add(seconds)

    def observe_draft(self, seconds_per_token: float) -> None:
        if self.draft_seconds.value <= 0.0:
            self.draft_seconds.value = seconds_per_token
        else:
            self.draft_seconds.add(seconds_per_token)


@dataclass
class _Proposed:
    """What drafted the tokens from one position on: the method, and for a suffix proposal its match length
    and score (the calibration's inputs)."""

    method: str
    match_len: int = 0
    score: float = 0.0


class HybridDrafter:
    """One generation's drafter over a draft model and the suffix trees; `by_method` is its rounds' statistics
    by the method that drafted each round's first token."""

    def __init__(self, model: ModelDrafter, suffix: SuffixDrafter, chooser: HybridChooser, cap: int = 0):
        self.model = model
        self.suffix = suffix
        self.chooser = chooser
        # Most tokens in a block of the trees' (the verifier's limit, or the request's K): free to draft, a
        # long one is worth verifying where the text repeats. 0: the round's model K.
        self.cap = cap
        self._round_s: RoundSeconds | None = None  # the round's time model, as free_block was last given it
        self.committed = 0  # tokens committed so far, prompt included: where the next round's block starts
        self._by_position: dict[int, _Proposed] = {}  # a block's first position -> what drafted it
        self._greedy = True
        self._model_only = False
        # The model's prefill waits for its first proposal: set by the caller for a turn whose rounds will
        # likely draft by the trees or not at all (under load the model's K is 0), so a turn that never drafts
        # by the model never pays its prefill.
        self.defer_model = False
        self.by_method: dict[str, SpecStats] = {}

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self._greedy = params.greedy
        # A seeded request must replay exactly, and the choice rests on timings: it drafts by the model alone.
        self._model_only = params.seed is not None
        self.committed = len(prompt_ids)
        self._by_position.clear()
        await self.suffix.start(prompt_ids, params)
        if self._model_only:
            await self.model.start(prompt_ids, params)
        else:  # the first rounds may be the trees': they need not wait for the model's prefill
            await self.model.begin(prompt_ids, params, defer=self.defer_model)

    async def propose(
        self, k: int, after: Sequence[int] = (), should_stop: Callable[[], bool] | None = None
    ) -> DraftBlock:
        at = self.committed + len(after)
        for later in [p for p in self._by_position if p > at]:  # drafted on assumptions this block replaces
            del self._by_position[later]
        # The round's own block had the trees weighed by free_block; a block drafted ahead (should_stop) has not.
        ahead = should_stop is not None and not self._model_only
        draft = self.suffix.speculate(k, after) if ahead else None
        n = len(draft.token_ids) if draft else 0
        if draft and n and self.chooser.prefers_suffix(k, draft.match_len, draft.score, n, self._round_s):
            return self._suffix_block(at, draft)
        self.chooser.chosen["model"] += 1
        self._by_position[at] = _Proposed("model")
        await self.model.ready()  # not the draft's time per token
        t0 = time.perf_counter()
        block = await self.model.propose(k, after, should_stop)
        if should_stop is None and block.k:  # racing a verification, its time says nothing of the draft's
            self.chooser.observe_draft((time.perf_counter() - t0) / block.k)
        return block

    def free_block(self, k: int, budget: int, round_s: RoundSeconds | None = None) -> DraftBlock | None:
        """The trees' block for the next round, up to `cap` (and `budget`) tokens, when it promises more
        committed tokens per second than k model draft tokens (k = 0, the model's K where speculation does not
        pay: a target-only step); None otherwise, and the round drafts as `propose` would. Costs no draft
        forward, so it is asked every round, under any load."""
        self._round_s = round_s
        cap = min(self.cap or k, budget)
        if self._model_only or cap <= 0:
            return None
        draft = self.suffix.speculate(cap)
        if not draft.token_ids:
            return None
        if not self.chooser.prefers_suffix(k, draft.match_len, draft.score, len(draft.token_ids), round_s):
            return None
        return self._suffix_block(self.committed, draft)

    def chained_block(
        self, after: Sequence[int], k: int, budget: int, round_s: RoundSeconds | None = None
    ) -> tuple[DraftBlock, int] | None:
        """The trees' block for the round after the one verifying `after` and the bonus token it assumes
        (`SuffixDrafter.chained_block`), when it wins that round by `free_block`'s rule (its probabilities
        given the guess); None otherwise."""
        found = None if self._model_only else self.suffix.guess_after(after, min(self.cap or k, budget))
        if found is None:
            return None
        bonus, draft = found
        if not self.chooser.prefers_suffix(k, draft.match_len, draft.score, draft.k, round_s):
            return None
        return self._suffix_block(self.committed + len(after) + 1, draft), bonus

    def _suffix_block(self, at: int, draft) -> DraftBlock:
        self.chooser.chosen["suffix"] += 1
        for later in [p for p in self._by_position if p > at]:  # a chained guess that failed
            del self._by_position[later]
        self._by_position[at] = _Proposed("suffix", draft.match_len, draft.score)
        self.suffix.count(draft)
        tokens = draft.token_ids
        if self._greedy:
            return DraftBlock(tokens, method="suffix")
        # Explicit point masses: the block may be joined to a model block with its q.
        ids = torch.tensor(tokens, dtype=torch.int64).unsqueeze(1)
        return DraftBlock(tokens, ids, torch.ones(len(tokens), 1), "suffix")

    def observe(self, drafted: int, accepted: int, verify_seconds: float | None) -> None:
        """A verdict on the block that starts at the committed position (before `commit`); `verify_seconds`
        None: its wait measured no round (a chained block's)."""
        if verify_seconds is not None:
            self.chooser.observe_verify(verify_seconds)
        proposed = self._covering(self.committed)
        if proposed is None or drafted == 0:
            return
        self.by_method.setdefault(proposed.method, SpecStats()).record(drafted, accepted)
        if proposed.method == "suffix":
            self.chooser.observe_suffix(proposed.match_len, proposed.score, accepted)
        else:
            self.chooser.observe_model(drafted, accepted)

    def _covering(self, position: int) -> _Proposed | None:
        """What drafted the token at `position`: the proposal that starts last at or before it (a block
        drafted ahead starts at the guessed bonus token, one before the block it becomes)."""
        starts = [at for at in self._by_position if at <= position]
        return self._by_position[max(starts)] if starts else None

    def commit(self, tokens: list[int]) -> None:
        self.committed += len(tokens)
        covering = max((at for at in self._by_position if at <= self.committed), default=None)
        for at in [at for at in self._by_position if covering is not None and at < covering]:
            del self._by_position[at]
        self.suffix.commit(tokens)
        self.model.commit(tokens)

    async def finish(self, output_ids: Sequence[int]) -> None:
        await self.suffix.finish(output_ids)

    async def settle(self) -> None:
        await self.model.settle()

    def release(self) -> None:
        self.model.release()
