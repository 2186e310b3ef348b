"""The loop's K policy and pipelined drafting, without models or network."""

import threading
import time
from concurrent.futures import Future

from specmesh.domain import DraftBlock, Verdict
from specmesh.loop import AdaptiveK, speculative_generate
from specmesh.sampling import SamplingParams, StopChecker


def feed(policy, k, accepted, t_draft, t_verify, rounds=40):
    for _ in range(rounds):
        policy.observe(k, accepted, t_draft * k, t_verify)


def test_adaptive_k_grows_with_acceptance_and_cheap_drafts():
    p = AdaptiveK(8)
    assert p.next_k() == 8  # measure first
    feed(p, 8, 7, t_draft=0.002, t_verify=0.03)
    assert p.alpha > 0.8 and p.next_k() >= 6


def test_adaptive_k_shrinks_to_zero_when_drafting_does_not_pay_and_probes():
    p = AdaptiveK(4)
    feed(p, 4, 0, t_draft=0.02, t_verify=0.01)  # the draft never agrees and costs twice a verification
    ks = [p.next_k() for _ in range(32)]
    assert ks.count(0) >= 28 and 1 in ks  # K = 0, with a K = 1 probe now and then


def test_adaptive_k_backs_off_when_verification_is_cheap_relative_to_drafting():
    p = AdaptiveK(8)
    feed(p, 4, 2, t_draft=0.01, t_verify=0.012)
    k_expensive_draft = p.next_k()
    q = AdaptiveK(8)
    feed(q, 4, 2, t_draft=0.001, t_verify=0.03)
    assert k_expensive_draft < q.next_k()


class ScriptedVerifier:
    """Accepts everything and answers after a delay on another thread, so the loop drafts ahead."""

    def __init__(self, delay, bonus):
        self.delay, self.bonus, self.blocks = delay, bonus, []

    def start(self, prompt_ids, params):
        self.committed = list(prompt_ids)

    def submit(self, proposal):
        self.blocks.append(list(proposal.token_ids))
        fut = Future()

        def answer():
            time.sleep(self.delay)
            tokens = proposal.token_ids + [self.bonus(self.committed + proposal.token_ids)]
            self.committed += tokens
            fut.set_result(Verdict(tokens, proposal.k, proposal.k))
        threading.Thread(target=answer).start()
        return fut


class CountingDrafter:
    """Drafts t+1 after t: the verifier's bonus agrees with it, so every drafted-ahead block is kept."""

    def start(self, prompt_ids, params):
        self.tokens = list(prompt_ids)

    def propose(self, k, after=(), should_stop=None):
        ctx = self.tokens + list(after)
        out = []
        for _ in range(k):
            if should_stop is not None and should_stop():
                break
            out.append((ctx + out)[-1] + 1)
        return DraftBlock(out)

    def commit(self, tokens):
        self.tokens += tokens


def test_pipelined_blocks_are_used_when_the_guess_holds():
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    verifier = ScriptedVerifier(0.01, bonus=lambda ctx: ctx[-1] + 1)
    r = speculative_generate(verifier, CountingDrafter(), [1], params, 3, StopChecker(params), pipeline=True)
    assert r.token_ids == list(range(2, 42))
    assert r.stats.pipelined_used > 5  # blocks drafted while the previous one was verified
    # the same output without pipelining
    r2 = speculative_generate(ScriptedVerifier(0.0, lambda c: c[-1] + 1), CountingDrafter(), [1], params, 3,
                              StopChecker(params), pipeline=False)
    assert r2.token_ids == r.token_ids and r2.stats.pipelined_used == 0


def test_pipelined_blocks_are_dropped_when_the_bonus_differs():
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    verifier = ScriptedVerifier(0.01, bonus=lambda ctx: 0)  # never the drafter's guess
    r = speculative_generate(verifier, CountingDrafter(), [1], params, 3, StopChecker(params), pipeline=True)
    assert r.stats.pipelined_used == 0 and r.stats.pipelined_discarded > 0
    # every block sent continues exactly the committed tokens
    committed = [1]
    for block, start in zip(verifier.blocks, range(len(verifier.blocks))):
        assert block == [committed[-1] + 1 + i for i in range(len(block))]
        committed += block + [0]
