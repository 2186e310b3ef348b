"""The loop's K policy and pipelined drafting, without models or network."""

import asyncio
import random

import pytest

from specmesh.domain import BatchLoad, DraftBlock, Verdict
from specmesh.loop import (
    FREE_BLOCK_RECHECK,
    AdaptiveK,
    GoodputGuard,
    GoodputGuards,
    GoodputK,
    expected_tokens,
    speculative_generate,
)
from specmesh.sampling import SamplingParams, StopChecker


def accepted_run(rng: random.Random, k: int, alpha: float) -> int:
    """Drafts accepted in a round of K when each is accepted with probability α (i.i.d.)."""
    n = 0
    while n < k and rng.random() < alpha:
        n += 1
    return n


def feed(policy, k, alpha, t_draft, t_verify, rounds=80, seed=0):
    rng = random.Random(seed)
    for _ in range(rounds):
        policy.observe(k, accepted_run(rng, k, alpha), t_draft * k, t_verify)


def test_adaptive_k_grows_with_acceptance_and_cheap_drafts():
    p = AdaptiveK(8)
    assert p.next_k() == 8  # measure first
    feed(p, 8, 0.9, t_draft=0.002, t_verify=0.03)
    assert p.alpha > 0.8 and p.next_k() >= 6


def test_adaptive_k_shrinks_to_zero_when_drafting_does_not_pay_and_probes():
    p = AdaptiveK(4)
    feed(p, 4, 0.0, t_draft=0.02, t_verify=0.01)  # the draft never agrees and costs twice a verification
    ks = [p.next_k() for _ in range(32)]
    assert ks.count(0) >= 28 and 1 in ks  # K = 0, with a K = 1 probe now and then


def test_adaptive_k_backs_off_when_verification_is_cheap_relative_to_drafting():
    p = AdaptiveK(8)
    feed(p, 4, 0.6, t_draft=0.01, t_verify=0.012)
    k_expensive_draft = p.next_k()
    q = AdaptiveK(8)
    feed(q, 4, 0.6, t_draft=0.001, t_verify=0.03)
    assert k_expensive_draft < q.next_k()


class ScriptedVerifier:
    """Accepts everything and answers after a delay, so the loop drafts ahead meanwhile."""

    def __init__(self, delay, bonus):
        self.delay, self.bonus, self.blocks = delay, bonus, []

    async def start(self, prompt_ids, params):
        self.committed = list(prompt_ids)

    async def submit(self, proposal):
        self.blocks.append(list(proposal.token_ids))
        await asyncio.sleep(self.delay)
        tokens = proposal.token_ids + [self.bonus(self.committed + proposal.token_ids)]
        self.committed += tokens
        return Verdict(tokens, proposal.k, proposal.k)

    async def target_only(self, steps):
        for _ in range(steps):
            yield await self.submit(DraftBlock([]))


class CountingDrafter:
    """Drafts t+1 after t: the verifier's bonus agrees with it, so every drafted-ahead block is kept.
    Each token takes a moment (as a draft forward does), so a verification can finish mid-block."""

    async def start(self, prompt_ids, params):
        self.tokens = list(prompt_ids)

    async def propose(self, k, after=(), should_stop=None):
        ctx = self.tokens + list(after)
        out = []
        for _ in range(k):
            if should_stop is not None and should_stop():
                break
            await asyncio.sleep(0.001)
            out.append((ctx + out)[-1] + 1)
        return DraftBlock(out)

    def commit(self, tokens):
        self.tokens += tokens


def test_pipelined_blocks_are_used_when_the_guess_holds():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    verifier = ScriptedVerifier(0.01, bonus=lambda ctx: ctx[-1] + 1)
    r = asyncio.run(
        speculative_generate(verifier, CountingDrafter(), [1], params, 3, StopChecker(params), pipeline=True)
    )
    assert r.token_ids == list(range(2, 42))
    assert r.stats.pipelined_used > 5  # blocks drafted while the previous one was verified
    # the same output without pipelining
    r2 = asyncio.run(
        speculative_generate(
            ScriptedVerifier(0.0, lambda c: c[-1] + 1),
            CountingDrafter(),
            [1],
            params,
            3,
            StopChecker(params),
            pipeline=False,
        )
    )
    assert r2.token_ids == r.token_ids and r2.stats.pipelined_used == 0


def test_pipelined_blocks_are_dropped_when_the_bonus_differs():
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    verifier = ScriptedVerifier(0.01, bonus=lambda ctx: 0)  # never the drafter's guess
    r = asyncio.run(
        speculative_generate(verifier, CountingDrafter(), [1], params, 3, StopChecker(params), pipeline=True)
    )
    assert r.stats.pipelined_used == 0 and r.stats.pipelined_discarded > 0
    # every block sent continues exactly the committed tokens
    committed = [1]
    for block, start in zip(verifier.blocks, range(len(verifier.blocks))):
        assert block == [committed[-1] + 1 + i for i in range(len(block))]
        committed += block + [0]


class PrefillingVerifier(ScriptedVerifier):
    """Its prefill takes a while; it notes what the drafter had drafted when the prefill ended."""

    def __init__(self, drafter, prefill_s):
        super().__init__(0.0, bonus=lambda ctx: ctx[-1] + 1)
        self.drafter, self.prefill_s = drafter, prefill_s

    async def start(self, prompt_ids, params):
        await super().start(prompt_ids, params)
        await asyncio.sleep(self.prefill_s)
        self.drafted_by_then = self.drafter.drafted


class TimedDrafter(CountingDrafter):
    drafted = 0

    async def propose(self, k, after=(), should_stop=None):
        block = await super().propose(k, after, should_stop)
        self.drafted += block.k
        return block


@pytest.mark.parametrize("cancel", [False, True])
def test_the_first_block_is_drafted_while_the_verifier_prefills(cancel):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    drafter = TimedDrafter()
    verifier = PrefillingVerifier(drafter, prefill_s=0.2)
    rounds = []
    r = asyncio.run(
        speculative_generate(
            verifier,
            drafter,
            [1],
            params,
            4,
            StopChecker(params),
            cancelled=lambda: cancel,
            on_round=rounds.append,
        )
    )
    if cancel:  # nothing drafted, nothing verified
        assert r.finish_reason == "cancelled" and drafter.drafted == 0 and verifier.blocks == []
        return
    assert r.token_ids == list(range(2, 14))
    assert verifier.drafted_by_then == 4  # the whole first block was there when the prefill ended
    assert verifier.blocks[0] == [2, 3, 4, 5] and rounds[0].from_pipeline
    assert not any(rd.from_pipeline for rd in rounds[1:])


def observe_load(policy, n, base, per_token, alpha=0.7, rounds=64, overhead=0.002, seed=0):
    """Rounds at varied K against a verifier whose batch of n sessions takes base + per_token·(positions)."""
    rng = random.Random(seed)
    for i in range(rounds):
        k = i % (policy.k_max + 1)
        tokens = n * (k + 1)
        batch_s = base + per_token * tokens
        accepted = accepted_run(rng, k, alpha)
        policy.observe(k, accepted, 0.001 * k, overhead + batch_s, BatchLoad(0.0, batch_s, n, tokens, 0))


def test_goodput_k_falls_to_zero_when_the_verifier_is_compute_bound():
    heavy, light = GoodputK(8), GoodputK(8)
    observe_load(heavy, n=16, base=0.01, per_token=0.004)  # every position costs the batch 4 ms
    observe_load(light, n=16, base=0.03, per_token=0.0001)  # memory-bound: positions are nearly free
    a, b = heavy.forward_model()
    assert a == pytest.approx(0.01, rel=1e-3) and b == pytest.approx(0.004, rel=1e-3)
    assert [heavy.next_k() for _ in range(15)].count(0) >= 14
    assert light.next_k() >= 4


def test_goodput_k_sees_the_whole_batch_not_one_session():
    """The same per-position cost: one session alone drafts, sixteen in one batch do not."""
    alone, crowded = GoodputK(8), GoodputK(8)
    observe_load(alone, n=1, base=0.02, per_token=0.006)
    observe_load(crowded, n=16, base=0.02, per_token=0.006)
    assert alone.next_k() >= 2 and crowded.next_k() == 0  # alone, K = 2-3 maximises E(K) / round time


class LoadedVerifier(ScriptedVerifier):
    """Accepts each draft token with probability 0.5 (seeded) and reports a batch of 16 sessions drafting
    what this one drafts, its forward cost growing with the positions computed."""

    rng = random.Random(0)

    async def submit(self, proposal):
        self.blocks.append(list(proposal.token_ids))
        accepted = proposal.token_ids[: accepted_run(self.rng, proposal.k, 0.5)]
        tokens = accepted + [self.bonus(self.committed + accepted)]
        self.committed += tokens
        positions = 16 * (proposal.k + 1)
        return Verdict(tokens, len(accepted), proposal.k, load=BatchLoad(0.0, 0.01 + 0.004 * positions, 16, positions))


def test_the_loop_moves_k_toward_zero_against_a_compute_bound_verifier():
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    verifier = LoadedVerifier(0.0, bonus=lambda ctx: ctx[-1] + 1)
    r = asyncio.run(speculative_generate(verifier, CountingDrafter(), [1], params, GoodputK(6), StopChecker(params)))
    assert r.token_ids == list(range(2, 122))  # the output never depends on K
    late = [len(b) for b in verifier.blocks[-20:]]
    assert verifier.blocks[0] and late.count(0) >= 15


def test_goodput_k_is_zero_while_the_verify_batch_is_past_the_limit():
    """batch_limit (vLLM's speculative_disable_by_batch_size, per round): a batch of more sessions than the
    limit gives K = 0 on the next round, without probes, and K comes back once a verdict shows it shrank."""
    policy = GoodputK(4, batch_limit=1)
    alone = BatchLoad(0.0, 0.02, 1, 5)
    crowded = BatchLoad(0.0, 0.04, 6, 6)
    for _ in range(5):
        policy.observe(4, 3, 0.004, 0.025, alone)
    assert policy.next_k() > 0
    policy.observe(4, 3, 0.004, 0.045, crowded)
    assert [policy.next_k() for _ in range(40)] == [0] * 40  # no K = 1 probes: the batch size is the signal
    policy.observe(0, 0, 0.0, 0.045, BatchLoad(0.0, 0.02, 1, 1))
    assert policy.next_k() > 0
    assert GoodputK(4).batch_limit == 0  # no limit unless asked


def test_expected_tokens_is_geometric_for_iid_acceptance_and_carries_on_past_the_measured_positions():
    alpha = 0.7
    measured = [alpha ** (i + 1) for i in range(3)]
    assert expected_tokens(measured, alpha, 6) == pytest.approx((1 - alpha**7) / (1 - alpha))
    assert expected_tokens([], alpha, 4) == pytest.approx((1 - alpha**5) / (1 - alpha))
    assert expected_tokens([0.9, 0.95], 0.5, 2) == pytest.approx(1 + 0.9 + 0.9)  # P_i never rises with i


def test_adaptive_k_values_blocks_by_the_measured_positions_when_acceptance_comes_in_runs():
    """Rounds that accept all 8 drafts or none: every position's P_i is 1/2, so E(K) = 1 + K/2. A geometric
    fit of the same rounds (pooled α = 8/9) says E(2) = 2.7 and E(8) = 5.9."""
    p = AdaptiveK(8)
    for i in range(200):
        p.observe(8, 8 if i % 2 else 0, 0.008, 0.03)
    assert p.alpha == pytest.approx(8 / 9, abs=0.02)
    assert p.expected_tokens(2) == pytest.approx(2.0, abs=0.1)
    assert p.expected_tokens(8) == pytest.approx(5.0, abs=0.15)


class RunRecordingVerifier(LoadedVerifier):
    """LoadedVerifier that records each run of target-only steps the loop asks for."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.runs: list[int] = []

    async def target_only(self, steps):
        self.runs.append(steps)
        async for verdict in super().target_only(steps):
            yield verdict


def test_k_zero_rounds_are_asked_for_as_runs_of_target_only_steps():
    """Past the batch limit the loop asks for BATCH_LIMIT_RUN target-only steps at once (a remote verifier
    takes them without a round trip each) and looks at the batch again after each run; the tokens are the
    target's, whatever K."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    verifier = RunRecordingVerifier(0.0, bonus=lambda ctx: ctx[-1] + 1)
    policy = GoodputK(4, batch_limit=1)
    r = asyncio.run(speculative_generate(verifier, CountingDrafter(), [1], params, policy, StopChecker(params)))
    assert r.token_ids == list(range(2, 42))
    assert verifier.blocks[0]  # the first round drafts: no batch seen yet
    run = GoodputK.BATCH_LIMIT_RUN
    assert verifier.runs and verifier.runs[:-1] == [run] * (len(verifier.runs) - 1)
    assert 1 <= verifier.runs[-1] <= run  # the last run is cut to the tokens left
    assert sum(verifier.runs) == r.stats.rounds - 1 and r.stats.drafts == 1  # every step after the first round


def test_a_k_zero_session_asks_for_the_whole_generation_as_one_run():
    params = SamplingParams(temperature=0.0, max_tokens=25, ignore_eos=True)
    verifier = RunRecordingVerifier(0.0, bonus=lambda ctx: ctx[-1] + 1)
    r = asyncio.run(speculative_generate(verifier, None, [1], params, 4, StopChecker(params)))
    assert r.token_ids == list(range(2, 27)) and verifier.runs == [25]


def test_a_k_zero_chosen_from_acceptance_is_one_step_not_a_run():
    """Only a standing K = 0 (past the batch limit, or asked for) becomes a run: one that the goodput model
    chose from the last rounds' acceptance is looked at again after the next verdict."""
    p = AdaptiveK(4)
    feed(p, 4, 0.0, t_draft=0.02, t_verify=0.01)
    assert p.next_k() == 0 and p.zero_run(50) == 1
    g = GoodputK(4, batch_limit=1)
    g.observe(4, 0, 0.004, 0.045, BatchLoad(0.0, 0.04, 6, 6))
    assert g.next_k() == 0 and g.zero_run(50) == GoodputK.BATCH_LIMIT_RUN and g.zero_run(3) == 3
    # A sampled request's runs are longer: each run's end costs it a step of the batch, and speculation coming
    # back sooner is worth less to it.
    s = GoodputK(4, batch_limit=1, sampled=True)
    s.observe(4, 0, 0.004, 0.045, BatchLoad(0.0, 0.04, 6, 6))
    assert s.next_k() == 0 and s.zero_run(100) == GoodputK.BATCH_LIMIT_RUN_SAMPLED > GoodputK.BATCH_LIMIT_RUN
    assert s.zero_run(3) == 3


def test_the_goodput_guard_turns_speculation_off_while_it_measures_slower_and_probes_both_sides():
    guard = GoodputGuard(every=8, probe=2, margin=0.05)
    assert guard.target_only_steps() == 0  # nothing measured: speculate as GoodputK chooses
    for _ in range(8):
        guard.observe(True, 3, 0.030)  # 100 tok/s speculating
    assert guard.speculation_pays() is None  # one side measured: nothing to report yet
    assert guard.target_only_steps() == 2  # every 8 speculative rounds, a 2-step target-only probe
    guard.observe(False, 2, 0.010)  # 200 tok/s target-only
    assert guard.speculation_loses() and guard.speculation_pays() is False
    assert guard.target_only_steps() == 8  # runs of `every` target-only steps ...
    for _ in range(4):
        guard.observe(False, 8, 0.040)
    assert [guard.target_only_steps() for _ in range(2)] == [0, 0]  # ... then `probe` rounds speculate
    assert guard.target_only_steps() == 8  # and if it still loses, back to target-only
    for _ in range(20):
        guard.observe(True, 4, 0.010)  # speculation got cheap: 400 tok/s
    assert not guard.speculation_loses() and guard.speculation_pays() is True
    assert guard.target_only_steps() == 2 and guard.target_only_steps() == 0  # the probe that was due, then none
    assert 300 < guard.rate(True) < 400 and guard.rate(False) == pytest.approx(200)  # older rounds fading


def test_a_goodput_k_with_the_guard_takes_the_runs_it_asks_for():
    guard = GoodputGuard(every=4, probe=3)
    policy = GoodputK(4, guard=guard)
    for _ in range(4):
        policy.observe_goodput(4, 3, 0.03)
    assert policy.next_k() == 0 and policy.zero_run(100) == 3 and policy.zero_run(100) == 1
    assert GoodputK(4).guard is None


class TimedVerifier(ScriptedVerifier):
    """Accepts half of each block; a speculative round costs `round_s`, a target-only step `step_s`."""

    def __init__(self, round_s, step_s):
        super().__init__(0.0, bonus=lambda ctx: ctx[-1] + 1)
        self.round_s, self.step_s, self.runs = round_s, step_s, []

    async def submit(self, proposal):
        self.blocks.append(list(proposal.token_ids))
        await asyncio.sleep(self.round_s if proposal.k else self.step_s)
        accepted = proposal.token_ids[: proposal.k // 2]
        tokens = accepted + [self.bonus(self.committed + accepted)]
        self.committed += tokens
        return Verdict(tokens, len(accepted), proposal.k)

    async def target_only(self, steps):
        self.runs.append(steps)
        async for verdict in super().target_only(steps):
            yield verdict


@pytest.mark.parametrize("speculation_pays", [False, True])
def test_the_loop_falls_back_to_target_only_where_speculation_measures_slower(speculation_pays):
    """A verifier where a round (3 tokens) takes 40 ms and a target-only step 2 ms (speculation at 75 tok/s
    against 500), and the reverse (a round 2 ms, a step 40 ms): with the guard the loop ends up in runs of
    target-only steps in the first case and keeps speculating in the second, the tokens the same."""
    round_s, step_s = (0.002, 0.040) if speculation_pays else (0.040, 0.002)
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    verifier = TimedVerifier(round_s, step_s)
    policy = GoodputK(4, guard=GoodputGuard(every=8, probe=2))
    r = asyncio.run(speculative_generate(verifier, CountingDrafter(), [1], params, policy, StopChecker(params)))
    assert r.token_ids == list(range(2, 152))
    steps_in_runs = sum(verifier.runs)
    if speculation_pays:
        assert all(n == 2 for n in verifier.runs[:-1]) and steps_in_runs <= 30  # only the guard's probes
    else:
        assert steps_in_runs >= 75 and verifier.runs.count(8) >= 5


class BatchReportingVerifier(TimedVerifier):
    """TimedVerifier whose verdicts report a batch of `batch_size` sessions."""

    def __init__(self, round_s, step_s, batch_size):
        super().__init__(round_s, step_s)
        self.batch_size = batch_size

    async def submit(self, proposal):
        verdict = await super().submit(proposal)
        verdict.load = BatchLoad(batch_seconds=0.001, batch_size=self.batch_size, batch_tokens=proposal.k + 1)
        return verdict


class FirstVerdictLateVerifier(BatchReportingVerifier):
    """The first block waits 200 ms more: the pass computing the prompt's end, which the open did not wait for."""

    async def submit(self, proposal):
        if not self.blocks:
            await asyncio.sleep(0.2)
        return await super().submit(proposal)


def test_the_first_verdict_seeds_neither_the_round_model_nor_the_guard():
    """The first round's 200 ms is the prompt's prefill, not what a round costs: the timings after it (2 ms
    rounds) are what the policy and the guard know. Seeded with it, the round model's verify time and overhead
    stayed above 20 ms for the whole generation, and the guard counted the prefill against speculation."""
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    guard = GoodputGuard(every=1000)
    policy = GoodputK(4, guard=guard)
    verifier = FirstVerdictLateVerifier(0.002, 0.040, batch_size=1)
    r = asyncio.run(speculative_generate(verifier, CountingDrafter(), [1], params, policy, StopChecker(params)))
    assert r.token_ids == list(range(2, 22)) and len(verifier.blocks) >= 4
    assert policy.t_verify is not None and policy.t_verify < 0.02
    assert policy.overhead is not None and policy.overhead < 0.02
    assert guard.rate(True) is not None and guard.rate(True) > 100  # 3 tokens per ~2-4 ms round


def test_a_guard_that_has_seen_a_round_or_two_does_not_decide():
    """The first rounds of a burst wait behind the other sessions' prefills: two such rounds against fast
    target-only steps are no measure of speculation. The guard decides from its fourth round on."""
    guard = GoodputGuard(every=1000)
    for _ in range(5):
        guard.observe(False, 1, 0.010)  # 100 tok/s target-only
    for seen in range(1, 6):
        guard.observe(True, 1, 0.050)  # 20 tok/s speculating
        assert guard.speculation_pays() is (None if seen < 4 else False)
        assert guard.target_only_steps() == (0 if seen < 4 else 1000)


def test_the_guards_keep_greedy_and_sampled_and_each_batch_size_apart():
    guards = GoodputGuards(every=8)
    assert [GoodputGuards.batch_bucket(n) for n in (0, 1, 2, 3, 4, 7, 8, 31, 32, 500)] == [
        1,
        1,
        2,
        2,
        4,
        4,
        8,
        16,
        32,
        32,
    ]
    assert guards.at(True, 5) is guards.at(True, 4) is not guards.at(False, 4)
    assert guards.at(True, 1) is not guards.at(True, 2)
    assert guards.at(True, 5).every == 8  # each made with the container's settings


@pytest.mark.parametrize("pooled", [True, False])
def test_a_loss_measured_under_another_load_does_not_hold_one_stream_off(pooled):
    """Speculation measured losing at 4 sessions (rounds that waited behind each other's prefills, say) and
    a single stream where it pays (a round 2 ms, a step 40 ms). One guard pooled over every load made the
    single stream's first 8 tokens a target-only run; guards by batch size let it speculate from its first
    round, and its rounds are measured by the one-session guard, leaving the 4-session one as it was."""
    settings = {"every": 8, "probe": 2}
    guards = GoodputGuard(**settings) if pooled else GoodputGuards(**settings)
    at4 = guards if isinstance(guards, GoodputGuard) else guards.at(True, 4)
    for _ in range(10):
        at4.observe(True, 2, 0.040)  # 50 tok/s speculating
        at4.observe(False, 1, 0.010)  # 100 tok/s target-only
    assert at4.speculation_loses()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    verifier = BatchReportingVerifier(0.002, 0.040, batch_size=1)
    policy = GoodputK(4, guard=guards)
    r = asyncio.run(speculative_generate(verifier, CountingDrafter(), [1], params, policy, StopChecker(params)))
    assert r.token_ids == list(range(2, 42))
    if pooled:
        assert verifier.runs[0] == 8
    else:
        assert not verifier.runs or verifier.runs[0] != 8
        assert verifier.blocks[0] and guards.at(True, 1).rate(True) is not None
        assert at4.speculation_loses() and at4.rate(True) == pytest.approx(50, rel=0.01)


def test_sampled_sessions_are_guarded_apart_from_greedy_ones():
    """A loss measured on sampled sessions (whose drafts are accepted with their probability only) does not
    hold a greedy session off at the same load, and the sampled one still takes the guard's run."""
    guards = GoodputGuards(every=8, probe=2)
    sampled = guards.at(False, 1)
    for _ in range(10):
        sampled.observe(True, 2, 0.040)
        sampled.observe(False, 1, 0.010)
    for temperature, held in ((0.0, False), (0.7, True)):
        params = SamplingParams(temperature=temperature, max_tokens=20, ignore_eos=True, seed=None)
        verifier = BatchReportingVerifier(0.002, 0.040, batch_size=1)
        policy = GoodputK(4, guard=guards, sampled=temperature > 0)
        asyncio.run(speculative_generate(verifier, CountingDrafter(), [1], params, policy, StopChecker(params)))
        assert (verifier.runs[:1] == [8]) is held


def test_a_sampled_guard_holds_speculation_that_measures_a_little_slower_than_target_only():
    """The greedy guards keep a 5 % band against flapping; a sampled session, whose blocks are accepted with
    their probability only and pay near parity at best, speculates only while speculation measures at least
    as fast as target-only: at 0.96x the sampled guard holds it, the greedy one does not."""
    guards = GoodputGuards(every=8)
    greedy, sampled = guards.at(True, 1), guards.at(False, 1)
    assert (greedy.margin, sampled.margin) == (0.05, 0.0)
    for guard in (greedy, sampled):
        for _ in range(10):
            guard.observe(True, 2, 0.0208)  # 96 tok/s speculating
            guard.observe(False, 1, 0.010)  # 100 tok/s target-only
    assert not greedy.speculation_loses() and greedy.speculation_pays()
    assert sampled.speculation_loses() and sampled.speculation_pays() is False
    assert sampled.target_only_steps() == 8 and greedy.target_only_steps() == 0
    assert GoodputGuards(sampled_margin=0.02).at(False, 4).margin == 0.02


def test_a_sampled_guard_measures_target_only_before_its_first_round():
    """A sampled guard hands its first asker a target-only probe (once), so it can judge after min_rounds
    rounds; a greedy guard speculates from the first round."""
    guards = GoodputGuards(every=8, probe=3)
    sampled, greedy = guards.at(False, 1), guards.at(True, 1)
    assert greedy.target_only_steps() == 0
    assert sampled.target_only_steps() == 3 and sampled.probes == 1
    assert sampled.target_only_steps() == 0  # once: the probe's steps are on their way
    sampled.observe(False, 3, 0.030)  # 100 tok/s target-only
    for _ in range(4):
        sampled.observe(True, 2, 0.025)  # 80 tok/s speculating
    assert sampled.speculation_loses() and sampled.target_only_steps() == 8
    fresh = GoodputGuards().at(False, 2)
    fresh.observe(False, 1, 0.01)  # target-only already measured: no probe first
    assert fresh.target_only_steps() == 0


def test_one_stalled_round_does_not_turn_the_guard_against_speculation():
    """A round that waited out a paused draft for 4 s counts as a round 4x as slow as usual, not as 4 s: a
    fault must not switch speculation off for the next thousand tokens."""
    guard = GoodputGuard(every=1000)
    for _ in range(20):
        guard.observe(True, 3, 0.020)  # 150 tok/s speculating
        guard.observe(False, 1, 0.010)  # 100 tok/s target-only
    guard.observe(True, 3, 4.0)
    assert not guard.speculation_loses() and guard.rate(True) > 100
    for _ in range(10):
        guard.observe(True, 3, 0.020)
    assert guard.rate(True) > 130


def test_a_goodput_probe_speculates_while_the_guard_says_speculation_loses():
    """A gateway sends most requests past a draft service whose guard reports that speculation loses, and
    a few as goodput probes. A probe takes none of the guard's target-only runs, so it feeds the guard fresh
    speculative rounds: once those measure faster, the guard reports that speculation pays again."""
    guard = GoodputGuard(every=8, probe=2, margin=0.05)
    for _ in range(8):
        guard.observe(True, 3, 0.030)  # 100 tok/s speculating
    guard.observe(False, 2, 0.010)  # 200 tok/s target-only
    assert guard.speculation_pays() is False
    assert guard.target_only_steps(runs=False) == 0  # the probe speculates ...
    assert guard.target_only_steps() == 8  # ... where any other session takes a run

    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    verifier = TimedVerifier(0.002, 0.040)  # speculation got cheap: a round 2 ms, a target-only step 40 ms
    probe = GoodputK(4, guard=guard, guard_runs=False)
    r = asyncio.run(speculative_generate(verifier, CountingDrafter(), [1], params, probe, StopChecker(params)))
    assert r.token_ids == list(range(2, 62))
    assert r.stats.drafted > 0 and all(n == 2 for n in verifier.runs)  # the guard's short probes, no run of 8
    assert guard.speculation_pays() is True


def test_a_goodput_probe_takes_the_guards_runs_after_its_own_rounds():
    """A probe where speculation keeps losing speculates PROBE_ROUNDS rounds (fresh measures for the guard),
    then takes the guard's target-only runs like any session rather than lose on the rest of its tokens."""
    guard = GoodputGuard(every=8, probe=2, margin=0.05)
    for _ in range(8):
        guard.observe(True, 3, 0.030)
    guard.observe(False, 2, 0.010)
    assert guard.speculation_loses()
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    verifier = TimedVerifier(0.040, 0.002)  # a round 40 ms, a target-only step 2 ms: speculation loses
    probe = GoodputK(4, guard=guard, guard_runs=False)
    r = asyncio.run(speculative_generate(verifier, CountingDrafter(), [1], params, probe, StopChecker(params)))
    assert r.token_ids == list(range(2, 122))
    assert r.stats.drafts >= GoodputK.PROBE_ROUNDS and probe.guard_runs
    assert 8 in verifier.runs  # the guard's run of `every` steps, once the probe's rounds were in
    assert r.stats.drafts < 120 // 2  # not a whole request of rounds


def test_a_probe_whose_caller_goes_on_itself_is_handed_back_after_its_rounds():
    """The same losing probe, asked `hand_off` (its caller, a gateway, decodes target-only itself): once its
    PROBE_ROUNDS rounds are measured and the guard still holds it to target-only steps, it ends there,
    "handed_off", with the tokens so far, and takes none of the guard's runs. A session that is not a probe,
    or a probe where speculation pays, is never handed back."""
    params = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)

    def losing_guard():
        guard = GoodputGuard(every=8, probe=2, margin=0.05)
        for _ in range(8):
            guard.observe(True, 3, 0.030)
        guard.observe(False, 2, 0.010)
        return guard

    def run(policy, verifier):
        loop = speculative_generate(
            verifier, CountingDrafter(), [1], params, policy, StopChecker(params), hand_off=policy.hands_off
        )
        return asyncio.run(loop)

    verifier = TimedVerifier(0.040, 0.002)  # speculation loses
    probe = GoodputK(4, guard=losing_guard(), guard_runs=False)
    r = run(probe, verifier)
    assert r.finish_reason == "handed_off" and all(n == 2 for n in verifier.runs)  # the guard's short probes only
    assert r.stats.drafts == GoodputK.PROBE_ROUNDS + 1  # the first round (behind the prefill) is not measured
    assert r.token_ids == list(range(2, 2 + len(r.token_ids))) and 0 < len(r.token_ids) < 120

    session = GoodputK(4, guard=losing_guard())  # not a probe: the guard's runs, to the end
    r = run(session, TimedVerifier(0.040, 0.002))
    assert r.finish_reason == "length" and r.token_ids == list(range(2, 122))

    pays = GoodputK(4, guard=losing_guard(), guard_runs=False)  # speculation got cheap: the probe goes on
    r = run(pays, TimedVerifier(0.002, 0.040))
    assert r.finish_reason == "length" and r.token_ids == list(range(2, 122))


def test_a_sampled_probe_held_by_the_batch_limit_is_handed_back_a_greedy_one_goes_on():
    """Past the batch limit a probe cannot measure speculation: a sampled one would relay target-only runs to
    its end, so it is handed back at its first target-only round; a greedy one keeps the trees' free blocks
    (its speculation past the limit) and runs to its end, as does a sampled session that is not a probe."""

    def run(temperature, probe):
        params = SamplingParams(temperature=temperature, max_tokens=150, ignore_eos=True, seed=None)
        policy = GoodputK(4, batch_limit=1, sampled=not params.greedy, guard_runs=not probe)
        verifier = RunRecordingVerifier(0.0, bonus=lambda ctx: ctx[-1] + 1)  # reports a batch of 16
        loop = speculative_generate(
            verifier, FreeDrafter(0), [1], params, policy, StopChecker(params), hand_off=policy.hands_off
        )
        return asyncio.run(loop), verifier

    r, verifier = run(0.7, probe=True)
    assert r.finish_reason == "handed_off" and 0 < len(r.token_ids) < 150 and not verifier.runs
    assert r.token_ids == list(range(2, 2 + len(r.token_ids)))
    for temperature, probe in ((0.0, True), (0.7, False)):
        r, verifier = run(temperature, probe)
        assert r.finish_reason == "length" and r.token_ids == list(range(2, 152)) and verifier.runs


class FreeDrafter(CountingDrafter):
    """CountingDrafter with blocks that cost no draft forward (as the hybrid's suffix trees): `free_block`
    offers `length` tokens every time it is asked, and counts the asks."""

    def __init__(self, length):
        self.length, self.asked = length, 0

    def free_block(self, k, budget, round_s=None):
        self.asked += 1
        n = min(self.length, budget)
        return DraftBlock([self.tokens[-1] + 1 + i for i in range(n)], method="suffix") if n else None


def test_a_free_block_is_asked_for_past_the_batch_limit_and_sent_whole():
    """K is 0 past the batch limit, but the trees' block is asked for every round and sent whole (longer than
    the policy's K of 2); the tokens are the target's."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    verifier = RunRecordingVerifier(0.0, bonus=lambda ctx: ctx[-1] + 1)
    drafter = FreeDrafter(6)
    r = asyncio.run(
        speculative_generate(verifier, drafter, [1], params, GoodputK(2, batch_limit=1), StopChecker(params))
    )
    assert r.token_ids == list(range(2, 42))
    assert not verifier.runs and drafter.asked == r.stats.rounds  # every round drafted by the trees
    assert max(len(b) for b in verifier.blocks) == 6 and r.stats.num_spec_tokens == 6


def test_a_free_block_waits_while_the_guard_measures_free_blocks_losing():
    """Where the free blocks' own rounds measure slower than target-only steps, the guard holds them back (the
    round model cannot see every cost; the guard measures them), and the model's drafts lose as well: the
    guard's runs, not cut for the trees."""
    params = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    verifier = TimedVerifier(0.040, 0.002)
    drafter = FreeDrafter(4)
    policy = GoodputK(4, guard=GoodputGuard(every=8, probe=2))
    r = asyncio.run(speculative_generate(verifier, drafter, [1], params, policy, StopChecker(params)))
    assert r.token_ids == list(range(2, 152))
    assert sum(verifier.runs) >= 60 and verifier.runs.count(8) >= 5  # the guard's runs, not cut for the trees
    assert drafter.asked < r.stats.rounds / 2


def test_free_blocks_are_a_side_of_their_own():
    """The guard measures rounds with a free block apart from the model's: the model's drafts losing to
    target-only steps hold the model's drafting (runs of `every`), not the trees' blocks, whose own rounds
    pay; the service then reports that speculation pays (the trees' share of it), and a free round does not
    count as a measure of the model's speculation (the runs' probe of it stays due)."""
    guard = GoodputGuard(every=8, probe=2, margin=0.05)
    for _ in range(8):
        guard.observe(True, 3, 0.030)  # the model's rounds: 100 tok/s
        guard.observe(False, 1, 0.004)  # target-only: 250 tok/s
    assert guard.speculation_loses() and guard.speculation_pays() is False and not guard.free_loses()
    for _ in range(3):
        guard.observe(True, 5, 0.010, free=True)  # the trees' rounds: 500 tok/s, not yet min_rounds
    assert guard.speculation_pays() is False and guard.rate(True) == pytest.approx(100)
    guard.observe(True, 5, 0.010, free=True)
    assert guard.speculation_pays() is True and guard.speculation_loses() and not guard.free_loses()
    assert guard.rate(True, free=True) == pytest.approx(500)
    guard.observe(False, 8, 0.032)
    guard.observe(True, 5, 0.010, free=True)
    assert guard.target_only_steps() == 0  # 8 target-only steps since the model's last round: its probe

    for _ in range(12):
        guard.observe(True, 1, 0.050, free=True)  # the trees' rounds got slow: 20 tok/s
    assert guard.free_loses() and guard.speculation_pays() is False


class MethodTimedVerifier(TimedVerifier):
    """A round with the trees' block (method "suffix") takes `free_s` and is accepted whole; the model's take
    `round_s` and half is accepted; a target-only step `step_s`."""

    def __init__(self, round_s, step_s, free_s):
        super().__init__(round_s, step_s)
        self.free_s = free_s

    async def submit(self, proposal):
        if proposal.method != "suffix":
            return await super().submit(proposal)
        self.blocks.append(list(proposal.token_ids))
        await asyncio.sleep(self.free_s)
        tokens = proposal.token_ids + [self.bonus(self.committed + proposal.token_ids)]
        self.committed += tokens
        return Verdict(tokens, proposal.k, proposal.k)


def test_free_blocks_that_pay_go_on_while_the_model_is_held():
    """Where the model's rounds measure slower than target-only steps, a session still sends the trees'
    blocks (5 tokens a round), each round's choice its own, and the tokens are the target's."""
    guard = GoodputGuard(every=8, probe=2)
    for _ in range(8):
        guard.observe(True, 3, 0.040)
        guard.observe(False, 1, 0.004)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    verifier = MethodTimedVerifier(0.040, 0.004, 0.008)
    drafter = FreeDrafter(4)
    policy = GoodputK(4, guard=guard)
    r = asyncio.run(speculative_generate(verifier, drafter, [1], params, policy, StopChecker(params)))
    assert r.token_ids == list(range(2, 62))
    free = [b for b in verifier.blocks if len(b) == 4]
    assert len(free) >= 8 and drafter.asked >= len(free)
    assert guard.speculation_loses() and guard.speculation_pays() is True


@pytest.mark.parametrize(("temperature", "run"), [(0.0, FREE_BLOCK_RECHECK), (0.7, GoodputK.BATCH_LIMIT_RUN_SAMPLED)])
def test_past_the_batch_limit_a_greedy_request_asks_the_trees_every_few_steps_a_sampled_one_per_run(temperature, run):
    """With no proposal from the trees, a greedy session's target-only runs are cut short so that the trees
    are asked again soon; a sampled one keeps the policy's runs (each cut is a round trip out of step with
    the verify batch, and its proposals are rarely accepted)."""
    params = SamplingParams(temperature=temperature, max_tokens=150, ignore_eos=True, seed=None)
    verifier = RunRecordingVerifier(0.0, bonus=lambda ctx: ctx[-1] + 1)
    drafter = FreeDrafter(0)  # the trees find nothing
    policy = GoodputK(4, batch_limit=1, sampled=not params.greedy)
    r = asyncio.run(speculative_generate(verifier, drafter, [1], params, policy, StopChecker(params)))
    assert len(r.token_ids) == 150
    assert verifier.runs[:-1] == [run] * (len(verifier.runs) - 1)


def test_requests_held_from_their_first_round_still_bring_the_probes_round():
    """Both sides measured losing, and requests shorter than the guard's runs: each is held to target-only
    steps from its first round, one run to its end, whose time is no measure (it waited for the prefill). Its
    steps still count toward the probes' schedule, so a later request probes the trees again, and where their
    blocks now pay they come back. (When untimed runs counted for nothing, no probe ever came: every request
    after the first decoded target-only for good.)"""
    guard = GoodputGuard(every=16, probe=2, margin=0.05)
    for _ in range(8):
        guard.observe(True, 3, 0.040)  # the model's rounds lose
        guard.observe(False, 1, 0.004)  # target-only 250 tok/s
        guard.observe(True, 1, 0.010, free=True)  # the trees' first blocks lose too
    assert guard.speculation_loses() and guard.free_loses()
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    drafted = []
    for _ in range(12):
        verifier = MethodTimedVerifier(0.040, 0.004, 0.004)  # the trees' blocks now commit 5 tokens in 4 ms
        r = asyncio.run(
            speculative_generate(verifier, FreeDrafter(4), [1], params, GoodputK(4, guard=guard), StopChecker(params))
        )
        assert r.token_ids == list(range(2, 14))
        drafted.append(r.stats.drafted)
    assert drafted[:2] == [0, 0] and drafted[-1] > 0, drafted  # held at first, the trees' blocks in the end
    assert not guard.free_loses()


def test_free_blocks_judged_losing_are_measured_again_after_every_target_only_steps():
    """A free side judged losing on its first blocks (text new to the trees) is not held for good: after every
    `every` target-only steps the trees offer `probe` blocks, and once those pay the blocks go on."""
    guard = GoodputGuard(every=8, probe=2, margin=0.05)
    for _ in range(8):
        guard.observe(True, 3, 0.040)  # the model's rounds lose: 75 tok/s
        guard.observe(False, 1, 0.004)  # target-only 250 tok/s
        guard.observe(True, 1, 0.010, free=True)  # the trees' first blocks: 100 tok/s
    assert guard.free_loses() and guard.free_held()
    guard.observe(False, 7, 0.028)
    assert guard.free_held()  # 7 target-only steps since the last free round: not yet
    guard.observe(False, 1, 0.004)
    probes = guard.probes
    assert not guard.free_held() and not guard.free_held() and guard.probes == probes + 1  # a probe, asked once
    guard.observe(True, 9, 0.010, free=True)
    assert not guard.free_held()  # the probe's second block
    guard.observe(True, 9, 0.010, free=True)
    assert guard.free_held() == guard.free_loses()  # the probe is over: the measure decides again

    params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    verifier = MethodTimedVerifier(0.040, 0.004, 0.004)  # the trees' blocks now commit 5 tokens in 4 ms
    drafter = FreeDrafter(4)
    r = asyncio.run(speculative_generate(verifier, drafter, [1], params, GoodputK(4, guard=guard), StopChecker(params)))
    assert r.token_ids == list(range(2, 202))
    assert not guard.free_loses() and guard.speculation_pays() is True
    free = [b for b in verifier.blocks if len(b) == 4]
    assert len(free) * 5 > 100  # most of the tokens came from the trees' blocks once measured again
