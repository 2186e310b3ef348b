"""StaticCacheRunner: same logits and cache semantics as ModelRunner, lossless as the engine's draft runner."""

import asyncio

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from specmesh.drafters import DraftBatcher, ModelDrafter
from specmesh.engine import SpeculativeEngine
from specmesh.errors import InvalidArgument
from specmesh.rejection import RejectionSampler
from specmesh.runtime import PrefillChunk
from specmesh.runtime.hf import ModelRunner
from specmesh.runtime.registry import build_runner
from specmesh.runtime.static import StaticCacheRunner
from specmesh.sampling import SamplingParams
from tests.support.models import noisy_copy, tiny_model, tiny_qwen3

ATOL = 1e-4


def gpt2_tiny():
    torch.manual_seed(4)
    return GPT2LMHeadModel(
        GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=512, bos_token_id=127, eos_token_id=127)
    ).eval()


class Pair:
    """The same script on a ModelRunner and a StaticCacheRunner sequence; every forward is compared."""

    def __init__(self, model, prompt, **kw):
        self.ref, self.fast = ModelRunner(model), StaticCacheRunner(model, **kw)
        self.a, self.b = self.ref.new_sequence(prompt), self.fast.new_sequence(prompt)

    def each(self, fn):
        fn(self.a)
        fn(self.b)

    def prefill(self):
        self.ref.prefill(self.a)
        self.fast.prefill(self.b)
        self.check_state()

    def forward(self, extra=None):
        x = self.ref.forward([self.a], None if extra is None else [extra])[0]
        y = self.fast.forward([self.b], None if extra is None else [extra])[0]
        assert y.dtype == torch.float32 and y.shape == x.shape == (len(extra or []) + 1, self.ref.vocab_size)
        torch.testing.assert_close(y, x, atol=ATOL, rtol=0)
        self.check_state()
        return x

    def check_state(self):
        assert self.b.token_ids == self.a.token_ids
        assert self.b.cached_ids == self.a.cached_ids and self.b.num_cached == self.a.num_cached
        assert self.b.cache.length == self.b.num_cached
        assert self.fast.prefix_tokens_reused == self.ref.prefix_tokens_reused


MODELS = {
    "llama": lambda: tiny_model("llama", seed=5),
    "qwen2": lambda: tiny_model("qwen2", seed=6),
    "qwen3": tiny_qwen3,
    "gpt2 (HF path)": gpt2_tiny,
}


# GPT-2 has no hand-written decoder: only its HF-forward path exists.
CASES = [
    pytest.param(arch, fp, id=f"{arch}-{'fast' if fp is None else 'hf-forward'}")
    for arch in MODELS
    for fp in (None, False)
    if not (arch.startswith("gpt2") and fp is None)
]


@pytest.mark.parametrize("arch,fast_path", CASES)
def test_logits_and_cache_match_model_runner(arch, fast_path):
    model = MODELS[arch]()
    p = Pair(model, [3, 1, 4, 1, 5, 9, 2, 6], initial_capacity=8, fast_path=fast_path)
    assert p.fast.uses_fast_path == (fast_path is None)
    p.prefill()
    g = torch.Generator().manual_seed(0)
    for step in range(12):
        k = step % 4
        drafts = torch.randint(0, 127, (k,), generator=g).tolist()
        logits = p.forward(drafts)  # verification-style: extra tokens fed after the committed ones
        accept = step % (k + 1)  # commit a prefix of the drafts, then a correction: the rest rolls back
        p.each(lambda s: s.commit(drafts[:accept] + [int(logits[accept].argmax())]))
        p.forward()  # drafter-style: one token at a time, appended and popped by hand
        p.each(lambda s: s.token_ids.append(7))
        p.forward()
        p.each(lambda s: s.token_ids.pop())
    assert p.b.cache.layers[0].capacity > 8  # the preallocated buffers grew on the way
    # a new turn sharing a prefix: only the prefix is reused, the rest recomputed
    p.each(lambda s: s.reset_tokens(s.token_ids[:20] + [11, 12, 13]))
    p.prefill()
    assert p.fast.prefix_tokens_reused > 0
    p.forward([1, 2])
    p.each(lambda s: s.reset_tokens([3, 1, 4]))  # shorter than what is cached
    p.forward()


def test_every_list_mutation_is_seen():
    """token_ids changed anywhere (not only at the tail) invalidates exactly what ModelRunner invalidates."""
    p = Pair(tiny_model("llama", seed=7), list(range(1, 30)), initial_capacity=16)
    p.prefill()
    p.forward([40, 41])
    mutations = [
        lambda t: t.__setitem__(5, 99),
        lambda t: t.insert(3, 50),
        lambda t: t.insert(-2, 51),
        lambda t: t.pop(0),
        lambda t: t.remove(50),
        lambda t: t.__delitem__(slice(10, 12)),
        lambda t: t.__setitem__(slice(-4, -2), [60, 61, 62]),
        lambda t: t.extend([70, 71]),
        lambda t: t.__iadd__([72]),
        lambda t: t.reverse(),
        lambda t: t.sort(),
        lambda t: t.__delitem__(-1),
        lambda t: t.__setitem__(-1, 80),
        lambda t: t.__setitem__(slice(None, None, -3), t[::-3]),
    ]
    for mutate in mutations:
        p.each(lambda s: mutate(s.token_ids))
        p.forward([1])
        p.forward()
    p.each(lambda s: setattr(s, "token_ids", [9] + list(s.token_ids[1:])))  # replaced wholesale
    p.forward()
    p.each(lambda s: s.token_ids.clear() or s.token_ids.extend([2, 3]))
    p.forward()


def test_growth_past_the_preallocated_length():
    model = tiny_model("qwen2", seed=8)
    p = Pair(model, [1, 2, 3], initial_capacity=4)
    p.prefill()
    for i in range(70):  # 1..4 tokens per step, past 4 -> 8 -> ... -> 256
        p.each(lambda s: s.commit([(i * 7 + j) % 120 for j in range(1 + i % 4)]))
        p.forward([5] if i % 3 else None)
    assert p.b.num_cached > 128 and p.b.cache.layers[0].capacity >= p.b.num_cached
    assert p.fast.uses_fast_path
    # one long feed that more than doubles the capacity at once
    p.each(lambda s: s.commit(list(range(1, 120)) * 3))
    p.forward([2, 3])


def test_speculative_greedy_with_static_draft_equals_target_greedy(tiny_pair):
    target, draft = tiny_pair
    fast = SpeculativeEngine(ModelRunner(target), StaticCacheRunner(draft), RejectionSampler("torch"))
    slow = SpeculativeEngine(ModelRunner(target), ModelRunner(draft), RejectionSampler("torch"))
    assert fast.draft.uses_fast_path
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    accepted = drafted = 0
    for _ in range(4):
        prompt = torch.randint(0, 127, (int(torch.randint(2, 20, (1,), generator=g)),), generator=g).tolist()
        baseline = fast.generate(prompt, params, num_speculative_tokens=0)
        spec = fast.generate(prompt, params, num_speculative_tokens=4)
        assert spec.token_ids == baseline.token_ids
        # the same drafts as with ModelRunner as the draft runner: same acceptance, round for round
        ref = slow.generate(prompt, params, num_speculative_tokens=4)
        assert (spec.stats.accepted, spec.stats.rounds) == (ref.stats.accepted, ref.stats.rounds)
        accepted, drafted = accepted + spec.stats.accepted, drafted + spec.stats.drafted
    assert 0 < accepted < drafted  # accept and reject paths both exercised


def test_model_drafter_sampling_and_new_turn():
    """ModelDrafter unchanged on top: seeded sampled drafts and their q equal ModelRunner's; turns reuse."""
    model = noisy_copy(tiny_model("llama", seed=9), 0.0)
    drafters = [ModelDrafter(DraftBatcher(ModelRunner(model))), ModelDrafter(DraftBatcher(StaticCacheRunner(model)))]
    params = SamplingParams(temperature=0.8, top_k=20, seed=3)

    async def run():
        for d in drafters:
            await d.start([1, 2, 3, 4], params)
        for _turn in range(2):
            for rnd in range(6):
                a, b = [await d.propose(3) for d in drafters]
                assert a.token_ids == b.token_ids
                torch.testing.assert_close(b.q_ids, a.q_ids)
                torch.testing.assert_close(b.q_probs, a.q_probs, atol=1e-5, rtol=0)
                for d in drafters:
                    d.commit(a.token_ids[: rnd % 4] + [rnd])
            prompt = drafters[0].state.seq.token_ids[:10] + [9, 9]
            for d in drafters:
                await d.start(prompt, params)  # a new turn: the cached common prefix is reused

    asyncio.run(run())
    reused = [d.batcher.runner.prefix_tokens_reused for d in drafters]
    assert reused[1] == reused[0] > 0


def test_in_place_weight_updates_are_seen():
    model = tiny_model("llama", seed=10)
    p = Pair(model, [1, 2, 3, 4])
    p.prefill()
    p.forward([5])
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
        model.model.layers[1].mlp.down_proj.weight.add_(0.01)
    p.each(lambda s: s.reset_tokens([1, 2]))  # recompute from the (changed) weights
    p.forward([3])


def test_refusals():
    runner = StaticCacheRunner(tiny_model("llama"))
    with pytest.raises(ValueError):
        runner.new_sequence([])
    with pytest.raises(ValueError):
        StaticCacheRunner(gpt2_tiny(), fast_path=True)
    seq = runner.new_sequence([1, 2, 3])
    with pytest.raises(IndexError):
        runner.forward([seq], [[10**6]])
    assert seq.num_cached == seq.cache.length == 0  # a failed forward leaves the cache as it was
    runner.forward([seq], [[4]])
    assert seq.cached_ids == [1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["hf", "static"])
def test_step_without_a_ragged_pass_is_prefill_then_forward(kind):
    """The runners without a ragged pass step by prefilling each chunk in a pass of its own, then running
    the decode forward: the same logits and caches as calling prefill and forward, each chunk's reuse, and
    the positions it computed."""
    model = tiny_model("llama", seed=3)
    stepped, called = build_runner(model, kind), build_runner(model, kind)
    assert not stepped.chunked_prefill
    prompt, opening = list(range(1, 12)), list(range(20, 37))
    a, b = stepped.new_sequence(prompt), stepped.new_sequence(opening)
    c, d = called.new_sequence(prompt), called.new_sequence(opening)
    stepped.prefill(a)
    called.prefill(c)
    out = stepped.step([a], [[5, 6]], num_logits=[2], prefill=[PrefillChunk(b, max_tokens=10)])
    left = called.prefill(d, max_tokens=10)
    want = called.forward([c], [[5, 6]])[0]
    assert out.prefill_left == [left] == [6] and out.prefill_reused == [0]
    assert out.tokens == 10 + 3  # the chunk, then the last prompt token and two extras
    torch.testing.assert_close(out.logits[0], want[1:])  # the last two of three rows
    assert a.cached_ids == c.cached_ids and b.cached_ids == d.cached_ids
    out = stepped.step([], prefill=[(b, None, False)])  # the rest of the chunk; a tuple is a chunk too
    assert out.logits == [] and out.prefill_left == [0] and out.prefill_reused == [0] and out.tokens == 6
    a.reset_tokens([*prompt, 5, 9, 10])  # a new turn: [*prompt, 5] is cached
    before = stepped.prefix_tokens_reused
    out = stepped.step([], prefill=[PrefillChunk(a)])
    assert out.prefill_reused == [12] and stepped.prefix_tokens_reused == before + 12 and out.tokens == 1
    with pytest.raises(InvalidArgument, match="num_logits"):
        stepped.step([a], [[1]], num_logits=[3])
    with pytest.raises(InvalidArgument, match="extra"):
        stepped.step([a], [[1], [2]])
