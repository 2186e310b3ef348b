"""Structured output (specmesh.structured): grammar masks per verified position, rolled back after a round,
and the output law of speculation exactly the masked target's."""

import json

import llguidance
import pytest
import torch

from specmesh.errors import InvalidArgument
from specmesh.rejection import RejectionInput, RejectionSampler
from specmesh.sampling import (
    BatchSamplingParams,
    LogitsContext,
    SamplingParams,
    StructuredSpec,
    allowed_from_bitmask,
    apply_context_processing,
    process_logits,
)
from specmesh.structured import GrammarCompiler, grammar_text
from tests.support.laws import assert_first_two_tokens_law

TOKENS = [b"<eos>", b"a", b"b", b"c", b"ab", b"ba", b"{", b"}"]
V = len(TOKENS)


class ByteTokenizer:
    """A tiny vocabulary for llguidance: token 0 is EOS, the rest are byte strings."""

    eos_token_id = 0
    bos_token_id = None
    tokens = TOKENS
    special_token_ids = (0,)

    def __call__(self, s):
        data = s if isinstance(s, bytes) else s.encode()
        return [self.tokens.index(bytes([c])) for c in data]


@pytest.fixture(scope="module")
def compiler():
    return GrammarCompiler(llguidance.TokenizerWrapper(ByteTokenizer()), V, [0])


REGEX = StructuredSpec("regex", "(ab|ba)c*", "guided_regex")


def allowed(compiler, spec, output, drafts=(), rows=1):
    g = compiler.grammar(spec)
    return allowed_from_bitmask(g.bitmask(output, drafts, rows), V)


def test_masks_follow_the_drafts_and_roll_back(compiler):
    g = compiler.grammar(REGEX)
    rows = allowed_from_bitmask(g.bitmask([], [1, 2, 3], 4), V)
    assert rows[0].nonzero().flatten().tolist() == [1, 2, 4, 5]  # a, b, ab, ba
    assert rows[1].nonzero().flatten().tolist() == [2]  # after a: b
    assert rows[2].nonzero().flatten().tolist() == [0, 3]  # after ab: EOS or c
    assert rows[3].nonzero().flatten().tolist() == [0, 3]
    # After the round the matcher is back at the committed output: asked again, the same answer as fresh.
    again = allowed_from_bitmask(g.bitmask([4], [3], 2), V)
    assert torch.equal(again, allowed(compiler, REGEX, [4], [3], 2))
    assert torch.equal(allowed_from_bitmask(g.bitmask([], (), 1), V)[0], rows[0])
    # A refused draft (c first): rows after it are never read, and nothing is masked there.
    bad = allowed_from_bitmask(g.bitmask([], [3, 1], 3), V)
    assert torch.equal(bad[0], rows[0]) and bool(bad[1:].all())
    assert torch.equal(allowed_from_bitmask(g.bitmask([5], (), 1), V)[0], allowed(compiler, REGEX, [5])[0])


def test_choice_and_json_object(compiler):
    choice = StructuredSpec("choice", json.dumps(["ab", "c{"]), "guided_choice")
    assert allowed(compiler, choice, [])[0].nonzero().flatten().tolist() == [1, 3, 4]
    assert allowed(compiler, choice, [3])[0].nonzero().flatten().tolist() == [6]
    obj = StructuredSpec("json_object", "", "response_format")
    assert allowed(compiler, obj, [])[0].nonzero().flatten().tolist() == [6]


@pytest.mark.parametrize(
    "spec, words",
    [
        (StructuredSpec("json_schema", "{not json", "response_format"), "response_format: not valid JSON"),
        (StructuredSpec("json_schema", '{"type": "string", "format": "no-such"}', "guided_json"), "guided_json"),
        (StructuredSpec("regex", "(a", "guided_regex"), "guided_regex"),
        (StructuredSpec("choice", "[]", "guided_choice"), "guided_choice"),
        (StructuredSpec("choice", '["a", 3]', "guided_choice"), "guided_choice"),
    ],
)
def test_bad_specs_name_their_field(spec, words):
    with pytest.raises(InvalidArgument, match=words):
        grammar_text(spec)


PARAMS = SamplingParams(temperature=1.0, max_tokens=8, structured=REGEX)


def test_speculation_samples_the_masked_target_law(compiler, n: int = 20_000, broken: bool = False):
    """One round, K = 2, drafts from a q over the whole vocabulary (grammar-refused tokens included): the
    joint law of the first two emitted tokens is the masked target's, each position masked under the tokens
    before it (chi-square), and no emitted token is ever outside the grammar."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(3, V, generator=g) * 1.5
    tokens, start = [6, 7], 2  # prompt "{}", no output yet
    grammar = compiler.grammar(REGEX)
    ctx = LogitsContext(tokens, start, (), frozenset([0]), grammar)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).T.tolist()
    q_ids = torch.arange(V).expand(2, V)
    if broken:  # every row masked under the committed context alone: the drafts before it not counted
        ctx = LogitsContext(tokens, start, (), frozenset([0]), None)
        mask0 = allowed(compiler, REGEX, [])[0]
        logits = logits.masked_fill(~mask0, float("-inf"))
    blocks = [RejectionInput.of(d, PARAMS, q_ids, q, context=ctx) for d in drafts]
    out = RejectionSampler("torch", seed=5)(logits.repeat(n, 1), blocks)

    def law(row, committed):
        fresh = compiler.grammar(REGEX)
        c = LogitsContext(committed, start, (), frozenset([0]), fresh)
        x = apply_context_processing(logits[row][None], [PARAMS], [c])
        return process_logits(x, BatchSamplingParams.from_params([PARAMS], [1]))[0].double()

    p0 = law(0, tokens)
    assert p0[[0, 3, 6, 7]].sum() == 0  # the grammar's first token is a, b, ab or ba
    assert_first_two_tokens_law(out, p0, q[0], lambda a: law(1, tokens + [a]))


def test_a_mask_that_ignores_the_drafts_fails_the_same_check(compiler):
    with pytest.raises(AssertionError):
        test_speculation_samples_the_masked_target_law(compiler, 5_000, broken=True)


def test_masks_equal_a_fresh_matchers_along_random_rounds(compiler):
    """The stateful grammar (rolled back between rounds, EOS and refused tokens among the drafts) answers
    every row that can be read exactly as a fresh matcher fed the same tokens does."""
    import random

    rng = random.Random(0)
    spec = StructuredSpec("json_schema", json.dumps({"type": "array", "items": {"enum": ["ab", "c"]}}))
    tokens = [*TOKENS, b"[", b"]", b'"', b","]
    tokenizer = ByteTokenizer()
    tokenizer.tokens = tokens
    big = GrammarCompiler(llguidance.TokenizerWrapper(tokenizer), len(tokens), [0])
    g = big.grammar(spec)

    def fresh_row(seq):
        return allowed_from_bitmask(big.grammar(spec).bitmask(seq, (), 1), len(tokens))[0]

    for _ in range(60):
        out: list[int] = []
        for _ in range(12):
            drafts = [rng.randrange(len(tokens)) for _ in range(rng.randint(0, 4))]
            got = allowed_from_bitmask(g.bitmask(out, drafts, len(drafts) + 1), len(tokens))
            for j in range(len(drafts) + 1):
                assert torch.equal(got[j], fresh_row(out + drafts[:j]))
                if j < len(drafts) and (not got[j][drafts[j]] or drafts[j] == 0):
                    break  # the rows after a refused token or an EOS are never read
            kept = 0
            while kept < len(drafts) and got[kept][drafts[kept]] and rng.random() < 0.6:
                kept += 1
            nxt = rng.choice(got[kept].nonzero().flatten().tolist())
            out = out + drafts[:kept] + [nxt]
            if 0 in out:
                break
