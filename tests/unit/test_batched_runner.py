"""BatchedRunner: ModelRunner's logits and sequence semantics over a slot KV pool, one ragged forward a batch."""

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from specmesh.errors import InvalidArgument, ResourceExhausted
from specmesh.runtime import Runner, RunnerSequence
from specmesh.runtime.batched import BatchedRunner, PrefillChunk
from specmesh.runtime.hf import ModelRunner
from specmesh.runtime.registry import build_runner
from specmesh.runtime.static import StaticCacheRunner, _can_pack
from tests.support.models import close_logits, full_logits, tiny_llama_mha, tiny_model, tiny_qwen3

MODELS = {
    "llama": lambda: tiny_model("llama", seed=5),
    "qwen2": lambda: tiny_model("qwen2", seed=6),
    # A shorter context than the configs' own, so that a runner sized by it allocates less.
    "llama-mha": lambda: tiny_llama_mha(max_position_embeddings=512),
    "qwen3": lambda: tiny_qwen3(max_position_embeddings=512),
}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model(request):
    return MODELS[request.param]()


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 9, 4, 17, 2, 11, 6, 3][:n]
    return [torch.randint(0, 127, (k,), generator=g).tolist() for k in lengths]


@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize(("batch", "packed"), [(1, None), (6, None), (6, True), (6, False)])
def test_ragged_batches_match_model_runner(arch, batch, packed):
    """Different cached lengths, different numbers of draft tokens, random rollbacks: same logits as
    ModelRunner (which batches them through the HF forward), and the same cached ids; with the weights as
    the runner chooses (tiny models: plain), all packed for oneDNN, and all plain."""
    m = MODELS[arch]()
    ref, run = ModelRunner(m), BatchedRunner(m, num_slots=8, packed=packed)
    assert run._dec.packed == (_can_pack(m.lm_head.weight) if packed is None else packed)
    if packed:  # every matrix, however small: the packed path itself is what is checked
        weights = [w for layer in run._dec.layers for w in (layer[2], layer[4], layer[11], layer[14])]
        assert all(isinstance(w, tuple) for w in weights)
    a = [ref.new_sequence(p) for p in prompts(batch)]
    b = [run.new_sequence(p) for p in prompts(batch)]
    for x, y in zip(a, b, strict=True):
        ref.prefill(x)
        run.prefill(y)
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        extra = [torch.randint(0, 127, ((i + step) % 5,), generator=g).tolist() for i in range(batch)]
        want = ref.forward(a, extra)
        got = run.forward(b, extra)
        for i in range(batch):
            close_logits(got[i], want[i])
            # Accept a varying prefix of the drafts plus the target's greedy token (rollback of the rest).
            k = (i + step) % (len(extra[i]) + 1)
            tokens = [*extra[i][:k], int(want[i][k].argmax())]
            a[i].commit(tokens)
            b[i].commit(tokens)
        assert [s.cached_ids for s in b] == [s.cached_ids for s in a]


def test_runner_protocol(model):
    run = BatchedRunner(model, num_slots=2)
    seq = run.new_sequence([1, 2, 3])
    assert isinstance(run, Runner) and isinstance(seq, RunnerSequence)
    assert run.vocab_size == 128 and run.device == torch.device("cpu")


def test_rollback_is_only_a_length(model):
    run = BatchedRunner(model, num_slots=2)
    pools = [t.data_ptr() for t in run._k + run._v]
    seq = run.new_sequence([5, 6, 7, 8])
    run.prefill(seq)
    run.forward([seq], [[9, 10, 11, 12]])
    assert seq.cached_ids == [5, 6, 7, 8, 9, 10, 11, 12]
    seq.commit([9, 40])  # 10, 11, 12 rejected; 40 is the recovered token
    assert run.longest_cached_prefix(seq) == 5
    got = run.forward([seq], [[41]])
    assert seq.cached_ids == [5, 6, 7, 8, 9, 40, 41]
    close_logits(got[0], full_logits(model, [5, 6, 7, 8, 9, 40, 41], 2))
    assert [t.data_ptr() for t in run._k + run._v] == pools  # written in place, never reallocated


def test_prefix_reuse_across_turns(model):
    run = BatchedRunner(model, num_slots=2)
    turn1 = [3, 1, 4, 1, 5, 9, 2, 6]
    seq = run.new_sequence(turn1)
    assert run.prefill(seq) == 0
    assert run.prefix_tokens_reused == 0
    seq.commit([run.forward([seq])[0][0].argmax().item()])
    turn2 = [*turn1[:6], 7, 7, 8]  # the next turn shares 6 tokens with what is cached
    seq.reset_tokens(turn2)
    assert run.longest_cached_prefix(turn2) == 6
    run.prefill(seq)
    assert run.prefix_tokens_reused == 6
    assert seq.cached_ids == turn2[:-1]
    close_logits(run.forward([seq])[0], full_logits(model, turn2, 1))


def test_chunked_prefill_equals_one_shot(model):
    run = BatchedRunner(model, num_slots=4)
    prompt = list(range(3, 40))
    one, chunked = run.new_sequence(prompt), run.new_sequence(prompt)
    assert run.prefill(one) == 0
    left = [run.prefill(chunked, max_tokens=5, count_reuse=first) for first in [True] + [False] * 7]
    assert left == [31, 26, 21, 16, 11, 6, 1, 0]
    assert chunked.cached_ids == one.cached_ids == prompt[:-1]
    assert run.prefix_tokens_reused == 0  # chunks are not reuse
    x, y = run.forward([one, chunked], [[7, 8], [7, 8]])
    close_logits(y, x)
    close_logits(x, full_logits(model, [*prompt, 7, 8], 3))


def test_prefill_chunk_and_decode_blocks_in_one_forward(model):
    """A step mixing decode blocks and a prefill chunk equals running them apart."""
    mixed, apart = BatchedRunner(model, num_slots=4), BatchedRunner(model, num_slots=4)
    ps = prompts(3, seed=4)
    long_prompt = list(range(10, 40))
    seqs = {}
    for name, run in (("mixed", mixed), ("apart", apart)):
        seqs[name] = [run.new_sequence(p) for p in ps] + [run.new_sequence(long_prompt)]
        for s in seqs[name][:3]:
            run.prefill(s)
    extra = [[1, 2], [], [3, 4, 5]]
    *decode, fresh = seqs["mixed"]
    out = mixed.step(decode, extra, prefill=[PrefillChunk(fresh, max_tokens=12)])
    assert out.prefill_left == [17] and fresh.cached_ids == long_prompt[:12]
    *decode2, fresh2 = seqs["apart"]
    want = apart.forward(decode2, extra)
    assert apart.prefill(fresh2, max_tokens=12) == 17
    for g, w in zip(out.logits, want, strict=True):
        close_logits(g, w)
    # The chunk can also ask for no logits while decode blocks ask for fewer rows than they feed.
    out = mixed.step(decode, extra, num_logits=[1, 0, 2], prefill=[(fresh, None, False)])
    assert [t.shape[0] for t in out.logits] == [1, 0, 2] and out.prefill_left == [0]
    assert fresh.cached_ids == long_prompt[:-1]
    close_logits(out.logits[2], want[2][-2:])
    close_logits(mixed.forward([fresh])[0], full_logits(model, long_prompt, 1))


def test_greedy_decoding_equals_generate(model):
    """30 greedy tokens for three prompts decoded together (one ragged forward a token) = HF generate."""
    run = BatchedRunner(model, num_slots=3)
    ps = [[5, 17, 3], [9, 9, 2, 44, 61, 7, 13], [100]]
    seqs = [run.new_sequence(p) for p in ps]
    for s in seqs:
        run.prefill(s)
    for _ in range(30):
        for s, logits in zip(seqs, run.forward(seqs), strict=True):
            s.commit([int(logits[-1].argmax())])
    for p, s in zip(ps, seqs, strict=True):
        ref = model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            do_sample=False,
            max_new_tokens=30,
            min_new_tokens=30,
            pad_token_id=0,
        )
        assert s.token_ids == ref[0].tolist()


def test_a_thousand_sequences_leak_no_slot(model):
    run = BatchedRunner(model, num_slots=4, max_seq_len=64)
    assert run.slot_bytes == 2 * 2 * 2 * 64 * 16 * 4  # K and V, 2 layers, 2 KV heads, 64 positions, D 16, fp32
    for i in range(1000):
        seq = run.new_sequence([i % 127, 1, 2])
        assert run.kv_bytes() == run.slot_bytes and run.free_slots == 3
        if i % 100 == 0:
            run.prefill(seq)
            run.forward([seq], [[3]])
        run.free(seq)
        run.free(seq)  # idempotent
    assert run.free_slots == run.num_slots == 4 and run.kv_bytes() == 0


# Measured in a fresh interpreter: in this one, memory that earlier tests freed (32 MiB blocks stay in
# glibc's heap once its mmap threshold has risen to them) can back the pool, resident or not, whatever
# prefault does.
_POOL_RSS = """
import sys
import torch
from specmesh.runtime.batched import BatchedRunner
from tests.support.models import tiny_model

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

model = tiny_model(sys.argv[1]).eval()
slots = 128 * 2**20 // BatchedRunner(model, num_slots=1, max_seq_len=256).slot_bytes
before = rss()
run = BatchedRunner(model, num_slots=slots, max_seq_len=256, prefault=sys.argv[2] == "True")
print(rss() - before, run.pool_bytes)
"""


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("prefault", [False, True])
def test_prefault_makes_the_pool_resident_at_start(arch, prefault):
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _POOL_RSS, arch, str(prefault)],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    grown, pool_bytes = map(int, out.stdout.split())
    assert pool_bytes >= 120 * 2**20
    if prefault:
        assert grown >= 0.9 * pool_bytes
    else:  # pages are taken only as slots are written
        assert grown < 0.25 * pool_bytes
    gc.collect()


def test_slot_exhaustion_and_reuse(model):
    run = BatchedRunner(model, num_slots=2)
    a, b = run.new_sequence([1, 2]), run.new_sequence([3, 4])
    with pytest.raises(ResourceExhausted):
        run.new_sequence([5])
    slot = a.slot
    run.free(a)
    c = run.new_sequence([6, 7, 8])  # gets a's slot; must not see a's keys/values
    assert c.slot == slot
    run.prefill(b)
    run.prefill(c)
    x, y = run.forward([b, c], [[9], []])
    close_logits(x, full_logits(model, [3, 4, 9], 2))
    close_logits(y, full_logits(model, [6, 7, 8], 1))
    with pytest.raises(InvalidArgument, match="freed"):
        run.forward([a])


def test_a_freed_slot_serves_its_prefix_to_a_new_sequence_of_its_scope_only(model):
    """A freed slot keeps its KV: a new sequence of the same scope whose prompt starts with it takes that
    slot and prefills only the rest, with the logits of a fresh forward; another scope never reads it. A
    prompt that matches no free slot takes the slot freed longest ago, so the recent prefixes stay."""
    run = BatchedRunner(model, num_slots=3)
    p = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    a = run.new_sequence(p, b"tenant-a")
    run.prefill(a)
    run.forward([a], [[7, 7]])  # drafts in the cache past the committed tokens
    a.commit([7])
    slot_a = a.slot
    run.free(a)
    assert (run.prefix_cache_query_tokens, run.prefix_cache_hit_tokens) == (len(p), 0)

    other = run.new_sequence(p, b"tenant-b")  # the same prompt in another scope: nothing reused
    assert other.cached_ids == [] and other.slot != slot_a
    run.free(other)

    turn = [*p[:6], 8, 8, 8]
    b = run.new_sequence(turn, b"tenant-a")
    assert b.slot == slot_a and b.cached_ids == p[:6] and run.prefix_cache_hit_tokens == 6
    run.prefill(b)
    assert b.cached_ids == turn[:-1]
    close_logits(run.forward([b])[0], full_logits(model, turn, 1))

    whole = [*p, 7, 7]  # everything the slot holds, drafts included: one token is still fed
    run.free(b)
    c = run.new_sequence(whole, b"tenant-a")
    assert c.slot == slot_a and c.cached_ids == turn[:6]  # b's prefix, what the slot holds now
    run.prefill(c)
    close_logits(run.forward([c])[0], full_logits(model, whole, 1))
    run.free(c)

    # LRU: three slots freed in order x, y, z; a prompt matching none takes x's, and y's prefix is still found
    x, y, z = (run.new_sequence([t, 2, 3, 4], b"") for t in (10, 11, 12))
    for s in (x, y, z):
        run.prefill(s)
    slots = [x.slot, y.slot, z.slot]
    for s in (x, y, z):
        run.free(s)
    assert run.new_sequence([13, 2, 3], b"").slot == slots[0]
    again = run.new_sequence([11, 2, 3, 4, 5], b"")
    assert again.slot == slots[1] and again.cached_ids == [11, 2, 3]


def test_common_prefix_is_the_leading_run_of_equal_ids():
    from specmesh.runtime.sequence import common_prefix

    def naive(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    g = torch.Generator().manual_seed(3)
    for _ in range(300):
        n, m = (int(v) for v in torch.randint(0, 40, (2,), generator=g))
        a = torch.randint(0, 3, (n,), generator=g).tolist()
        b = a[: int(torch.randint(0, n + 1, (1,), generator=g))] + torch.randint(0, 3, (m,), generator=g).tolist()
        assert common_prefix(a, b) == naive(a, b) == common_prefix(b, a)


def test_garbage_collected_sequence_returns_its_slot(model):
    run = BatchedRunner(model, num_slots=2)
    seq = run.new_sequence([1, 2, 3])
    run.prefill(seq)
    del seq
    gc.collect()
    assert run.free_slots == 2 and run.kv_bytes() == 0


def test_length_limit(model):
    run = BatchedRunner(model, num_slots=2, max_seq_len=16)
    assert run.slot_len == 16
    with pytest.raises(InvalidArgument, match="limit of 16 tokens"):
        run.new_sequence(list(range(17)))
    seq = run.new_sequence(list(range(14)))
    run.prefill(seq)
    run.forward([seq], [[1, 2]])  # exactly 16 positions
    with pytest.raises(InvalidArgument, match="limit of 16 tokens"):
        run.forward([seq], [[1, 2, 3]])
    assert BatchedRunner(model, num_slots=1, max_seq_len=10**6).slot_len == 1024  # capped by the model


def test_bad_requests_are_refused_before_anything_runs(model):
    run = BatchedRunner(model, num_slots=3)
    a, b = run.new_sequence([1, 2, 3]), run.new_sequence([4, 5])
    with pytest.raises(InvalidArgument, match="twice"):
        run.forward([a, a])
    with pytest.raises(InvalidArgument, match="vocabulary"):
        run.forward([a, b], [[1], [128]])
    with pytest.raises(InvalidArgument, match="num_logits"):
        run.forward([a], [[1]], num_logits=[3])
    other = BatchedRunner(model, num_slots=1).new_sequence([1])
    with pytest.raises(InvalidArgument, match="belong"):
        run.forward([a, other])
    assert a.cached_ids == [] and b.cached_ids == []
    close_logits(run.forward([a, b], [[6], []])[0], full_logits(model, [1, 2, 3, 6], 2))


def test_a_failed_forward_leaves_only_the_kept_prefix(model):
    """An error in the middle of the layers (some slots half written): no sequence counts the new tokens,
    and the next forward recomputes them."""
    run = BatchedRunner(model, num_slots=2)
    run.fused_step = False  # the layers below are the torch path's (the fused step fails before it writes)
    a, b = run.new_sequence([1, 2, 3, 4]), run.new_sequence([5, 6])
    run.prefill(a)
    run.prefill(b)
    run.forward([a, b], [[7, 8], [9]])
    a.commit([7])  # 8 rejected
    b.commit([9, 10])
    layers = run._dec.layers
    broken = list(layers[1])
    broken[-1] = lambda x: (_ for _ in ()).throw(RuntimeError("boom"))  # layer 1's activation raises
    run._dec.layers = [layers[0], tuple(broken), *layers[2:]]
    with pytest.raises(RuntimeError, match="boom"):
        run.forward([a, b], [[11, 12], [13]])
    assert a.cached_ids == [1, 2, 3, 4] and b.cached_ids == [5, 6, 9]
    run._dec.layers = layers
    x, y = run.forward([a, b], [[11, 12], [13]])
    close_logits(x, full_logits(model, [1, 2, 3, 4, 7, 11, 12], 3))
    close_logits(y, full_logits(model, [5, 6, 9, 10, 13], 2))


def test_longest_cached_prefix_over_open_sequences(model):
    run = BatchedRunner(model, num_slots=3)
    a, b = run.new_sequence([1, 2, 3, 4, 5]), run.new_sequence([1, 2, 9])
    run.prefill(a)
    run.prefill(b)
    assert run.longest_cached_prefix([1, 2, 3, 7]) == 3
    assert run.longest_cached_prefix([1, 2, 9, 9]) == 2  # b caches only [1, 2]: its last token is fed next
    assert run.longest_cached_prefix([8]) == 0
    run.free(a)
    assert run.longest_cached_prefix([1, 2, 3, 7]) == 2


def test_unsupported_models_are_refused():
    torch.manual_seed(4)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    assert not BatchedRunner.supports(gpt2)
    with pytest.raises(ValueError, match="ModelRunner"):
        BatchedRunner(gpt2, num_slots=1)
    assert isinstance(build_runner(gpt2, "auto"), ModelRunner)
    with pytest.raises(ValueError, match="has no decoder for GPT2LMHeadModel"):
        build_runner(gpt2, "paged")
    with pytest.raises(ValueError, match="runner kind must be one of"):
        build_runner(gpt2, "nope")


def test_the_registry_builds_every_kind_behind_one_protocol(model):
    """What callers ask instead of the class: whether chunks ride in the pass, the context, the KV account."""
    batched = build_runner(model, "auto", num_slots=2, max_seq_len=64)
    assert isinstance(batched, BatchedRunner) and isinstance(batched, Runner) and batched.chunked_prefill
    assert batched.context_limit() == 64 and batched.context_limit(32) == 32
    account = batched.kv_account()
    assert account.pool_bytes == batched.pool_bytes and account.max_sequences == 2
    seq = batched.new_sequence([1, 2, 3])
    assert account.held(seq) == batched.slot_bytes == account.needed(None, 5) and account.needed(seq, 50) == 0
    batched.free(seq)
    assert account.held(seq) == 0 and account.needed(seq, 5) == batched.slot_bytes
    for kind, cls in [("hf", ModelRunner), ("static", StaticCacheRunner)]:
        runner = build_runner(model, kind)
        assert isinstance(runner, cls) and isinstance(runner, Runner) and not runner.chunked_prefill
        account = runner.kv_account(bytes_per_token=10)
        assert account.pool_bytes is None and account.max_sequences is None and account.needed(None, 3) == 30
        assert runner.context_limit() == 1024 and runner.context_limit(100) == 100
        runner.free(runner.new_sequence([1]))  # nothing to give back: a no-op


DEMO_TARGET = Path(__file__).resolve().parents[2] / "models" / "demo" / "target"


def test_the_probe_passes_the_demo_target_in_bf16_and_still_catches_a_layout_mistake():
    """In bf16 the decoder's masked attention and HF's causal call round differently (about 0.5% of the
    logits' scale for the demo target), which a fp32 bound refused: a CUDA service failed to start. A rotary
    turned the wrong way must still be refused."""
    from specmesh.models import load_model

    model, _ = load_model(DEMO_TARGET, "cpu", dtype=torch.bfloat16)
    runner = BatchedRunner(model, num_slots=2, max_seq_len=32)  # raises if the probe disagrees
    assert StaticCacheRunner(model).uses_fast_path
    runner._dec.sin.neg_()
    try:
        assert not runner._matches_hf()
    finally:
        runner._dec.sin.neg_()


@pytest.mark.parametrize("make", [lambda: tiny_model("llama", vocab=97, seed=0), tiny_llama_mha, tiny_qwen3])
def test_padded_attention_gives_the_per_segment_logits(make):
    """CUDA's layout (decode blocks in one padded SDPA call per layer) against the per-segment calls, on
    ragged batches with a prefill chunk beside the blocks, rollback and a sequence that leaves and returns;
    each runner is also checked against the HF forward when built."""
    model = make()
    outs = []
    for padded in (False, True):
        r = BatchedRunner(model, num_slots=4, max_seq_len=64, padded_attention=padded)
        a, b = r.new_sequence([1, 2, 3, 4, 5, 6, 7]), r.new_sequence([9, 8, 7])
        c = r.new_sequence(list(range(10, 50)))
        r.prefill(a)
        r.prefill(b)
        got = list(r.step([a, b], [[11, 12, 13], [14]], prefill=[PrefillChunk(c, 20)]).logits)
        a.commit([11])  # 12 and 13 rejected
        got += r.forward([a, b, c], [[21, 22], [], [5, 6, 7, 8]])
        got += r.forward([c, a], [[1], [3, 3, 3, 3, 3]])
        outs.append(got)
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
