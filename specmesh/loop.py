"""THE speculation loop, written once against two small interfaces.

A `Drafter` proposes blocks of draft tokens; a `Verifier` returns verdicts (the committed tokens of a
round: accepted drafts, then the recovered or bonus token). In-process generation plugs in a local
drafter and a local verifier; the draft service plugs in a remote verifier that speaks gRPC. K = 0 is
target-only decoding through the very same path, the baseline every speedup is measured against.

The loop is a coroutine: in the draft service every session's loop runs on the one event loop that also
owns the gRPC streams and the batched draft model, so a round costs no thread hand-off; in process it runs
under `asyncio.run`.

Pipelined drafting: `Verifier.submit` returns an awaitable, and while it is pending the drafter keeps going
past the block as if all of it were accepted: first a guess of the bonus token, then the next block. If
the verdict accepts the whole block and its bonus equals the guess, the next block is already drafted;
otherwise it is thrown away (the drafter's cache rolls back on its own). Keeping it is exact: the kept
tokens were sampled from q given exactly the committed prefix, and whether they are kept depends only on
tokens before them. A local verifier completes at once, so nothing is drafted ahead in-process.

A K = 0 that stands for a while (past the verifier's batch limit, or a generation asked to be target-only)
is asked of the verifier as one run of target-only steps (`Verifier.target_only`): a remote verifier takes
them without a block, or a round trip, per step, and streams a verdict per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from specmesh.domain import BatchLoad, DraftBlock, SpecStats, TokenLogprob, Verdict
from specmesh.sampling import SamplingParams, StopChecker


class Drafter(Protocol):
    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None: ...

    async def propose(
        self, k: int, after: Sequence[int] = (), should_stop: Callable[[], bool] | None = None
    ) -> DraftBlock:
        """Draft up to k tokens continuing the committed tokens + `after` (tokens assumed, not committed);
        return early, with fewer tokens, once should_stop() is true."""
        ...

    def commit(self, tokens: list[int]) -> None: ...


class Verifier(Protocol):
    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None: ...

    def submit(self, proposal: DraftBlock) -> Awaitable[Verdict]:
        """Start verifying now; the awaitable's result is the Verdict. A verifier with `chains` set also
        takes `then` (a chained block and the token it assumes this verdict ends with, sent right behind)
        and `sent` (the proposal went out chained already: await its verdict)."""
        ...

    def target_only(self, steps: int) -> AsyncGenerator[Verdict, None]:
        """Take up to `steps` target-only steps in a row, yielding each step's Verdict as it is taken (the
        caller stops reading once the generation has ended): a run of K = 0 rounds without a block, and
        for a remote verifier without a round trip, per step."""
        ...


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled" | "handed_off" (speculative_generate's hand_off)
    stats: SpecStats
    text: str | None = None
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them


@dataclass
class RoundRecord:
    """One round's facts, for tracing. Times are time.perf_counter() instants."""

    k: int  # draft tokens sent
    num_drafted: int  # draft tokens the verifier verified (0 for a deadline step)
    num_accepted: int
    num_committed: int
    t_start: float  # drafting began (or the drafted-ahead block was taken)
    t_sent: float  # the block was submitted
    t_ahead_done: float  # drafting ahead during verification ended
    t_verdict: float  # the verdict arrived
    from_pipeline: bool = False


class FixedK:
    """Always draft k tokens."""

    def __init__(self, k: int):
        self.k_max = k

    def next_k(self) -> int:
        return self.k_max

    def zero_run(self, remaining: int) -> int:
        """Target-only steps to take in a row, now that next_k() said 0 with `remaining` tokens left to
        generate: K is never coming back, so all of them."""
        return remaining if self.k_max == 0 else 1

    def observe(
        self,
        k: int,
        num_accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        load: BatchLoad | None = None,
        timed: bool = True,
    ) -> None:
        """A round's verdict: k drafted, num_accepted accepted, and its times; `timed` False: the times are no
        measure of a round (the generation's first, which waited for the pass computing its prompt's end)."""

    def observe_goodput(self, k: int, tokens: int, seconds: float, free: bool = False, timed: bool = True) -> None:
        """A round (k > 0) or a run of target-only steps (k = 0) committed `tokens` in `seconds` of wall time;
        `free`: the round's block cost no draft forward (the suffix trees'); `timed` False: its time is no
        measure (the generation's first round), only its tokens count."""


def expected_tokens(cumulative: Sequence[float], alpha: float, k: int) -> float:
    """Tokens a round of K drafts commits, E(K) = 1 + sum_{i<K} P_i. P_i, the chance that its first i + 1
    drafts are all accepted, is `cumulative[i]` where measured (never rising with i); past the measured
    positions each further one is accepted with the last measured conditional acceptance P_n / P_(n-1), or
    `alpha` before two positions are measured. Measured rather than α^(i+1): a draft's acceptance comes in
    runs (text it knows, it knows for several tokens), so the first positions are the hardest and a pooled α
    misjudges E(K). For the demo pair it undervalues long blocks: in process, K = 2 implies α = 0.73, which
    predicts 2.30 accepted per round at K = 6, where 2.84 are."""
    beyond = alpha
    if len(cumulative) >= 2 and cumulative[-2] > 0:
        beyond = min(0.999, cumulative[-1] / cumulative[-2])
    e, last = 1.0, 1.0
    for i in range(k):
        last = min(last, cumulative[i]) if i < len(cumulative) else last * beyond
        e += last
    return e


def _ema(old: float | None, new: float) -> float:
    """An exponential moving average of timings: the first observation as it is, then 20% per new one."""
    return new if old is None else 0.8 * old + 0.2 * new


class AdaptiveK:
    """K per session from live acceptance and timings, maximising expected tokens per second (SmartSpec).

    A round of K drafts commits E(K) = 1 + Σ_{i<K} P_i tokens (`expected_tokens`: P_i, the chance that its
    first i + 1 drafts are accepted, as measured per position over recent rounds, extrapolated past the
    positions measured; with i.i.d. acceptance that is (1 - α^(K+1)) / (1 - α)) and takes
    K·t_draft + t_verify, where t_verify is the time from submitting a block to its verdict
    (network, queueing and the target forward: what K = 0 costs on its own). α is estimated by censored
    geometric MLE (accepted / (accepted + rejections)) with exponential forgetting. When K = 0 wins
    (a draft that rarely agrees, or a verifier so loaded that drafting costs more than it saves) a K = 1
    probe every `probe_every` rounds keeps the estimate alive.
    """

    # Per-position acceptance forgets more slowly than α (each position is seen only in rounds that draft
    # it), and a position counts as measured once this many recent rounds drafted it.
    POSITION_DECAY = 0.95
    POSITION_MIN_ROUNDS = 4.0

    def __init__(
        self, k_max: int, decay: float = 0.9, prior_alpha: float = 0.6, prior_weight: float = 4.0, probe_every: int = 16
    ):
        self.k_max = k_max
        self.decay = decay
        self.accepted = prior_alpha * prior_weight  # forgetting sums
        self.trials = prior_weight
        # per draft position i: rounds that drafted it, and rounds that accepted it and every one before it
        self.position_drafted = [0.0] * k_max
        self.position_accepted = [0.0] * k_max
        self.t_draft: float | None = None  # seconds per draft token
        self.t_verify: float | None = None
        self.probe_every = probe_every
        self.rounds_at_zero = 0

    @property
    def alpha(self) -> float:
        return min(self.accepted / self.trials, 0.999) if self.trials else 0.0

    def observe(
        self,
        k: int,
        num_accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        load: BatchLoad | None = None,
        timed: bool = True,
    ) -> None:
        if k > 0:
            self.accepted = self.decay * self.accepted + num_accepted
            self.trials = self.decay * self.trials + num_accepted + (num_accepted < k)
            d = self.POSITION_DECAY
            for i in range(len(self.position_drafted)):
                drafted = i < k
                self.position_drafted[i] = d * self.position_drafted[i] + drafted
                self.position_accepted[i] = d * self.position_accepted[i] + (drafted and num_accepted > i)
            if draft_seconds > 0 and timed:
                self.t_draft = _ema(self.t_draft, draft_seconds / k)
        if timed:
            self.t_verify = _ema(self.t_verify, verify_seconds)

    def cumulative(self) -> list[float]:
        """P_i of the positions measured so far (the leading ones with enough recent rounds)."""
        out = []
        for drafted, accepted in zip(self.position_drafted, self.position_accepted, strict=True):
            if drafted < self.POSITION_MIN_ROUNDS:
                break
            out.append(accepted / drafted)
        return out

    def expected_tokens(self, k: int) -> float:
        return expected_tokens(self.cumulative(), self.alpha, k)

    def _expected_by_k(self) -> list[float]:
        """E(K) for K = 0..k_max, from one read of the estimates (a round's choice weighs them all)."""
        measured, alpha = self.cumulative(), self.alpha
        return [expected_tokens(measured, alpha, k) for k in range(self.k_max + 1)]

    def next_k(self) -> int:
        if self.t_draft is None or self.t_verify is None:
            return self.k_max  # measure first
        e = self._expected_by_k()
        rate = lambda k: e[k] / (k * self.t_draft + self.t_verify)
        return self._probed(self._best_k(rate))

    def _best_k(self, rate: Callable[[int], float]) -> int:
        """The K in [0, k_max] of the highest rate, the smallest of those on a tie."""
        return max(range(self.k_max + 1), key=lambda k: (rate(k), -k))

    def _probed(self, best: int) -> int:
        """`best`, except that while K = 0 wins every `probe_every`-th round drafts one token, so that the
        acceptance estimate still sees drafts and K can come back."""
        if best == 0:
            self.rounds_at_zero += 1
            if self.rounds_at_zero % self.probe_every == 0:
                return min(1, self.k_max)
        else:
            self.rounds_at_zero = 0
        return best

    def zero_run(self, remaining: int) -> int:
        """Target-only steps to take in a row, now that next_k() said 0: one. A K = 0 chosen from acceptance and
        timings is a judgement on the last rounds that each verdict's timings may revise (they refit the
        forward model), so it is not held for a run."""
        return 1

    def observe_goodput(self, k: int, tokens: int, seconds: float, free: bool = False, timed: bool = True) -> None:
        pass


class GoodputGuard:
    """Measured goodput of speculation against target-only, pooled over every session of a draft service.

    GoodputK chooses K from a model of a round's time, and a model can miss what a round really costs: a
    verifier that serves speculating sessions in more, smaller batches than target-only ones, a draft that
    competes with the target for one GPU, a round trip per round where target-only steps come in runs. The
    guard measures instead: tokens committed per second of wall time, in speculative rounds and in
    target-only steps, summed over sessions with exponential forgetting (`decay` per observation).

    Every `every` speculative rounds (service-wide) one session takes `probe` target-only steps, so that side
    stays measured. While speculation measures slower than target-only by more than `margin`, sessions take
    target-only steps in runs, and after every `every` such steps `probe` rounds speculate, so that
    speculation comes back when it pays again. Until both sides are measured, and speculation in at least
    `min_rounds` rounds, speculation goes on as GoodputK chooses it: a guard that has seen a session's first
    round or two only (the first rounds of a burst wait behind the other sessions' prefills) has measured the
    burst, not speculation. `decay` forgets an observation's weight by 10% per newer one on the same side:
    about the last ten rounds, or the last ten target-only runs, count.

    Rounds whose block cost no draft forward (`free`: the suffix trees', sent whole whatever K) are a side of
    their own, measured against target-only apart from the model's rounds: on an edit loop a session's text
    may be new (the model's drafts, a forward each, lose to one-row target-only steps) or copied (the trees'
    blocks commit several tokens a round for one verify block), and pooled the first hid the second. The runs
    above hold the model's drafting; `free_held` holds the free blocks while they measure losing, and after
    every `every` target-only steps lets the trees offer `probe` blocks, so that side is measured again: the
    trees' first blocks come while the text is new to them, and a side judged on those alone stayed held for
    good (greedy HumanEval samples, which the trees would copy whole from the first sample on, ran target-only
    at 0.93x where the blocks measured 2.1x).
    """

    TARGET_ONLY, MODEL, FREE = 0, 1, 2  # the sides, indexes of the sums

    def __init__(
        self,
        every: int = 64,
        probe: int = 4,
        margin: float = 0.05,
        decay: float = 0.9,
        min_rounds: int = 4,
        measure_first: bool = False,
    ):
        if every < 1 or probe < 1 or not 0.0 <= margin < 1.0 or not 0.0 < decay <= 1.0 or min_rounds < 1:
            raise ValueError(
                "GoodputGuard needs every >= 1, probe >= 1, 0 <= margin < 1, 0 < decay <= 1 and min_rounds >= 1"
            )
        self.every, self.probe, self.margin, self.decay = every, probe, margin, decay
        self.min_rounds = min_rounds
        # measure_first: the first session to ask takes a probe of target-only steps before any round, so the
        # guard can judge after min_rounds rounds rather than after `every` (a sampled stream's first requests
        # otherwise speculated at a loss for ~100 tokens before the first target-only probe measured the other
        # side); handed out once, the `every` probes measure from then on.
        self._zero_first = measure_first
        self._rounds = [0, 0, 0]  # speculative rounds observed in all, by side (target-only: unused)
        self._tokens = [0.0, 0.0, 0.0]  # decayed sums, [target-only, model speculation, free blocks]
        self._seconds = [0.0, 0.0, 0.0]
        self._spec_rounds_since_probe = 0  # speculative rounds since target-only was last measured
        self._zero_steps_since_probe = 0  # target-only steps since speculation was last measured
        self._spec_probe_left = 0  # rounds of a speculation probe still to hand out
        self._zero_steps_since_free = 0  # target-only steps since a free block was last measured
        self._free_probe_left = 0  # free blocks of a probe of that side still to measure
        self.probes = 0  # probes handed out, either side (sessions share a guard on one event loop)

    # An observation counts for at most this many times its side's current seconds per token: a round that
    # waited out a stalled replica or a paused process is a fault, not what speculation costs, and without
    # a bound one such round would outweigh the last ten.
    CLIP = 4.0

    @classmethod
    def _side(cls, speculative: bool, free: bool) -> int:
        return cls.FREE if free and speculative else int(speculative)

    def observe(self, speculative: bool, tokens: int, seconds: float, free: bool = False, timed: bool = True) -> None:
        """`timed` False: the round or run's time is no measure (a generation's first, which waited for its
        prompt's prefill): it counts toward the probes' schedule but is no measure of its side. Counted all the
        same, or a request held to target-only from its first round on (one run to its end, never timed) left
        the schedule where it was, and with both sides measured losing no probe ever came again (measured: an
        edit loop's repeated prompts decoded target-only for good where the trees' blocks had measured 4x)."""
        if tokens <= 0 or (timed and seconds <= 0):
            return
        i = self._side(speculative, free)
        if timed:
            rate = self.rate(speculative, free)
            if rate is not None:
                seconds = min(seconds, self.CLIP * tokens / rate)
            self._tokens[i] = self.decay * self._tokens[i] + tokens
            self._seconds[i] = self.decay * self._seconds[i] + seconds
        if i == self.TARGET_ONLY:
            self._zero_steps_since_probe += tokens
            self._zero_steps_since_free += tokens
            if timed:  # the target-only side was measured
                self._spec_rounds_since_probe = 0
            return
        self._spec_rounds_since_probe += 1
        if not timed:
            return
        if i == self.FREE:
            self._zero_steps_since_free = 0
            self._free_probe_left = max(0, self._free_probe_left - 1)
        self._rounds[i] += 1
        if i == self.MODEL:  # the model's speculation was measured (what the target-only runs wait for)
            self._zero_steps_since_probe = 0

    def rate(self, speculative: bool, free: bool = False) -> float | None:
        """Tokens per second of wall time per session on a side, None before any observation there."""
        i = self._side(speculative, free)
        return self._tokens[i] / self._seconds[i] if self._seconds[i] > 0 else None

    def measured(self, free: bool = False) -> bool:
        """Target-only measured, and the model's speculation (the free blocks') in at least min_rounds rounds."""
        return self._rounds[self._side(True, free)] >= self.min_rounds and self.rate(False) is not None

    def _loses(self, free: bool) -> bool:
        spec, zero = self.rate(True, free), self.rate(False)
        return self.measured(free) and spec is not None and zero is not None and spec < (1.0 - self.margin) * zero

    def speculation_loses(self) -> bool:
        """The model's speculation measures slower than target-only (by more than the margin)."""
        return self._loses(False)

    def free_loses(self) -> bool:
        """The free blocks' rounds measure slower than target-only (by more than the margin)."""
        return self._loses(True)

    def free_held(self) -> bool:
        """Whether the free blocks are held back now: while they measure losing, but for `probe` of them after
        every `every` target-only steps (the probe lasts until that many free rounds are measured)."""
        if not self.free_loses():
            self._free_probe_left = 0
            return False
        if not self._free_probe_left and self._zero_steps_since_free >= self.every:
            self._free_probe_left = self.probe
            self.probes += 1
        return not self._free_probe_left

    def speculation_pays(self) -> bool | None:
        """What the service reports to its callers: None until target-only and either kind of speculation are
        measured, then whether one that is measured is within the margin of target-only or faster."""
        sides = [free for free in (False, True) if self.measured(free)]
        if not sides:
            return None
        return any(not self._loses(free) for free in sides)

    def target_only_steps(self, runs: bool = True) -> int:
        """Target-only steps the asking session should take now instead of speculating (0: speculate).
        `runs` False: a session sent to measure speculation (its caller routes the others past it): it
        speculates as if speculation paid, short target-only probes included, so both sides stay measured."""
        if self._zero_first:
            self._zero_first = False
            if self.rate(False) is None:
                self.probes += 1
                return self.probe
        if self.speculation_loses() and runs:
            if self._spec_probe_left:
                self._spec_probe_left -= 1
                return 0
            if self._zero_steps_since_probe >= self.every:
                self._zero_steps_since_probe = 0
                self._spec_probe_left = self.probe - 1  # this round and the next probe - 1 speculate
                self.probes += 1
                return 0
            return self.every
        if self._spec_rounds_since_probe >= self.every:
            self._spec_rounds_since_probe = 0
            self.probes += 1
            return self.probe
        return 0


class GoodputGuards:
    """A draft service's goodput guards, one per kind of session they compare: greedy or sampled (a sampled
    block's tokens are accepted with their probability only, so the same drafts pay less), and the size of
    the verify batch the session shares, by powers of two (a session's tokens per second at 4 or 16 streams
    say nothing of one stream alone). Pooled over every session, the guard compared speculative rounds
    measured in one regime with target-only steps measured in another: after a burst of 4 streams whose
    first rounds waited behind each other's prefills, the next single stream took a whole run of 64
    target-only steps. Each guard is a GoodputGuard with the same settings, made when first asked for, but for
    the sampled guards' margin (`sampled_margin`): a greedy guard's band of 5 % keeps it from flapping between
    two sides that measure alike, while a sampled block's best is near parity, so within the band a sampled
    session speculated at 0.95x target-only (both edit-loop runs at one stream, T = 0.7). A sampled session
    speculates only while speculation measures at least as fast as target-only, and its guard measures
    target-only first (`measure_first`)."""

    BATCH_EDGES = (1, 2, 4, 8, 16, 32)  # a batch of n sessions shares the guard of the largest edge <= n

    def __init__(self, sampled_margin: float = 0.0, **settings) -> None:
        self.settings = settings
        self.sampled_settings = settings | {"margin": sampled_margin, "measure_first": True}
        self.guards: dict[tuple[bool, int], GoodputGuard] = {}

    @classmethod
    def batch_bucket(cls, batch_size: int) -> int:
        """The edge a batch of `batch_size` sessions is counted under (0 or 1, one unmeasured yet: 1)."""
        return max((e for e in cls.BATCH_EDGES if e <= batch_size), default=cls.BATCH_EDGES[0])

    def at(self, greedy: bool, batch_size: int) -> GoodputGuard:
        key = (greedy, self.batch_bucket(batch_size))
        guard = self.guards.get(key)
        if guard is None:
            guard = self.guards[key] = GoodputGuard(**(self.settings if greedy else self.sampled_settings))
        return guard

    @property
    def probes(self) -> int:
        return sum(g.probes for g in self.guards.values())


class GoodputK(AdaptiveK):
    """K chosen for the tokens the verifier commits per second across its whole batch, not for one session.

    Each verdict reports the batch that served it (`BatchLoad`: sessions, positions computed, forward
    seconds). From those a live linear model of the target forward, t_fwd(T) = a + b·T over the batch's
    positions T, is fitted by exponentially weighted least squares. With N sessions in the batch each
    drafting K, a round takes K·t_draft + o + t_fwd(N·(K + 1)), o being what the round costs besides the
    forward (network, queueing, sampling), and commits N·E(K) tokens; K maximises their ratio. Where the
    verifier is compute-bound (b·N large against a), every extra draft position costs more target time
    than it saves and K falls to 0: speculation never loses to target-only. With no load reports (an
    in-process verifier) it is AdaptiveK. While every batch has the same size the slope cannot be seen, so
    every `explore_every` rounds one round drafts a different K until the batch sizes spread out.
    `batch_limit` > 0: K is 0 while the verifier's last batch held more sessions than that (vLLM's
    speculative_disable_by_batch_size, per round: the verifier's batch is reported on every verdict, K = 0
    rounds included, so speculation comes back as soon as the batch shrinks).
    """

    def __init__(
        self,
        k_max: int,
        decay: float = 0.95,
        explore_every: int = 8,
        batch_limit: int = 0,
        guard: GoodputGuard | GoodputGuards | None = None,
        guard_runs: bool = True,
        sampled: bool = False,
        **kw,
    ):
        super().__init__(k_max, **kw)
        self.batch_limit = batch_limit
        self.sampled = sampled  # the request samples (T > 0): its runs under the batch limit are longer
        self.guard = guard
        # False: a goodput probe, which takes none of the guard's target-only runs until it has speculated
        # PROBE_ROUNDS measured rounds (the first, which waited for the prompt's prefill, is not one)
        self.guard_runs = guard_runs
        self.probe = not guard_runs
        self._probe_rounds = 0
        self._guard_steps = 0  # target-only steps the guard asked for, taken as the next run
        self._guard_probe = False  # ... to measure the target-only side (not because speculation loses)
        self.last_batch_size = 0
        self.fit_decay = decay
        self.explore_every = explore_every
        self._rounds = 0
        self._sums = [0.0] * 5  # weighted n, ΣT, ΣT², Σy, ΣTy of (batch tokens T, forward seconds y)
        self.batch_size: float | None = None
        self.overhead: float | None = None  # seconds per round outside the target forward

    def observe(
        self,
        k: int,
        num_accepted: int,
        draft_seconds: float,
        verify_seconds: float,
        load: BatchLoad | None = None,
        timed: bool = True,
    ) -> None:
        super().observe(k, num_accepted, draft_seconds, verify_seconds, load, timed)
        if load is None or load.batch_size <= 0 or load.batch_tokens <= 0:
            return
        self.last_batch_size = load.batch_size
        if not timed:
            return
        d, t, y = self.fit_decay, float(load.batch_tokens), load.batch_seconds
        for j, v in enumerate((1.0, t, t * t, y, t * y)):
            self._sums[j] = d * self._sums[j] + v
        self.batch_size = _ema(self.batch_size, float(load.batch_size))
        self.overhead = _ema(self.overhead, max(0.0, verify_seconds - load.batch_seconds))

    def _spread(self) -> tuple[float, float]:
        n, st, stt = self._sums[:3]
        mean_t = st / n
        return mean_t, stt / n - mean_t * mean_t

    def forward_model(self) -> tuple[float, float] | None:
        """(a, b) of t_fwd(T) = a + b·T, b >= 0; None before any load report."""
        n, _, _, sy, sty = self._sums
        if n <= 0:
            return None
        mean_t, var = self._spread()
        mean_y = sy / n
        b = max(0.0, (sty / n - mean_t * mean_y) / var) if var > 1e-6 * max(1.0, mean_t * mean_t) else 0.0
        return max(0.0, mean_y - b * mean_t), b

    @property
    def guard_holds(self) -> bool:
        """The goodput guard measured the model's speculation losing and holds this session's drafting off now."""
        return bool(self._guard_steps)

    @property
    def free_held(self) -> bool:
        """The loop asks the trees for no block now: the goodput guard measured the free blocks' rounds losing
        (and no probe of them is due), or its steps now are a probe of the target-only side (which a free block
        would skip)."""
        if self._guard_probe:
            return True
        guard = self.current_guard()
        return guard is not None and self.k_max > 0 and guard.free_held()

    def round_seconds(self, positions: int, draft_tokens: int = 0) -> float | None:
        """A round's predicted seconds were every session of the batch to verify `positions` positions (its
        draft and the bonus) after `draft_tokens` draft forwards; None before the forward model is fitted."""
        fit = self.forward_model()
        if fit is None or self.batch_size is None or self.overhead is None:
            return None
        a, b = fit
        t_draft = (self.t_draft or 0.0) * draft_tokens
        return t_draft + self.overhead + a + b * self.batch_size * positions

    # Target-only steps in a row while the verifier's batch is past batch_limit: the batch is looked at again
    # after each run, so speculation comes back within this many tokens of the batch shrinking. Each run's end
    # costs the session about a step of the batch (it sits out the forward that starts before its next run
    # arrives); a sampled request, whose drafts are accepted with their probability only, gains less from
    # speculation coming back sooner and takes runs four times as long.
    BATCH_LIMIT_RUN = 16
    BATCH_LIMIT_RUN_SAMPLED = 64

    def _batch_limited(self) -> bool:
        return bool(self.batch_limit) and self.last_batch_size > self.batch_limit

    def zero_run(self, remaining: int) -> int:
        if self._batch_limited():
            run = self.BATCH_LIMIT_RUN_SAMPLED if self.sampled else self.BATCH_LIMIT_RUN
            return max(1, min(run, remaining))
        if self._guard_steps:
            steps, self._guard_steps, self._guard_probe = self._guard_steps, 0, False
            return max(1, min(steps, remaining))
        return super().zero_run(remaining)

    def hands_off(self) -> bool:
        """A goodput probe that has speculated its PROBE_ROUNDS measured rounds, now held to target-only steps
        because the guard measures speculation losing: what it came to measure is measured, and the rest of
        its request is target-only decoding, which its caller can do without this hop. Likewise a sampled
        probe held by the batch limit: it has nothing to measure while the batch stays past the limit, and
        its runs (BATCH_LIMIT_RUN_SAMPLED steps each, the trees asked once a run) are target-only decoding
        relayed through this hop, a draft slot held, to the end of most requests (the one probe of a T = 0.7
        level of bench.load at 4 streams relayed 61-63 of its 64 tokens). A greedy one keeps going: past the
        limit the trees' free blocks are its speculation."""
        if self.probe and self.sampled and self._batch_limited():
            return True
        return self.probe and self.guard_runs and self._guard_steps > 0 and not self._guard_probe

    def current_guard(self) -> GoodputGuard | None:
        """The guard of this session's kind at the batch its last verdict reported (one guard: that one)."""
        if isinstance(self.guard, GoodputGuards):
            return self.guard.at(not self.sampled, self.last_batch_size)
        return self.guard

    # A goodput probe speculates this many measured rounds whatever the guard says, enough for the guard to measure its
    # side afresh (it weighs about the last ten rounds), then takes the guard's runs like any session: a probe
    # that speculated through its whole request where speculation measured losing paid that loss on all of its
    # tokens (sampled edit loop and HumanEval at one stream, one request in eight a probe: 0.91-0.93x
    # target-only in two of four runs).
    PROBE_ROUNDS = 8

    def observe_goodput(self, k: int, tokens: int, seconds: float, free: bool = False, timed: bool = True) -> None:
        guard = self.current_guard()  # `observe` has just recorded the round's batch
        if guard is not None:
            guard.observe(k > 0, tokens, seconds, free, timed)
        if not self.guard_runs and k > 0 and timed:
            self._probe_rounds += 1
            self.guard_runs = self._probe_rounds >= self.PROBE_ROUNDS

    def next_k(self) -> int:
        if self._batch_limited():
            return 0
        guard = self.current_guard()
        if guard is not None and self.k_max:
            self._guard_steps = guard.target_only_steps(self.guard_runs)
            # Steps the guard asks for while the model's speculation does not lose measure the target-only side.
            self._guard_probe = bool(self._guard_steps) and not (guard.speculation_loses() and self.guard_runs)
            if self._guard_steps:
                return 0
        fit = self.forward_model()
        if fit is None or self.t_draft is None or self.batch_size is None or self.overhead is None:
            return super().next_k()
        a, b = fit
        n, t_draft, overhead = self.batch_size, self.t_draft, self.overhead
        e = self._expected_by_k()

        def rate(k: int) -> float:
            return e[k] / (k * t_draft + overhead + a + b * n * (k + 1))

        best = self._best_k(rate)
        self._rounds += 1
        mean_t, var = self._spread()
        if self._rounds % self.explore_every == 0 and var < 0.01 * mean_t * mean_t:
            return best // 2 if best > 1 else min(best + 1, self.k_max)
        return self._probed(best)


# Target-only steps in a row at most, with a drafter whose proposals cost nothing: its trees are asked again
# after each run. Each run is a round trip that takes the session out of step with its verify batch once, so a
# sampled request, whose proposals are accepted with their probability only (16 % of the trees' tokens on the
# edit loop at T = 0.7, against 70 % greedy), keeps the policy's runs and asks the trees after each.
FREE_BLOCK_RECHECK = 4


async def speculative_generate(
    verifier: Verifier,
    drafter: Drafter | None,
    prompt_ids: list[int],
    params: SamplingParams,
    num_speculative_tokens: int | FixedK | AdaptiveK,
    stop: StopChecker,
    on_tokens: Callable[[list[int], list[TokenLogprob] | None], None] | None = None,
    pipeline: bool = False,
    chain: bool = False,
    cancelled: Callable[[], bool] | None = None,
    on_round: Callable[[RoundRecord], None] | None = None,
    hand_off: Callable[[], bool] | None = None,
) -> GenerationResult:
    """Run rounds until `stop` (or the verifier's verdict) says so. Tokens past a stop condition are
    dropped, never emitted. `on_tokens` receives each round's kept tokens (and their log-probabilities when
    the request asks for them) as soon as they are known;
    `on_round` a RoundRecord per round (tracing). `pipeline`: draft the next block while one is verified;
    `chain`: send a free block's successor right behind it (where the verifier takes chained blocks).
    `hand_off`: asked when a round would be target-only steps; True ends the generation there, finish reason
    "handed_off", for a caller that decodes the rest itself."""
    policy = num_speculative_tokens if not isinstance(num_speculative_tokens, int) else FixedK(num_speculative_tokens)
    if drafter is None:
        policy = FixedK(0)
    stats = SpecStats.per_generation(policy.k_max)
    # A drafter that chooses its method per round learns from each verdict (before its tokens commit).
    observe: Callable[[int, int, float | None], None] | None = getattr(drafter, "observe", None)
    # A drafter with proposals that cost no draft forward (suffix trees) is asked for one every round, however
    # small the policy's K (0 under load, or while the goodput guard holds the model's drafting off): it weighs
    # the block's length against `round_s`, the policy's model of a round's time, and such a block is sent
    # whole. Not while the guard measures the free blocks' own rounds losing (`free_held`): the model of a
    # round can miss what a round costs (a slope it could not fit), and the guard measures it.
    free_block: Callable[..., DraftBlock | None] | None = getattr(drafter, "free_block", None)
    round_s = getattr(policy, "round_seconds", None)
    free_ahead = False  # `ahead` is such a block
    # Such a block's successor costs nothing to guess either, so with a verifier that takes chained blocks it
    # goes on the wire right behind it, drafted as if the verdict took the block whole and ended with the
    # trees' next token: where the guess holds, the verifier verifies it as soon as the verdict is out, and
    # the verdict's trip back and the next block's trip out overlap a verification instead of following it.
    chain_block: Callable[..., tuple[DraftBlock, int] | None] | None = (
        getattr(drafter, "chained_block", None) if chain else None
    )
    chained: DraftBlock | None = None  # a block on the wire already, whose guess the last verdict held
    # The generation's first verdict is no measure of a round: the verifier may answer the open while the pass
    # computing the prompt's end runs, and the first block then waits for that pass as well as its own (its
    # time, several rounds' worth for a long prompt, seeded the round model and the goodput guard).
    timed = False
    logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
    ahead: DraftBlock | None = None  # the next block, drafted while the previous one was being verified
    # The first block is drafted while the verifier prefills the prompt: it depends on the prompt alone,
    # and it is what the first round would draft first anyway (the same K, the same draws in the same
    # order, whatever the timing: seeded requests still replay), so the first token no longer waits for
    # the draft's prefill and K forwards after the target's prefill.
    first_k: int | None = None
    opening = asyncio.ensure_future(verifier.start(prompt_ids, params))
    try:
        if drafter is not None and policy.k_max:
            await drafter.start(prompt_ids, params)
            budget = params.draft_budget(len(stop.token_ids))
            first_k = min(policy.next_k(), budget)
            held = getattr(policy, "free_held", False)
            if free_block is not None and not held and not (cancelled is not None and cancelled()):
                ahead = free_block(first_k, budget, round_s)
                free_ahead = ahead is not None
            if ahead is None and first_k > 0 and not (cancelled is not None and cancelled()):
                ahead = await drafter.propose(first_k)
        await opening
    except BaseException:  # the drafter failed, or the generation was cancelled: the opening is not wanted
        opening.cancel()
        await asyncio.gather(opening, return_exceptions=True)
        raise

    def take(verdict: Verdict) -> None:
        """Emit a verdict's tokens up to any stop condition."""
        nonlocal logprobs
        kept = stop.extend(verdict.tokens)
        if verdict.finish_reason is not None and not stop.finished:
            stop.finish(verdict.finish_reason)
        kept_logprobs = verdict.logprobs[:kept] if verdict.logprobs is not None else None
        if logprobs is not None and kept_logprobs is not None:
            logprobs += kept_logprobs
        if on_tokens is not None and kept:
            on_tokens(verdict.tokens[:kept], kept_logprobs)

    async def target_only_run(steps: int) -> None:
        """`steps` K = 0 rounds in a row, as one run the verifier takes without waiting for a block per step."""
        nonlocal timed
        t_sent = t_prev = time.perf_counter()
        first_seconds, load, committed = None, None, 0
        async with contextlib.aclosing(verifier.target_only(steps)) as verdicts:
            async for verdict in verdicts:
                now = time.perf_counter()
                first_seconds = now - t_sent if first_seconds is None else first_seconds
                stats.verify_seconds += now - t_prev
                stats.record(0, 0)
                load = verdict.load if verdict.load.batch_size else load
                if on_round is not None:
                    on_round(RoundRecord(0, 0, 0, len(verdict.tokens), t_prev, t_prev, t_prev, now))
                take(verdict)
                committed += len(verdict.tokens)
                if drafter is not None and policy.k_max and not stop.finished:
                    drafter.commit(verdict.tokens)
                t_prev = now
                if stop.finished or (cancelled is not None and cancelled()):
                    break
        if first_seconds is not None:  # one observation for the run: its per-step times are no round trips
            policy.observe(0, 0, 0.0, first_seconds, load, timed)
            policy.observe_goodput(0, committed, t_prev - t_sent, timed=timed)
            timed = True

    while not stop.finished:
        if cancelled is not None and cancelled():
            stop.finish("cancelled")
            break
        budget = params.draft_budget(len(stop.token_ids))
        k = min(policy.next_k() if first_k is None else first_k, budget)
        first_k = None
        held = getattr(policy, "free_held", False)
        sent = chained is not None
        if sent:
            ahead, free_ahead, chained = chained, True, None
        if free_block is not None and ahead is None and not held:
            ahead = free_block(k, budget, round_s)
            free_ahead = ahead is not None
        if free_ahead:
            assert ahead is not None  # free_ahead says what ahead is
            k = ahead.k
        if k == 0:
            if hand_off is not None and hand_off():
                stop.finish("handed_off")
                break
            steps = policy.zero_run(params.max_tokens - len(stop.token_ids))
            if free_block is not None and not held and params.greedy:  # the trees may match within a few tokens
                steps = min(steps, FREE_BLOCK_RECHECK)
            if steps > 1:
                ahead = None
                await target_only_run(steps)
                continue
        t0 = time.perf_counter()
        from_ahead = False
        if ahead is not None and ahead.k >= k:
            proposal, from_ahead = ahead[:k], True
        elif k > 0:
            assert drafter is not None  # k <= policy.k_max, and that is 0 without a drafter
            proposal = (ahead or DraftBlock([])) + await drafter.propose(
                k - (ahead.k if ahead else 0), after=ahead.token_ids if ahead else ()
            )
        else:
            proposal = DraftBlock([])
        t1 = time.perf_counter()
        then = None
        # (a remote verifier says whether it takes chained blocks once its session is open)
        if chain_block is not None and free_ahead and proposal.k and not held and getattr(verifier, "chains", False):
            after_budget = params.draft_budget(len(stop.token_ids) + proposal.k + 1)
            then = chain_block(proposal.token_ids, policy.next_k(), after_budget, round_s)
        if then is not None or sent:
            pending = asyncio.ensure_future(verifier.submit(proposal, then, sent))  # type: ignore[call-arg]
        else:
            pending = asyncio.ensure_future(verifier.submit(proposal))
        guess = None
        try:
            if pipeline and not free_ahead and proposal.k and proposal.k == k and budget - k > 1:
                assert drafter is not None  # a non-empty proposal was drafted
                # Guess the bonus, then draft the next block, until the verdict arrives.
                guess = await drafter.propose(k + 1, after=proposal.token_ids, should_stop=pending.done)
            t2 = time.perf_counter()
            verdict = await pending
        finally:
            if not pending.done():  # cancelled, or drafting ahead failed: the verification is not wanted
                pending.cancel()
        t3 = time.perf_counter()
        drafted = proposal.k if verdict.num_drafted is None else verdict.num_drafted
        stats.draft_seconds += (t1 - t0) + (t2 - t1)
        stats.verify_seconds += t3 - t2
        stats.record(drafted, verdict.num_accepted)
        if observe is not None:  # a chained round's wait is no measure of a round
            observe(drafted, verdict.num_accepted, None if sent else t3 - t1)
        # A block drafted during the previous verification cost no time here: no draft-speed sample. A free
        # block says nothing of the model's acceptance or speed: the round's timing and batch alone.
        policy.observe(
            0 if free_ahead else drafted,
            0 if free_ahead else verdict.num_accepted,
            0.0 if from_ahead or free_ahead else t1 - t0,
            t3 - t1,
            verdict.load if verdict.load.batch_size else None,
            timed and not sent,
        )
        policy.observe_goodput(drafted, len(verdict.tokens), t3 - t0, free_ahead, timed=timed)
        timed = True
        if on_round is not None:
            on_round(
                RoundRecord(
                    proposal.k,
                    drafted,
                    verdict.num_accepted,
                    len(verdict.tokens),
                    t0,
                    t1,
                    t2,
                    t3,
                    from_pipeline=ahead is not None,
                )
            )
        take(verdict)
        ahead, free_ahead = None, False
        if then is not None:
            # the verifier checks the same: the block taken whole, ending with the guessed token
            whole = verdict.num_drafted in (None, proposal.k) and verdict.num_accepted == proposal.k
            if whole and len(verdict.tokens) == proposal.k + 1 and verdict.tokens[-1] == then[1]:
                chained = then[0]
                stats.chained_used += 1
            else:
                stats.chained_discarded += 1
        if guess is not None:
            full = verdict.num_drafted in (None, proposal.k) and verdict.num_accepted == proposal.k
            if full and guess.k > 1 and verdict.tokens[-1] == guess.token_ids[0]:
                ahead = guess[1:]
                stats.pipelined_used += 1
            elif guess.k > 1:
                stats.pipelined_discarded += 1
        if drafter is not None and policy.k_max and not stop.finished:
            drafter.commit(verdict.tokens)
    assert stop.finish_reason is not None  # the loop ends only once stop.finished
    if stats.step_drafted:  # blocks of the trees may be longer than the policy's K
        stats.num_spec_tokens = max(stats.num_spec_tokens, max(stats.step_drafted))
    return GenerationResult(stop.token_ids, stop.finish_reason, stats, logprobs=logprobs)
