"""Triton implementation of the rejection sampler's accept loop and exponential race.

One program per request, one launch per batch step. The loop over draft positions runs to the
compile-time bound MAX_SPEC_LEN with the request's runtime K as a mask, so a new K never recompiles.
After the loop the program makes one pass over the vocabulary for the single token it emits (recovered
at the first rejection, or bonus): argmax(residual / E), first index on ties, exactly like the torch
reference in `sampler.py`, with which it must agree token for token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from specmesh.rejection.limits import MAX_SPEC_LEN, PLACEHOLDER_TOKEN_ID

if TYPE_CHECKING:
    from specmesh.rejection.batch import PreparedBatch


# Sizes and strides are runtime values: no recompilation when K, the batch or the vocabulary changes shape.
@triton.jit(do_not_specialize=["out_stride", "probs_stride", "exp_stride", "vocab"])
def _rejection_kernel(
    out_ptr,  # [B, out_width] int64, prefilled with PLACEHOLDER_TOKEN_ID
    out_stride,
    draft_ptr,  # [T] int64
    cu_ptr,  # [B] int32 inclusive cumsum
    p_x_ptr,  # [T] float32
    q_x_ptr,  # [T] float32
    u_ptr,  # [T] float64
    probs_ptr,  # [R, V] float32 residual / bonus rows
    probs_stride,
    argmax_ptr,  # [R] int64
    greedy_ptr,  # [B] int1
    exp_ptr,  # [B, V] float32
    exp_stride,
    vocab,
    MAX_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0)
    end = tl.load(cu_ptr + b)
    start = tl.load(cu_ptr + b - 1, mask=b > 0, other=0)
    k = end - start
    row0 = (start + b).to(tl.int64)
    greedy = tl.load(greedy_ptr + b)

    num_accepted = 0
    rejected = 0
    for i in range(MAX_K):
        if (i < k) & (rejected == 0):
            x = tl.load(draft_ptr + start + i)
            if greedy:
                ok = x == tl.load(argmax_ptr + row0 + i)
            else:
                p = tl.load(p_x_ptr + start + i).to(tl.float64)
                q = tl.load(q_x_ptr + start + i).to(tl.float64)
                u = tl.load(u_ptr + start + i)
                ok = (q > 0) & (u < p / tl.where(q > 0, q, 1.0))
            if ok:
                tl.store(out_ptr + b * out_stride + i, x)
                num_accepted += 1
            else:
                rejected = 1

    emit_row = row0 + num_accepted
    if greedy:
        token = tl.load(argmax_ptr + emit_row)
    else:
        best = -1.0
        token = tl.zeros((), dtype=tl.int64)
        for v0 in range(0, vocab, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            m = offs < vocab
            p = tl.load(probs_ptr + emit_row * probs_stride + offs, mask=m, other=0.0)
            e = tl.load(exp_ptr + b.to(tl.int64) * exp_stride + offs, mask=m, other=1.0)
            # div_rn: IEEE round-to-nearest like torch; plain `/` compiles to an approximate division on
            # NVIDIA GPUs, which could flip near-ties of the race between the two backends.
            score = tl.where(m, tl.math.div_rn(p, e), -1.0)
            blk_best = tl.max(score, axis=0)
            if blk_best > best:  # strictly greater: the first index wins ties, as torch.argmax
                best = blk_best
                token = (tl.argmax(score, axis=0) + v0).to(tl.int64)
    tl.store(out_ptr + b * out_stride + num_accepted, token)


def rejection_sample_triton(b: PreparedBatch) -> torch.Tensor:
    """Same interface and result as `rejection_sample_torch`; checks inputs, allocates, launches once."""
    if b.max_spec_len > MAX_SPEC_LEN:
        raise ValueError(f"K = {b.max_spec_len} exceeds the kernel bound {MAX_SPEC_LEN}")
    n_req = b.cu_num_draft_tokens.numel()
    probs, exps = b.residual_probs, b.exponentials
    assert probs.dtype == torch.float32 and exps.dtype == torch.float32
    assert b.uniforms.dtype == torch.float64 and b.draft_token_ids.dtype == torch.int64
    assert probs.stride(1) == 1 and exps.stride(1) == 1
    out = torch.full((n_req, b.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=probs.device)
    if n_req == 0:
        return out
    # Empty draft tensors still need a valid pointer.
    draft = b.draft_token_ids if b.draft_token_ids.numel() else out.new_zeros(1)
    p_x = b.draft_p_x if b.draft_p_x.numel() else probs.new_zeros(1)
    q_x = b.draft_q_x if b.draft_q_x.numel() else probs.new_zeros(1)
    u = b.uniforms if b.uniforms.numel() else b.uniforms.new_zeros(1)
    _rejection_kernel[(n_req,)](
        out,
        out.stride(0),
        draft,
        b.cu_num_draft_tokens.contiguous(),
        p_x,
        q_x,
        u,
        probs,
        probs.stride(0),
        b.target_argmax.contiguous(),
        b.is_greedy.contiguous(),
        exps,
        exps.stride(0),
        probs.size(1),
        MAX_K=MAX_SPEC_LEN,
        BLOCK_V=1024,
    )
    return out
