"""`PagedRunner`: `BatchedRunner`'s runner (one ragged forward per batch, the same `Runner` protocol and
sequence semantics) with the KV in fixed-size blocks from a `BlockManager` instead of one fixed slot per
sequence, so a sequence holds only the blocks its tokens need and full blocks of a shared prompt prefix are
computed once and shared (prefix caching, scoped by tenant).

* KV arena: per layer one K and one V tensor [n_kv, num_blocks * block_size, D], token-addressed (the
  physical slot of position i is block * block_size + offset). A run of physically consecutive blocks is
  the strided view `k[:, s:e]`, laid out as `BatchedRunner`'s slot view, so a sequence whose blocks form one
  run attends exactly as there: one SDPA call over a view, no copy.
* A sequence with several runs (a shared prefix elsewhere in the pool, or fragmentation) attends on CPU,
  past a short context (`gather_max_tokens`, below which a gather is cheaper), run by run with the flash
  kernel, which also returns each row's log-sum-exp, and the runs are merged:
  lse = logaddexp over the pieces, out = sum of out_r * exp(lse_r - lse). The pieces are the runs covering
  the cached prefix (visible to every new query, no mask) and the new tokens' own keys straight from the
  batch (causal among themselves), so the new tokens may span runs.
* On a CPU in float32 (`attention_backend="auto"`) every sequence of up to `cpu_kernels.MAX_TOKENS` new
  tokens (a decode step, a verify block) attends through the block-table C kernel
  (`specmesh.runtime.cpu_kernels`): one call per layer for all of them, the KV read where it lies, so
  neither the merge nor the gather above is needed for them; prefill chunks keep the paths above.
* On CUDA every sequence of the batch attends through the block-table Triton kernel
  (`specmesh.runtime.block_attention`): one launch per layer, the KV read where it lies, whatever the runs.
  Without it (`block_kernel=False`, or `attention_backend="math"`) a multi-run sequence's keys and values are
  gathered through `index_select` on its slots: correct, not fast.
* A step: per sequence, sync (keep the longest valid prefix; the table is truncated to it, and a kept
  partial block that is shared or registered is given back, so the cached prefix may shrink to a block
  boundary), reserve blocks for everything fed (OutOfBlocks, a ResourceExhausted, is raised before anything
  is written, every sequence left as it was), write every new key/value with one index_put per tensor,
  attend, and only once the pass succeeded mark the positions written and register the full blocks of
  committed tokens (draft tokens fed as `extra` are cached but not committed: their blocks stay private).
* `new_sequence(token_ids, scope)` opens the table with the cached full blocks of the prompt's prefix in
  that scope; the next forward computes only the rest (`prefix_cache_hit_tokens` counts those tokens).

The decoder is `batched._RaggedDecoder` with a `KvAttention` of its own; the runner checks it against the
stock HF forward on a probe (a chunked prefill, a decode block with a rollback, a shared prefix, a sequence
of several runs) when built and refuses models it cannot reproduce.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specmesh.errors import InvalidArgument
from specmesh.runtime import PrefillChunk, StepResult, cpu_kernels
from specmesh.runtime import block_attention as kernel
from specmesh.runtime.attention import check_attention_backend, sdpa_context
from specmesh.runtime.batched import (
    BatchedRunner,
    _RaggedDecoder,
    _RaggedRunner,
    _Work,
    causal_mask,
    fold_queries,
    unfold_rows,
)
from specmesh.runtime.blocks import BlockManager, BlockPool, BlockTable, OutOfBlocks
from specmesh.runtime.graphs import DecodeGraphs
from specmesh.runtime.static import TrackedSequence, logits_agree

log = logging.getLogger(__name__)
_flash_lse = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
GATHER_MAX_TOKENS = 256  # see PagedRunner.gather_max_tokens


class PagedSequence(TrackedSequence):
    """One sequence: committed ids, the ids whose KV its table's positions [0, len) hold, and the table
    (`freed` once given back)."""

    __slots__ = ("__weakref__", "_release", "_runner", "freed", "table")

    def __init__(self, token_ids: list[int], runner: PagedRunner, table: BlockTable):
        super().__init__(token_ids)
        self.table = table
        self.freed = False
        self._runner = runner
        # Gives the blocks back when the sequence is freed or garbage-collected, whichever comes first.
        self._release = weakref.finalize(self, runner._release_table, table)


class _Segment(NamedTuple):
    """How one sequence attends in a forward."""

    start: int  # its first new token's position
    n: int  # new tokens
    off: int  # their first row in the batch
    view: tuple[int, int] | None  # one run: the physical token range [s, e) of positions [0, start + n)
    prefix: list[tuple[int, int]]  # several runs: the physical ranges of positions [0, start)
    gather: torch.Tensor | None  # no flash kernel: the slots of positions [0, start + n)
    mask: torch.Tensor | None  # view / gather: the causal mask over [0, start + n); runs: over the new keys


def physical_ranges(table: BlockTable, end: int) -> list[tuple[int, int]]:
    """The physical token ranges [s, e) holding positions [0, end) of `table`, in logical order."""
    out: list[tuple[int, int]] = []
    bs, left = table.block_size, end
    for first, count in table.runs():
        if left <= 0:
            break
        n = min(count * bs, left)
        out.append((first * bs, first * bs + n))
        left -= n
    return out


class _BlockAttention:
    """The block arena's KV write and attention (see the module docstring). slots: [T] the physical slot of
    each new token."""

    __slots__ = ("block_size", "cos", "cpu", "g", "k_pool", "nkv", "plan", "segments", "sin", "slots", "v_pool")

    def __init__(
        self,
        dec: _RaggedDecoder,
        k_pool: list[torch.Tensor],
        v_pool: list[torch.Tensor],
        slots: torch.Tensor,
        segments: list[_Segment],
        plan: tuple[torch.Tensor, torch.Tensor] | None = None,
        block_size: int = 0,
        cpu: cpu_kernels.Plan | None = None,
    ):
        self.k_pool, self.v_pool, self.slots, self.segments = k_pool, v_pool, slots, segments
        self.nkv, self.g = dec.n_kv, dec.group
        self.plan, self.block_size = plan, block_size  # the kernel's (block tables, programs), if it runs
        self.cpu = cpu  # the CPU kernel's call for the short sequences; `segments` are the others
        self.cos, self.sin = dec.cos, dec.sin

    @property
    def takes_qkv(self) -> bool:
        """Whether the whole batch is the CPU kernel's, so `qkv_attend` can do its rotary and KV write too."""
        return self.cpu is not None and not self.segments and self.plan is None

    def qkv_attend(self, layer: int, qkv: torch.Tensor, attn: torch.Tensor, scale: float) -> None:
        """Rotary, the KV write and attention from the layer's projection output [T, nh + 2 n_kv, D]."""
        assert self.cpu is not None
        cpu_kernels.block_attention_rope(
            attn, qkv, self.k_pool[layer], self.v_pool[layer], self.cpu, self.block_size, scale, self.cos, self.sin
        )

    def __call__(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, attn: torch.Tensor, scale: float
    ) -> None:
        k_layer, v_layer = self.k_pool[layer], self.v_pool[layer]
        nkv, g = self.nkv, self.g
        kw, vw = k.to(k_layer.dtype), v.to(v_layer.dtype)  # rounded once where the cache is narrower
        # Every new key/value of the batch at its physical slot: one index_put per tensor.
        k_layer[:, self.slots] = kw.transpose(0, 1)
        v_layer[:, self.slots] = vw.transpose(0, 1)
        if kw is not k:  # every later read of a new key sees it as the pool holds it
            k, v = kw.to(k.dtype), vw.to(v.dtype)
        if self.plan is not None:
            kernel.block_attention(attn, q, k_layer, v_layer, *self.plan, self.block_size, scale)
            return
        if self.cpu is not None:
            cpu_kernels.block_attention(attn, q, k_layer, v_layer, self.cpu, self.block_size, scale)
        for seg in self.segments:
            n, off = seg.n, seg.off
            qs = fold_queries(q[off : off + n], nkv, g)
            if seg.view is not None:
                s, e = seg.view
                keys, values = k_layer[:, s:e][None], v_layer[:, s:e][None]  # [1, n_kv, end, D], a view
                keys, values = keys.to(qs.dtype), values.to(qs.dtype)  # widened where the cache is narrower
                a = F.scaled_dot_product_attention(qs, keys, values, attn_mask=seg.mask, scale=scale)
            elif seg.gather is not None:
                keys = k_layer.index_select(1, seg.gather)[None].to(qs.dtype)  # [1, n_kv, end, D], gathered
                values = v_layer.index_select(1, seg.gather)[None].to(qs.dtype)
                a = F.scaled_dot_product_attention(qs, keys, values, attn_mask=seg.mask, scale=scale)
            else:
                a = self._runs(seg, qs, k[off : off + n], v[off : off + n], k_layer, v_layer, scale)
            attn[off : off + n] = unfold_rows(a, n, nkv, g)

    def _runs(
        self,
        seg: _Segment,
        qs: torch.Tensor,
        k_new: torch.Tensor,
        v_new: torch.Tensor,
        k_layer: torch.Tensor,
        v_layer: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Attention over several pieces merged by their log-sum-exp: the prefix runs (fully visible) and
        the new keys [n, n_kv, D] (causal among the new queries)."""
        assert _flash_lse is not None  # segments plan runs only where the kernel exists
        outs, lses = [], []
        for s, e in seg.prefix:  # every new query sees the whole cached prefix
            keys, values = k_layer[:, s:e][None].to(qs.dtype), v_layer[:, s:e][None].to(qs.dtype)
            o, lse = _flash_lse(qs, keys, values, 0.0, False, scale=scale)
            outs.append(o)
            lses.append(lse.float())
        # The new keys: causal among the new queries (square, so is_causal is exact; a GQA fold needs the mask).
        causal = seg.mask is None and seg.n > 1
        k_new, v_new = k_new.transpose(0, 1)[None], v_new.transpose(0, 1)[None]
        o, lse = _flash_lse(qs, k_new, v_new, 0.0, causal, attn_mask=seg.mask, scale=scale)
        outs.append(o)
        lses.append(lse.float())
        # Each piece's share of a row's softmax is exp(its lse - the lse of all), a softmax over the pieces:
        # five operators for any number of pieces (a sum of pieces took four per piece, the bulk of a 1-row
        # step's attention over a shared prefix).
        share = torch.stack(lses).softmax(0)  # [pieces, 1, H, R]
        return (torch.stack(outs).float() * share[..., None]).sum(0).to(qs.dtype)


class PagedRunner(_RaggedRunner):
    """`BatchedRunner`'s interface and semantics with the KV in `num_blocks` blocks of `block_size` tokens.

    A sequence may reach the model's `max_position_embeddings`, capped by `max_model_len` (and by the pool).
    `check`, `packed`, `prefault` and `attention_backend` as in `BatchedRunner`. `cuda_graph_max_bs`,
    `graph_tokens_per_seq`, `graph_capture`: decode steps from CUDA graphs (`_graphs`). `kv_cache_dtype`: the
    pools' element (None: the model's dtype); a float32 model on a CPU may keep its KV in bfloat16, which halves
    the bytes a long context's attention reads and doubles the tokens the same pool memory holds (vLLM's and
    SGLang's `--kv-cache-dtype`). Keys and values are rounded once, when written, and read back widened: every
    path (the fused step, the CPU kernel, SDPA) sees the same values, so a verify block and the target-only steps
    at the same positions still agree to the bit; against a float32 cache the logits move by bfloat16's rounding
    of K and V.
    """

    graphs: DecodeGraphs | None = None  # decode steps from CUDA graphs, once built (after the probes)

    def __init__(
        self,
        model: PreTrainedModel,
        num_blocks: int,
        block_size: int = 16,
        max_model_len: int | None = None,
        check: bool = True,
        packed: bool | None = None,
        prefault: bool = False,
        attention_backend: str = "auto",
        block_kernel: bool | None = None,
        cpu_kernel: bool | None = None,
        cuda_graph_max_bs: int = 0,
        graph_tokens_per_seq: int = 1,
        graph_capture: bool = True,
        kv_cache_dtype: torch.dtype | None = None,
    ):
        if not self.supports(model):
            raise ValueError(f"PagedRunner has no decoder for {type(model).__name__} with this config; use ModelRunner")
        super().__init__(model)
        self.attention_backend = check_attention_backend(attention_backend)
        self.max_len = self._limit(self.model_len, max_model_len, "max_model_len")
        self._dec = _RaggedDecoder(model, packed, padded=False)
        self._dec.reserve(self.max_len)
        self.num_layers = len(self._dec.layers)
        self.kv_dtype = self._dec.dtype if kv_cache_dtype is None else kv_cache_dtype
        if self.kv_dtype != self._dec.dtype and not (
            self.kv_dtype == torch.bfloat16 and self._dec.dtype == torch.float32 and self.device.type == "cpu"
        ):
            raise ValueError(
                f"kv_cache_dtype {self.kv_dtype} with a {self._dec.dtype} model on {self.device.type}: the cache "
                "keeps the model's dtype, or bfloat16 for a float32 model on a CPU"
            )
        self._prefault = prefault
        # Whether multi-run sequences attend run by run (the CPU flash kernel returns the log-sum-exp the
        # merge needs); otherwise their keys are gathered. "math" asks for the reference kernel everywhere.
        self.merge_runs = _flash_lse is not None and self.device.type == "cpu" and attention_backend != "math"
        # Up to this context a multi-run sequence is gathered even so: a merge costs a kernel call and a few
        # small ops per run and layer, a gather a copy of the context (on the demo target, 2 threads: gather
        # ahead at 200 tokens, even at ~400, the merge ahead at 900).
        self.gather_max_tokens = GATHER_MAX_TOKENS
        # The block-table kernel: by default wherever Triton compiles (CUDA); elsewhere only when asked (tests,
        # under TRITON_INTERPRET=1). "math" keeps the reference SDPA kernel everywhere.
        if block_kernel is None:
            block_kernel = self.device.type == "cuda" and attention_backend != "math"
        self.block_kernel = bool(block_kernel)
        if self.block_kernel and self.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"block_kernel: Triton runs on CUDA, or on {self.device.type} under TRITON_INTERPRET=1")
        # The CPU block-table kernel (`cpu_kernels`) for decode steps and verify blocks: by default on a CPU in
        # float32 under `auto` wherever it builds; other backends keep torch's SDPA.
        fits = self.device.type == "cpu" and self._dec.dtype == torch.float32 and not self.block_kernel
        if cpu_kernel is None:
            cpu_kernel = fits and attention_backend == "auto" and cpu_kernels.load() is not None
        elif cpu_kernel and not (fits and cpu_kernels.load() is not None):
            raise ValueError("cpu_kernel: the CPU attention kernel takes float32 on a CPU with a C compiler")
        self.cpu_kernel = bool(cpu_kernel)
        self._lock = threading.Lock()  # tables are opened/freed on the event loop, used on the model thread
        self._orphans: collections.deque[BlockTable] = collections.deque()  # given back, not yet freed
        self.prefix_cache_query_tokens = 0  # prompt tokens new_sequence looked up in the block cache
        self.prefix_cache_hit_tokens = 0  # ... and found there
        self._alloc(BlockPool(num_blocks, block_size))
        self.blocks = PagedBlocks(self)
        self.block_bytes = 2 * self.num_layers * self._dec.n_kv * block_size * self._dec.head_dim * self._elem
        if check and (self.block_kernel or self.cpu_kernel) and not self._matches_hf():
            # Never serve a kernel that disagrees with the model: the SDPA path is slower, not wrong.
            log.warning("the block-table attention kernel disagrees with the HF forward here; attending by SDPA")
            self.block_kernel = self.cpu_kernel = False
        if check and not self._matches_hf():
            raise ValueError(
                f"PagedRunner's decoder disagrees with the HF forward for {type(model).__name__}; use ModelRunner"
            )
        self.graphs = self._graphs(cuda_graph_max_bs, graph_tokens_per_seq, graph_capture)

    def _graphs(self, max_bs: int, tokens_per_seq: int, capture: bool) -> DecodeGraphs | None:
        """Decode steps from CUDA graphs (`specmesh.runtime.graphs`): on CUDA with the block-table kernel
        when `max_bs` > 0; `capture=False` runs their static padded forward eagerly (any device the kernel
        runs on)."""
        if max_bs < 0 or tokens_per_seq < 1:
            raise ValueError("cuda_graph_max_bs must be >= 0 and graph_tokens_per_seq >= 1")
        if not max_bs or (capture and self.device.type != "cuda"):
            return None
        if not self.block_kernel:
            log.warning("CUDA graphs off: they need the block-table attention kernel, which is off here")
            return None
        graphs = DecodeGraphs(self, max_bs, tokens_per_seq, capture)
        if capture:
            seconds = graphs.capture_all()
            log.info(
                "CUDA graphs: %d decode steps of up to %d tokens (%d sequences) captured in %.1f s",
                len(graphs.buckets),
                graphs.buckets[-1],
                max_bs,
                seconds,
            )
        return graphs

    def _alloc(self, pool: BlockPool) -> None:
        d = self._dec
        self.pool = pool
        self._blocks = BlockManager(pool)
        # One spare block past the pool's: the slot CUDA graphs' padding tokens write to, which no table names.
        shape = (d.n_kv, (pool.num_blocks + 1) * pool.block_size, d.head_dim)
        # Attention reads only written positions, so the arena needs no zeroing (prefault: resident at once).
        alloc = torch.zeros if self._prefault else torch.empty
        self._k = [alloc(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]
        self._v = [alloc(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]
        self._elem = self._k[0].element_size()

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        """Whether this runner can serve `model` (what `BatchedRunner` serves)."""
        return BatchedRunner.supports(model)

    # blocks ---------------------------------------------------------------------------------------
    # What metrics read (blocks used / free / shared / cached, usage, evictions, prefix hits) is `self.pool`'s.
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def pool_bytes(self) -> int:
        return self.pool.num_blocks * self.block_bytes

    def kv_account(self, bytes_per_token: int | None = None) -> BlockAccount:
        """`Runner.kv_account`: whole blocks (`bytes_per_token` does not apply)."""
        return BlockAccount(self)

    def context_limit(self, max_model_len: int = 0) -> int:
        """`Runner.context_limit`: the model's context capped by `max_model_len` (the runner's and this one)
        and by the pool."""
        limit = min(self.max_len, self.pool.num_blocks * self.pool.block_size)
        return limit if not max_model_len else min(limit, max_model_len)

    def new_sequence(self, token_ids: list[int], scope: bytes = b"") -> PagedSequence:
        """A sequence of `token_ids` holding the cached full blocks of their prefix in `scope`
        (`blocks.scope_of`): the next forward computes only the rest."""
        if not token_ids:
            raise InvalidArgument("a sequence needs at least one token")
        self._check_len(len(token_ids))
        with self._locked():
            table, hit = self._blocks.open(token_ids, scope)
        seq = PagedSequence(list(token_ids), self, table)
        seq.cached_ids = list(token_ids[:hit])
        self.prefix_cache_query_tokens += len(token_ids)
        self.prefix_cache_hit_tokens += hit
        return seq

    def free(self, seq: PagedSequence) -> None:
        """Give the sequence's blocks back now (full committed ones stay cached for other sequences); the
        sequence can no longer be run. Idempotent."""
        self._own(seq, allow_freed=True)
        seq.freed = True
        seq.cached_ids = []
        seq._release()  # runs _release_table once, and never again at garbage collection

    def _release_table(self, table: BlockTable) -> None:
        """Give a table's blocks back. Also a finalizer, which the garbage collector may run at any point of
        any thread, inside a section that holds the lock too: so it only queues the table, and frees it at
        once only where it can take the lock without waiting; `_locked` frees what is queued."""
        self._orphans.append(table)
        if self._lock.acquire(blocking=False):
            try:
                self._free_orphans()
            finally:
                self._lock.release()

    def _free_orphans(self) -> None:
        while self._orphans:
            self._blocks.free(self._orphans.popleft())

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """The lock, with the tables given back meanwhile freed first."""
        with self._lock:
            self._free_orphans()
            yield

    def _own(self, seq, allow_freed: bool = False) -> None:
        if not isinstance(seq, PagedSequence) or seq._runner is not self:
            raise InvalidArgument("the sequence does not belong to this runner")
        if seq.freed and not allow_freed:
            raise InvalidArgument("the sequence was freed")

    def _check_len(self, n: int) -> None:
        if n > self.max_len:
            raise InvalidArgument(
                f"a sequence of {n} tokens exceeds this runner's limit of {self.max_len} tokens per sequence"
            )

    # forward --------------------------------------------------------------------------------------
    def _sync(self, seq: PagedSequence) -> int:
        """Cut the cache back to the prefix still valid for token_ids (>= 1 token left to feed); the table
        may keep fewer positions (a kept partial block that is shared or registered is never rewritten).
        Where that prefix ends at a block boundary short of the prompt, the pool's cached blocks of the
        prompt's next full blocks join it (`BlockManager.extend`)."""
        keep = seq.sync()
        ids = seq.token_ids
        with self._locked():
            fork = self._blocks.fork(seq.table, keep)
            if fork is not None:  # the kept part of a shared or cached block: copied, not recomputed
                self._copy_block(*fork, keep & (self.pool.block_size - 1))
            valid = self._blocks.truncate(seq.table, keep)
            if valid + self.pool.block_size < len(ids) and not valid & (self.pool.block_size - 1):
                gained = self._blocks.extend(seq.table, ids)
            else:
                gained = 0
        if valid < keep:
            del seq.cached_ids[valid:]
        if gained:
            seq.cached_ids.extend(ids[valid : valid + gained])
            self.prefix_cache_hit_tokens += gained
        return valid + gained

    @torch.no_grad()
    def _copy_block(self, src: int, dst: int, n: int) -> None:
        """The first `n` positions' keys and values of block `src` into block `dst`, in every layer."""
        bs = self.pool.block_size
        for t in (*self._k, *self._v):
            t[:, dst * bs : dst * bs + n] = t[:, src * bs : src * bs + n]

    @torch.inference_mode()
    def step(
        self,
        seqs: list[PagedSequence],
        extra: list[list[int]] | None = None,
        num_logits: list[int] | None = None,
        prefill: Sequence[PrefillChunk[PagedSequence]] = (),
    ) -> StepResult:
        """`forward` over `seqs` and `prefill` chunks of other sequences, in ONE pass of the model.

        OutOfBlocks before anything is written when the pool cannot hold what is fed. Nothing is counted,
        marked cached or registered unless the whole pass succeeds; if it raises, the blocks reserved for it
        are given back and every sequence's cache is its kept prefix."""
        work, reused, left = self._plan(seqs, extra, num_logits, prefill)
        self._reserve(work)
        try:
            logits = self._run(work) if work else []
        except BaseException:
            with self._locked():
                for w in work:  # the reserved blocks go back; the written prefix stays
                    self._blocks.truncate(w.seq.table, w.seq.table.num_tokens)
            raise
        # The pass succeeded: only now do its tokens count as cached, and full committed blocks as content.
        with self._locked():
            for w in work:
                table = w.seq.table
                table.mark_written(w.start + len(w.feed))
                w.seq.cached_ids.extend(w.feed)
                self._blocks.commit(table, w.seq.token_ids)
        self.prefix_tokens_reused += sum(reused)
        return StepResult(logits[: len(seqs)], left, reused, sum(len(w.feed) for w in work))

    def _reserve(self, work: list[_Work]) -> None:
        """Blocks for everything fed, all or none (OutOfBlocks with no table changed)."""
        with self._locked():
            blocks = self._blocks
            need = sum(blocks.blocks_needed(w.seq.table, w.start + len(w.feed)) for w in work)
            if need > self.pool.num_free:
                raise OutOfBlocks(
                    f"KV cache out of blocks: {need} needed, {self.pool.num_free} of {self.pool.num_blocks} free"
                )
            for w in work:
                blocks.reserve(w.seq.table, w.start + len(w.feed))

    def _run(self, work: list[_Work]) -> list[torch.Tensor]:
        """One forward over every sequence's feed; per work item float32 logits [num_logits, V]."""
        if self.graphs is not None and self.graphs.takes(work):
            host_ids, host_pos, host_rows = self._host_batch(work)
            self._dec.refresh_if_stale()
            return self._logits(self.graphs.run(work, host_ids, host_pos, host_rows), work)
        if self.cpu_kernel:
            fused = self._fused_pass(work, lambda w: w.seq.table.blocks, self.pool.block_size)
            if fused is not None:
                return fused
        ids, pos, rows = self._batch(work)
        flat_slot: list[int] = []
        for w in work:
            flat_slot += w.seq.table.slots(w.start, w.start + len(w.feed))
        dev = self.device
        slots = torch.tensor(flat_slot, dtype=torch.long, device=dev)  # [T]
        dec = self._dec
        cpu: cpu_kernels.Plan | None = None
        if self.block_kernel:
            segments: list[_Segment] = []
            plan: tuple[torch.Tensor, torch.Tensor] | None = self._kernel_plan(work)
        else:
            short = self._cpu_kernel_takes(work)
            segments, plan = self._segments(work, short), None
            if short:
                cpu = self._cpu_plan(work, short)
        dec.refresh_if_stale()
        with sdpa_context(self.attention_backend, dev):
            kv = _BlockAttention(dec, self._k, self._v, slots, segments, plan, self.pool.block_size, cpu)
            out = dec.ragged(kv, ids, pos, rows)
        return self._logits(out, work)

    def _graph_attention(self, slots: torch.Tensor, plan: tuple[torch.Tensor, torch.Tensor]) -> _BlockAttention:
        """The block-table kernel's attention over the arena, for a CUDA graph's static buffers."""
        return _BlockAttention(self._dec, self._k, self._v, slots, [], plan, self.pool.block_size)

    def _kernel_plan(self, work: list[_Work]) -> tuple[torch.Tensor, torch.Tensor]:
        """The block-table kernel's inputs for this forward, built once for every layer: the sequences'
        block tables and the programs (`block_attention.plan`)."""
        spans, off = [], 0
        for w in work:
            spans.append((off, len(w.feed), w.start))
            off += len(w.feed)
        tables = kernel.block_tables([w.seq.table.blocks for w in work], self.device)
        return tables, kernel.plan(spans, self._dec.group, self.device)

    def _cpu_kernel_takes(self, work: list[_Work]) -> set[int]:
        """The work items the CPU kernel attends for (decode steps and verify blocks; prefill chunks go to
        SDPA's flash kernel, which is faster for many queries)."""
        if not self.cpu_kernel:
            return set()
        return {i for i, w in enumerate(work) if 0 < len(w.feed) <= cpu_kernels.MAX_TOKENS}

    def _cpu_plan(self, work: list[_Work], take: set[int]) -> cpu_kernels.Plan:
        spans, tables, off = [], [], 0
        for i, w in enumerate(work):
            if i in take:
                spans.append((off, len(w.feed), w.start))
                tables.append(w.seq.table.blocks)
            off += len(w.feed)
        return cpu_kernels.Plan(spans, tables, self._dec.n_kv, self._dec.group)

    def _segments(self, work: list[_Work], skip: set[int] | None = None) -> list[_Segment]:
        """How each sequence attends: over one view, run by run, or gathered (see the module docstring);
        none for the items in `skip` (the CPU kernel's)."""
        dev, g, off = self.device, self._dec.group, 0
        out = []
        for i, w in enumerate(work):
            start, n = w.start, len(w.feed)
            end = start + n
            if skip and i in skip:
                off += n
                continue
            table = w.seq.table
            ranges = physical_ranges(table, end)
            if len(ranges) == 1 or not self.merge_runs or end <= self.gather_max_tokens:
                mask = causal_mask(start, n, g, dev) if n > 1 else None
                if len(ranges) == 1:
                    out.append(_Segment(start, n, off, ranges[0], [], None, mask))
                else:
                    gather = torch.tensor(table.slots(0, end), dtype=torch.long, device=dev)
                    out.append(_Segment(start, n, off, None, [], gather, mask))
            else:
                mask = None
                if n > 1 and g > 1:
                    # The new keys among themselves: causal, additive (the flash kernel takes the query's dtype).
                    vis = causal_mask(0, n, g, dev)
                    mask = torch.zeros(vis.shape, dtype=self._dec.dtype, device=dev).masked_fill_(~vis, float("-inf"))
                out.append(_Segment(start, n, off, None, physical_ranges(table, start), None, mask))
            off += n
        return out

    def _matches_hf(self) -> bool:
        """A probe against the stock HF forward, on a pool of its own (the runner's stays untouched): a
        chunked prefill, a decode block with drafts and a rollback, a second sequence sharing the first's
        prefix blocks whose own block lies elsewhere (several runs)."""
        saved = (self.pool, self._blocks, self._k, self._v)
        bs = self.pool.block_size
        ids = [(7 * i + 3) % self.vocab_size for i in range(2 * bs + 9)]
        p = 2 * bs + 3  # the first prompt: two full blocks and a partial one
        seqs: list[PagedSequence] = []
        gather_max, max_len = self.gather_max_tokens, self.max_len
        self.gather_max_tokens = 0  # the probe's sequences are short: check the merge wherever it may run
        # A session cap shorter than the probe does not apply to it (its longest sequence: the ids, a few
        # commits and a block of up to half the fused step's rows).
        reach = len(ids) + 4 + cpu_kernels.STEP_MAX_TOKENS_SMALL
        self.max_len = max(max_len, reach)
        self._dec.reserve(self.max_len)
        try:
            self._alloc(BlockPool(max(16, 4 * (-(-reach // bs))), bs))
            with torch.inference_mode():
                a = self.new_sequence(ids[:p])
                seqs.append(a)
                self.prefill(a, max_tokens=bs)
                got = self.forward([a], [ids[p : p + 3]])
                fed = [ids[: p + 3]]
                a.commit(ids[p : p + 1])  # rejects the rest: the next pass recomputes from there
                other = (ids[p + 1] + 1) % self.vocab_size
                b = self.new_sequence([*ids[: 2 * bs], other, *ids[2 * bs + 1 : p]])
                seqs.append(b)
                got += self.forward([a, b], [[ids[p + 2], ids[p + 3]], [ids[1], ids[2]]])
                fed += [ids[: p + 1] + [ids[p + 2], ids[p + 3]], [*b.token_ids, ids[1], ids[2]]]
                if len(b.table.runs()) < 2 or b.cached_ids[: 2 * bs] != ids[: 2 * bs]:
                    return False  # the probe did not exercise what it is for
                # One token of one sequence at a time (a decode step alone: the fused CPU step where it runs).
                a.commit([ids[p + 2]])
                b.commit([ids[1]])
                got += self.forward([a]) + self.forward([b])
                fed += [[*a.token_ids], [*b.token_ids]]
                # The ragged forward's passes, the fused step's limit lowered for the probe (so that they stay
                # short): a decode block in the same pass as another sequence's prefill chunk (rotary in torch,
                # the chunk by SDPA, the block by the CPU kernel from rotated q, k, v), then that sequence's step;
                # decode blocks past the limit (rotary, the KV writes and attention by the CPU kernel from the
                # projection's output).
                rows, step = cpu_kernels.STEP_MAX_TOKENS, self._dec.step
                limit = (step.max_rows, step.max_seq_rows) if step is not None else (0, 0)
                if step is not None:
                    step.max_rows = step.max_seq_rows = rows
                try:
                    c = self.new_sequence([(5 * i + 2) % self.vocab_size for i in range(cpu_kernels.MAX_TOKENS + 3)])
                    seqs.append(c)
                    a.commit([ids[0]])
                    got += self.step([a], [[ids[4]]], prefill=[PrefillChunk(c)]).logits + self.forward([c])
                    fed += [[*a.token_ids, ids[4]], [*c.token_ids]]
                    more = [[(ids[i % len(ids)] + j) % self.vocab_size for i in range(rows // 2 + 1)] for j in (5, 6)]
                    got += self.forward([a, b], more)
                finally:
                    if step is not None:
                        step.max_rows, step.max_seq_rows = limit
                fed += [[*a.token_ids, *more[0]], [*b.token_ids, *more[1]]]
                # a bfloat16 cache under a float32 model: bfloat16's bound
                bound = self.kv_dtype if self.kv_dtype.itemsize < self._dec.dtype.itemsize else self._dec.dtype
                for logits, f in zip(got, fed, strict=True):
                    with sdpa_context(self.attention_backend, self.device):
                        out = self.model(input_ids=torch.tensor([f], device=self.device))
                    if not logits_agree(out.logits[0, -len(logits) :].float(), logits, bound):
                        return False
            return True
        finally:
            for seq in seqs:  # into the probe's pool, before the runner's comes back
                self.free(seq)
            self.pool, self._blocks, self._k, self._v = saved
            self.gather_max_tokens, self.max_len = gather_max, max_len
            self.prefix_tokens_reused = 0
            self.prefix_cache_query_tokens = self.prefix_cache_hit_tokens = 0


class PagedBlocks:
    """`Runner.blocks` of a `PagedRunner` (see `specmesh.runtime.BlockBudget`). Called on the event loop
    between passes; the runner's lock keeps it off a table the model thread is changing."""

    def __init__(self, runner: PagedRunner):
        self.runner = runner
        self.block_size = runner.pool.block_size
        self.num_blocks = runner.pool.num_blocks

    def free_blocks(self) -> int:
        with self.runner._locked():
            return self.runner.pool.num_free

    def cached(self, seq: PagedSequence) -> int:
        return 0 if seq.freed else self.runner._sync(seq)

    def needed(self, seq: PagedSequence, positions: int) -> int:
        r = self.runner
        with r._locked():
            return r._blocks.blocks_needed(seq.table, positions)

    def held(self, seq: PagedSequence) -> int:
        return 0 if seq.freed else len(seq.table.blocks)

    def preempt(self, seq: PagedSequence) -> int:
        r = self.runner
        r._own(seq)
        with r._locked():
            before = r.pool.num_free
            r._blocks.free(seq.table)
            seq.cached_ids = []
            return r.pool.num_free - before


class BlockAccount:
    """`PagedRunner`'s KV accounting: a sequence holds whole blocks (a shared block counts for each
    sequence holding it); the blocks, not a count of sequences, cap what is open."""

    max_sequences: int | None = None

    def __init__(self, runner: PagedRunner):
        self.runner = runner

    @property
    def pool_bytes(self) -> int:
        return self.runner.pool_bytes

    def held(self, seq: PagedSequence) -> int:
        return 0 if seq.freed else len(seq.table.blocks) * self.runner.block_bytes

    def needed(self, seq: PagedSequence | None, tokens: int) -> int:
        """None up front: blocks are taken as a sequence's passes need them, and a scheduler admits and
        preempts by the free blocks (`PagedBlocks`) rather than a store reserving bytes at open."""
        return 0
