"""Suffix drafting through the real services on loopback: lossless (greedy token for token, the sampled law
at T = 0.7), one tenant's generations never shaping another's drafts (through the gateway too), the global
trees' bound, its metrics, and bad settings refused naming them."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, verify_pb2, verify_pb2_grpc
from tests.support.laws import LAW_PROMPT, LAW_VOCAB, first_two_counts, law_target, pooled_chisquare
from tests.support.models import ROOT, tiny_model
from tests.support.services import (
    GatewayServer,
    draft_stub,
    generate,
    learnt,
    random_prompts,
    service_metrics,
    start_draft,
    start_verify,
    verify_replica_without,
)

VOCAB = 128

GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_target():
    return tiny_model("llama", vocab=VOCAB, seed=11)


@pytest.fixture(scope="module")
def reference(tiny_target):
    engine = SpeculativeEngine.from_models(tiny_target)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    return lambda prompt: engine.generate(prompt, params, num_speculative_tokens=0).token_ids


def test_greedy_through_the_services_equals_target_only(tiny_target, reference):
    """Each prompt twice: the second run drafts from the first one's output in the global tree (the tiny
    target's output is nothing its prompt predicts), and both are the target's own greedy output."""
    verify = start_verify(tiny_target, max_batch_size=16)
    draft = start_draft(None, verify.address, speculative_algorithm="suffix", speculative_num_steps=8, metrics_port=0)
    stub = draft_stub(draft)
    try:
        first = second = None
        for p in [[5, 6, 7, 8] * 4, *random_prompts(3, VOCAB, seed=3, longest=19)]:
            for run in range(2):
                tokens, chunks = generate(stub, p, GREEDY)
                assert tokens == reference(p)
                stats = chunks[-1].finished.stats
                first, second = (stats, second) if run == 0 else (first, stats)
            assert second.accepted > first.accepted  # what the global tree adds
        with ThreadPoolExecutor(4) as pool:  # concurrent sessions, the tree changing under them
            ps = random_prompts(8, VOCAB, seed=4, longest=19)
            assert list(pool.map(lambda p: generate(draft_stub(draft), p, GREEDY)[0], ps)) == list(map(reference, ps))
        info = stub.Info(draft_pb2.DraftServiceInfoRequest())
        assert info.algorithm == "suffix" and not info.model_path and info.accepted > 0
        learnt(draft)
        cache = draft.server.engine.suffix
        assert cache.proposals["global"] > 0 and cache.proposals["local"] > 0 and cache.cached_requests == 16
        m = service_metrics(draft)
        assert m[("specmesh_draft_spec_accepted_tokens_total", (("method", "suffix"),))] == info.accepted
        assert m[("specmesh_draft_spec_draft_tokens_total", (("method", "suffix"),))] == info.drafted
        assert m[("specmesh_draft_suffix_cached_requests", ())] == 16
        assert m[("specmesh_draft_suffix_cache_bytes", ())] > 0
        assert m[("specmesh_draft_suffix_proposals_total", (("source", "global"),))] == cache.proposals["global"]
        # The second runs' blocks went chained behind the ones before them, and the guesses that held saved
        # their round trips (the verify service counts what came chained and what it answered stale).
        used = m[("specmesh_draft_chained_blocks_total", (("outcome", "used"),))]
        stale = m[("specmesh_draft_chained_blocks_total", (("outcome", "discarded"),))]
        counters = verify.server.engine.counters
        assert used > 0 and counters.chained_blocks == used + stale and counters.chained_stale == stale
    finally:
        draft.stop()
        verify.stop()


def test_a_chained_block_is_verified_where_its_guess_holds_and_answered_stale_where_not(tiny_target, reference):
    """Through the verify service's own gRPC API: blocks sent ahead of the verdict before them
    (`chained_after`), each at the epoch and position that verdict leaves if it takes its block whole."""
    verify = start_verify(tiny_target, max_batch_size=4)
    channel = grpc.insecure_channel(verify.address)
    try:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        prompt = [5, 6, 7, 8] * 4
        want = reference(prompt)  # the target's greedy output: blocks of it are accepted whole
        opened = stub.OpenSession(verify_pb2.OpenSessionRequest(prompt_ids=prompt, params=GREEDY))
        assert opened.chained_blocks
        sid, n = opened.session_id, opened.base_position

        def block(epoch, base, ids, after=None):
            return verify_pb2.VerifyRequest(
                session_id=sid, epoch=epoch, base_position=base, draft_ids=ids, chained_after=after
            )

        wrong = (want[7] + 1) % VOCAB
        verdicts = list(
            stub.Verify(
                iter(
                    [
                        block(0, n, want[0:3]),
                        block(1, n + 4, want[4:7], after=want[3]),  # the guess holds: verified at once
                        block(2, n + 8, want[8:10], after=wrong),  # the bonus guessed wrong
                        block(5, n + 8, want[8:10], after=want[7]),  # an epoch ahead: stale, not an error
                        block(2, n + 8, want[8:10]),  # what the draft sends after the verdict
                    ]
                ),
                timeout=60,
            )
        )
        assert [(v.stale, v.epoch, v.num_accepted, list(v.token_ids)) for v in verdicts] == [
            (False, 0, 3, want[0:4]),
            (False, 1, 3, want[4:8]),
            (True, 2, 0, []),
            (True, 5, 0, []),
            (False, 2, 2, want[8:11]),
        ]
        counters = verify.server.engine.counters
        assert counters.chained_blocks == 3 and counters.chained_stale == 2
    finally:
        channel.close()
        verify.stop()


def test_a_replica_without_chained_blocks_gets_none(tiny_target, reference, monkeypatch):
    """Version skew (draft services upgraded first): a verify replica from before chained blocks leaves
    OpenSessionResponse.chained_blocks false, and would take a chained block for one ahead of its epoch."""
    verify_replica_without(monkeypatch, "chained_blocks")
    verify = start_verify(tiny_target, max_batch_size=4)
    draft = start_draft(None, verify.address, speculative_algorithm="suffix", speculative_num_steps=8)
    try:
        stub = draft_stub(draft)
        p = [5, 6, 7, 8] * 4
        for _ in range(2):
            assert generate(stub, p, GREEDY)[0] == reference(p)
        assert stub.Info(draft_pb2.DraftServiceInfoRequest()).accepted > 0
        assert verify.server.engine.counters.chained_blocks == 0
    finally:
        draft.stop()
        verify.stop()


def law(target, ids, temperature):
    with torch.no_grad():
        return torch.softmax(target(input_ids=torch.tensor([ids])).logits[0, -1] / temperature, -1).double()


def test_sampled_output_is_the_target_law_at_t_0_7():
    """Through both services with suffix drafts (point masses: no draft probabilities), pipelining on: the
    joint law of tokens 1-2 and the law of token 3 at temperature 0.7. The drafts come from the global tree
    of the runs before (and the run's own tokens), so blocks are both accepted and rejected."""
    t, vocab, prompt = 0.7, LAW_VOCAB, LAW_PROMPT
    target = law_target()
    p1 = law(target, prompt, t)
    joint = p1[:, None] * torch.stack([law(target, prompt + [a], t) for a in range(vocab)])
    p3 = sum(joint[a, b] * law(target, prompt + [a, b], t) for a in range(vocab) for b in range(vocab))
    verify = start_verify(target)
    draft = start_draft(
        None, verify.address, speculative_algorithm="suffix", adaptive=False, speculative_num_steps=3, metrics_port=0
    )
    params = common_pb2.SamplingParams(temperature=t, max_tokens=4, ignore_eos=True)
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
    assert 0.1 < info.accepted / info.drafted < 0.9 and info.drafted > n  # both outcomes, many times
    assert pooled_chisquare(first_two_counts(runs), joint, n) > 1e-3
    assert pooled_chisquare(c3, p3, n) > 1e-3


def fixed_stats(stub, prompt, scope):
    _, chunks = generate(stub, prompt, GREEDY, cache_scope=scope, num_speculative_tokens=6)
    s = chunks[-1].finished.stats
    return s.rounds, s.drafted, s.accepted


def test_one_scopes_generations_never_shape_anothers_drafts(tiny_target):
    """With a fixed K and no drafting ahead a greedy request's statistics are a function of its drafts: the
    first request of a scope drafts exactly as the first of another, whatever the other scope generated,
    while a repeat in the same scope drafts from what came before."""
    verify = start_verify(tiny_target)
    draft = start_draft(
        None, verify.address, speculative_algorithm="suffix", adaptive=False, pipeline=False, metrics_port=0
    )
    stub = draft_stub(draft)
    p = random_prompts(1, VOCAB, seed=7, longest=19)[0]
    try:
        alone = fixed_stats(stub, p, "tenant-a")
        again = fixed_stats(stub, p, "tenant-a")
        assert again[2] > alone[2] and again[0] < alone[0]  # the first output, drafted back
        assert fixed_stats(stub, p, "tenant-b") == alone  # as if tenant-a had never generated
        assert fixed_stats(stub, p, "tenant-a/salt") == alone
        learnt(draft)
        assert draft.server.engine.suffix.scopes == 3
    finally:
        draft.stop()
        verify.stop()


def test_tenants_behind_the_gateway_draft_from_their_own_generations(target, tokenizer):
    """The gateway's scope of a request (its API key, its cache_salt) partitions the draft's global trees:
    a tenant repeating a request drafts its own earlier output back, another tenant (or salt) does not."""
    verify = start_verify(target, tokenizer)
    draft = start_draft(
        None, verify.address, speculative_algorithm="suffix", adaptive=False, pipeline=False, metrics_port=0
    )
    gw = GatewayServer([verify.address], [draft.address], tokenizer, api_keys=("sk-a", "sk-b"))

    def accepted(key, **extra):
        r = gw.openai(key).completions.create(
            model="demo",
            prompt="def parse(line):",
            max_tokens=40,
            temperature=0,
            extra_body={"num_speculative_tokens": 6, **extra},
        )
        spec = r.model_extra["specmesh"]
        assert set(spec["by_method"]) <= {"suffix"}  # the per-request split: one method here
        if spec["drafts"]:
            assert spec["by_method"]["suffix"] == {k: spec[k] for k in ("drafts", "drafted", "accepted")}
        return spec["accepted"], r.choices[0].text

    try:
        a1, text = accepted("sk-a")
        a2, again = accepted("sk-a")
        assert again == text and a2 > a1
        assert accepted("sk-b") == (a1, text)
        assert accepted("sk-a", cache_salt="s1") == (a1, text)
        learnt(draft)
        assert draft.server.engine.suffix.scopes == 3
    finally:
        gw.stop()
        draft.stop()
        verify.stop()


def test_the_global_trees_hold_at_most_the_bound(tiny_target):
    verify = start_verify(tiny_target)
    draft = start_draft(
        None, verify.address, speculative_algorithm="suffix", suffix_decoding_max_cached_requests=3, metrics_port=0
    )
    stub = draft_stub(draft)
    try:
        ps = random_prompts(5, VOCAB, seed=9, longest=19)
        for p in ps:
            generate(stub, p, GREEDY, cache_scope="a" if len(p) % 2 else "b")
        learnt(draft)
        cache = draft.server.engine.suffix
        assert cache.cached_requests == 3 and cache.evicted == 2
        m = service_metrics(draft)
        assert m[("specmesh_draft_suffix_cached_requests", ())] == 3
        assert m[("specmesh_draft_suffix_evicted_requests_total", ())] == 2
        # the last three outputs, each led by its prompt's last max_tree_depth - 1 (23) tokens: here the whole prompt
        assert max(map(len, ps)) < 23
        assert m[("specmesh_draft_suffix_cache_tokens", ())] == sum(map(len, ps[-3:])) + 3 * GREEDY.max_tokens
    finally:
        draft.stop()
        verify.stop()


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--suffix-decoding-max-tree-depth", "0"], "--suffix-decoding-max-tree-depth"),
        (["--suffix-decoding-max-cached-requests", "-1"], "--suffix-decoding-max-cached-requests"),
        (["--suffix-decoding-max-spec-factor", "-2"], "--suffix-decoding-max-spec-factor"),
        (["--suffix-decoding-min-token-prob", "1.5"], "--suffix-decoding-min-token-prob"),
        (["--suffix-decoding-min-token-prob", "x"], "--suffix-decoding-min-token-prob"),
        (["--speculative-algorithm", "suffix-tree"], "--speculative-algorithm"),
    ],
)
def test_bad_suffix_flags_are_usage_errors_naming_them(flags, named, capsys):
    from draft_service.__main__ import parse_args

    argv = ["--speculative-algorithm", "suffix", *flags] if flags[0] != "--speculative-algorithm" else flags
    with pytest.raises(SystemExit) as e:
        parse_args(["--verify-address", "127.0.0.1:1", *argv])
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_the_draft_service_exits_2_on_a_bad_suffix_flag():
    r = subprocess.run(
        [sys.executable, "-m", "draft_service", "--speculative-algorithm", "suffix"]
        + ["--suffix-decoding-max-tree-depth", "0"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert r.returncode == 2 and "--suffix-decoding-max-tree-depth must be >= 1, got 0" in r.stderr, r.stderr


def test_serve_takes_suffix_without_a_draft_model():
    from specmesh.cli import UsageError, parser, plan_from_args

    plan = plan_from_args(parser().parse_args(["serve", "--model-path", "T", "--speculative-algorithm", "SUFFIX"]))
    assert (plan.algorithm, plan.draft) == ("suffix", None)
    with pytest.raises(UsageError, match=r"suffix .*give no draft model"):
        plan_from_args(
            parser().parse_args(
                ["serve", "--model-path", "T", "--speculative-algorithm", "suffix", "--draft-model", "D"]
            )
        )


def test_a_bad_request_is_invalid_argument_naming_it(tiny_target):
    verify = start_verify(tiny_target)
    draft = start_draft(None, verify.address, speculative_algorithm="suffix", metrics_port=0)
    try:
        with pytest.raises(grpc.RpcError) as e:
            generate(draft_stub(draft), [1, 2, 3], GREEDY, num_speculative_tokens=33)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_speculative_tokens" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            generate(draft_stub(draft), [1, 2, VOCAB + 5], GREEDY)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        draft.stop()
        verify.stop()
