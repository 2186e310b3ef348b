"""The block-table attention kernel (Triton; here in its interpreter, which the suite's plugin turns on)
against a gathered torch reference: GQA groups, block sizes, fragmented tables, sequences from one token to
several key tiles, half precision."""

import pytest
import torch

from specmesh.errors import InvalidArgument
from specmesh.runtime import block_attention as ba

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def batch(n_kv, group, d, block_size, dtype, spans, seed=0, device=DEVICE):
    """A pool with the sequences' blocks scattered over it, their queries, tables and (row, n, start) spans."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(start + n) // block_size) for n, start in spans) + 7
    k = torch.randn(n_kv, num_blocks * block_size, d, generator=g).to(dtype)
    v = torch.randn(n_kv, num_blocks * block_size, d, generator=g).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables, segs, off = [], [], 0
    for n, start in spans:
        need = -(-(start + n) // block_size)
        tables.append(free[:need])
        free = free[need:]
        segs.append((off, n, start))
        off += n
    # Queries as the decoder has them: a slice of a wider [T, heads, D] tensor (strided, last dim unit).
    q = torch.randn(off, n_kv * group + n_kv, d, generator=g).to(dtype)[:, : n_kv * group]
    return [t.to(device) for t in (q, k, v)], tables, segs


SHAPES = [  # n_kv, group, head_dim, block size
    (2, 1, 64, 16),
    (2, 4, 64, 16),
    (1, 3, 32, 4),
    (4, 2, 80, 8),
    (1, 8, 128, 32),
]
SPANS = [(1, 0), (5, 37), (20, 3), (1, 100), (6, 64), (40, 0)]  # (new tokens, first position)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "kv{}-g{}-d{}-bs{}".format(*s))
def test_kernel_matches_the_gathered_reference(shape):
    n_kv, group, d, bs = shape
    (q, k, v), tables, segs = batch(n_kv, group, d, bs, torch.float32, SPANS)
    out = torch.full_like(q, float("nan")).contiguous()
    ba.block_attention(out, q, k, v, ba.block_tables(tables, DEVICE), ba.plan(segs, group, DEVICE), bs, d**-0.5)
    ref = ba.reference(q.cpu(), k.cpu(), v.cpu(), tables, segs, bs, d**-0.5)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_its_rounding(dtype):
    (q, k, v), tables, segs = batch(2, 2, 64, 16, dtype, SPANS, seed=3)
    out = torch.empty_like(q).contiguous()
    ba.block_attention(out, q, k, v, ba.block_tables(tables, DEVICE), ba.plan(segs, 2, DEVICE), 16, 0.125)
    ref = ba.reference(q.cpu(), k.cpu(), v.cpu(), tables, segs, 16, 0.125)
    assert out.dtype == dtype
    torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2)


def test_a_shared_block_serves_two_sequences_and_padding_rows_are_untouched():
    """Two sequences whose tables share their first blocks (a shared prefix) read the same keys; rows the
    plan does not cover (none here) and positions past a sequence's end are never read or written."""
    (q, k, v), tables, segs = batch(2, 2, 32, 4, torch.float32, [(3, 8), (2, 9)], seed=5)
    tables[1][:2] = tables[0][:2]  # positions 0..7 shared
    out = torch.zeros_like(q).contiguous()
    ba.block_attention(out, q, k, v, ba.block_tables(tables, DEVICE), ba.plan(segs, 2, DEVICE), 4, 0.2)
    torch.testing.assert_close(out.cpu(), ba.reference(q.cpu(), k.cpu(), v.cpu(), tables, segs, 4, 0.2))


def test_plan_tiles_each_sequence_by_tokens_per_program():
    block_g, block_q = ba.tiles(4)
    assert block_g == 4 and block_q * block_g == ba.ROWS
    p = ba.plan([(0, 1, 7), (1, 2 * block_q + 1, 30)], 4, torch.device("cpu")).tolist()
    bq = block_q
    assert p == [[0, 0, 1, 7], [1, 1, bq, 30], [1, 1 + bq, bq, 30 + bq], [1, 1 + 2 * bq, 1, 30 + 2 * bq]]
    assert ba.plan([], 4, torch.device("cpu")).shape == (0, 4)


def test_bad_shapes_are_refused():
    (q, k, v), tables, segs = batch(2, 2, 32, 4, torch.float32, [(2, 0)])
    t, p = ba.block_tables(tables, DEVICE), ba.plan(segs, 2, DEVICE)
    with pytest.raises(InvalidArgument, match="block attention"):
        ba.block_attention(torch.empty_like(q), q[:, :3], k, v, t, p, 4, 1.0)  # 3 heads over 2 KV heads
    with pytest.raises(InvalidArgument, match="contiguous"):
        ba.block_attention(torch.empty_like(q), q.transpose(1, 2).contiguous().transpose(1, 2), k, v, t, p, 4, 1.0)


def test_off_cuda_without_the_interpreter_is_refused(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    (q, k, v), tables, segs = batch(1, 1, 16, 4, torch.float32, [(1, 0)], device=torch.device("cpu"))
    with pytest.raises(InvalidArgument, match="TRITON_INTERPRET"):
        t, p = ba.block_tables(tables, q.device), ba.plan(segs, 1, q.device)
        ba.block_attention(torch.empty_like(q), q, k, v, t, p, 4, 1.0)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_bf16_one_compiled_variant_for_every_batch():
    for seed, spans in enumerate([SPANS, [(1, 3)], [(5, 200)] * 16, [(300, 0), (1, 999)]]):
        (q, k, v), tables, segs = batch(2, 4, 128, 16, torch.bfloat16, spans, seed=seed)
        out = torch.empty_like(q).contiguous()
        ba.block_attention(out, q, k, v, ba.block_tables(tables, DEVICE), ba.plan(segs, 4, DEVICE), 16, 128**-0.5)
        ref = ba.reference(q.cpu(), k.cpu(), v.cpu(), tables, segs, 16, 128**-0.5)
        torch.testing.assert_close(out.cpu().float(), ref, atol=2e-2, rtol=2e-2)
    assert len(ba._kernel().device_caches[0][0]) == 1
