"""CUDA graphs for `PagedRunner`'s decode steps: each step's forward replayed from a graph captured at start
instead of launched kernel by kernel (SGLang's and vLLM's answer to launch-bound decoding; on a GPU a small
model's forward is mostly launch overhead: ~5 ms for the demo target at any batch, without graphs).

A graph holds fixed shapes and addresses, so the step's inputs live in static buffers and the step is padded
to a bucket of tokens. The buckets are token counts, not batch sizes: a verify step of B sessions carrying
K drafts each feeds B x (K + 1) tokens, the draft's one-token step B tokens, and adaptive K makes both vary
by session, so the flattened ragged batch is what is bucketed (vLLM's "uniform decode" keys its graphs by
token count the same way). What a step of T real tokens in bucket b >= T fills:

* ids, positions and KV slots [b]: the padding tokens are token 0 at position 0, writing their keys and
  values to one scratch slot past the pool's last block, which no table names;
* the block tables [max_bs, W] (W: the blocks of the runner's longest sequence): one row per sequence;
* the attention kernel's programs [b, 4]: at most one per real token, the rest zero rows, which the kernel
  runs as no-ops (no tokens: nothing read, nothing written);
* the graph ends at the last hidden states [b, hidden]; the wanted rows are copied out and their logits
  made eagerly (the final norm and the LM head: two launches), so no graph holds a [b, vocabulary] output and
  padding rows cost no LM head (vLLM computes logits outside its graphs too).

Every bucket up to `max_bs` x `tokens_per_seq` tokens is captured when the runner is built (largest first,
all in one memory pool, under inference mode: no autograd state may outlive a capture), and again, lazily,
after the decoder rebuilt its weight copies (online distillation swaps weights in) or grew its rotary tables:
each bucket's first step after a swap then pays its capture (a few forwards). A step with a prefill chunk,
more than `max_bs` sequences or more tokens than the largest bucket runs eagerly, as without graphs.

`capture=False` runs the same static, padded forward eagerly: what the graphs replay, checkable off CUDA
(the block-table kernel under TRITON_INTERPRET=1).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch

from specmesh.runtime import block_attention as kernel

if TYPE_CHECKING:
    from specmesh.runtime.batched import _Work

log = logging.getLogger(__name__)

DEFAULT_MAX_BS = 32  # --cuda-graph-max-bs


def token_buckets(max_tokens: int) -> list[int]:
    """The captured token counts up to `max_tokens`: 1, 2, 4, 8, then steps of 8 to 64, 16 to 256, 32 to
    512 and 64 beyond (past 32 tokens a step's padding stays under a fifth of its bucket), the last one
    >= max_tokens."""
    out, b = [], 1
    while True:
        out.append(b)
        if b >= max_tokens:
            return out
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 256 else 32 if b < 512 else 64)


class DecodeGraphs:
    """The captured decode steps of one `PagedRunner` (see the module docstring)."""

    def __init__(self, runner: Any, max_bs: int, tokens_per_seq: int, capture: bool = True):
        """`runner`: the `PagedRunner` whose steps these are (it builds the step's attention over its arena,
        `_graph_attention`)."""
        if max_bs < 1 or tokens_per_seq < 1:
            raise ValueError("CUDA graphs need max_bs >= 1 and tokens_per_seq >= 1")
        if not runner.block_kernel:
            raise ValueError("CUDA graphs need the block-table attention kernel (no per-sequence host work)")
        self.runner = runner
        self.max_bs = max_bs
        self.capture = capture
        self.buckets = token_buckets(max_bs * tokens_per_seq)
        top, dev = self.buckets[-1], runner.device
        bs = runner.pool.block_size
        self.scratch = runner.pool.num_blocks * bs  # the padding's slot: the arena's spare block
        width = -(-runner.max_len // bs)
        # ids, positions, slots in one buffer, so that a step's host inputs are one copy.
        self.io = torch.zeros((3, top), dtype=torch.long, device=dev)
        self.tables = torch.zeros((max_bs, width), dtype=torch.int32, device=dev)
        self.programs = torch.zeros((top, 4), dtype=torch.int32, device=dev)
        self.rows = torch.arange(top, device=dev)
        self._graphs: dict[int, tuple[Any, torch.Tensor]] = {}  # bucket -> (graph, its hidden states [b, H])
        self._pool: Any = None
        self._stamp: tuple = ()
        self.replays = 0  # steps served from a graph (or its eager twin)
        self.captures = 0

    # what takes a graph ----------------------------------------------------------------------------
    def takes(self, work: list[_Work]) -> bool:
        """Whether this step runs from a graph: decode blocks only (every sequence wants logits), at most
        `max_bs` sequences, at most the largest bucket's tokens."""
        if not work or len(work) > self.max_bs or any(w.num_logits == 0 for w in work):
            return False
        return sum(len(w.feed) for w in work) <= self.buckets[-1]

    def bucket(self, tokens: int) -> int:
        return next(b for b in self.buckets if b >= tokens)

    # capture ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every bucket, largest first (the smaller ones reuse its memory); seconds taken."""
        t0 = time.perf_counter()
        self._clear()
        self._stamp = self._current_stamp()
        for b in reversed(self.buckets):
            self._graph(b)
        return time.perf_counter() - t0

    def _clear(self) -> None:
        """Drop every graph, and their pool with them: a pool whose graphs are all gone is not captured into
        again."""
        self._graphs.clear()
        self._pool = None

    def _current_stamp(self) -> tuple:
        dec = self.runner._dec
        return (dec.version, dec.cos.data_ptr(), tuple(k.data_ptr() for k in self.runner._k))

    def _forward(self, b: int) -> torch.Tensor:
        """The padded step over the static buffers' first `b` tokens: last hidden states [b, hidden]."""
        r = self.runner
        ids, pos, slots = self.io[0, :b], self.io[1, :b], self.io[2, :b]
        kv = r._graph_attention(slots, (self.tables, self.programs[:b]))
        out = r._dec.ragged(kv, ids, pos, self.rows[:b], head=False)
        assert out is not None
        return out

    def _pad(self) -> None:
        """Every buffer as padding (a warm-up or capture then writes only the scratch slot)."""
        self.io[:2].zero_()
        self.io[2].fill_(self.scratch)
        self.programs.zero_()
        self.tables.zero_()

    @torch.inference_mode()
    def _graph(self, b: int) -> tuple[Any, torch.Tensor] | None:
        """Bucket `b`'s graph, captured now if it is missing; None when not capturing."""
        if not self.capture:
            return None
        got = self._graphs.get(b)
        if got is not None:
            return got
        self._pad()
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # Triton's compile and cuBLAS's workspaces happen outside the capture
                self._forward(b)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = self._forward(b)
        self._graphs[b] = (graph, out)
        self.captures += 1
        return graph, out

    # a step ----------------------------------------------------------------------------------------
    def run(self, work: list[_Work], ids: list[int], pos: list[int], rows: list[int]) -> torch.Tensor:
        """The step's logits [len(rows), V], from bucket(len(ids))'s graph."""
        r = self.runner
        t = len(ids)
        b = self.bucket(t)
        slots: list[int] = []
        spans: list[tuple[int, int, int]] = []
        # Only the step's rows and block columns: the kernel reads a row's entries below its sequence's end.
        width = max(len(w.seq.table.blocks) for w in work)
        tables = torch.zeros((len(work), width), dtype=torch.int32)
        off = 0
        for i, w in enumerate(work):
            n, table = len(w.feed), w.seq.table
            slots += table.slots(w.start, w.start + n)
            tables[i, : len(table.blocks)] = torch.tensor(table.blocks, dtype=torch.int32)
            spans.append((off, n, w.start))
            off += n
        programs = kernel.plan_rows(spans, r._dec.group)
        pad = b - t
        host = torch.tensor([ids + [0] * pad, pos + [0] * pad, slots + [self.scratch] * pad], dtype=torch.long)
        prog = torch.zeros((b, 4), dtype=torch.int32)
        prog[: len(programs)] = torch.tensor(programs, dtype=torch.int32)
        if self._current_stamp() != self._stamp:  # new weight copies or tables: the graphs point at the old
            self._clear()
            self._stamp = self._current_stamp()
        graph = self._graph(b)  # captured before the inputs are written: a capture pads the buffers
        self.io[:, :b].copy_(host)
        self.tables[: len(work), :width].copy_(tables)
        self.programs[:b].copy_(prog)
        if graph is None:
            out = self._forward(b)
        else:
            graph[0].replay()
            out = graph[1]
        self.replays += 1
        return r._dec.head(out.index_select(0, torch.tensor(rows, dtype=torch.long, device=r.device)))
