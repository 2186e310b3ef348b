"""The prepared batch every accept-loop backend reads (the torch reference and the Triton kernel alike): built
once by `sampler.prepare` with shared torch code, so the backends differ only in the loop itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specmesh.rejection.limits import PLACEHOLDER_TOKEN_ID


@dataclass
class PreparedBatch:
    """Everything the accept loop needs; shapes: T = sum K_b, R = T + B rows, V vocab."""

    draft_token_ids: torch.Tensor  # [T] int64
    cu_num_draft_tokens: torch.Tensor  # [B] int32 inclusive cumsum of K_b
    draft_p_x: torch.Tensor  # [T] float32  p_i(x_i)
    draft_q_x: torch.Tensor  # [T] float32  q_i(x_i) (1 for point masses, 0 if x_i is outside the support)
    uniforms: torch.Tensor  # [T] float64
    residual_probs: torch.Tensor  # [R, V] float32: draft rows max(p - q, 0) (unnormalised), bonus rows p
    target_argmax: torch.Tensor  # [R] int64 (greedy rule)
    is_greedy: torch.Tensor  # [B] bool
    exponentials: torch.Tensor  # [B, V] float32, Exp(1); unused rows of greedy requests are ones
    max_spec_len: int

    def num_accepted_from(self, out: torch.Tensor) -> list[int]:
        # accepted = (filled entries) - 1; one sync for the whole batch
        return ((out != PLACEHOLDER_TOKEN_ID).sum(dim=1) - 1).tolist()
