"""Batched rejection sampling for speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

One call verifies a batch of requests with ragged draft lengths (K = 0..MAX_SPEC_LEN), greedy and sampled
requests mixed. Layout follows vLLM v1: draft ids of the batch flattened, with inclusive cumulative counts;
target logits hold K_b + 1 rows per request (one per draft position, then the bonus row); the output is
`[B, max_K + 1]` padded with -1.

Rules, for request b and position i (p = target's processed distribution, q = draft's):
  greedy:  accept x_i while x_i == argmax p_i; at the first mismatch emit argmax p_i.
  sampled: accept x_i iff u_i < p_i(x_i) / q_i(x_i), u_i ~ U[0, 1) in float64 (q = 0 rejects);
           at the first rejection emit the recovered token ~ norm(max(p_i - q_i, 0)),
           drawn by exponential race argmax(residual / E), E ~ Exp(1);
  if all K pass, emit the bonus token ~ p_{K+1} (same race). At most one of recovered / bonus is used per
  request, so one E vector per request suffices.
A draft that sends no probabilities is a point mass q = δ_x: accept with probability p(x), else sample p
with x removed — the same formulas. A sparse q (ids + probs, the draft's truncated processed distribution)
enters the residual only at its support.

Everything up to the accept loop (processing logits, gathering p(x), writing residuals, drawing random
numbers from per-request generators) is shared torch code; the accept loop + race has two backends with
one interface: `torch` (vectorised reference, the CPU path) and `triton` (one launch per batch step,
MAX_SPEC_LEN a compile-time bound so K changes never recompile). `auto` = triton on CUDA, torch on CPU.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specmesh.domain import DraftBlock, TokenLogprob
from specmesh.errors import InvalidArgument
from specmesh.rejection.batch import PreparedBatch
from specmesh.rejection.limits import MAX_SPEC_LEN, PLACEHOLDER_TOKEN_ID
from specmesh.sampling import (
    BatchSamplingParams,
    LogitsContext,
    SamplingParams,
    apply_context_processing,
    process_logits,
    row_argmax,
)

_EXP_FLOOR = torch.finfo(torch.float32).tiny  # exponential_ can round to 0; keep p / E finite


@dataclass
class RejectionInput:
    """One request's input to the sampler for one batch step: its draft block, and the sampling parameters
    and random stream it is verified under."""

    block: DraftBlock
    params: SamplingParams
    generator: torch.Generator | None = None  # per-request stream (seeded requests); None = shared
    # The committed tokens the block continues, for context-dependent processing (penalties, bans, ...);
    # its draft_ids are ignored: the block's own tokens are used. None = no such processing.
    context: LogitsContext | None = None

    @classmethod
    def of(
        cls,
        token_ids: list[int],
        params: SamplingParams,
        q_ids: torch.Tensor | None = None,
        q_probs: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        context: LogitsContext | None = None,
    ) -> RejectionInput:
        return cls(DraftBlock(list(token_ids), q_ids, q_probs), params, generator, context)

    @property
    def block_context(self) -> LogitsContext | None:
        """The context of this block's K + 1 rows: row i continues the committed tokens + x_1..x_i."""
        if self.context is None:
            return None
        c = self.context
        return LogitsContext(c.tokens, c.output_start, self.block.token_ids, c.eos_token_ids, c.grammar)

    @property
    def k(self) -> int:
        return self.block.k

    @property
    def token_ids(self) -> list[int]:
        return self.block.token_ids

    @property
    def q_ids(self) -> torch.Tensor | None:
        return self.block.q_ids

    @property
    def q_probs(self) -> torch.Tensor | None:
        return self.block.q_probs


def validate_block(block: DraftBlock | RejectionInput, vocab_size: int, max_spec_len: int = MAX_SPEC_LEN) -> None:
    """Raise InvalidArgument saying what is wrong; called before a block joins a batch, so it cannot poison it."""
    k = block.k
    if k > max_spec_len:
        raise InvalidArgument(f"draft block has {k} tokens, the limit is {max_spec_len}")
    bad = [t for t in block.token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"draft token ids out of range [0, {vocab_size}): {bad[:8]}")
    q_ids, probs = block.q_ids, block.q_probs
    if q_ids is None and probs is None:
        return
    if q_ids is None or probs is None:
        raise InvalidArgument("draft probabilities need both ids and probs")
    if q_ids.shape != probs.shape or q_ids.dim() != 2 or q_ids.size(0) != k:
        raise InvalidArgument(
            f"draft probabilities must be [K={k}, S] ids and probs, got {tuple(q_ids.shape)} and {tuple(probs.shape)}"
        )
    valid = q_ids >= 0
    if bool(((q_ids >= vocab_size) & valid).any()):
        raise InvalidArgument(f"draft probability ids out of range [0, {vocab_size})")
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise InvalidArgument("draft probabilities must be finite and >= 0")
    sums = torch.where(valid, probs, 0).sum(dim=1)
    if bool(((sums - 1).abs() > 1e-3).any()):
        raise InvalidArgument(f"draft probabilities must sum to 1 per position, got {sums.tolist()}")
    ids = torch.where(valid, q_ids, -1 - torch.arange(q_ids.size(1)))
    if bool((ids.sort(dim=1).values.diff(dim=1) == 0).any()):
        raise InvalidArgument("draft probability ids repeat within a position")
    # A token the draft says it could not have sampled would bias the residual: refuse it.
    x = torch.tensor(block.token_ids, dtype=q_ids.dtype)[:, None]
    q_x = torch.where(q_ids == x, probs, 0).sum(dim=1)
    if bool((q_x <= 0).any()):
        raise InvalidArgument("a draft token is outside its own draft distribution's support (q(x) = 0)")


@dataclass
class RejectionOutput:
    output_token_ids: torch.Tensor  # [B, max_K + 1] int64, PLACEHOLDER_TOKEN_ID padded
    num_accepted: list[int]  # [B] accepted draft tokens (the emitted recovered/bonus token not counted)
    # [B] per committed token of request b, its raw log-probability (and top ones); None where not asked for
    logprobs: list[list[TokenLogprob] | None] = dataclasses.field(default_factory=list)

    def tokens(self, b: int) -> list[int]:
        """Committed tokens of request b: accepted drafts + the recovered or bonus token."""
        return self.output_token_ids[b, : self.num_accepted[b] + 1].tolist()


class RejectionSampler:
    """Verifies a batch of draft blocks against target logits. See the module docstring."""

    def __init__(self, backend: str = "auto", seed: int | None = None, device: str | torch.device = "cpu"):
        if backend not in ("auto", "torch", "triton"):
            raise ValueError(f"unknown rejection sampler backend {backend!r}")
        self.device = torch.device(device)
        if backend == "auto":
            backend = "triton" if self.device.type == "cuda" else "torch"
        if (
            backend == "triton"
            and self.device.type != "cuda"
            and os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on")
        ):
            # A compiled kernel cannot read CPU tensors; without this the first verify would fail instead.
            raise ValueError(
                f"the triton rejection sampler needs a CUDA device (got {self.device}); use the torch backend, or "
                "set TRITON_INTERPRET=1 to run the kernel in Triton's interpreter"
            )
        self.backend = backend
        self.generator = torch.Generator(device=self.device)  # shared stream for unseeded requests
        if seed is not None:
            self.generator.manual_seed(seed)
        else:
            self.generator.seed()

    @torch.inference_mode()
    def __call__(self, target_logits: torch.Tensor, blocks: list[RejectionInput]) -> RejectionOutput:
        """target_logits: [sum(K_b + 1), V], request b's rows contiguous, bonus row last."""
        if self.backend == "torch" and blocks and all(b.params.greedy for b in blocks):
            out, num_accepted = _greedy(target_logits, blocks)
            return RejectionOutput(out, num_accepted, _logprobs(target_logits, blocks, out, num_accepted))
        prep = prepare(target_logits, blocks, self.generator)
        if self.backend == "triton":
            from specmesh.rejection.triton_kernel import rejection_sample_triton as kernel
        else:
            kernel = rejection_sample_torch
        out = kernel(prep)
        num_accepted = prep.num_accepted_from(out)
        return RejectionOutput(out, num_accepted, _logprobs(target_logits, blocks, out, num_accepted))


def _check_rows(target_logits: torch.Tensor, rows: int) -> None:
    if target_logits.dim() != 2 or target_logits.size(0) != rows:
        raise ValueError(f"target_logits must be [{rows}, V], got {tuple(target_logits.shape)}")


def _greedy(target_logits: torch.Tensor, blocks: list[RejectionInput]) -> tuple[torch.Tensor, list[int]]:
    """`rejection_sample_torch(prepare(...))` where every request is greedy: a draft token is accepted while it is
    the processed logits' argmax at its row, and the argmax of the first row that rejects (or of the bonus row)
    follows. One argmax and the rest over Python lists: the vectorised path's thirty-odd small tensor ops cost
    ~0.15 ms a verify step on a CPU, a few percent of a one-stream round."""
    num_draft = [b.k for b in blocks]
    _check_rows(target_logits, sum(num_draft) + len(blocks))
    processed = apply_context_processing(
        target_logits, [b.params for b in blocks], [b.block_context for b in blocks], [k + 1 for k in num_draft]
    )
    best = row_argmax(processed).tolist()
    width = max(num_draft) + 1
    out: list[list[int]] = []
    accepted: list[int] = []
    row = 0
    for b in blocks:
        n = 0
        while n < b.k and b.token_ids[n] == best[row + n]:
            n += 1
        out.append([*b.token_ids[:n], best[row + n], *[PLACEHOLDER_TOKEN_ID] * (width - n - 1)])
        accepted.append(n)
        row += b.k + 1
    return torch.tensor(out, dtype=torch.int64, device=target_logits.device), accepted


def token_logprobs(raw_logits: torch.Tensor, token_ids: Sequence[int], top: Sequence[int]) -> list[TokenLogprob]:
    """raw_logits [n, V] (row i: the logits token_ids[i] was drawn from) -> the log-softmax of the raw logits
    at each token, with its `top[i]` most likely tokens. One log-softmax and one top-k for all rows."""
    if not len(token_ids):
        return []
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    n_top = max(top)
    top_v, top_i = logprobs.topk(n_top, dim=-1) if n_top else (logprobs[:, :0], ids[:, None][:, :0])
    top_v_l, top_i_l = top_v.tolist(), top_i.tolist()
    return [
        TokenLogprob(int(t), float(c), tuple(zip(top_i_l[r][: top[r]], top_v_l[r][: top[r]], strict=True)))
        for r, (t, c) in enumerate(zip(token_ids, chosen, strict=True))
    ]


def _logprobs(
    raw_logits: torch.Tensor, blocks: list[RejectionInput], out: torch.Tensor, num_accepted: list[int]
) -> list[list[TokenLogprob] | None]:
    """The raw log-probabilities of each committed token, for the requests that ask (nothing otherwise): the
    committed token at position i was drawn from row i of its request, so the rows are read as they are."""
    result: list[list[TokenLogprob] | None] = [None] * len(blocks)
    want = [b for b, blk in enumerate(blocks) if blk.params.logprobs is not None]
    if not want:
        return result
    row0 = [0]
    for blk in blocks:
        row0.append(row0[-1] + blk.k + 1)
    rows: list[int] = []
    tokens: list[int] = []
    tops: list[int] = []
    for b in want:
        n = num_accepted[b] + 1
        rows += range(row0[b], row0[b] + n)
        tokens += out[b, :n].tolist()
        tops += [blocks[b].params.logprobs or 0] * n
    lps = token_logprobs(raw_logits[torch.tensor(rows, device=raw_logits.device)], tokens, tops)
    at = 0
    for b in want:
        n = num_accepted[b] + 1
        result[b], at = lps[at : at + n], at + n
    return result


def prepare(target_logits: torch.Tensor, blocks: list[RejectionInput], shared: torch.Generator) -> PreparedBatch:
    device = target_logits.device
    num_draft = [b.k for b in blocks]
    n_req, n_tok = len(blocks), sum(num_draft)
    rows_per_req = [k + 1 for k in num_draft]
    _check_rows(target_logits, n_tok + n_req)
    vocab = target_logits.size(1)
    params = [b.params for b in blocks]
    # Context-dependent processing first: every rule below (greedy's argmax included) sees processed logits.
    target_logits = apply_context_processing(target_logits, params, [b.block_context for b in blocks], rows_per_req)
    target_argmax = row_argmax(target_logits)
    cu = torch.tensor(num_draft, device=device).cumsum(0)
    draft_ids = torch.tensor([t for b in blocks for t in b.token_ids], dtype=torch.int64, device=device)
    if all(p.greedy for p in params):
        # Greedy needs only the argmax: skip softmax, residuals and random draws (a width-1 race is unused).
        zeros = torch.zeros(n_tok, device=device)
        return PreparedBatch(
            draft_ids,
            cu.to(torch.int32),
            zeros,
            zeros,
            zeros.double(),
            target_logits.new_zeros((n_tok + n_req, 1), dtype=torch.float32),
            target_argmax,
            torch.ones(n_req, dtype=torch.bool, device=device),
            torch.ones((n_req, 1), device=device),
            max(num_draft, default=0),
        )
    probs = process_logits(target_logits, BatchSamplingParams.from_params(params, rows_per_req, device))

    # row of each draft position in the [R, V] layout: request b's rows start at (tokens before b) + b
    req_of_tok = torch.repeat_interleave(torch.arange(n_req, device=device), torch.tensor(num_draft, device=device))
    draft_rows = torch.arange(n_tok, device=device) + req_of_tok
    p_x = probs[draft_rows, draft_ids] if n_tok else probs.new_zeros(0)

    # sparse q of every draft position, padded to S_max; point masses become (x, 1.0)
    s_max = max([b.q_ids.size(1) for b in blocks if b.q_ids is not None and b.k] or [1])
    ids_parts, prob_parts = [], []
    for b in blocks:
        if not b.k:
            continue
        if b.q_ids is None:
            ids = torch.tensor(b.token_ids, dtype=torch.int64)[:, None]
            probs_b = torch.ones((b.k, 1))
        else:
            assert b.q_probs is not None  # blocks are validated: ids and probs come together
            ids, probs_b = b.q_ids.long(), b.q_probs.float()
        pad = s_max - ids.size(1)
        if pad:
            ids = torch.nn.functional.pad(ids, (0, pad), value=-1)
            probs_b = torch.nn.functional.pad(probs_b, (0, pad), value=0.0)
        ids_parts.append(ids)
        prob_parts.append(probs_b)
    if ids_parts:
        q_ids = torch.cat(ids_parts).to(device)
        q_probs = torch.cat(prob_parts).to(device)
        # Sent q sums to 1 only within validate_block's tolerance: make it exact, so p <= q everywhere
        # cannot leave a rejection with nothing to recover from.
        q_probs = q_probs / q_probs.sum(dim=1, keepdim=True)
    else:
        q_ids = torch.empty((0, s_max), dtype=torch.int64, device=device)
        q_probs = torch.empty((0, s_max), dtype=torch.float32, device=device)
    q_x = torch.where(q_ids == draft_ids[:, None], q_probs, 0).sum(dim=1)

    _write_residual(probs, draft_rows, q_ids, q_probs)

    is_greedy = torch.tensor([p.greedy for p in params], dtype=torch.bool, device=device)
    uniforms = torch.zeros(n_tok, dtype=torch.float64, device=device)
    exponentials = torch.ones((n_req, vocab), dtype=torch.float32, device=device)
    _draw_random(blocks, cu, uniforms, exponentials, shared)
    return PreparedBatch(
        draft_ids,
        cu.to(torch.int32),
        p_x,
        q_x,
        uniforms,
        probs,
        target_argmax,
        is_greedy,
        exponentials,
        max(num_draft, default=0),
    )


def _write_residual(probs: torch.Tensor, draft_rows: torch.Tensor, q_ids: torch.Tensor, q_probs: torch.Tensor) -> None:
    """Turn each draft row of `probs` into max(p - q, 0), in place; q is zero outside its support.

    Where the residual is zero everywhere (p == q up to rounding), a rejection has probability zero in exact
    arithmetic but can still happen in floating point; the row then keeps p, so the race never picks a
    token the target gives no probability.
    """
    valid = q_ids >= 0
    if bool(valid.any()):
        rows = draft_rows[:, None].expand_as(q_ids)[valid]
        cols = q_ids[valid]
        p_support = probs[rows, cols]
        probs[rows, cols] = (p_support - q_probs[valid]).clamp_min(0)
        empty = probs[draft_rows].amax(dim=1) <= 0  # [T]
        if bool(empty.any()):
            restore = empty[:, None].expand_as(q_ids)[valid]
            probs[rows[restore], cols[restore]] = p_support[restore]


def _draw_random(blocks, cu, uniforms, exponentials, shared) -> None:
    """Per request, in a fixed order: K uniforms, then V exponentials. Greedy requests draw nothing.

    Seeded requests draw from their own generator (replay exactly whatever they are batched with);
    the others share one stream, drawn in a single call per tensor.
    """
    starts = (cu - torch.tensor([b.k for b in blocks], device=cu.device)).tolist()
    shared_tok = torch.zeros(uniforms.numel(), dtype=torch.bool)
    shared_e = []
    for i, b in enumerate(blocks):
        if b.params.greedy:
            continue
        s = starts[i]
        if b.generator is None:
            shared_tok[s : s + b.k] = True
            shared_e.append(i)
            continue
        if b.k:
            uniforms[s : s + b.k].uniform_(generator=b.generator)
        exponentials[i].exponential_(generator=b.generator)
    n_shared = int(shared_tok.sum())
    if n_shared:
        idx = shared_tok.nonzero().squeeze(1).to(uniforms.device)
        uniforms[idx] = torch.rand(n_shared, dtype=torch.float64, device=uniforms.device, generator=shared)
    if shared_e:
        rows = torch.tensor(shared_e, device=exponentials.device)
        exponentials[rows] = torch.empty(
            (len(shared_e), exponentials.size(1)), device=exponentials.device
        ).exponential_(generator=shared)
    exponentials.clamp_(min=_EXP_FLOOR)


def rejection_sample_torch(b: PreparedBatch) -> torch.Tensor:
    """Vectorised reference of the accept loop + exponential race. Returns [B, max_spec_len + 1]."""
    device = b.draft_token_ids.device
    n_req, k_max = b.cu_num_draft_tokens.numel(), b.max_spec_len
    cu = b.cu_num_draft_tokens.long()
    num_draft = torch.diff(cu, prepend=cu.new_zeros(1))
    starts = cu - num_draft
    pos = torch.arange(k_max, device=device)[None, :]
    valid = pos < num_draft[:, None]  # [B, Kmax]
    flat = (starts[:, None] + pos).clamp(max=max(b.draft_token_ids.numel() - 1, 0))
    row0 = starts + torch.arange(n_req, device=device)  # first target row of each request

    out = torch.full((n_req, k_max + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device)
    if b.draft_token_ids.numel():
        x = b.draft_token_ids[flat]
        ratio = b.draft_p_x[flat].double() / b.draft_q_x[flat].double()
        accept_sampled = (b.draft_q_x[flat] > 0) & (b.uniforms[flat] < ratio)
        accept_greedy = x == b.target_argmax[(row0[:, None] + pos).clamp(max=b.target_argmax.numel() - 1)]
        accept = torch.where(b.is_greedy[:, None], accept_greedy, accept_sampled) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)
        keep = pos < num_accepted[:, None]
        out[:, :k_max] = torch.where(keep, x, PLACEHOLDER_TOKEN_ID)
    else:
        num_accepted = torch.zeros(n_req, dtype=torch.int64, device=device)
    emit_rows = row0 + num_accepted  # the first rejected position's row, or the bonus row
    raced = row_argmax(b.residual_probs[emit_rows] / b.exponentials)
    emitted = torch.where(b.is_greedy, b.target_argmax[emit_rows], raced)
    out[torch.arange(n_req, device=device), num_accepted] = emitted
    return out
