"""PagedRunner: BatchedRunner's logits and sequence semantics with the KV in blocks (prefix sharing by scope,
sequences of several physical runs, out of blocks, freeing)."""

import gc
import itertools

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from specmesh.errors import ResourceExhausted
from specmesh.runtime import PrefillChunk, Runner
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.blocks import OutOfBlocks, scope_of
from specmesh.runtime.paged import PagedRunner
from specmesh.runtime.registry import build_runner
from tests.support.models import ROOT, close_logits, full_logits, tiny_llama_mha, tiny_model, tiny_qwen3

MODELS = {
    "llama-gqa": lambda: tiny_model("llama", seed=5),
    "qwen2-gqa": lambda: tiny_model("qwen2", seed=6),
    "llama-mha": lambda: tiny_llama_mha(max_position_embeddings=512),
    "qwen3": lambda: tiny_qwen3(max_position_embeddings=512),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.fixture(scope="module")
def gqa():
    return MODELS["llama-gqa"]()


def ids_of(n: int, seed: int = 0, vocab: int = 127) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# How a sequence of several runs attends: runs merged by log-sum-exp (CPU), gathered, the block-table
# Triton kernel (CUDA's path; here in the interpreter, which the suite's plugin turns on), or the CPU
# block-table kernel (the CPU's default for decode steps and verify blocks; prefill chunks by SDPA).
ATTEND = ["merge", "gather", "kernel", "cpu"]


def paged(model, num_blocks: int, block_size: int, attend: str, **kw) -> PagedRunner:
    return PagedRunner(model, num_blocks, block_size, block_kernel=attend == "kernel", cpu_kernel=attend == "cpu", **kw)


def attending(r: PagedRunner, attend: str) -> PagedRunner:
    r.merge_runs = attend == "merge" and r.merge_runs
    r.gather_max_tokens = 0  # short sequences: merge wherever the runs allow
    return r


@pytest.mark.parametrize("attend", ATTEND)
def test_prefill_chunks_drafts_and_rollbacks_match_hf(model, attend):
    """Chunked prefill, decode blocks with drafts, a rollback inside a block and one across a block
    boundary: every row as the HF forward over the whole sequence (GQA and not; runs merged, gathered or
    through the kernel)."""
    r = attending(paged(model, 32, 4, attend), attend)
    assert r.block_kernel == (attend == "kernel") and r.cpu_kernel == (attend == "cpu")  # the probe passed with it
    ids = ids_of(40, seed=1)
    seq = r.new_sequence(ids[:11])
    assert r.prefill(seq, max_tokens=3) == 7 and r.prefill(seq, max_tokens=4) == 3 and r.prefill(seq) == 0
    assert seq.cached_ids == ids[:10]
    got = r.forward([seq], [ids[11:14]])[0]
    close_logits(got, full_logits(model, ids[:14], 4))
    seq.commit(ids[11:12])  # positions 12, 13 rolled back inside block 3
    got = r.forward([seq], [ids[20:25]])[0]
    close_logits(got, full_logits(model, ids[:12] + ids[20:25], 6))
    assert seq.cached_ids == ids[:12] + ids[20:25] and len(seq.table.blocks) == 5
    seq.commit(ids[20:21])  # block 4 (positions 16..) is given back: the rollback crosses a boundary
    assert r.forward([seq], [[]])[0].shape[0] == 1
    assert len(seq.table.blocks) == 4 and seq.table.num_tokens == 13
    close_logits(r.forward([seq], [ids[30:33]])[0], full_logits(model, [*ids[:12], ids[20], *ids[30:33]], 4))


def test_forward_batch_and_step_with_prefill_chunks(gqa):
    """Several sequences and a prefill chunk in one pass: each as HF; a chunk asks for no logits."""
    r = PagedRunner(gqa, 64, 4)
    prompts = [ids_of(n, seed=n) for n in (1, 9, 6, 17)]
    seqs = [r.new_sequence(p) for p in prompts]
    extra = [ids_of(k, seed=50 + k) for k in (0, 3, 1, 4)]
    late = r.new_sequence(ids_of(13, seed=99))
    res = r.step(seqs, extra, prefill=[PrefillChunk(late, 5)])
    assert res.prefill_left == [7] and res.tokens == sum(len(p) + len(e) for p, e in zip(prompts, extra)) + 5
    for seq, p, e, got in zip(seqs, prompts, extra, res.logits, strict=True):
        close_logits(got, full_logits(gqa, p + e, len(e) + 1))
    close_logits(r.forward([late])[0], full_logits(gqa, late.token_ids, 1))


def test_shared_prefix_computes_only_the_suffix_and_scope_isolates(gqa):
    bs = 4
    r = PagedRunner(gqa, 64, bs)
    prompt = ids_of(11, seed=3)  # two full blocks and a partial one
    a = r.new_sequence(prompt)
    close_logits(r.forward([a])[0], full_logits(gqa, prompt, 1))
    assert r.prefix_cache_hit_tokens == 0 and r.pool.num_shared == 0
    b_ids = [*prompt[:9], 5, 6, 7]
    b = r.new_sequence(b_ids)
    assert r.prefix_cache_hit_tokens == 2 * bs and b.cached_ids == prompt[: 2 * bs]
    assert r.pool.num_shared == 2 and b.table.blocks[:2] == a.table.blocks[:2]
    res = r.step([b])
    assert res.tokens == len(b_ids) - 2 * bs  # only the suffix is computed
    close_logits(res.logits[0], full_logits(gqa, b_ids, 1))
    assert len(b.table.runs()) >= 2  # its own block lies past a's
    # Another tenant's scope finds nothing, though the ids are the same.
    c = r.new_sequence(prompt, scope=scope_of("other"))
    assert r.prefix_cache_hit_tokens == 2 * bs and c.cached_ids == []
    close_logits(r.forward([c])[0], full_logits(gqa, prompt, 1))
    # Freed, the prefix stays cached for a later sequence of the same scope.
    r.free(a)
    r.free(b)
    d = r.new_sequence(prompt + [1])
    assert d.cached_ids == prompt[:8] and r.prefix_cache_hit_tokens == 4 * bs
    close_logits(r.forward([d])[0], full_logits(gqa, prompt + [1], 1))


def test_drafts_are_cached_but_not_registered(gqa):
    r = PagedRunner(gqa, 32, 4)
    ids = ids_of(20, seed=4)
    seq = r.new_sequence(ids[:3])
    r.forward([seq], [ids[3:9]])  # positions 0..8: block 0 holds 3 committed ids and a draft
    assert seq.table.num_tokens == 9
    assert all(r.pool.hash_of(b) is None for b in seq.table.blocks)
    seq.commit(ids[3:8])
    r.forward([seq], [[]])  # block 0 and 1 now hold committed ids only
    assert [r.pool.hash_of(b) is not None for b in seq.table.blocks] == [True, True]


def squat(r: PagedRunner, seq) -> list[int]:
    """Take the block right after the sequence's last one, so its next block lands elsewhere."""
    return r.pool.allocate(1, after=seq.table.blocks[-1])


@pytest.mark.parametrize("attend", ATTEND)
def test_fragmented_sequence_equals_one_run(model, attend):
    ids = ids_of(30, seed=7)
    one = PagedRunner(model, 64, 2, check=False)
    frag = attending(paged(model, 64, 2, attend, check=False), attend)
    a, b = one.new_sequence(ids[:3]), frag.new_sequence(ids[:3])
    for step in range(8):
        if b.table.blocks and step % 2 == 0:
            squat(frag, b)
        n = len(a.token_ids)
        la, lb = one.forward([a], [ids[n : n + 2]])[0], frag.forward([b], [ids[n : n + 2]])[0]
        close_logits(lb, la)
        close_logits(lb, full_logits(model, ids[: n + 2], 3))
        a.commit(ids[n : n + 1 + step % 2])
        b.commit(ids[n : n + 1 + step % 2])
    assert len(a.table.runs()) == 1 and len(b.table.runs()) >= 3


def test_out_of_blocks_leaves_sequences_intact(gqa):
    r = PagedRunner(gqa, 6, 4)
    ids = ids_of(30, seed=8)
    a, b = r.new_sequence(ids[:9]), r.new_sequence(ids[10:17])
    r.forward([a, b])  # a: 3 blocks, b: 2
    a.commit([ids[9]])
    b.commit([ids[17]])
    before = [(list(s.cached_ids), list(s.table.blocks), s.table.num_tokens) for s in (a, b)]
    used = r.pool.num_used
    with pytest.raises(OutOfBlocks) as e:
        r.forward([a, b], [ids[20:25], ids[20:22]])  # a needs 2 more, b 0: 1 free
    assert isinstance(e.value, ResourceExhausted)
    assert [(s.cached_ids, s.table.blocks, s.table.num_tokens) for s in (a, b)] == before
    assert r.pool.num_used == used
    r.free(b)
    close_logits(r.forward([a], [ids[20:25]])[0], full_logits(gqa, ids[:10] + ids[20:25], 6))


def test_free_returns_blocks_and_accounts(gqa):
    r = PagedRunner(gqa, 16, 4)
    acct = r.kv_account()
    assert acct.max_sequences is None and acct.pool_bytes == 16 * r.block_bytes == r.pool_bytes
    seq = r.new_sequence(ids_of(10, seed=9))
    blocks = r.blocks
    assert blocks is not None and blocks.block_size == 4 and blocks.num_blocks == 16
    # bytes are never reserved up front (a scheduler admits by blocks); the blocks a pass needs are counted
    assert acct.held(seq) == 0 and acct.needed(seq, 10) == acct.needed(None, 17) == 0
    assert blocks.cached(seq) == 0 and blocks.needed(seq, 10) == 3 and blocks.held(seq) == 0
    r.forward([seq])
    assert r.pool.num_used == 3 and acct.held(seq) == 3 * r.block_bytes and blocks.held(seq) == 3
    assert blocks.cached(seq) == 9 and blocks.needed(seq, 12) == 0 and blocks.needed(seq, 13) == 1
    free = blocks.free_blocks()
    assert blocks.preempt(seq) == 3 and blocks.free_blocks() == free + 3 and blocks.held(seq) == 0
    assert seq.cached_ids == [] and blocks.cached(seq) == 8  # its two full blocks come back from the cache
    r.forward([seq])
    r.free(seq)
    r.free(seq)  # idempotent
    assert r.pool.num_used == 0 and r.pool.num_free == 16 and r.pool.num_cached == 2  # the two full blocks stay cached
    assert acct.held(seq) == 0 and r.pool.usage == 0.0
    other = r.new_sequence(ids_of(5, seed=10))
    r.forward([other])
    del other
    gc.collect()
    assert r.pool.num_used == 0
    assert r.context_limit() == min(gqa.config.max_position_embeddings, 64) and r.context_limit(10) == 10


def test_registry_builds_paged(gqa):
    r = build_runner(gqa, "paged", num_blocks=8, block_size=8, max_seq_len=32)
    assert isinstance(r, PagedRunner) and isinstance(r, Runner)
    assert (r.pool.num_blocks, r.block_size, r.context_limit()) == (8, 8, 32) and r.chunked_prefill
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    with pytest.raises(ValueError, match="'paged' has no decoder for GPT2LMHeadModel"):
        build_runner(gpt2, "paged", num_blocks=8)


def test_a_bfloat16_cache_takes_half_the_bytes_and_is_refused_where_it_cannot_serve(gqa):
    """`kv_cache_dtype=torch.bfloat16` under a float32 model on a CPU: pools of half the bytes (the same budget
    holds twice the blocks), the HF probe passed within bfloat16's bound, prefix sharing as in float32; any
    other pairing is refused by name."""
    half, full = PagedRunner(gqa, 32, 4, kv_cache_dtype=torch.bfloat16), PagedRunner(gqa, 32, 4)
    assert half._k[0].dtype == torch.bfloat16 and half.cpu_kernel  # the probe served the kernels with it
    assert 2 * half.block_bytes == full.block_bytes
    assert 2 * half.kv_account().pool_bytes == full.kv_account().pool_bytes
    prompt = ids_of(11, seed=12)
    a = half.new_sequence(prompt)
    first = half.forward([a])[0]
    b = half.new_sequence(prompt)  # two full blocks from a's: only the rest is computed
    res = half.step([b])
    assert half.prefix_cache_hit_tokens == 8 and res.tokens == 3
    torch.testing.assert_close(res.logits[0], first, atol=1e-4 * max(1.0, float(first.abs().max())), rtol=0)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        PagedRunner(gqa, 32, 4, kv_cache_dtype=torch.float16)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        build_runner(gqa, "batched", num_slots=2, max_seq_len=64, kv_cache_dtype=torch.bfloat16)


def test_greedy_on_demo_target_equals_batched():
    """64 greedy tokens through `forward`, token for token as BatchedRunner's, on the demo checkpoint."""
    target = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "demo" / "target", dtype=torch.float32).eval()
    prompt = ids_of(21, seed=11, vocab=target.config.vocab_size)
    out = []
    for runner in (BatchedRunner(target, 1, 128), PagedRunner(target, 12, 16, max_model_len=128)):
        seq = runner.new_sequence(prompt)
        toks = []
        for _ in range(64):
            t = int(runner.forward([seq])[0][-1].argmax())
            seq.commit([t])
            toks.append(t)
        out.append(toks)
    assert out[0] == out[1]


def test_probe_refuses_a_decoder_that_disagrees(gqa, monkeypatch):
    """The probe covers sequences of several runs: a broken run merge is caught when the runner is built."""
    from specmesh.runtime import paged

    monkeypatch.setattr(paged._BlockAttention, "_runs", lambda self, seg, qs, *a: torch.zeros_like(qs))
    with pytest.raises(ValueError, match="disagrees"):
        PagedRunner(gqa, 16, 4, cpu_kernel=False)


def test_a_kernel_that_disagrees_is_not_served(gqa, monkeypatch):
    """A block-table kernel that disagrees with the HF forward on the probe is turned off, and the runner
    attends by SDPA instead (slower, never wrong)."""
    from specmesh.runtime import block_attention

    monkeypatch.setattr(block_attention, "block_attention", lambda out, q, *a: out.copy_(q))
    r = PagedRunner(gqa, 16, 4, block_kernel=True)
    assert not r.block_kernel
    seq = r.new_sequence(ids_of(9, seed=2))
    close_logits(r.forward([seq])[0], full_logits(gqa, seq.token_ids, 1))


@pytest.mark.parametrize("entry", ["block_attention", "block_attention_rope"])
def test_a_cpu_kernel_that_disagrees_is_not_served(gqa, monkeypatch, entry):
    """The CPU block-table kernel is checked by the same probe, in both its forms (a batch with prefill
    chunks attends from rotated q, k, v; a batch of decode and verify blocks from the projection's output):
    one that disagrees is turned off and the runner attends by SDPA."""
    from specmesh.runtime import cpu_kernels

    monkeypatch.setattr(cpu_kernels, entry, lambda out, *a: out.zero_())
    r = PagedRunner(gqa, 16, 4)
    assert not r.cpu_kernel
    seq = r.new_sequence(ids_of(9, seed=2))
    close_logits(r.forward([seq])[0], full_logits(gqa, seq.token_ids, 1))


def test_the_cpu_kernel_is_the_default_in_float32_under_auto_only(gqa):
    """On a CPU in float32 `auto` attends decode steps and verify blocks by the CPU kernel; any other backend
    keeps torch's SDPA, and so does another dtype (asking for the kernel there is refused)."""
    assert PagedRunner(gqa, 16, 4).cpu_kernel
    for backend in ("default", "no-cudnn", "math"):
        assert not PagedRunner(gqa, 16, 4, attention_backend=backend).cpu_kernel
    half = tiny_model("llama", seed=5).to(torch.bfloat16)
    assert not PagedRunner(half, 16, 4, check=False).cpu_kernel
    with pytest.raises(ValueError, match="cpu_kernel"):
        PagedRunner(half, 16, 4, check=False, cpu_kernel=True)


def test_without_a_compiler_the_runner_attends_by_sdpa(gqa, monkeypatch):
    """No C compiler on the machine: the kernel cannot be built, `load` says so, the runner serves by SDPA."""
    from specmesh.runtime import cpu_kernels

    monkeypatch.setattr(cpu_kernels, "_tried", False)
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert cpu_kernels.load() is None
    r = PagedRunner(gqa, 16, 4)
    assert not r.cpu_kernel
    seq = r.new_sequence(ids_of(9, seed=2))
    close_logits(r.forward([seq])[0], full_logits(gqa, seq.token_ids, 1))


def test_the_kernel_off_cuda_needs_the_interpreter(gqa, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        PagedRunner(gqa, 16, 4, block_kernel=True)


def test_a_sequence_collected_while_the_runner_holds_its_lock_frees_its_blocks_later(gqa):
    """The garbage collector may finalize a forgotten sequence inside any locked section (the event loop's
    open, the model thread's pass): its blocks are queued, not freed under the lock, which would deadlock."""
    import gc

    r = PagedRunner(gqa, 16, 4)
    seq = r.new_sequence(ids_of(10, seed=9))
    r.forward([seq])
    assert r.pool.num_used == 3
    with r._lock:  # as if a pass held it
        del seq
        gc.collect()
        assert r.pool.num_used == 3  # queued
    assert r.blocks is not None and r.blocks.free_blocks() == 16 and r.pool.num_used == 0


def test_a_turn_diverging_inside_a_shared_block_copies_its_kept_part_instead_of_recomputing_it(gqa):
    r = PagedRunner(gqa, 32, 4)
    ids = ids_of(20, seed=11)
    a = r.new_sequence(ids[:18])
    r.forward([a])  # 17 positions: blocks 0-3 full (registered), block 4 partial
    b = r.new_sequence(ids[:18])  # shares a's 4 full blocks
    assert b.cached_ids == ids[:16] and r.pool.num_shared == 4
    # b's next turn keeps 10 tokens: position 10 lies in shared, registered block 2, whose first two positions
    # it keeps. A private copy of that block takes its place: 10 positions stay cached, not 8.
    b.reset_tokens(ids[:10] + [5, 6, 7])
    assert r.step([], prefill=[PrefillChunk(b)]).prefill_reused == [10]
    got = r.forward([b], [[8, 9]])[0]
    close_logits(got, full_logits(gqa, ids[:10] + [5, 6, 7, 8, 9], 3))
    assert r.pool.num_shared == 2  # blocks 0-1 still shared; a keeps blocks 2-4 to itself
    close_logits(r.forward([a], [ids[18:20]])[0], full_logits(gqa, ids[:20], 3))  # a's KV untouched


def _decode_rounds(r: PagedRunner, prompts: list[list[int]], rounds: int, seed: int) -> list[torch.Tensor]:
    """Decode rounds over `prompts`: each round every sequence gets a block of 0-4 drafts and commits a
    random prefix of it plus one token (the next round rolls the rest back); the logits of every round."""
    gen = torch.Generator().manual_seed(seed)
    seqs = [r.new_sequence(p) for p in prompts]
    for s in seqs:
        r.prefill(s)
    out = []
    for _ in range(rounds):
        k = [int(torch.randint(0, 5, (1,), generator=gen)) for _ in seqs]
        drafts = [torch.randint(0, 127, (n,), generator=gen).tolist() for n in k]
        out += r.forward(seqs, drafts)
        for s, d in zip(seqs, drafts, strict=True):
            keep = int(torch.randint(0, len(d) + 1, (1,), generator=gen))
            s.commit([*d[:keep], int(torch.randint(0, 127, (1,), generator=gen))])
    for s in seqs:
        r.free(s)
    return out


def test_graph_steps_equal_eager_steps(gqa):
    """The CUDA graphs' static, padded step (run eagerly here: the block-table kernel in the interpreter)
    gives the eager step's logits: ragged blocks of 1-5 tokens per sequence padded to a token bucket, the
    padding's KV in the spare slot (the sequences' own KV untouched: later rounds still agree), rollbacks
    across blocks. A batch over the graphs' sequence bound runs eagerly."""
    eager = PagedRunner(gqa, 64, 4, block_kernel=True)
    graphed = PagedRunner(
        gqa, 64, 4, block_kernel=True, cuda_graph_max_bs=3, graph_tokens_per_seq=5, graph_capture=False
    )
    assert eager.graphs is None and graphed.graphs is not None
    assert graphed.graphs.buckets == [1, 2, 4, 8, 16]
    prompts = [ids_of(n, seed=n) for n in (9, 14, 5)]
    want = _decode_rounds(eager, prompts, 6, seed=3)
    got = _decode_rounds(graphed, prompts, 6, seed=3)
    assert graphed.graphs.replays == 6 and graphed.graphs.captures == 0
    for a, b in zip(got, want, strict=True):
        close_logits(a, b)
    four = [*prompts, ids_of(7, seed=7)]  # more sequences than the graphs hold
    _decode_rounds(graphed, four, 1, seed=4)
    assert graphed.graphs.replays == 6


def test_graph_bucket_bounds():
    from specmesh.runtime.graphs import token_buckets

    b = token_buckets(32 * 17)
    assert b[:5] == [1, 2, 4, 8, 16] and b[-1] >= 544 and b == sorted(set(b))
    assert all(later / earlier <= 2 for earlier, later in itertools.pairwise(b))
    assert all((later - earlier - 1) / later < 0.2 for earlier, later in itertools.pairwise(b) if earlier >= 32)
    assert token_buckets(1) == [1]


def test_graph_flags_are_checked(gqa):
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        PagedRunner(gqa, 16, 4, cuda_graph_max_bs=-1)
    # Off CUDA a capture is not possible: the runner runs eagerly, as with graphs disabled.
    assert PagedRunner(gqa, 16, 4, cuda_graph_max_bs=8).graphs is None


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_captured_graphs_equal_eager_steps():
    """On CUDA: every bucket captured at build, decode rounds replayed from the graphs equal to the eager
    runner's, and a weight change re-captures (the graphs hold the old copies' addresses)."""
    model = tiny_model("llama", seed=5).to("cuda")
    eager = PagedRunner(model, 64, 4)
    graphed = PagedRunner(model, 64, 4, cuda_graph_max_bs=3, graph_tokens_per_seq=5)
    assert graphed.graphs is not None and graphed.graphs.captures == len(graphed.graphs.buckets)
    assert not graphed._k[0].requires_grad  # captured under inference mode: no autograd state kept alive
    prompts = [ids_of(n, seed=n) for n in (9, 14, 5)]
    for a, b in zip(_decode_rounds(graphed, prompts, 6, 3), _decode_rounds(eager, prompts, 6, 3), strict=True):
        close_logits(a, b)
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    captures = graphed.graphs.captures
    for a, b in zip(_decode_rounds(graphed, prompts, 2, 5), _decode_rounds(eager, prompts, 2, 5), strict=True):
        close_logits(a, b)
    assert graphed.graphs.captures > captures
