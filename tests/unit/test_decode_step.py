"""The fused CPU decode step (`cpu_kernels.DecodeStep`): one token of one sequence through the whole decoder
in one C call. Checked against the HF forward and against the decoders' own torch ops (the step turned off)
on every architecture the decoders take (GQA or not, q/k/v biases, q/k norms), over scattered and shared
blocks, 1-3 threads, a growing single-sequence buffer and rollbacks; the runners' probes catch a step that
disagrees; concurrent calls (the draft service's workers) each keep their own arguments."""

import os
import shutil
import subprocess
import threading
import time

import pytest
import torch

from specmesh.runtime import cpu_kernels
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.paged import PagedRunner
from specmesh.runtime.static import StaticCacheRunner
from tests.support.models import close_logits, full_logits, tiny_llama_mha, tiny_model, tiny_qwen3

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here: the step cannot be built")


def built_for() -> set[str]:
    """The vector extensions the kernels are built with: the compiler's own macros for their -march (this CPU's,
    or SPECMESH_CPU_MARCH's where the suite runs for another)."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    assert cc is not None  # the kernels were built
    cmd = [cc, f"-march={cpu_kernels.march()}", "-dM", "-E", "-x", "c", os.devnull]
    macros = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=60).stdout
    return {m for m in ("__AVX512F__", "__AVX2__", "__FMA__") if f"#define {m} " in macros}


ARCHS = {
    "llama-gqa": lambda: tiny_model("llama", seed=5),
    "qwen2-bias": lambda: tiny_model("qwen2", seed=6),
    "qwen3-qk-norm": tiny_qwen3,
    "llama-mha": tiny_llama_mha,
}


@pytest.fixture(params=["panels", "rows"])
def layout(request, monkeypatch):
    """The step's weights in panels (a build with AVX-512 or AVX2, this CPU's) or [in, out] rows (any other CPU's)."""
    monkeypatch.setenv("SPECMESH_CPU_PANELS", "1" if request.param == "panels" else "0")
    return request.param


def test_panels_hold_the_rows_columns_in_order():
    """`panels` lays [in, out] rows out as [ceil(out / w), in, w], the last panel's missing columns zero."""
    w = torch.arange(5 * 7, dtype=torch.float32).reshape(5, 7).t()  # an [out, in] view of [in = 5, out = 7] rows
    p = cpu_kernels.panels(w, 4)
    assert p.shape == (2, 5, 4) and p.is_contiguous()
    rows = w.t()
    assert torch.equal(p[0], rows[:, :4]) and torch.equal(p[1, :, :3], rows[:, 4:])
    assert not p[1, :, 3].any()


def test_packed_panels_share_one_region_from_a_huge_page_boundary():
    ws = [torch.randn(70, 9).t(), torch.randn(64, 5).t(), torch.randn(3, 2).t()]  # [out, in] views
    packed = cpu_kernels.pack_panels(ws, 64)
    assert packed[0].data_ptr() % cpu_kernels.HUGE_PAGE == 0
    for w, p in zip(ws, packed, strict=True):
        assert torch.equal(p, cpu_kernels.panels(w, 64)) and p.data_ptr() % 64 == 0
    # one after another, none overlapping
    ends = [p.data_ptr() + p.numel() * 4 for p in packed]
    assert all(end <= nxt.data_ptr() for end, nxt in zip(ends, packed[1:], strict=False))


@pytest.mark.skipif(not cpu_kernels.load().specmesh_decode_step_panel(), reason="this build packs no panels")
@pytest.mark.parametrize("layout", ["panels"], indirect=True)
def test_over_panels_the_logits_do_not_depend_on_the_thread_count(layout):
    """Each thread computes whole columns over panels (no partial sums across the team): 1, 2 and 3 threads give
    the same bits, one token or a block."""
    model = ARCHS["qwen2-bias"]()
    got = {}
    before = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            r = PagedRunner(model, 64, 4)
            seq = r.new_sequence([(7 * i + 2) % 120 for i in range(11)])
            r.prefill(seq)
            got[n] = (r.forward([seq])[0], r.forward([seq], [[5, 9, 13]])[0])
    finally:
        torch.set_num_threads(before)
    for n in (2, 3):
        assert all(torch.equal(a, b) for a, b in zip(got[1], got[n], strict=True)), n


@pytest.mark.parametrize("layout", ["panels", "rows"], indirect=True)
def test_the_step_packs_panels_where_the_build_can(layout):
    r = PagedRunner(ARCHS["llama-gqa"](), 16, 4)
    built = cpu_kernels.load().specmesh_decode_step_panel()
    isa = built_for()
    # six rows' sums in the registers: 64 columns with AVX-512, 16 with AVX2 and FMA, none without
    assert built == (64 if "__AVX512F__" in isa else 16 if {"__AVX2__", "__FMA__"} <= isa else 0)
    assert r._dec.step.panel_width == (built if layout == "panels" else 0)
    limits = (
        (cpu_kernels.STEP_MAX_TOKENS_PANELS,)
        if r._dec.step.panel_width
        else (cpu_kernels.STEP_MAX_TOKENS, cpu_kernels.STEP_MAX_TOKENS_SMALL)
    )
    assert r._dec.step.max_seq_rows in limits
    batch = cpu_kernels.STEP_MAX_BATCH_TOKENS_PANELS if r._dec.step.panel_width else r._dec.step.max_seq_rows
    assert r._dec.step.max_rows == batch


@pytest.fixture
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def greedy_steps(runner, seqs, steps: int) -> list[list[torch.Tensor]]:
    """One token at a time per sequence, in turn (their blocks interleave in the pool): the logits of each."""
    out: list[list[torch.Tensor]] = [[] for _ in seqs]
    for _ in range(steps):
        for i, seq in enumerate(seqs):
            logits = runner.forward([seq])[0]
            out[i].append(logits)
            seq.commit([int(logits[-1].argmax())])
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("threads", [1, 2, 3], indirect=True)
def test_paged_one_token_steps_match_hf_and_the_torch_ops(arch, threads):
    model = ARCHS[arch]()
    fused = PagedRunner(model, 64, 4)
    assert fused.cpu_kernel and fused._dec.step is not None
    plain = PagedRunner(model, 64, 4)
    plain._dec.step = None
    prompt = [(5 * i + 1) % 120 for i in range(10)]
    # b shares a's first two blocks: its table is a's prefix and then blocks of its own.
    a, b = fused.new_sequence(prompt), fused.new_sequence(prompt[:8] + [3, 9, 27])
    got = greedy_steps(fused, [a, b], 14)
    assert a.table.blocks[:2] == b.table.blocks[:2]
    for seq, logits in zip((a, b), got, strict=True):
        first = len(seq.token_ids) - len(logits)  # the prompt's length
        ref_seq = plain.new_sequence(seq.token_ids[:first])
        for j, row in enumerate(logits):
            ids = seq.token_ids[: first + j]
            want = plain.forward([ref_seq])[0]
            torch.testing.assert_close(row, want, atol=2e-5 * max(1.0, float(want.abs().max())), rtol=0)
            close_logits(row, full_logits(model, ids, 1))
            ref_seq.commit([seq.token_ids[len(ids)]])


@pytest.mark.skipif(not cpu_kernels.load().specmesh_decode_step_panel(), reason="this build packs no panels")
@pytest.mark.parametrize("layout", ["panels"], indirect=True)
def test_a_batch_past_one_sequences_limit_goes_through_the_step_in_one_call(layout, monkeypatch):
    """Sixteen verify blocks of 9 rows (144, past a sequence's STEP_MAX_TOKENS_PANELS, within the batch's
    STEP_MAX_BATCH_TOKENS_PANELS): one call of the step, each row as the sequence alone to the bit; a block past
    a sequence's limit sends the pass to the ragged forward."""
    model = ARCHS["llama-gqa"]()
    calls = []
    step_call = cpu_kernels.DecodeStep.__call__

    def counted(self, seqs, *args, **kw):
        calls.append(sum(len(t) for t, _, _ in seqs))
        return step_call(self, seqs, *args, **kw)

    monkeypatch.setattr(cpu_kernels.DecodeStep, "__call__", counted)
    prompts = [[(5 * i + 7 * k + 1) % 120 for i in range(5 + k)] for k in range(16)]
    extras = [[(3 * k + j) % 120 for j in range(8)] for k in range(16)]
    alone = []
    for p, e in zip(prompts, extras, strict=True):
        r = PagedRunner(model, 64, 4)
        seq = r.new_sequence(p)
        r.prefill(seq)
        alone.append(r.forward([seq], [e])[0])
    r = PagedRunner(model, 400, 4)
    seqs = [r.new_sequence(p) for p in prompts]
    for seq in seqs:
        r.prefill(seq)
    calls.clear()
    together = r.forward(seqs, extras)
    assert calls == [144] and r._dec.step.max_seq_rows < 144
    for got, want, p, e in zip(together, alone, prompts, extras, strict=True):
        assert torch.equal(got, want)
        close_logits(got, full_logits(model, p + e, len(e) + 1))
    calls.clear()
    long = [(j * 7) % 120 for j in range(r._dec.step.max_seq_rows)]  # one block of max_seq_rows + 1 tokens
    r.forward(seqs[:2], [long, extras[1]])
    assert calls == []


def near_logits(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Logits over a bfloat16 KV cache against the HF forward's (float32 keys and values): within bfloat16's
    rounding of K and V, a few tenths of a percent of the logits' scale on these models."""
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, atol=2e-2 * max(1.0, float(ref.abs().max())), rtol=0)


KV = {"float32": None, "bfloat16": torch.bfloat16}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
@pytest.mark.parametrize("kv", list(KV))
def test_a_verify_block_computes_the_steps_bit_for_bit(arch, threads, layout, kv):
    """A block of K + 1 tokens of one sequence (a verify round at one stream) and the one-token steps that
    decode the same positions go through the same arithmetic: their logits are equal to the bit, so greedy
    speculation on this path is target-only decoding token for token, near-ties included; with the KV in
    bfloat16 too (each key and value rounded once, when written)."""
    model = ARCHS[arch]()
    r = PagedRunner(model, 64, 4, kv_cache_dtype=KV[kv])
    assert r._k[0].dtype == (KV[kv] or torch.float32) and r.cpu_kernel  # the probe passed with the kernels
    rows_max = r._dec.step.max_seq_rows
    prompt = [(11 * i + 4) % 120 for i in range(13)]
    steps_seq = r.new_sequence(prompt)
    r.prefill(steps_seq)  # as the block's sequence: the prompt's last token is the first of the steps
    rows = []
    for _ in range(rows_max):
        logits = r.forward([steps_seq])[0]
        rows.append(logits[-1])
        steps_seq.commit([int(logits[-1].argmax())])
    drafts = steps_seq.token_ids[len(prompt) : len(prompt) + rows_max - 1]
    block_seq = r.new_sequence(prompt)
    r.prefill(block_seq)
    block = r.forward([block_seq], [drafts])[0]
    assert block.shape[0] == rows_max
    assert torch.equal(block, torch.stack(rows))
    (near_logits if KV[kv] else close_logits)(block, full_logits(model, prompt + drafts, len(drafts) + 1))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_a_vocabulary_of_part_of_a_panel_sums_its_logits_the_same(threads, layout):
    """Over panels the LM head writes its sums straight into the logits where the vocabulary is whole panels
    (the other tests' 128); 120 is a panel and 56 columns, whose sums go through the team's partials: the same
    arithmetic either way, so a verify block's rows equal its steps' to the bit, and the HF forward's."""
    model = tiny_model("llama", vocab=120, seed=9)
    r = PagedRunner(model, 64, 4)
    assert r.cpu_kernel
    prompt = [(7 * i + 2) % 120 for i in range(11)]
    steps_seq = r.new_sequence(prompt)
    r.prefill(steps_seq)
    rows = []
    for _ in range(6):
        logits = r.forward([steps_seq])[0]
        rows.append(logits[-1])
        steps_seq.commit([int(logits[-1].argmax())])
    drafts = steps_seq.token_ids[len(prompt) : len(prompt) + 5]
    block_seq = r.new_sequence(prompt)
    r.prefill(block_seq)
    block = r.forward([block_seq], [drafts])[0]
    assert block.shape == (6, 120) and torch.equal(block, torch.stack(rows))
    close_logits(block, full_logits(model, prompt + drafts, 6))


def test_the_steps_phases_add_up_within_its_time_and_change_no_bit(layout):
    """`record_step_phases` times each phase of the calls made inside it (and only those): every phase a call
    goes through is timed, they add up to no more than the call's wall time, and the logits are the same bits
    as untimed; the process's totals (a service's counters) take what it recorded."""
    model = ARCHS["llama-gqa"]()
    r = PagedRunner(model, 64, 4)
    seq = r.new_sequence([(3 * i + 1) % 120 for i in range(9)])
    r.prefill(seq)
    extra = [5, 6, 7, 8]
    plain = r.forward([seq], [extra])[0]  # not committed: each forward below computes the same positions
    totals = cpu_kernels.step_phase_totals()
    t = time.perf_counter()
    with cpu_kernels.record_step_phases() as rec:
        timed = r.forward([seq], [extra])[0]
    wall = time.perf_counter() - t
    assert torch.equal(timed, plain)
    assert rec.calls == 1 and list(rec.seconds) == list(cpu_kernels.STEP_PHASES)
    assert all(rec.seconds[p] > 0 for p in ("products", "attention", "norms and sums", "logits"))
    assert rec.seconds["barrier wait"] >= 0 and sum(rec.seconds.values()) <= wall
    after = cpu_kernels.step_phase_totals()
    assert after.calls == totals.calls + 1
    assert after.seconds["products"] - totals.seconds["products"] == pytest.approx(rec.seconds["products"])
    r.forward([seq], [extra])  # after the block: counted only where something else counts
    assert rec.calls == 1 and cpu_kernels.step_phase_totals().calls == after.calls + (cpu_kernels._counting > 0)


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("make", ["paged", "batched"])
@pytest.mark.parametrize("streams", [3, 8])
def test_a_batch_of_sequences_computes_each_alone_bit_for_bit(arch, make, streams, layout):
    """Several sequences' decode steps and verify blocks in one call (a few streams): each row's logits equal
    what the sequence computes alone, to the bit (batch invariance), and the HF forward's."""
    model = ARCHS[arch]()
    build = {
        "paged": lambda: PagedRunner(model, 160, 4),
        "batched": lambda: BatchedRunner(model, streams, max_seq_len=64),
    }
    prompts = [[(5 * i + 7 * k + 1) % 120 for i in range(6 + 3 * k)] for k in range(streams)]
    # three streams: a step, a verify block of 3, one of 2 (6 rows); eight: blocks of 1 to 8 rows (36 rows, so
    # the panels' groups of rows straddle sequences), or of 1 and 2 (12 rows, within the rows step's limit)
    panels = layout == "panels" and cpu_kernels.load().specmesh_decode_step_panel() > 0
    widths = range(8) if panels else [k % 2 for k in range(8)]
    extras = (
        [[], [11, 12], [13]] if streams == 3 else [[(3 * k + j) % 120 for j in range(w)] for k, w in enumerate(widths)]
    )
    alone = []
    for p, e in zip(prompts, extras, strict=True):
        r = build[make]()
        seq = r.new_sequence(p)
        r.prefill(seq)
        alone.append(r.forward([seq], [e])[0])
    r = build[make]()
    assert sum(len(e) + 1 for e in extras) <= r._dec.step.max_rows
    seqs = [r.new_sequence(p) for p in prompts]
    for seq in seqs:
        r.prefill(seq)
    together = r.forward(seqs, extras)
    for got, want, p, e in zip(together, alone, prompts, extras, strict=True):
        assert torch.equal(got, want)
        close_logits(got, full_logits(model, p + e, len(e) + 1))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_over_a_bfloat16_cache_the_step_and_the_torch_ops_read_the_same_keys(arch):
    """A bfloat16 cache written and read by the fused step (steps, a batch of verify blocks) and by the
    decoder's torch ops with the CPU attention kernel or SDPA (the step off). Each path computes the keys and
    values in its own order (rotary in C or in torch), and where that moves one across a rounding boundary of
    bfloat16 the cached value differs by a unit of it: the paths agree within 5e-4 of the logits' scale where
    the step's weights are in panels (seen: up to 7e-5), 2e-3 over the [in, out] rows, whose products sum eight
    rows at a time, further from torch's order (seen: 1.04e-3, on a build for x86-64-v2); a layout mistake would
    move them by their own scale. Against the HF forward's float32 KV, within bfloat16's rounding (seen: up to 1
    %)."""
    model = ARCHS[arch]()
    runners = [PagedRunner(model, 160, 4, kv_cache_dtype=torch.bfloat16) for _ in range(3)]
    runners[1]._dec.step = None  # the ragged forward, attention by the CPU kernel
    runners[2]._dec.step, runners[2].cpu_kernel = None, False  # ... by SDPA
    prompts = [[(5 * i + 7 * k + 1) % 120 for i in range(6 + 3 * k)] for k in range(4)]
    extras = [[], [11, 12], [13], [14, 15, 16]]
    got = []
    for r in runners:
        seqs = [r.new_sequence(p) for p in prompts]
        for seq in seqs:
            r.prefill(seq)
        rows = r.forward(seqs, extras)
        for seq, e in zip(seqs, extras, strict=True):
            seq.commit(e[:1])
        rows += greedy_steps(r, seqs, 3)[0]
        got.append(rows)
    within = 5e-4 if runners[0]._dec.step.panel_width else 2e-3
    for a, b, c in zip(*got, strict=True):
        torch.testing.assert_close(a, b, atol=within * max(1.0, float(b.abs().max())), rtol=0)
        torch.testing.assert_close(c, b, atol=within * max(1.0, float(b.abs().max())), rtol=0)
    for rows, p, e in zip(got[0][: len(prompts)], prompts, extras, strict=True):
        near_logits(rows, full_logits(model, p + e, len(e) + 1))


@pytest.mark.parametrize("n", [2, 5, "max", "max + 1"])
def test_blocks_and_short_chunks_match_hf(n, layout):
    """Verify blocks and prefill chunks of one sequence up to STEP_MAX_TOKENS through the step (past it, the
    ragged forward), rollbacks in between, on the paged and batched runners."""
    model = ARCHS["llama-gqa"]()
    for r in (PagedRunner(model, 128, 4), BatchedRunner(model, 2, max_seq_len=512)):
        n = {"max": r._dec.step.max_seq_rows, "max + 1": r._dec.step.max_seq_rows + 1}.get(n, n)
        seq = r.new_sequence([(7 * i + 1) % 120 for i in range(3 * n + 2)])
        while r.prefill(seq, max_tokens=n):  # chunks of n tokens, no logits
            pass
        drafts = [(5 * i + 2) % 120 for i in range(n - 1)]
        close_logits(r.forward([seq], [drafts])[0], full_logits(model, seq.token_ids + drafts, n))
        seq.commit(drafts[:1] + [9])  # one accepted, a correction: the rest is recomputed
        close_logits(r.forward([seq], [drafts])[0], full_logits(model, seq.token_ids + drafts, n))


@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_a_step_after_rejected_drafts_overwrites_their_positions(threads):
    """A verify block writes K + 1 positions; a rollback keeps fewer; the next one-token step writes over what
    was rejected and attends only up to its own position."""
    model = ARCHS["llama-gqa"]()
    r = PagedRunner(model, 64, 4)
    seq = r.new_sequence(list(range(3, 12)))
    r.forward([seq], [[7, 8, 9, 10]])
    seq.commit([7, 50])  # 7 accepted, 50 the correction: 8, 9, 10 rejected
    close_logits(r.forward([seq])[0], full_logits(model, seq.token_ids, 1))
    seq.commit([int(r.forward([seq])[0][-1].argmax())])
    close_logits(r.forward([seq])[0], full_logits(model, seq.token_ids, 1))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_static_runner_steps_match_hf_through_buffer_growth(arch):
    """The draft's runner: one buffer per sequence, doubled as it grows (the step's one block grows with it)."""
    model = ARCHS[arch]()
    r = StaticCacheRunner(model, initial_capacity=4)
    assert r.uses_fast_path and r._fast.step is not None
    seq = r.new_sequence([1, 2, 3])
    r.prefill(seq)
    for _ in range(40):  # past 4 -> 8 -> 16 -> 32 -> 64 positions
        logits = r.forward([seq])[0]
        close_logits(logits, full_logits(model, seq.token_ids, 1))
        seq.commit([int(logits[-1].argmax())])
    assert seq.cache.layers[0].capacity >= 43


@pytest.mark.parametrize("arch", list(ARCHS))
def test_batched_runner_steps_match_hf(arch):
    """The draft service's default runner on a CPU: a sequence's slot is its one block."""
    model = ARCHS[arch]()
    r = BatchedRunner(model, 3, max_seq_len=64)
    assert r.fused_step
    seqs = [r.new_sequence([(3 * i + k) % 120 for i in range(4 + 5 * k)]) for k in range(2)]
    for seq, logits in zip(seqs, greedy_steps(r, seqs, 12), strict=True):
        first = len(seq.token_ids) - len(logits)
        for j, row in enumerate(logits):
            close_logits(row, full_logits(model, seq.token_ids[: first + j], 1))
    assert not BatchedRunner(model, 2, max_seq_len=64, attention_backend="default").fused_step


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("threads", [1, 2], indirect=True)
def test_bfloat16_panels_step_as_the_float_ones_within_their_rounding(arch, threads, layout):
    """A draft's runner (`step_panels` bfloat16): the fused step reads its panels in bfloat16 where the build packs
    panels (else the float rows, the same as a float32 runner's); its steps stay within bfloat16's rounding of
    the weights of the HF forward's logits, and a step and a block still compute the same bits."""
    model = ARCHS[arch]()
    r = BatchedRunner(model, 3, max_seq_len=64, step_panels=torch.bfloat16)
    assert r.fused_step  # its probe passed, at bfloat16's bound
    panels = r._dec.step.panel_width != 0
    assert r._dec.step.panels_dtype == (torch.bfloat16 if panels else torch.float32)
    assert r._dec.probe_dtype == (torch.bfloat16 if panels else torch.float32)
    seq = r.new_sequence([(5 * i + 2) % 120 for i in range(9)])
    steps = greedy_steps(r, [seq], 6)[0]
    first = len(seq.token_ids) - len(steps)
    for j, row in enumerate(steps):
        (near_logits if panels else close_logits)(row, full_logits(model, seq.token_ids[: first + j], 1))
    block_seq = r.new_sequence(seq.token_ids[:first])
    r.prefill(block_seq)
    block = r.forward([block_seq], [seq.token_ids[first : first + 5]])[0]
    assert torch.equal(block, torch.cat(steps[:6]))


@pytest.mark.skipif(not cpu_kernels.load().specmesh_decode_step_panel(), reason="this build packs no panels")
def test_bfloat16_panels_halve_the_bytes_and_round_as_torch():
    ws = [torch.randn(70, 9).t(), torch.randn(3, 2).t()]
    packed = cpu_kernels.pack_panels(ws, 64, torch.bfloat16)
    for w, p in zip(ws, packed, strict=True):
        assert p.dtype == torch.bfloat16 and p.data_ptr() % 64 == 0
        assert torch.equal(p, cpu_kernels.panels(w, 64).to(torch.bfloat16))
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_kernels.DecodeStep(BatchedRunner(ARCHS["llama-gqa"](), 2, max_seq_len=32)._dec, torch.float16)


def test_a_draft_steps_over_bfloat16_panels_unless_its_dtype_is_float32():
    """A draft's numerics cannot change the output distribution: on a CPU under --dtype auto its runner's fused
    step reads bfloat16 panels (where the build packs panels); --dtype float32 keeps the float32 step."""
    from draft_service.engine import DraftConfig, make_runner

    model = ARCHS["llama-gqa"]()
    panels = cpu_kernels.load().specmesh_decode_step_panel() != 0
    auto = make_runner(model, DraftConfig(model_path="m", max_sessions=2, max_cached_sessions=0))
    assert auto.fused_step and auto._dec.step.panels_dtype == (torch.bfloat16 if panels else torch.float32)
    exact = make_runner(model, DraftConfig(model_path="m", dtype="float32", max_sessions=2, max_cached_sessions=0))
    assert exact._dec.step.panels_dtype == torch.float32


def test_concurrent_steps_on_worker_threads_keep_their_own_arguments():
    """The draft service steps several sessions at once: each call's position, buffers and output are its own."""
    model = ARCHS["qwen2-bias"]()
    r = StaticCacheRunner(model)
    prompts = [[(7 * i + k) % 120 for i in range(5 + 3 * k)] for k in range(4)]

    def run(prompt: list[int]) -> list[int]:
        seq = r.new_sequence(prompt)
        for _ in range(24):
            seq.commit([int(r.forward([seq])[0][-1].argmax())])
        return seq.token_ids

    alone = [run(p) for p in prompts]
    got: dict[int, list[int]] = {}
    workers = [threading.Thread(target=lambda k=k: got.__setitem__(k, run(prompts[k]))) for k in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=60)
    assert [got.get(k) for k in range(4)] == alone


def test_a_step_that_disagrees_is_not_served(monkeypatch):
    """The runners' probes run one-token steps: a wrong step turns the CPU kernels off (paged), the step off
    (batched) or the hand-written decoder off (static), and all serve the HF forward's logits."""
    model = ARCHS["llama-gqa"]()

    def wrong(self, seqs, k, v, block_size, num_logits, strides=None):
        return torch.zeros((sum(num_logits), 128)) if sum(num_logits) else None

    monkeypatch.setattr(cpu_kernels.DecodeStep, "__call__", wrong)
    r = PagedRunner(model, 64, 4)
    assert not r.cpu_kernel
    seq = r.new_sequence(list(range(1, 10)))
    close_logits(r.forward([seq])[0], full_logits(model, seq.token_ids, 1))
    with pytest.warns(UserWarning, match="disagrees"):
        s = StaticCacheRunner(model)
    assert not s.uses_fast_path
    b = BatchedRunner(model, 2, max_seq_len=64)
    assert not b.fused_step
    seq = b.new_sequence(list(range(1, 10)))
    close_logits(b.forward([seq])[0], full_logits(model, seq.token_ids, 1))


def test_what_the_step_does_not_take_is_said():
    from specmesh.runtime.static import _FastDecoder

    gelu = tiny_model("llama", seed=5)
    gelu.config.hidden_act = "gelu"
    for layer in gelu.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    assert "activation" in cpu_kernels.DecodeStep.reason(_FastDecoder(gelu))
    assert _FastDecoder(gelu).step is None
    half = _FastDecoder(tiny_model("llama", seed=5).to(torch.bfloat16))
    assert "float32" in cpu_kernels.DecodeStep.reason(half) and half.step is None
    with pytest.raises(ValueError, match="activation"):
        cpu_kernels.DecodeStep(_FastDecoder(gelu))


def test_other_attention_backends_keep_torchs_path(monkeypatch):
    """`--attention-backend default` (or math, no-cudnn) means torch's kernels: no runner takes the fused step."""
    calls = []
    real = cpu_kernels.DecodeStep.__call__
    monkeypatch.setattr(
        cpu_kernels.DecodeStep, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k)
    )
    model = ARCHS["llama-gqa"]()
    for backend, used in (("default", False), ("auto", True)):
        calls.clear()
        runners = [
            StaticCacheRunner(model, attention_backend=backend),
            PagedRunner(model, 64, 4, attention_backend=backend),
            BatchedRunner(model, 2, max_seq_len=64, attention_backend=backend),
        ]
        calls.clear()  # the probes' own
        for r in runners:
            seq = r.new_sequence(list(range(1, 7)))  # six tokens: one forward the step takes
            close_logits(r.forward([seq])[0], full_logits(model, seq.token_ids, 1))
        assert bool(calls) is used and (not used or len(calls) == 3)


def test_the_denormal_mode_the_kernels_set_is_given_back(layout):
    """The kernels flush denormals while they run (a softmax's tiny weights made the values' multiply-adds take
    microcode assists) and give the mode back: torch's arithmetic on the same threads (its OpenMP team is the
    kernels') still keeps a denormal, on the calling thread and across a parallel op."""
    model = ARCHS["llama-gqa"]()
    r = PagedRunner(model, 64, 4)
    seq = r.new_sequence([(3 * i + 1) % 120 for i in range(9)])
    r.prefill(seq)
    r.forward([seq], [[5, 6, 7]])
    tiny = torch.full((1 << 20,), 1e-39)  # a float32 denormal
    assert float(tiny[0] * 1.0) > 0
    assert float((tiny * 1.0).min()) > 0
