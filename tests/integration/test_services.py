"""The service pair over real gRPC on loopback: lossless output, batching, sessions, errors, lifecycle."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, verify_pb2
from tests.support.laws import (
    LAW_PROMPT,
    LAW_VOCAB,
    first_two_counts,
    law_target,
    next_token_law,
    pooled_chisquare,
    sampling_services,
    two_token_law,
)
from tests.support.models import noisy_copy, tiny_model
from tests.support.services import (
    draft_stub,
    generate,
    start_draft,
    start_verify,
    verify_replica_without,
    verify_stub,
)
from verify_service.engine import BlockIn

VOCAB = 128
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, VOCAB - 1, (int(torch.randint(3, 20, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab=VOCAB, seed=11)


@pytest.fixture(scope="module")
def reference(target):
    engine = SpeculativeEngine.from_models(target)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return lambda prompt: engine.generate(prompt, params, num_speculative_tokens=0).token_ids


@pytest.fixture(scope="module")
def stack(target):
    verify = start_verify(target, max_batch_size=16)
    draft = start_draft(noisy_copy(target, 0.03, seed=2), verify.address)
    ngram = start_draft(None, verify.address, speculative_algorithm="ngram")
    yield verify, draft, ngram
    for s in (ngram, draft, verify):
        s.stop()


def test_greedy_through_the_pair_equals_target_only(stack, reference):
    verify, draft, _ = stack
    stub = draft_stub(draft)
    drafted = accepted = 0
    for p in prompts(10):
        tokens, chunks = generate(stub, p, GREEDY)
        assert tokens == reference(p)
        assert chunks[0].opened.prompt_tokens == len(p) and chunks[0].opened.session_id
        last = chunks[-1]
        assert last.finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
        drafted += last.finished.stats.drafted
        accepted += last.finished.stats.accepted
    assert 0.1 < accepted / drafted < 0.99  # both paths ran
    info = stub.Info(draft_pb2.DraftServiceInfoRequest())
    assert info.algorithm == "standalone" and info.adaptive and info.pipelined
    assert info.pipelined_blocks_used > 0  # some blocks were drafted while the previous one was verified
    assert info.draft_seconds_per_token > 0


def test_fixed_k_without_pipelining_is_lossless_too(target, reference):
    verify = start_verify(target)
    draft = start_draft(
        noisy_copy(target, 0.03, seed=2), verify.address, adaptive=False, pipeline=False, speculative_num_steps=3
    )
    try:
        for p in prompts(4, seed=1):
            tokens, chunks = generate(draft_stub(draft), p, GREEDY)
            assert tokens == reference(p)
            per_pos = chunks[-1].finished.stats.drafted_per_pos
            assert max(per_pos and range(len(per_pos))) == 2
    finally:
        draft.stop()
        verify.stop()


def test_over_a_bfloat16_kv_cache_greedy_through_the_pair_equals_target_only_in_it(target):
    """`--kv-cache-dtype bfloat16`: the replica's pool in bfloat16 at half the bytes, and greedy speculation
    through the pair, several sessions at once, equals the replica's own target-only decoding over the same
    cache dtype token for token (each key and value is rounded once, when written, whichever path writes it)."""
    verify = start_verify(target, kv_cache_dtype="bfloat16", max_batch_size=16)
    draft = start_draft(noisy_copy(target, 0.03, seed=2), verify.address)
    try:
        runner = verify.server.engine.runner
        assert runner._k[0].dtype == torch.bfloat16 and runner.cpu_kernel
        batch = prompts(6, seed=5)
        want = [generate(verify_stub(verify), p, GREEDY)[0] for p in batch]
        with ThreadPoolExecutor(len(batch)) as pool:
            got = list(pool.map(lambda p: generate(draft_stub(draft), p, GREEDY), batch))
        assert [tokens for tokens, _ in got] == want
        assert sum(chunks[-1].finished.stats.accepted for _, chunks in got) > 0  # the drafts were verified
    finally:
        draft.stop()
        verify.stop()


def test_target_only_generate_equals_reference(stack, reference):
    verify, _, _ = stack
    for p in prompts(3, seed=2):
        tokens, chunks = generate(verify_stub(verify), p, GREEDY)
        assert tokens == reference(p)
        assert chunks[-1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH


def test_ngram_algorithm_is_lossless(stack, reference):
    """N-gram blocks are drafted and verified, and the output is the target's. (The tiny random target does not
    continue its prompts' n-grams, so whether a block is ever accepted here is luck, about 1 in 30 drafts, and
    the K policy rightly drafts less once it has seen that: acceptance is not asserted.)"""
    verify, _, ngram = stack
    stub = draft_stub(ngram)
    drafted = 0
    for p in [[5, 6, 7, 8] * 4, *prompts(3, seed=3)]:
        tokens, chunks = generate(stub, p, GREEDY)
        assert tokens == reference(p)
        drafted += chunks[-1].finished.stats.drafted
    assert drafted > 0
    assert stub.Info(draft_pb2.DraftServiceInfoRequest()).algorithm == "ngram"


def test_eight_concurrent_sessions_are_batched(stack, reference):
    verify, draft, _ = stack
    vstub = verify_stub(verify)
    before = vstub.Info(verify_pb2.VerifyServiceInfoRequest())
    drafting = draft.server.engine.batcher.stats
    forwards, rows = drafting.forwards, drafting.rows
    ps = prompts(8, seed=4)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: generate(draft_stub(draft), p, GREEDY)[0], ps))
    for p, tokens in zip(ps, results):
        assert tokens == reference(p)
    # one draft forward advanced several sessions at once (and the metric says so)
    assert (drafting.rows - rows) / (drafting.forwards - forwards) > 1.2
    assert max(drafting.batch_size_hist) > 1
    after = vstub.Info(verify_pb2.VerifyServiceInfoRequest())
    batches = after.batches - before.batches
    blocks = after.batched_blocks - before.batched_blocks
    assert after.max_batch_size_seen > 1
    assert blocks / batches > 1.2, (blocks, batches)  # one forward verified several sessions' blocks
    # target-only sessions resubmit at once: the batch window gathers (nearly) all of them every tick
    before = vstub.Info(verify_pb2.VerifyServiceInfoRequest())
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: generate(vstub, p, GREEDY)[0], ps))
    assert all(tokens == reference(p) for p, tokens in zip(ps, results))
    after = vstub.Info(verify_pb2.VerifyServiceInfoRequest())
    assert (after.batched_blocks - before.batched_blocks) / (after.batches - before.batches) > 5


def test_session_turns_reuse_the_kv_cache(stack, target):
    verify, draft, _ = stack
    stub = draft_stub(draft)
    engine = SpeculativeEngine.from_models(target)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    short = common_pb2.SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    turn1 = [3, 4, 5, 6, 7, 8, 9]
    out1, chunks1 = generate(stub, turn1, short, session_id="chat-1")
    assert chunks1[0].opened.cached_prompt_tokens == 0
    turn2 = turn1 + out1 + [10, 11, 12]
    out2, chunks2 = generate(stub, turn2, short, session_id="chat-1")
    # everything but the new message's tokens (and the last committed one) came from the cache
    assert chunks2[0].opened.cached_prompt_tokens >= len(turn1) + len(out1) - 1
    assert out2 == engine.generate(turn2, params, 0).token_ids
    vstub = verify_stub(verify)
    assert vstub.ReleaseSession(verify_pb2.ReleaseSessionRequest(session_id="chat-1")).released
    assert not vstub.ReleaseSession(verify_pb2.ReleaseSessionRequest(session_id="chat-1")).released


def test_sampled_output_is_the_target_distribution():
    """Through both services, pipelining on: the joint law of tokens 1-2 and the law of token 3."""
    vocab, prompt = LAW_VOCAB, LAW_PROMPT
    target = law_target()
    verify, draft = sampling_services(target, 0.5, steps=1)
    _, joint = two_token_law(target, prompt)
    p3 = sum(joint[a, b] * next_token_law(target, prompt + [a, b]) for a in range(vocab) for b in range(vocab))
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    n = 2000
    stub = draft_stub(draft)
    try:
        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(lambda _: generate(stub, prompt, params), range(n)))
        info = stub.Info(draft_pb2.DraftServiceInfoRequest())
    finally:
        draft.stop()
        verify.stop()
    c3 = torch.zeros(vocab, dtype=torch.float64)
    for tokens, _ in runs:
        c3[tokens[2]] += 1
    accepted = sum(chunks[-1].finished.stats.accepted for _, chunks in runs)
    drafted = sum(chunks[-1].finished.stats.drafted for _, chunks in runs)
    assert 0.2 < accepted / drafted < 0.95
    assert info.pipelined_blocks_used > 0  # the pipelined path was exercised by the law under test
    assert pooled_chisquare(first_two_counts(runs), joint, n) > 1e-3
    assert pooled_chisquare(c3, p3, n) > 1e-3


def test_seeded_sampling_replays_through_the_pair(stack):
    _, draft, _ = stack
    stub = draft_stub(draft)
    params = lambda seed: common_pb2.SamplingParams(
        temperature=0.8, top_p=0.95, seed=seed, max_tokens=40, ignore_eos=True
    )
    p = [3, 1, 4, 1, 5]
    first = generate(stub, p, params(7))[0]
    assert all(generate(stub, p, params(7))[0] == first for _ in range(3))
    assert generate(stub, p, params(8))[0] != first


def test_chunked_prefill_gives_the_same_output(target, reference):
    verify = start_verify(target, prefill_chunk_tokens=4)
    try:
        vs = verify_stub(verify)
        prompt = list(range(10, 40))  # 29 tokens to prefill: 8 chunks of <= 4
        tokens, chunks = generate(vs, prompt, GREEDY, session_id="long")
        assert tokens == reference(prompt)
        assert verify.server.engine.counters.prefill_chunks == 8
        again, chunks = generate(vs, prompt + tokens + [5, 6], GREEDY, session_id="long")
        assert chunks[0].opened.cached_prompt_tokens == len(prompt) + len(tokens) - 1  # counted once, not per chunk
    finally:
        verify.stop()


def test_num_speculative_tokens_zero_is_target_only_and_unset_is_the_default(stack, reference):
    verify, draft, _ = stack
    stub = draft_stub(draft)
    p = prompts(1, seed=9)[0]
    tokens, chunks = generate(stub, p, GREEDY, num_speculative_tokens=0)
    assert tokens == reference(p)
    assert not chunks[-1].finished.HasField("stats") or chunks[-1].finished.stats.drafted == 0
    tokens, chunks = generate(stub, p, GREEDY)  # unset: the service's K
    assert tokens == reference(p) and chunks[-1].finished.stats.drafted > 0
    with pytest.raises(grpc.RpcError) as e:
        generate(stub, p, GREEDY, num_speculative_tokens=33)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_speculative_tokens" in e.value.details()


def test_k_above_the_verifiers_limit_is_clamped_to_it(target, reference):
    """A K the verify replica would refuse (its --max-spec-len) is clamped by the draft service, which
    learns the limit from the replica's Info, instead of failing the request."""
    verify = start_verify(target, max_spec_len=3)
    draft = start_draft(noisy_copy(target, 0.03, seed=2), verify.address, adaptive=False)
    try:
        p = prompts(1, seed=12)[0]
        tokens, chunks = generate(draft_stub(draft), p, GREEDY, num_speculative_tokens=20)
        assert tokens == reference(p)
        assert len(chunks[-1].finished.stats.drafted_per_pos) == 3
    finally:
        draft.stop()
        verify.stop()


def batch_limited_burst(target, n=6):
    """n concurrent generations through a draft service with --speculative-disable-by-batch-size 1: their
    outputs and stats, and the verify replica's Info afterwards."""
    verify = start_verify(target, max_batch_size=16)
    draft = start_draft(noisy_copy(target, 0.03, seed=2), verify.address, speculative_disable_by_batch_size=1)
    ps = prompts(n, seed=4)
    try:
        with ThreadPoolExecutor(n) as pool:
            outs = list(pool.map(lambda p: generate(draft_stub(draft), p, GREEDY), ps))
        info = verify_stub(verify).Info(verify_pb2.VerifyServiceInfoRequest())
    finally:
        draft.stop()
        verify.stop()
    return ps, outs, info


def test_sessions_past_the_batch_limit_decode_in_runs_without_a_block_per_step(target, reference):
    """--speculative-disable-by-batch-size 1: once a verdict shows a batch of several sessions, a session
    asks for target-only steps in runs (one message, a verdict per step), and the tokens stay the target's."""
    ps, outs, info = batch_limited_burst(target)
    assert [tokens for tokens, _ in outs] == [reference(p) for p in ps]
    assert sum(chunks[-1].finished.stats.drafted for _, chunks in outs) > 0  # first rounds speculate
    assert info.max_batch_size_seen > 1 and info.run_steps > 0 and info.deadline_steps == 0


def test_a_replica_without_runs_gets_an_empty_block_per_step(target, reference, monkeypatch):
    """Version skew (a rolling upgrade, draft services first): a verify replica from before target-only runs
    leaves OpenSessionResponse.target_only_runs false and ignores target_only_steps. The draft service asks it
    for one step per block, so its sessions never wait for verdicts that are not coming (with a block per
    step asked for in a run, each step after the first would wait out the 5 s draft deadline)."""
    import verify_service.servicer as servicer

    monkeypatch.setattr(
        servicer, "BlockIn", lambda sid, epoch, base, block, steps=0, chained=None: BlockIn(sid, epoch, base, block)
    )
    verify_replica_without(monkeypatch, "target_only_runs", "chained_blocks")  # it predates both
    ps, outs, info = batch_limited_burst(target)
    assert [tokens for tokens, _ in outs] == [reference(p) for p in ps]
    assert info.max_batch_size_seen > 1 and info.run_steps == 0 and info.deadline_steps == 0


@pytest.fixture
def slow_link(monkeypatch):
    """Every speculative block waits 30 ms more on its way to the verifier; target-only runs do not."""
    from draft_service.remote import RemoteVerifier

    submit = RemoteVerifier.submit

    async def slow_submit(self, proposal, *chained):
        await asyncio.sleep(0.03)
        return await submit(self, proposal, *chained)

    monkeypatch.setattr(RemoteVerifier, "submit", slow_submit)


@pytest.mark.parametrize("guard", [True, False])
def test_the_goodput_guard_turns_speculation_off_where_rounds_cost_what_the_model_does_not_see(
    target, reference, slow_link, guard
):
    """Every speculative block waits 30 ms more on its way to the verifier (a slow link, a busy scheduler),
    target-only runs do not (one message asks for a whole run). GoodputK's model charges that wait to K = 0
    steps too, so it keeps drafting; the guard measures that target-only runs commit more tokens per second
    and turns speculation off. Without the guard the same stack keeps speculating. The output is the target's
    either way."""
    verify = start_verify(target)
    draft = start_draft(noisy_copy(target, 0.03, seed=2), verify.address, goodput_guard=guard)
    try:
        stub = draft_stub(draft)
        drafted = []
        for p in prompts(8, seed=7):
            tokens, chunks = generate(stub, p, GREEDY)
            assert tokens == reference(p)
            drafted.append(chunks[-1].finished.stats.drafted)
        assert drafted[0] > 0
        engine = draft.server.engine
        if guard:
            one_greedy_stream = engine.goodput_guards.at(True, 1)  # the guard these sessions were measured by
            assert one_greedy_stream.speculation_loses() and engine.goodput_guards.probes >= 1
            assert sum(drafted[4:]) <= sum(drafted[:4]) / 3  # what is left is the guard's probes
            assert verify_stub(verify).Info(verify_pb2.VerifyServiceInfoRequest()).run_steps > 100
        else:
            assert engine.goodput_guards is None and min(drafted[4:]) > 0
    finally:
        draft.stop()
        verify.stop()


def test_the_gateway_skips_the_draft_hop_while_the_draft_reports_that_speculation_loses(target, reference, slow_link):
    """The same slow link as above, with a gateway in front (--goodput-probe-every 4). Once the draft
    service's guard reports that speculation loses, requests that leave K unset go target-only straight to
    the verify replica, all but the fourth, which still goes through the draft service and speculates there
    (a goodput probe), so that its guard keeps measuring speculation; while the loss stands each probe
    doubles the wait before the next (the eighth, then the sixteenth), and the draft service hands each probe
    back once its measured rounds are done (the gateway decodes the rest target-only). Requests that set K,
    or a seed, keep the draft path. Every output is the target's."""
    from specmesh.v1 import gateway_pb2, gateway_pb2_grpc
    from tests.support.services import GatewayServer

    verify = start_verify(target)
    draft = start_draft(noisy_copy(target, 0.03, seed=2), verify.address, goodput_guard=True)
    gw = GatewayServer([verify.address], [draft.address], None, goodput_probe_every=4)
    try:
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gw.grpc_address))

        verify_stats = verify.server.engine.scheduler.stats
        prefilled = []  # positions each request prefilled on the verify replica

        def one(p, params=GREEDY, **kw):
            before = verify_stats.prefill_tokens
            r = stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt_ids=p, params=params, **kw))
            assert list(r.token_ids) == reference(p)
            prefilled.append(verify_stats.prefill_tokens - before)
            return r

        answers = [one(p) for p in prompts(16, seed=7)]
        direct = [r.target_only for r in answers]
        assert draft.server.engine.goodput_guards.at(True, 1).speculation_pays() is False
        first = direct.index(True)
        assert first >= 1 and not any(direct[:first])  # through the draft until its guard had measured both sides
        # from then on three straight to the verify replica (--goodput-probe-every 4), then a goodput probe
        # through the draft, which speculates rather than take the guard's runs; then seven, fifteen, ...
        runs = [len(r) for r in "".join("d" if d else "p" for d in direct[first:]).split("p")]
        assert sum(direct) >= 6 and len(runs) >= 2, direct
        assert runs[:-1] == [4 * 2**i - 1 for i in range(len(runs) - 1)] and runs[-1] < 4 * 2 ** len(runs), direct
        probes = [r for r in answers[first:] if not r.target_only]
        assert probes and all(r.stats.drafted > 0 for r in probes)
        # Each probe speculated its measured rounds (the first, behind the prefill, is not one), found the loss
        # standing and was handed back: the rest of its tokens came straight from the verify replica.
        from specmesh.loop import GoodputK

        assert gw.gateway.handoffs == len(probes) and all(r.handed_off for r in probes)
        assert not any(r.handed_off for r in answers if r.target_only or r not in probes)
        assert all(r.stats.rounds <= GoodputK.PROBE_ROUNDS + 1 < len(r.token_ids) for r in probes)
        # ... in a new session that found the probe's tokens in the prefix cache (the tail past its last full
        # block goes with the first step): nothing was prefilled again
        ps = prompts(16, seed=7)
        assert all(prefilled[i] < len(ps[i]) for i in range(first, 16) if not answers[i].target_only)
        assert gw.gateway.draft_pool.decisions["target_only_by_goodput"] == sum(direct)
        p = prompts(1, seed=9)[0]
        assert not one(p, num_speculative_tokens=2).target_only  # the caller's K: through the draft
        seeded = common_pb2.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, seed=3)
        assert not one(p, seeded).target_only  # a seeded request keeps the draft path (it must replay exactly)
    finally:
        gw.stop()
        draft.stop()
        verify.stop()
