"""GgufRunner: the Runner protocol on llama.cpp's kernels (llama-cpp-python, a test dependency): logits as
the HF forward's through chunked prefill, drafts and rollbacks; a batch of sequences and chunks in one pass;
the cells as virtual blocks (admission, preemption, out of blocks); greedy on the demo target token for token
as the paged runner's; models it cannot serve refused."""

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM

from specmesh.errors import ResourceExhausted
from specmesh.runtime import PrefillChunk, Runner
from specmesh.runtime.blocks import OutOfBlocks
from specmesh.runtime.gguf import GgufRunner, export_gguf
from specmesh.runtime.paged import PagedRunner
from specmesh.runtime.registry import build_runner
from tests.support.models import ROOT, close_logits, full_logits, tiny_llama_mha, tiny_model, tiny_qwen3

MODELS = {
    "llama-gqa": lambda: tiny_model("llama", seed=5),
    "llama-mha": lambda: tiny_llama_mha(max_position_embeddings=512),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return MODELS[request.param]()


@pytest.fixture(scope="module")
def gqa():
    return MODELS["llama-gqa"]()


def ids_of(n: int, seed: int = 0, vocab: int = 127) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_prefill_chunks_drafts_and_rollbacks_match_hf(model):
    r = GgufRunner(model, 256, threads=1)
    ids = ids_of(40, seed=1)
    seq = r.new_sequence(ids[:11])
    assert r.prefill(seq, max_tokens=3) == 7 and r.prefill(seq, max_tokens=4) == 3 and r.prefill(seq) == 0
    assert seq.cached_ids == ids[:10]
    close_logits(r.forward([seq], [ids[11:14]])[0], full_logits(model, ids[:14], 4))
    seq.commit(ids[11:12])  # positions 12, 13 rolled back
    close_logits(r.forward([seq], [ids[20:25]])[0], full_logits(model, ids[:12] + ids[20:25], 6))
    assert seq.cached_ids == ids[:12] + ids[20:25]
    seq.commit(ids[20:21])
    close_logits(r.forward([seq], [ids[30:33]])[0], full_logits(model, [*ids[:12], ids[20], *ids[30:33]], 4))


def test_a_batch_and_prefill_chunks_in_one_pass_and_long_steps_split(gqa):
    r = GgufRunner(gqa, 1024, threads=1, max_batch_tokens=16)  # raised to 256 (one output per sequence id)
    assert r.max_batch_tokens == 256
    prompts = [ids_of(n, seed=n) for n in (1, 90, 60, 170)]  # a step of 334 tokens: two decode calls
    seqs = [r.new_sequence(p) for p in prompts]
    extra = [ids_of(k, seed=50 + k) for k in (0, 3, 1, 4)]
    late = r.new_sequence(ids_of(13, seed=99))
    res = r.step(seqs, extra, prefill=[PrefillChunk(late, 5)])
    assert res.prefill_left == [7] and res.tokens == sum(len(p) + len(e) for p, e in zip(prompts, extra)) + 5
    for p, e, got in zip(prompts, extra, res.logits, strict=True):
        close_logits(got, full_logits(gqa, p + e, len(e) + 1))
    close_logits(r.forward([late])[0], full_logits(gqa, late.token_ids, 1))


def test_cells_as_blocks_admission_preemption_and_freeing(gqa):
    r = GgufRunner(gqa, 64, block_size=4, threads=1)
    blocks, acct = r.blocks, r.kv_account()
    assert isinstance(r, Runner) and blocks is not None and (blocks.block_size, blocks.num_blocks) == (4, 16)
    assert acct.pool_bytes == 64 * r.bytes_per_token and acct.needed(None, 10) == 0
    seq = r.new_sequence(ids_of(10, seed=9))
    assert blocks.cached(seq) == 0 and blocks.needed(seq, 10) == 3 and blocks.held(seq) == 0
    r.forward([seq])
    assert blocks.held(seq) == 3 and blocks.free_blocks() == 13 and acct.held(seq) == 12 * r.bytes_per_token
    assert blocks.preempt(seq) == 3 and blocks.free_blocks() == 16 and seq.cached_ids == []
    close_logits(r.forward([seq])[0], full_logits(gqa, seq.token_ids, 1))  # recomputed from nothing
    r.free(seq)
    r.free(seq)  # idempotent
    assert blocks.free_blocks() == 16
    other = r.new_sequence(ids_of(5, seed=10))
    r.forward([other])
    del other
    gc.collect()
    assert blocks.free_blocks() == 16
    assert r.context_limit() == 64 and r.context_limit(10) == 10


def test_out_of_blocks_before_anything_is_written(gqa):
    r = GgufRunner(gqa, 24, block_size=4, threads=1)
    ids = ids_of(30, seed=8)
    a, b = r.new_sequence(ids[:9]), r.new_sequence(ids[10:17])
    r.forward([a, b])  # a: 3 blocks, b: 2 of 6
    a.commit([ids[9]])
    b.commit([ids[17]])
    before = [list(s.cached_ids) for s in (a, b)]
    with pytest.raises(OutOfBlocks) as e:
        r.forward([a, b], [ids[20:25], ids[20:22]])  # a needs 2 more, b 1: 1 free
    assert isinstance(e.value, ResourceExhausted)
    assert [s.cached_ids for s in (a, b)] == before
    r.free(b)
    close_logits(r.forward([a], [ids[20:25]])[0], full_logits(gqa, ids[:10] + ids[20:25], 6))


def test_greedy_on_the_demo_target_equals_the_paged_runner():
    target = AutoModelForCausalLM.from_pretrained(ROOT / "models" / "demo" / "target", dtype=torch.float32).eval()
    prompt = ids_of(21, seed=11, vocab=target.config.vocab_size)
    out = []
    for runner in (PagedRunner(target, 12, 16, max_model_len=128), GgufRunner(target, 256, threads=2)):
        seq = runner.new_sequence(prompt)
        toks = []
        for i in range(64):
            # every fourth step verifies a block of three guesses, as a speculative round does
            guess = toks[-3:] if i % 4 == 3 and len(toks) >= 3 else []
            logits = runner.forward([seq], [guess])[0]
            t = int(logits[0].argmax())
            seq.commit([t])
            toks.append(t)
        out.append(toks)
    assert out[0] == out[1]


def test_models_it_cannot_serve_are_refused_with_the_reason(gqa):
    with pytest.raises(ValueError, match="only the Llama architecture"):
        GgufRunner(tiny_qwen3(), 64)
    with pytest.raises(ValueError, match="only the Llama architecture"):
        build_runner(tiny_model("qwen2"), "gguf", num_blocks=4)
    r = build_runner(gqa, "gguf", num_blocks=8, block_size=8, max_seq_len=32)
    assert isinstance(r, GgufRunner) and r.context_limit() == 32 and r.blocks.num_blocks == 8


def test_bf16_weights_export_and_serve(gqa, tmp_path):
    m = tiny_model("llama", seed=5).to(torch.bfloat16)
    export_gguf(m, str(tmp_path / "m.gguf"))
    assert (tmp_path / "m.gguf").stat().st_size > 0
    r = GgufRunner(m, 128, threads=1)  # the probe passed at bf16's tolerance
    seq = r.new_sequence(ids_of(12, seed=4))
    assert r.forward([seq])[0].shape == (1, r.vocab_size)
