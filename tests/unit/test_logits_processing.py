"""Context-dependent logit processing (penalties, min_p, logit_bias, min_tokens, stop_token_ids, bad_words)
and raw log-probabilities: equal to transformers' own processors, lossless through speculation."""

import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
)

from specmesh.engine import SpeculativeEngine
from specmesh.rejection import RejectionInput, RejectionSampler
from specmesh.sampling import (
    BatchSamplingParams,
    LogitsContext,
    SamplingParams,
    apply_context_processing,
    process_logits,
)
from tests.support.laws import assert_first_two_tokens_law
from tests.support.models import noisy_copy, tiny_model

V = 16


def one_row(logits, params, tokens, output_start, eos=frozenset()):
    return apply_context_processing(logits[None], [params], [LogitsContext(tokens, output_start, (), eos)])[0]


def test_each_rule_equals_transformers_or_openai():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(V, generator=g) * 2
    prompt, output = [1, 2, 3, 3], [4, 5, 4, 6]
    ids = torch.tensor([prompt + output])
    ref = RepetitionPenaltyLogitsProcessor(1.7)(ids, logits[None].clone())[0]
    assert torch.allclose(one_row(logits, SamplingParams(repetition_penalty=1.7), prompt + output, 4), ref)
    # OpenAI: logit - frequency * count - presence * (count > 0), over output tokens only
    ref = logits.clone()
    for t, c in {4: 2, 5: 1, 6: 1}.items():
        ref[t] -= 0.5 * c + 0.25
    got = one_row(logits, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), prompt + output, 4)
    assert torch.allclose(got, ref)
    ref = logits.clone()
    ref[7] += 30.0
    ref[8] -= 100.0
    assert torch.allclose(one_row(logits, SamplingParams(logit_bias=((7, 30.0), (8, -100.0))), prompt + output, 4), ref)
    # bad words: single tokens always, a sequence after its prefix (output [.., 4, 6]: [6, 9] bans 9)
    words = ((11,), (6, 9), (5, 10))
    ref = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=15)(ids, logits[None].clone())[0]
    assert torch.equal(one_row(logits, SamplingParams(bad_words=words), prompt + output, 4), ref)
    # min_tokens holds back EOS and stop_token_ids until that many output tokens
    params = SamplingParams(min_tokens=5, stop_token_ids=(12,), max_tokens=8)
    got = one_row(logits, params, prompt + output, 4, frozenset({15}))
    ref = MinNewTokensLengthLogitsProcessor(4, 9, [12, 15])(ids, logits[None].clone())[0]
    assert torch.equal(got, ref) and got[12] == got[15] == float("-inf")
    assert torch.equal(one_row(logits, params, prompt + output + [1], 4, frozenset({15})), logits)
    # min_p keeps what transformers' MinPLogitsWarper keeps
    probs = process_logits(logits[None], BatchSamplingParams.from_params([SamplingParams(min_p=0.1)], [1]))[0]
    kept = MinPLogitsWarper(0.1)(ids, logits[None].clone())[0] > float("-inf")
    assert torch.equal(probs > 0, kept)
    assert torch.allclose(probs[kept], torch.softmax(logits[kept], 0))


def test_a_blocks_rows_count_the_drafts_before_them():
    """Row i of a block = one row processed with x_1..x_i committed; the input is left as it was."""
    g = torch.Generator().manual_seed(1)
    params = SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=-0.2,
        bad_words=((3, 7), (9,)),
        min_tokens=4,
        stop_token_ids=(2,),
        logit_bias=((5, 1.5),),
        max_tokens=9,
    )
    tokens, start, drafts = [1, 2, 3, 4, 5], 3, [3, 7, 7]
    logits = torch.randn(len(drafts) + 1, V, generator=g)
    raw = logits.clone()
    other = SamplingParams()  # a request without processing shares the batch and is left alone
    batch = torch.cat([logits, raw[:1]])
    got = apply_context_processing(
        batch, [params, other], [LogitsContext(tokens, start, drafts, frozenset({15})), None], rows=[4, 1]
    )
    assert torch.equal(logits, raw) and torch.equal(got[4], raw[0])
    for j in range(len(drafts) + 1):
        assert torch.allclose(got[j], one_row(raw[j], params, tokens + drafts[:j], start, frozenset({15})))
    assert got[1, 7] == float("-inf") and got[0, 7] > float("-inf")  # [3, 7] banned after x_1 = 3 only
    assert got[0, 2] == float("-inf") and got[2, 2] > float("-inf")  # min_tokens: output 2 + j < 4


def test_validation_names_the_parameter():
    for kw, name in [
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(min_p=1.5), "min_p"),
        (dict(logit_bias=((1, 101.0),)), "logit_bias"),
        (dict(min_tokens=20), "min_tokens"),
        (dict(min_tokens=1, stop=("x",)), "min_tokens"),
        (dict(bad_words=((),)), "bad_words"),
        (dict(logprobs=21), "logprobs"),
    ]:
        with pytest.raises(ValueError, match=name):
            SamplingParams(**kw).validate(V)
    with pytest.raises(ValueError, match="bad_words"):
        SamplingParams(bad_words=((V,),)).validate(V)


PROCESSED = SamplingParams(
    temperature=0.9,
    top_p=0.95,
    min_p=0.05,
    repetition_penalty=1.6,
    frequency_penalty=0.5,
    presence_penalty=0.3,
    logit_bias=((0, 1.0), (5, -2.0)),
    bad_words=((2, 3), (6,)),
    min_tokens=3,
    stop_token_ids=(7,),
    max_tokens=8,
)


def test_speculation_samples_the_processed_target_law(n: int = 30_000):
    """One round, K = 2, against a committed context: the joint law of the first two emitted tokens is the
    processed target's, each position processed under the context of the tokens before it (chi-square)."""
    vocab = 8
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, vocab, generator=g) * 1.5
    tokens, start = [1, 2, 4, 4, 2], 3  # prompt [1, 2, 4], output [4, 2]: [2, 3] bans 3 at row 0
    ctx = LogitsContext(tokens, start, (), frozenset())
    q = torch.softmax(torch.randn(2, vocab, generator=g), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.tolist()
    q_ids = torch.arange(vocab).expand(2, vocab)
    blocks = [RejectionInput.of(d, PROCESSED, q_ids, q, context=ctx) for d in drafts]
    out = RejectionSampler("torch", seed=5)(logits.repeat(n, 1), blocks)

    def law(row, committed):
        c = LogitsContext(committed, start, (), frozenset())
        x = apply_context_processing(logits[row][None], [PROCESSED], [c])
        return process_logits(x, BatchSamplingParams.from_params([PROCESSED], [1]))[0].double()

    p0 = law(0, tokens)
    assert p0[3] == 0 and p0[6] == 0 and p0[7] == 0  # banned by bad_words, and by min_tokens (7 is a stop)
    # Joint law of (first, second) over the trials whose first token was accepted (second is then emitted
    # from row 1, processed under the context + first): min(p0, q0)(a) p1(b | a); the first token alone
    # over every trial.
    c0 = assert_first_two_tokens_law(out, p0, q[0], lambda a: law(1, tokens + [a]))
    assert 0.5 * (c0 / n - p0).abs().sum() < 0.01


def test_a_broken_context_fails_the_same_check(monkeypatch):
    """Processing every row under the committed context alone (drafts not counted) must be caught."""
    import specmesh.rejection.sampler as sampler

    monkeypatch.setattr(RejectionInput, "block_context", property(lambda self: self.context))
    with pytest.raises(AssertionError):
        test_speculation_samples_the_processed_target_law(10_000)
    assert sampler  # the module under test stays imported


GREEDY = dict(temperature=0.0, max_tokens=24, ignore_eos=True)


def test_greedy_equals_transformers_generate_with_its_processors():
    """Speculative greedy (K = 4, a noisy draft) = target-only greedy = model.generate with transformers'
    own processors, for repetition penalty, bad words, min_tokens (with a stop token) and min_p."""
    target = tiny_model("llama", vocab=128, seed=11)
    engine = SpeculativeEngine.from_models(target, noisy_copy(target, 0.03, seed=2))
    prompt = [5, 17, 33, 17, 90, 4, 61]
    ids = torch.tensor([prompt])
    plain = engine.generate(prompt, SamplingParams(**GREEDY), num_speculative_tokens=0).token_ids
    common = dict(do_sample=False, max_new_tokens=24, pad_token_id=0)
    eos = target.config.eos_token_id
    bad = [[plain[2]], [plain[5], plain[6]]]  # the greedy path's own tokens: the bans must bite
    cases = [
        (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
        (dict(bad_words=tuple(map(tuple, bad))), dict(bad_words_ids=bad)),
        (dict(min_p=0.2), dict(min_p=0.2)),
    ]
    for ours, theirs in cases:
        params = SamplingParams(**GREEDY, **ours)
        ref = target.generate(ids, **common, **theirs, eos_token_id=None)[0, len(prompt) :].tolist()
        for k in (0, 4):
            assert engine.generate(prompt, params, num_speculative_tokens=k).token_ids == ref, (ours, k)
        if "min_p" not in ours:
            assert ref != plain, ours  # the parameter changed the output
    # min_tokens with stop_token_ids: the greedy path's 3rd token is a stop token, held back until 6 tokens
    stop = plain[2]
    params = SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=(stop,), min_tokens=6, ignore_eos=True)
    ref = target.generate(ids, **common, min_new_tokens=6, eos_token_id=[stop])[0, len(prompt) :].tolist()
    if stop in ref:
        ref = ref[: ref.index(stop) + 1]
    for k in (0, 4):
        got = engine.generate(prompt, params, num_speculative_tokens=k)
        assert got.token_ids == ref and len(ref) >= 6
        assert got.finish_reason == ("stop" if ref[-1] == stop else "length")
    assert eos is not None


def test_logprobs_are_the_raw_target_log_softmax():
    target = tiny_model("llama", vocab=128, seed=11)
    engine = SpeculativeEngine.from_models(target, noisy_copy(target, 0.03, seed=2))
    prompt = [5, 17, 33, 17, 90]
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=3, repetition_penalty=1.5)
    result = engine.generate(prompt, params, num_speculative_tokens=4)
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) == 12
    with torch.no_grad():
        raw = target(torch.tensor([prompt + result.token_ids])).logits[0, len(prompt) - 1 : -1]
    ref = torch.log_softmax(raw.float(), -1)
    for i, lp in enumerate(result.logprobs):
        assert lp.token_id == result.token_ids[i]
        assert abs(lp.logprob - ref[i, lp.token_id].item()) < 1e-4
        top = ref[i].topk(3)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert all(abs(v - r) < 1e-4 for (_, v), r in zip(lp.top, top.values.tolist(), strict=True))
    assert engine.generate(prompt, SamplingParams(**GREEDY), num_speculative_tokens=4).logprobs is None


def test_the_draft_processes_as_the_target_does():
    """A draft identical to the target, sending its whole processed distribution: q = p at every position
    only if the draft applies the same context-dependent processing (its drafted tokens counted as output),
    so every draft is accepted; greedy likewise."""
    target = tiny_model("llama", vocab=64, seed=5)
    engine = SpeculativeEngine.from_models(target, target, draft_topk=64)
    prompt = [3, 9, 3, 12, 40, 9]
    common = dict(
        repetition_penalty=0.5,  # rewards repeats: the drafted tokens before a position matter
        frequency_penalty=-0.5,
        logit_bias=((7, 2.0),),
        bad_words=((9, 3),),
        min_tokens=6,
        max_tokens=16,
    )
    for temperature in (0.0, 0.9):
        params = SamplingParams(temperature=temperature, seed=1, **common)
        result = engine.generate(prompt, params, num_speculative_tokens=4)
        assert result.stats.drafted > 0 and result.stats.acceptance_rate > 0.99, (temperature, result.stats)
