"""Block-table attention in Triton: every sequence of a ragged batch attends over its KV where the block pool
holds it, in one launch per layer (the GPU path of `PagedRunner`; vLLM's paged / unified attention).

Layout (`PagedRunner`'s arena): per layer K and V [n_kv, num_blocks * block_size, D], token-addressed, so
position p of a sequence lives at slot table[p // block_size] * block_size + p % block_size.

One program per (tile of a sequence's new tokens, KV head). The tile's query rows are its tokens x the query
heads sharing that KV head (GQA folded into rows, so the cache is read once per group, not once per query
head), each row at its token's position. It walks the sequence's keys [0, last position] in tiles of BLOCK_N
positions, looking each tile's slots up in the block table, and keeps an online softmax (running max and
sum), with a causal mask by position: a new token sees the cached prefix and the new tokens before it.
Keys and values are read once per program and never copied: nothing per sequence is gathered.

The batch's new keys and values are written into the pool before the call (one index_put per tensor), so
the kernel reads the new tokens' own keys from the pool like any other.

Shapes and counts are runtime values and the tile sizes depend only on the model (head_dim, the GQA group,
the block size, the dtype): a new batch, length or block table never recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specmesh.errors import InvalidArgument

BLOCK_N = 32  # key positions per tile
ROWS = 32  # target query rows per program (tokens x GQA group), >= 16 for tl.dot


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def tiles(group: int) -> tuple[int, int]:
    """(BLOCK_G, BLOCK_Q): query heads per KV head padded to a power of two, and tokens per program."""
    block_g = _next_pow2(group)
    return block_g, max(1, ROWS // block_g)


def plan(segments: Sequence[tuple[int, int, int]], group: int, device: torch.device) -> torch.Tensor:
    """The programs of one forward: [P, 4] int32 rows (sequence index, first batch row, tokens, first
    position), from each sequence's (first batch row, new tokens, first new position)."""
    return torch.tensor(plan_rows(segments, group), dtype=torch.int32, device=device).view(-1, 4)


def plan_rows(segments: Sequence[tuple[int, int, int]], group: int) -> list[tuple[int, int, int, int]]:
    """`plan`'s rows, on the host."""
    _, block_q = tiles(group)
    rows: list[tuple[int, int, int, int]] = []
    for i, (off, n, start) in enumerate(segments):
        for j in range(0, n, block_q):
            rows.append((i, off + j, min(block_q, n - j), start + j))
    return rows


def block_tables(tables: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[S, max blocks] int32, rows padded with block 0 (never read: positions past a sequence's end are
    masked)."""
    width = max(1, max((len(t) for t in tables), default=1))
    out = torch.zeros((len(tables), width), dtype=torch.int32)
    for i, t in enumerate(tables):
        if t:
            out[i, : len(t)] = torch.tensor(list(t), dtype=torch.int32)
    return out.to(device)


def check_device(t: torch.Tensor) -> None:
    """Triton runs on CUDA, or anywhere in its interpreter (TRITON_INTERPRET=1, read when the kernel is
    defined: for tests)."""
    import os

    if t.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise InvalidArgument(
            f"the block-table attention kernel runs on CUDA, or on {t.device.type} under TRITON_INTERPRET=1"
        )


def block_attention(
    out: torch.Tensor,
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: torch.Tensor,
    programs: torch.Tensor,
    block_size: int,
    scale: float,
) -> None:
    """out[t] = attention of q[t] ([T, nh, D], any strides with a unit last one) over its sequence's keys
    and values in the pool (k_pool, v_pool: [n_kv, slots, D]) up to its own position, per `programs`
    (`plan`) and `tables` (`block_tables`). out: [T, nh, D]."""
    check_device(q)
    kernel = _kernel()
    _, nh, d = q.shape
    n_kv = k_pool.shape[0]
    if nh % n_kv or out.shape != q.shape or k_pool.shape != v_pool.shape or k_pool.shape[2] != d:
        raise InvalidArgument(f"block attention: q {tuple(q.shape)} against a pool {tuple(k_pool.shape)}")
    if q.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1 or out.stride(2) != 1:
        raise InvalidArgument("block attention needs the head dimension contiguous")
    if not programs.numel():
        return
    group = nh // n_kv
    block_g, block_q = tiles(group)
    grid = (programs.shape[0], n_kv)
    kernel[grid](
        out,
        q,
        k_pool,
        v_pool,
        tables,
        programs,
        out.stride(0),
        out.stride(1),
        q.stride(0),
        q.stride(1),
        k_pool.stride(0),
        k_pool.stride(1),
        v_pool.stride(0),
        v_pool.stride(1),
        tables.stride(0),
        float(scale),
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        HEAD_DIM=d,
        BLOCK_D=max(16, _next_pow2(d)),
        KV_BLOCK=block_size,
        # fp32 inputs: exact products, not TF32. Off CUDA (the interpreter, whose dot gets bf16 wrong) the
        # products are taken in fp32 whatever the dtype.
        IEEE=q.dtype == torch.float32 or q.device.type != "cuda",
    )


def reference(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    tables: Sequence[Sequence[int]],
    segments: Sequence[tuple[int, int, int]],
    block_size: int,
    scale: float,
) -> torch.Tensor:
    """What `block_attention` computes, in torch (gathered, float32): for tests."""
    t, nh, d = q.shape
    group = nh // k_pool.shape[0]
    out = torch.zeros((t, nh, d), dtype=torch.float32)
    for table, (off, n, start) in zip(tables, segments, strict=True):
        end = start + n
        pos = torch.arange(end)
        slots = torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size
        k = k_pool[:, slots].float().repeat_interleave(group, 0)  # [nh, end, D]
        v = v_pool[:, slots].float().repeat_interleave(group, 0)
        qs = q[off : off + n].float().transpose(0, 1)  # [nh, n, D]
        s = qs @ k.transpose(1, 2) * scale  # [nh, n, end]
        vis = pos[None, :] <= torch.arange(start, end)[:, None]
        s = s.masked_fill(~vis, float("-inf"))
        out[off : off + n] = (s.softmax(-1) @ v).transpose(0, 1)
    return out


_KERNEL = None


def _kernel():
    """The jitted kernel, defined on first use so that importing the runtime never needs Triton."""
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = _define()
    return _KERNEL


def _define():
    import triton
    import triton.language as tl

    @triton.jit(
        do_not_specialize=[
            "s_out_t",
            "s_out_h",
            "s_q_t",
            "s_q_h",
            "s_k_h",
            "s_k_s",
            "s_v_h",
            "s_v_s",
            "s_table",
        ]
    )
    def _block_attention_kernel(
        out_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        table_ptr,  # [S, W] int32
        prog_ptr,  # [P, 4] int32: sequence, first row, tokens, first position
        s_out_t,
        s_out_h,
        s_q_t,
        s_q_h,
        s_k_h,
        s_k_s,
        s_v_h,
        s_v_s,
        s_table,
        scale,
        GROUP: tl.constexpr,
        BLOCK_G: tl.constexpr,
        BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        KV_BLOCK: tl.constexpr,
        IEEE: tl.constexpr,
    ):
        pid = tl.program_id(0)
        kvh = tl.program_id(1)
        seq = tl.load(prog_ptr + pid * 4)
        row0 = tl.load(prog_ptr + pid * 4 + 1)
        nq = tl.load(prog_ptr + pid * 4 + 2)
        pos0 = tl.load(prog_ptr + pid * 4 + 3)

        r = tl.arange(0, BLOCK_Q * BLOCK_G)
        tok = r // BLOCK_G
        gh = r % BLOCK_G
        row_ok = (tok < nq) & (gh < GROUP)
        head = kvh * GROUP + gh
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        qrow = (row0 + tok).to(tl.int64)
        q = tl.load(
            q_ptr + qrow[:, None] * s_q_t + head[:, None] * s_q_h + d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        qpos = pos0 + tok

        m_i = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
        end = pos0 + nq
        k_base = k_ptr + kvh.to(tl.int64) * s_k_h
        v_base = v_ptr + kvh.to(tl.int64) * s_v_h
        for first in range(0, end, BLOCK_N):
            p = first + tl.arange(0, BLOCK_N)
            p_ok = p < end
            blk = tl.load(table_ptr + seq * s_table + p // KV_BLOCK, mask=p_ok, other=0)
            slot = blk.to(tl.int64) * KV_BLOCK + p % KV_BLOCK
            kv_mask = p_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + slot[:, None] * s_k_s + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * scale
            vis = (p[None, :] <= qpos[:, None]) & p_ok[None, :]
            s = tl.where(vis, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp(m_i - m_safe)
            pexp = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(pexp, 1)
            v = tl.load(v_base + slot[:, None] * s_v_s + d[None, :], mask=kv_mask, other=0.0)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(pexp, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(pexp.to(v.dtype), v)
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + qrow[:, None] * s_out_t + head[:, None] * s_out_h + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & d_ok[None, :],
        )

    return _block_attention_kernel
