"""The draft chosen per round (a draft model and the suffix trees) through the real services on loopback:
lossless (greedy token for token, the sampled law at T = 0.7 with blocks of both kinds joined by drafting
ahead), both methods drafting and each counted under its own label, suffix rounds running no draft forward,
seeded requests replaying, and the flag that turns it off."""

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from draft_service.engine import DraftConfig
from specmesh.drafters import HybridChooser
from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2
from tests.support.laws import LAW_PROMPT, LAW_VOCAB, first_two_counts, law_target, pooled_chisquare
from tests.support.models import noisy_copy, tiny_model
from tests.support.services import (
    draft_stub,
    generate,
    learnt,
    random_prompts,
    service_metrics,
    start_draft,
    start_verify,
)

VOCAB = 128

GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", vocab=VOCAB, seed=11)
    return target, noisy_copy(target, 0.4, seed=2)


def reference(target, ps, repeat=1) -> list[list[int]]:
    """The target's greedy output of each prompt (`repeat` times in a row), decoded alone."""
    engine = SpeculativeEngine.from_models(target)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return [engine.generate(p, params, num_speculative_tokens=0).token_ids for p in ps for _ in range(repeat)]


def run_twice(draft, ps):
    """Each prompt twice: the second run finds the first one's output in the global trees."""
    stub = draft_stub(draft)
    out = []
    for p in ps:
        for _ in range(2):
            out.append(generate(stub, p, GREEDY)[0])
    learnt(draft)
    return out


def test_greedy_equals_target_only_with_both_methods_drafting(pair):
    target, draft_model = pair
    ps = [[5, 6, 7, 8] * 4, *random_prompts(5, VOCAB, seed=3, longest=15)]
    want = reference(target, ps, repeat=2)
    verify = start_verify(target, max_batch_size=16)
    forwards = {}
    try:
        for hybrid in (False, True):
            draft = start_draft(
                draft_model,
                verify.address,
                enable_suffix_decoding=hybrid,
                speculative_num_steps=6,
                pipeline=False,
                metrics_port=0,
            )
            try:
                assert run_twice(draft, ps) == want
                e = draft.server.engine
                forwards[hybrid] = e.batcher.stats.rows  # draft tokens the model computed
                if hybrid:
                    assert e.chooser.chosen["suffix"] > 0 and e.chooser.chosen["model"] > 0
                    # greedy rounds calibrate the greedy chooser only: sampled requests learn their own odds
                    assert e.sampled_chooser.chosen == {"suffix": 0, "model": 0}
                    assert e.sampled_chooser.suffix_calibration == HybridChooser().suffix_calibration
                    by = e.by_method
                    assert by["suffix"].drafted > 0 and by["suffix"].accepted > 0 and by["model"].drafted > 0
                    info = draft_stub(draft).Info(draft_pb2.DraftServiceInfoRequest())
                    assert by["suffix"].drafted + by["model"].drafted == info.drafted
                    m = service_metrics(draft)
                    for method in ("model", "suffix"):
                        label = (("method", method),)
                        assert m[("specmesh_draft_spec_draft_tokens_total", label)] == by[method].drafted
                        assert m[("specmesh_draft_spec_accepted_tokens_total", label)] == by[method].accepted
                    assert e.suffix.cached_requests == len(want)
                else:
                    assert set(e.by_method) == {"model"} and e.suffix is None
            finally:
                draft.stop()
    finally:
        verify.stop()
    assert forwards[True] < forwards[False]  # the rounds the suffix won ran no draft forward


def test_sampled_output_is_the_target_law_at_t_0_7():
    """Through both services, a noisy-copy draft with its q (top 4) and suffix proposals as point masses,
    drafting ahead on (a block drafted ahead by one method is joined to one by the other): the joint law of
    tokens 1-2 and the law of token 3 at temperature 0.7."""
    t, vocab, prompt = 0.7, LAW_VOCAB, LAW_PROMPT
    target = law_target()

    def law(ids):
        with torch.no_grad():
            return torch.softmax(target(input_ids=torch.tensor([ids])).logits[0, -1] / t, -1).double()

    p1 = law(prompt)
    joint = p1[:, None] * torch.stack([law(prompt + [a]) for a in range(vocab)])
    p3 = sum(joint[a, b] * law(prompt + [a, b]) for a in range(vocab) for b in range(vocab))
    verify = start_verify(target)
    draft = start_draft(
        noisy_copy(target, 0.5, seed=3),
        verify.address,
        draft_topk=4,
        adaptive=False,
        speculative_num_steps=2,
        enable_suffix_decoding=True,
        metrics_port=0,
    )
    # The choice by coin, not by timings (which decide it by the machine's load): the law must hold however
    # rounds are given to one method or the other, and a fair coin gives many rounds of each.
    coin = random.Random(0)
    draft.server.engine.sampled_chooser.prefers_suffix = lambda *_: coin.random() < 0.5
    params = common_pb2.SamplingParams(temperature=t, max_tokens=4, ignore_eos=True)
    n = 2000
    stub = draft_stub(draft)
    try:
        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(lambda _: generate(stub, prompt, params), range(n)))
        by = draft.server.engine.by_method
        info = stub.Info(draft_pb2.DraftServiceInfoRequest())
        greedy_chosen = draft.server.engine.chooser.chosen
    finally:
        draft.stop()
        verify.stop()
    c3 = torch.zeros(vocab, dtype=torch.float64)
    for tokens, _ in runs:
        c3[tokens[2]] += 1
    assert by["suffix"].drafted > 100 and by["model"].drafted > 100  # both kinds of block, many times
    assert greedy_chosen == {"suffix": 0, "model": 0}  # the sampled requests' choices are their chooser's
    assert 0.1 < info.accepted / info.drafted < 0.95
    assert pooled_chisquare(first_two_counts(runs), joint, n) > 1e-3
    assert pooled_chisquare(c3, p3, n) > 1e-3


def test_a_seeded_request_replays(pair):
    target, draft_model = pair
    verify = start_verify(target)
    draft = start_draft(draft_model, verify.address, enable_suffix_decoding=True, speculative_num_steps=4)
    params = common_pb2.SamplingParams(temperature=0.9, seed=17, max_tokens=40, ignore_eos=True)
    try:
        stub = draft_stub(draft)
        runs = [generate(stub, [9, 8, 7, 9, 8, 7], params)[0] for _ in range(3)]  # the trees fill in between
    finally:
        draft.stop()
        verify.stop()
    assert runs[0] == runs[1] == runs[2]


def test_the_chooser_weighs_tokens_per_second():
    c = HybridChooser()
    # Before any timing: a proposal the trees rate at a token or more.
    assert c.prefers_suffix(4, 3, 1.2) and not c.prefers_suffix(4, 3, 0.5) and not c.prefers_suffix(4, 3, 0.0)
    c.observe_verify(0.010)
    c.observe_draft(0.005)  # a draft token costs half a verify round
    # model: 1 + .75 + .56 + .42 + .32 = 3.05 tokens in 30 ms; suffix: 1 + score tokens in 10 ms
    assert c.prefers_suffix(4, 3, 0.2)
    c.draft_seconds.value = 0.0001  # a nearly free draft model: the suffix needs the better estimate
    assert not c.prefers_suffix(4, 3, 0.5) and c.prefers_suffix(4, 3, 2.2)
    for _ in range(200):  # proposals of short matches that never land
        c.observe_suffix(1, 2.0, 0)
    assert not c.prefers_suffix(4, 1, 2.2) and c.prefers_suffix(4, 8, 2.2)  # long matches keep their own record
    for _ in range(200):
        c.observe_model(4, 0)  # the model's drafts are all rejected
    assert c.model_acceptance < 0.05 and c.prefers_suffix(4, 8, 0.3)


def test_a_long_suffix_block_pays_for_the_wider_verify_batch():
    """With the policy's model of a round's time, the block's length counts: on a compute-bound verifier
    (16 sessions, 1.6 ms per position each) a 12-token block needs about 7 expected tokens to beat a
    target-only step, and a memory-bound one (1 session) takes it for about one."""

    def round_s(sessions):
        return lambda positions, drafts: 0.025 + 0.0016 * sessions * positions + 0.004 * drafts

    c = HybridChooser()
    assert not c.prefers_suffix(0, 12, 5.0, 12, round_s(16)) and c.prefers_suffix(0, 12, 7.0, 12, round_s(16))
    assert c.prefers_suffix(0, 12, 1.0, 12, round_s(1))
    # Against model drafts of K = 4 (3.05 expected tokens in the same round plus 4 draft forwards): the
    # trees' block of 4 at a score of 2.1 wins, the same score spread over 12 tokens does not.
    assert c.prefers_suffix(4, 4, 2.1, 4, round_s(1)) and not c.prefers_suffix(4, 12, 2.1, 12, round_s(16))
    assert not c.prefers_suffix(0, 12, 0.0, 12, round_s(1))  # nothing the trees rate is never sent


def test_the_flag_turns_it_off():
    from draft_service.__main__ import parse_args

    on = DraftConfig(model_path="d")
    off, _ = parse_args(["--model-path", "d", "--no-enable-suffix-decoding"])
    assert on.hybrid and not off.hybrid
    assert not DraftConfig(speculative_algorithm="suffix").hybrid


def test_past_the_batch_limit_it_still_drafts_by_the_trees_and_the_gateway_sends_it_there(pair):
    """A hybrid replica says so in its Info, and a gateway past --speculative-disable-by-batch-size still routes
    through it (a model-only replica gets the request target-only); past its own per-round limit the replica
    drafts no model token but sends the trees' blocks, longer than its K, and the output is the target's."""
    import asyncio

    from gateway.config import GatewayConfig
    from gateway.router import Router, RouteRequest

    target, draft_model = pair
    ps = random_prompts(8, VOCAB, seed=5, longest=15)
    want = reference(target, ps)
    verify = start_verify(target, max_batch_size=16)
    hybrid = start_draft(
        draft_model,
        verify.address,
        enable_suffix_decoding=True,
        speculative_num_steps=2,
        speculative_disable_by_batch_size=1,
    )
    model_only = start_draft(draft_model, verify.address)
    try:

        async def routes():
            config = GatewayConfig(verify=(verify.address,), draft=(hybrid.address, model_only.address))
            router = Router.from_config(config)
            try:
                await router.draft_pool.check_all()
                said = {r.address: r.suffix_decoding for r in router.draft_pool.replicas.values()}
                router.speculative_disable_by_batch_size = 1
                router.draft_pool.replicas[model_only.address].inflight = 0
                router.draft_pool.replicas[hybrid.address].inflight = 1  # the model-only replica is chosen
                past_limit = router.route(RouteRequest("", [1, 2, 3]), inflight=5)
                router.draft_pool.replicas[hybrid.address].inflight = 0
                router.draft_pool.replicas[model_only.address].inflight = 1
                through_hybrid = router.route(RouteRequest("", [1, 2, 3]), inflight=5)
                return said, past_limit, through_hybrid
            finally:
                await router.close()

        said, past_limit, through_hybrid = asyncio.run(routes())
        assert said == {hybrid.address: True, model_only.address: False}
        assert past_limit.target_only
        assert through_hybrid.draft is not None and through_hybrid.draft.address == hybrid.address

        stub = draft_stub(hybrid)
        assert [generate(stub, p, GREEDY)[0] for p in ps] == want  # the outputs join the global trees
        learnt(hybrid)
        e = hybrid.server.engine
        rows, prefills = e.batcher.stats.rows, e.batcher.stats.prefills
        before = e.by_method["suffix"].drafts
        together = threading.Barrier(len(ps))

        def at_once(p):
            together.wait(30)
            return generate(stub, p, GREEDY)

        with ThreadPoolExecutor(len(ps)) as pool:  # 8 in the verify batch: past the replica's limit of 1
            burst = list(pool.map(at_once, ps))
        assert [tokens for tokens, _ in burst] == want
        # A generation that starts past the limit leaves the model's prefill to its first model proposal,
        # which most never make (the output above is the target's all the same).
        assert e.batcher.stats.prefills - prefills < len(ps)
        # Each request's statistics by method add up to its own (the per-request split).
        for _, chunks in burst:
            stats = chunks[-1].finished.stats
            counts = list(stats.by_method.values())
            assert sum(c.drafted for c in counts) == stats.drafted and sum(c.drafts for c in counts) == stats.drafts
            assert sum(c.accepted for c in counts) == stats.accepted
        assert any(chunks[-1].finished.stats.by_method["suffix"].drafts for _, chunks in burst)
        suffix = e.by_method["suffix"]
        assert suffix.drafts > before
        assert max(k for k in suffix.accepted_by_draft_length) > 2  # blocks longer than the model's K
        assert e.batcher.stats.rows - rows < 8 * 48 // 4  # few model draft tokens: most rounds past the limit
    finally:
        model_only.stop()
        hybrid.stop()
        verify.stop()


def test_with_online_distillation_a_weight_version_is_judged_by_the_models_drafts_alone(pair, tmp_path):
    """Both halves of the optimize loop on: the trees learn at once and the model over minutes; the live
    acceptance that decides a rollback counts the model's blocks, not the trees' (whose acceptance says
    nothing of the weights), and the output stays the target's."""
    target, draft_model = pair
    ps = [[5, 6, 7, 8] * 4, *random_prompts(3, VOCAB, seed=3, longest=15)]
    want = reference(target, ps, repeat=2)
    verify = start_verify(target, max_batch_size=16)
    draft = start_draft(
        noisy_copy(target, 0.4, seed=2),
        verify.address,
        enable_suffix_decoding=True,
        speculative_num_steps=4,
        pipeline=False,
        online_distill=True,
        online_distill_dir=str(tmp_path),
    )
    try:
        assert run_twice(draft, ps) == want
        e = draft.server.engine
        by = e.by_method
        assert by["suffix"].drafted > 0 and by["model"].drafted > 0
        judged = sum(drafted for drafted, _ in e.online.distiller.acceptance_by_version().values())
        assert judged == by["model"].drafted
    finally:
        draft.stop()
        verify.stop()


def test_a_guard_that_measured_both_sides_losing_lets_the_trees_back_in_on_short_requests(pair):
    """The draft replica's guard has measured the model's drafts and the trees' blocks both losing (a cold
    start on new text), and the requests that follow are shorter than its runs: each is held to target-only
    steps from its first round. Their steps still count toward the probes' schedule, so the trees are probed
    again and their blocks come back into the requests (on prompts they have seen: each is sent again).
    Greedy output is the target's throughout."""
    target, draft_model = pair
    ps = random_prompts(4, VOCAB, seed=5, longest=15)
    want = reference(target, ps)
    verify = start_verify(target)
    draft = start_draft(draft_model, verify.address, enable_suffix_decoding=True, goodput_guard=True)
    try:
        stub = draft_stub(draft)
        for p, w in zip(ps, want, strict=True):  # the trees learn the outputs
            assert generate(stub, p, GREEDY)[0] == w
        learnt(draft)
        guard = draft.server.engine.goodput_guards.at(True, 1)
        for _ in range(20):  # both sides measured losing against 250 tok/s target-only steps
            guard.observe(False, 1, 0.004)
            guard.observe(True, 1, 0.040)
            guard.observe(True, 1, 0.040, free=True)
        assert guard.speculation_loses() and guard.free_loses()
        short = common_pb2.SamplingParams(temperature=0.0, max_tokens=guard.every // 2, ignore_eos=True)
        drafted = []
        for i in range(12):
            tokens, chunks = generate(stub, ps[i % 4], short)
            assert tokens == want[i % 4][: guard.every // 2]
            drafted.append(chunks[-1].finished.stats.drafted)
        assert drafted[0] == 0 and sum(drafted[-4:]) > 0, drafted
    finally:
        draft.stop()
        verify.stop()
