"""`BatchedRunner`: the verify service's runner for the Llama family — one ragged batched forward over
sequences whose KV caches live in fixed slots of one preallocated pool, so batching copies no cache.

ModelRunner batches by left-padding every sequence's DynamicCache into one batch cache and appending the
new keys/values back afterwards: two copies of every cache per tick, growing with context and batch.
Here the caches never move:

* KV pool: per layer one K and one V tensor [num_slots, H_kv, slot_len, D], allocated once. A sequence
  owns one slot from `new_sequence` to `free` (or until it is garbage-collected); its valid length is
  `len(cached_ids)`, so rolling back rejected draft tokens only changes a length.
* Forward: the new tokens of all sequences are flattened to [T, hidden]; per layer one fused qkv matmul,
  rotary by each token's own position, one index_put writing every new key/value into its slot, then
  attention per sequence over a view of its slot [:, :end] (causal over its own new queries), and o_proj,
  MLP and (only for the rows whose logits are asked for) lm_head batched over all T tokens. On CUDA the
  decode blocks attend in one call per layer instead, padded to the longest block and the longest context
  (a forward over many sequences is bound by kernel launches there, not by the padded work).
* Sequence semantics are ModelRunner's: a sequence has committed `token_ids` and `cached_ids`; a forward
  keeps the longest common prefix of the two (leaving at least the last committed token to feed) and
  recomputes the rest, which covers rejected drafts, a draft's own speculation and multi-turn prefix reuse.
* `step` runs decode blocks and prefill chunks in the same forward (a chunk asks for no logits), which is
  what lets a scheduler fill one pass up to a token budget.

The decoder is `static._FastDecoder`'s (fused [in, out] weights, same ops), made ragged; the runner checks
it against the stock HF forward on a probe when built and refuses models it cannot reproduce
(`specmesh.runtime.registry` chooses it where `BatchedRunner.supports(model)`, ModelRunner otherwise).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from specmesh.errors import InvalidArgument, ResourceExhausted
from specmesh.runtime import PrefillChunk, StepResult
from specmesh.runtime.attention import check_attention_backend, sdpa_context
from specmesh.runtime.base import RunnerBase, logits_wanted, plain_full_attention
from specmesh.runtime.sequence import common_prefix
from specmesh.runtime.static import TrackedSequence, _FastDecoder, logits_agree

log = logging.getLogger(__name__)


class SlotSequence(TrackedSequence):
    """One sequence: committed ids, the ids whose KV its slot positions [0, len) hold, and the slot (-1 once
    freed)."""

    __slots__ = ("__weakref__", "_release", "_runner", "slot")

    def __init__(self, token_ids: list[int], runner: BatchedRunner, slot: int):
        super().__init__(token_ids)
        self.slot = slot
        self._runner = runner
        # Returns the slot when the sequence is freed or garbage-collected, whichever comes first.
        self._release = weakref.finalize(self, runner._release_slot, slot)

    @property
    def freed(self) -> bool:
        return self.slot < 0


class _Work(NamedTuple):
    """One sequence's part of a forward, planned before anything is written."""

    seq: Any  # the runner's own sequence kind (SlotSequence, PagedSequence)
    start: int  # cached tokens kept = the position of feed[0]
    feed: list[int]  # token ids fed this forward
    num_logits: int  # logits rows wanted: the last num_logits of feed


# Segments of at most this many new tokens (decode blocks: K + 1 <= 17) attend in one padded SDPA call per
# layer; longer ones (prefill chunks) attend one by one, so a chunk does not pad every block to its length.
PADDED_MAX_ROWS = 32


class _Padded(NamedTuple):
    """One padded attention call over S short segments: index plans built once per forward, on the host."""

    rows: list[int]  # which segments (indices into `segments`)
    slots: torch.Tensor  # [S] their slots
    gather: torch.Tensor  # [S * n_max] batch row of each padded query (padding repeats a real row)
    scatter: torch.Tensor  # [R] padded position of each real row ...
    real: torch.Tensor  # [R] ... and its batch row
    mask: torch.Tensor  # [S, 1, n_max, L] key p visible to query j of segment s: p <= start_s + j
    n_max: int
    length: int  # L: the longest segment's end


def causal_mask(start: int, n: int, group: int, dev) -> torch.Tensor:
    """[group * n, start + n] bool: key p is visible to new query j (at position start + j) when p <= start + j.
    With GQA a sequence's queries are laid out [n_kv, group * n] (see `fold_queries`), so the [n, end] mask
    is tiled `group` times."""
    end = start + n
    m = torch.arange(end, device=dev)[None, :] <= torch.arange(start, end, device=dev)[:, None]
    return m.repeat(group, 1) if group > 1 else m


def fold_queries(q: torch.Tensor, n_kv: int, group: int) -> torch.Tensor:
    """One sequence's queries [n, nh, D] as SDPA's [1, heads, rows, D] against its keys [1, n_kv, L, D].

    Query head j uses KV head j // group (HF's repeat_kv): with GQA the group is folded into the query
    length ([1, n_kv, group * n, D]) instead of repeating the keys, so the cache is read as it is."""
    n, _nh, hd = q.shape
    if group > 1:
        return q.view(n, n_kv, group, hd).permute(1, 2, 0, 3).reshape(1, n_kv, group * n, hd)
    return q.transpose(0, 1)[None]


def unfold_rows(a: torch.Tensor, n: int, n_kv: int, group: int) -> torch.Tensor:
    """`fold_queries`'s inverse on SDPA's output [1, heads, rows, D]: [n, nh, D]."""
    hd = a.shape[-1]
    if group > 1:
        return a.view(n_kv, group, n, hd).permute(2, 0, 1, 3).reshape(n, n_kv * group, hd)
    return a[0].transpose(0, 1)


class KvAttention(Protocol):
    """The part of a layer that depends on where the KV lives: writing the batch's new keys/values and
    attending each sequence's queries over its cache. Built once per forward (index plans and masks serve
    every layer); `_RaggedDecoder.ragged` calls it once per layer."""

    def __call__(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, attn: torch.Tensor, scale: float
    ) -> None:
        """Write layer `layer`'s new keys `k` and values `v` [T, n_kv, D] (rotary applied), then fill
        `attn` [T, nh, D] with the attention of the new queries `q` [T, nh, D]."""
        ...


class _SlotAttention:
    """BatchedRunner's KV: per layer one K and one V tensor [num_slots, n_kv, slot_len, D]; a sequence's
    keys are its slot's first positions.

    segments: per sequence (slot, start, n, offset): its tokens are rows offset..offset+n of the batch, at
    positions start..start+n. pos, slots: [T] position and slot of each new token."""

    __slots__ = ("g", "in_plan", "k_pool", "masks", "nkv", "plan", "pos", "segments", "slots", "v_pool")

    def __init__(
        self,
        dec: _RaggedDecoder,
        k_pool: list[torch.Tensor],
        v_pool: list[torch.Tensor],
        pos: torch.Tensor,
        slots: torch.Tensor,
        segments: list[tuple[int, int, int, int]],
    ):
        self.k_pool, self.v_pool, self.pos, self.slots, self.segments = k_pool, v_pool, pos, slots, segments
        self.nkv, self.g = dec.n_kv, dec.group
        dev = pos.device
        self.plan = self._padded_plan(segments, dev) if dec.padded else None
        self.in_plan = frozenset(self.plan.rows if self.plan else ())  # segments that attend in the padded call
        # Causal masks over each other sequence's slot prefix, built once for all layers.
        self.masks: list[torch.Tensor | None] = [
            None if n == 1 or i in self.in_plan else causal_mask(start, n, self.g, dev)
            for i, (_slot, start, n, _off) in enumerate(segments)
        ]  # None: one query sees the whole prefix (or the plan holds the mask)

    @staticmethod
    def _padded_plan(segments: list[tuple[int, int, int, int]], dev) -> _Padded | None:
        short = [i for i, (_slot, _start, n, _off) in enumerate(segments) if n <= PADDED_MAX_ROWS]
        if len(short) < 2:
            return None
        n_max = max(segments[i][2] for i in short)
        length = max(segments[i][1] + segments[i][2] for i in short)
        gather, scatter, real, qpos = [], [], [], []
        for s, i in enumerate(short):
            _slot, start, n, off = segments[i]
            for j in range(n_max):
                jj = min(j, n - 1)  # a padding query repeats the last real one: same keys, no empty row
                gather.append(off + jj)
                qpos.append(start + jj)
                if j < n:
                    scatter.append(s * n_max + j)
                    real.append(off + j)
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)
        qp = as_long(qpos).view(len(short), 1, n_max, 1)
        mask = torch.arange(length, device=dev).view(1, 1, 1, length) <= qp
        slots = as_long([segments[i][0] for i in short])
        return _Padded(short, slots, as_long(gather), as_long(scatter), as_long(real), mask, n_max, length)

    def __call__(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor, attn: torch.Tensor, scale: float
    ) -> None:
        k_layer, v_layer = self.k_pool[layer], self.v_pool[layer]
        nkv, g, plan = self.nkv, self.g, self.plan
        # Every new key/value of the batch into its slot at its position: one index_put per tensor.
        k_layer[self.slots, :, self.pos] = k
        v_layer[self.slots, :, self.pos] = v
        if plan is not None:
            _t, nh, hd = q.shape
            s_n = len(plan.rows)
            qs = q.index_select(0, plan.gather).view(s_n, plan.n_max, nh, hd).transpose(1, 2)
            keys = k_layer[plan.slots, :, : plan.length]  # [S, n_kv, L, D], gathered from the slots
            values = v_layer[plan.slots, :, : plan.length]
            if g > 1:  # query head j uses KV head j // group (HF's repeat_kv)
                keys, values = keys.repeat_interleave(g, dim=1), values.repeat_interleave(g, dim=1)
            a = F.scaled_dot_product_attention(qs, keys, values, attn_mask=plan.mask, scale=scale)
            attn[plan.real] = a.transpose(1, 2).reshape(s_n * plan.n_max, nh, hd)[plan.scatter]
        in_plan = self.in_plan
        for i, ((slot, start, n, off), mask) in enumerate(zip(self.segments, self.masks, strict=True)):
            if i in in_plan:
                continue
            end = start + n
            keys = k_layer[slot, :, :end][None]  # [1, n_kv, end, D], a view of the slot
            values = v_layer[slot, :, :end][None]
            qs = fold_queries(q[off : off + n], nkv, g)
            a = F.scaled_dot_product_attention(qs, keys, values, attn_mask=mask, scale=scale)
            attn[off : off + n] = unfold_rows(a, n, nkv, g)


class _RaggedDecoder(_FastDecoder):
    """`_FastDecoder`'s weights and ops over a flattened ragged batch; where the KV lives and how each
    sequence attends is a `KvAttention` (`_SlotAttention` for the slot pool).

    `padded`: short segments attend in one padded SDPA call per layer instead of one call per segment
    (None: on CUDA, where a forward over many sequences is bound by kernel launches; on CPU the per-segment
    calls do no padded work and cost little next to the matmuls)."""

    def __init__(
        self,
        model: PreTrainedModel,
        packed: bool | None = None,
        padded: bool | None = None,
        step_panels: torch.dtype = torch.float32,
    ):
        super().__init__(model, packed, step_panels)
        self.group = self.n_heads // self.n_kv  # query heads per KV head (1 without GQA)
        self.padded = self.embed.device.type == "cuda" if padded is None else bool(padded)

    def ragged(
        self, kv: KvAttention, ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor | None, head: bool = True
    ) -> torch.Tensor | None:
        """Run every layer over all T new tokens, their K/V written and attended through `kv`; logits of
        `rows`.

        ids, pos: [T] token id and position of each new token. rows: [R] batch rows whose logits are
        returned ([R, V]), None for none. head=False: their last hidden states [R, hidden] instead (`head`
        makes the logits).
        """
        hd, half, nh, nkv, rms = self.head_dim, self.half, self.n_heads, self.n_kv, self._rms
        lin = self.linear
        nqk = nh + nkv
        t = ids.shape[0]
        assert self.cos is not None and self.sin is not None  # tables are built in __init__
        x = F.embedding(ids, self.embed)  # [T, hidden]
        cos, sin = self.cos[pos], self.sin[pos]  # [T, 1, D]
        attn = x.new_empty((t, nh, hd))  # [T, nh, D]
        fused = getattr(kv, "takes_qkv", False)  # the CPU kernel's rotary + KV write + attention in one call
        for i, (
            ln1,
            eps1,
            wqkv,
            bqkv,
            wo,
            bo,
            scale,
            qn,
            kn,
            ln2,
            eps2,
            wgu,
            bgu,
            inter,
            wd,
            bd,
            act,
        ) in enumerate(self.layers):
            h = rms(x, ln1, eps1)
            qkv = lin(h, wqkv, bqkv).view(t, nqk + nkv, hd)  # [T, nh + 2 n_kv, D]
            if fused and qn is None:
                kv.qkv_attend(i, qkv, attn, scale)  # type: ignore[attr-defined]  # takes_qkv says it has it
            else:
                qk = qkv[:, :nqk]
                if qn is not None and kn is not None:
                    qk = torch.cat(
                        (
                            rms(qk[:, :nh], qn.weight, qn.variance_epsilon),
                            rms(qk[:, nh:], kn.weight, kn.variance_epsilon),
                        ),
                        dim=1,
                    )
                qk = qk * cos + qk.roll(half, -1) * sin  # rotary, each token at its own position
                kv(i, qk[:, nh:], qkv[:, nqk:], qk[:, :nh], attn, scale)
            x = x + lin(attn.view(t, nh * hd), wo, bo)
            h = rms(x, ln2, eps2)
            gu = lin(h, wgu, bgu)
            x = x + lin(self._swiglu(act, gu, inter), wd, bd)
        if rows is None:
            return None
        return self.head(x[rows]) if head else x[rows]

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits [R, V] of last hidden states [R, hidden]: the final norm and the LM head."""
        return self.linear(self._rms(x, self.norm_w, self.norm_eps), self.lm_w, self.lm_b)


class _RaggedRunner(RunnerBase):
    """What the runners with one ragged forward per batch share (`BatchedRunner`, `paged.PagedRunner`): prefill
    and forward as a `step`, the step's plan, checked before anything is written, and the flattened batch.
    Subclasses give `_own`, `_check_len` and `_sync` (their sequences' bookkeeping) and `step` (the pass)."""

    chunked_prefill = True  # `step` runs its prefill chunks in the same pass as its decode blocks

    def _own(self, seq, allow_freed: bool = False) -> None:
        raise NotImplementedError

    def _check_len(self, n: int) -> None:
        raise NotImplementedError

    def _sync(self, seq) -> int:
        raise NotImplementedError

    def step(self, seqs, extra=None, num_logits=None, prefill=()) -> StepResult:
        raise NotImplementedError

    @staticmethod
    def _limit(model_len: int, cap: int | None, name: str) -> int:
        """Most tokens a sequence may reach: the model's context capped by `cap` (the runner's `name` flag)."""
        limit = model_len
        if cap is not None:
            limit = min(limit, int(cap)) if limit else int(cap)
        if limit < 2:
            raise ValueError(f"this runner needs {name} >= 2 (or a model max_position_embeddings)")
        return limit

    @torch.inference_mode()
    def prefill(self, seq, max_tokens: int | None = None, count_reuse: bool = True) -> int:
        """`Runner.prefill`, chunked: one `step` with this sequence's chunk and no decode blocks."""
        return self.step([], prefill=[PrefillChunk(seq, max_tokens, count_reuse)]).prefill_left[0]

    @torch.inference_mode()
    def forward(self, seqs, extra: list[list[int]] | None = None, num_logits: list[int] | None = None):
        """Feed each sequence its uncached committed tokens plus `extra[i]` (draft tokens), all in one pass.

        Returns, per sequence, float32 logits [num_logits[i], V], by default [len(extra[i]) + 1, V]: row j
        predicts the token after the j-th of (last committed token, extra...); a smaller num_logits keeps
        the last rows only. Afterwards the cache holds everything fed; the next forward drops what was not
        committed."""
        return self.step(seqs, extra, num_logits).logits

    def _plan(
        self, seqs, extra, num_logits, prefill: Sequence[PrefillChunk]
    ) -> tuple[list[_Work], list[int], list[int]]:
        """A step's work (decode blocks first, then the prefill chunks that have tokens to compute), and per
        chunk the cached prefix it found (0 unless count_reuse) and the tokens it leaves to prefill."""
        chunks = [PrefillChunk(*c) for c in prefill]
        wanted = logits_wanted(len(seqs), extra, num_logits)
        everyone = [*seqs, *(c.seq for c in chunks)]
        for seq in everyone:
            self._own(seq)
        if len({id(s) for s in everyone}) != len(everyone):
            raise InvalidArgument("a sequence appears twice in one forward")
        work: list[_Work] = []
        for i, seq in enumerate(seqs):
            ext = list(extra[i]) if extra is not None else []
            self._check_len(len(seq.token_ids) + len(ext))
            keep = self._sync(seq)
            work.append(_Work(seq, keep, seq.token_ids[keep:] + ext, wanted[i]))
        reused, left = [], []
        for c in chunks:
            if c.max_tokens is not None and c.max_tokens < 0:
                raise InvalidArgument("max_tokens must be >= 0")
            self._check_len(len(c.seq.token_ids))
            keep = self._sync(c.seq)
            todo = c.seq.token_ids[keep:-1]
            now = todo if c.max_tokens is None else todo[: c.max_tokens]
            reused.append(keep if c.count_reuse else 0)
            left.append(len(todo) - len(now))
            if now:
                work.append(_Work(c.seq, keep, now, 0))
        return work, reused, left

    def _batch(self, work: list[_Work]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The flattened batch: token ids [T], positions [T] and the rows whose logits are wanted [R] (None
        for none); token ids outside the vocabulary are refused here, before anything is written."""
        flat_ids, flat_pos, rows = self._host_batch(work)
        dev = self.device
        ids = torch.tensor(flat_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(flat_pos, dtype=torch.long, device=dev)
        return ids, pos, torch.tensor(rows, dtype=torch.long, device=dev) if rows else None

    def _host_batch(self, work: list[_Work]) -> tuple[list[int], list[int], list[int]]:
        """`_batch`'s lists, on the host."""
        flat_ids: list[int] = []
        flat_pos: list[int] = []
        rows: list[int] = []
        for w in work:
            off, n = len(flat_ids), len(w.feed)
            flat_ids += w.feed
            flat_pos += range(w.start, w.start + n)
            rows += range(off + n - w.num_logits, off + n)
        lo, hi = min(flat_ids), max(flat_ids)
        if lo < 0 or hi >= self.vocab_size:
            raise InvalidArgument(f"token id {lo if lo < 0 else hi} is outside the vocabulary [0, {self.vocab_size})")
        return flat_ids, flat_pos, rows

    def _fused_pass(
        self,
        work: list[_Work],
        blocks_of: Callable[[_Work], Sequence[int]],
        block_size: int,
        strides: tuple[int, int, int, int] | None = None,
    ) -> list[torch.Tensor] | None:
        """A pass of a few tokens in all (decode steps, verify blocks, short chunks of one or several
        sequences) through the decoder's fused CPU step (`cpu_kernels.DecodeStep`) over the runner's pools:
        per work item its logits, or None where the step does not take the pass. `blocks_of(w)`: the item's
        block table in blocks of `block_size` slots."""
        dec = self._dec  # type: ignore[attr-defined]  # both subclasses have the decoder and the pools
        if (
            dec.step is None
            or sum(len(w.feed) for w in work) > dec.step.max_rows
            or max(len(w.feed) for w in work) > dec.step.max_seq_rows
        ):
            return None
        self._host_batch(work)  # the vocabulary check, before anything is written
        dec.refresh_if_stale()
        step = dec.step  # rebuilt with the weights' copies
        if step is None:
            return None
        seqs = [(w.feed, w.start, blocks_of(w)) for w in work]
        out = step(seqs, self._k, self._v, block_size, [w.num_logits for w in work], strides)  # type: ignore[attr-defined]
        return self._logits(out, work)

    def _logits(self, out: torch.Tensor | None, work: list[_Work]) -> list[torch.Tensor]:
        """Per work item float32 logits [num_logits, V] from the pass's [R, V]."""
        if out is None:
            return [_no_logits(self.vocab_size, self.device) for _ in work]
        out = out if out.dtype == torch.float32 else out.float()
        return [out] if len(work) == 1 else list(out.split([w.num_logits for w in work]))


class BatchedRunner(_RaggedRunner):
    """ModelRunner's interface and semantics over a shared slot KV pool, with one ragged forward per batch.

    `num_slots` sequences can be open at once, each up to `slot_len` tokens: `max_seq_len`, or the model's
    `max_position_embeddings` capped by it. `check`: compare the decoder with the stock HF forward on a
    probe when built (raises ValueError if they disagree). `packed`: oneDNN-packed weights (None: wherever
    the device and dtype allow, see `_FastDecoder`). `prefault`: write the whole pool once when built, so
    its memory is resident from the start (a service's memory then stays flat as slots fill, and a memory
    limit too small for the pool is met at start rather than under load). `attention_backend`: which SDPA
    kernels the forward may use (`specmesh.runtime.attention`; "auto" keeps cuDNN's per-shape plans out).
    `padded_attention`: decode blocks attend in one padded call per layer (None: on CUDA; see
    `_RaggedDecoder`). `step_panels` bfloat16: the fused CPU step reads its weights' panels in bfloat16 (a
    draft's runner: `cpu_kernels.DecodeStep`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        num_slots: int,
        max_seq_len: int | None = None,
        check: bool = True,
        packed: bool | None = None,
        prefault: bool = False,
        attention_backend: str = "auto",
        padded_attention: bool | None = None,
        step_panels: torch.dtype = torch.float32,
    ):
        if not self.supports(model):
            raise ValueError(
                f"BatchedRunner has no decoder for {type(model).__name__} with this config; use ModelRunner"
            )
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        super().__init__(model)
        self.attention_backend = check_attention_backend(attention_backend)
        self.slot_len = self._limit(self.model_len, max_seq_len, "max_seq_len")
        self._dec = _RaggedDecoder(model, packed, padded_attention, step_panels)
        self._dec.reserve(self.slot_len)
        d = self._dec
        self.num_layers = len(d.layers)
        shape = (num_slots, d.n_kv, self.slot_len, d.head_dim)
        # Per-segment attention never reads a slot past its valid length, so that pool needs no zeroing (on
        # CPU torch.empty's pages cost no memory until first written, which prefault does up front). Padded
        # attention does read past it, under a mask: masked keys and values must be finite (0 x NaN is NaN),
        # so its pool starts zeroed; what later sequences leave there is finite.
        alloc = torch.zeros if prefault or d.padded else torch.empty
        self._k = [alloc(shape, dtype=d.dtype, device=self.device) for _ in range(self.num_layers)]
        self._v = [alloc(shape, dtype=d.dtype, device=self.device) for _ in range(self.num_layers)]
        self.slot_bytes = 2 * self.num_layers * d.n_kv * self.slot_len * d.head_dim * self._k[0].element_size()
        self._num_slots = num_slots
        self._lock = threading.Lock()  # slots are taken/freed on the event loop, used on the model thread
        # Free slots, the one freed longest ago (or never used) first: a freed slot keeps its KV, and a new
        # sequence in the same scope whose prompt starts with what a free slot holds takes that slot and
        # prefills only the rest (a client that re-sends a conversation or a prompt without a session).
        # A sequence that matches none takes the slot freed longest ago, so recent prefixes stay longest.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_slots))
        # Per slot: its scope and the ids whose KV it holds (while open, the sequence's own cached_ids list).
        self._kept: list[tuple[bytes, list[int]] | None] = [None] * num_slots
        self._owners: list[weakref.ref | None] = [None] * num_slots
        self.prefix_cache_query_tokens = 0  # prompt tokens new sequences looked up in the free slots
        self.prefix_cache_hit_tokens = 0  # ... and found there
        # One token of one sequence (a draft's step at one stream) through the fused CPU step, as the paged
        # runner's; under `auto` only, the C kernels being the CPU's choice there.
        self.fused_step = self.device.type == "cpu" and attention_backend == "auto" and d.step is not None
        if check and self.fused_step and not self._matches_hf():
            log.warning("the fused CPU decode step disagrees with the HF forward here; stepping by torch")
            self.fused_step = False
        if check and not self._matches_hf():
            raise ValueError(
                f"BatchedRunner's decoder disagrees with the HF forward for {type(model).__name__}; use ModelRunner"
            )

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        """Whether this runner can serve `model` (the Llama family; full attention only)."""
        return _FastDecoder.supports(model) and plain_full_attention(model.config)

    # slots ----------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def padded_attention(self) -> bool:
        """Whether decode blocks attend in one padded call per layer (see `_RaggedDecoder`)."""
        return self._dec.padded

    @property
    def pool_bytes(self) -> int:
        """Bytes of the whole pool, in use or not."""
        return self._num_slots * self.slot_bytes

    def kv_bytes(self) -> int:
        """Bytes of the slots held by open sequences (a slot is held whole, whatever its length)."""
        return (self._num_slots - len(self._free)) * self.slot_bytes

    def kv_account(self, bytes_per_token: int | None = None) -> SlotAccount:
        """`Runner.kv_account`: whole slots (`bytes_per_token` does not apply)."""
        return SlotAccount(self)

    def context_limit(self, max_model_len: int = 0) -> int:
        """`Runner.context_limit`: a slot's length (already capped by the model's context and the
        `max_seq_len` the runner was built with)."""
        return self.slot_len if not max_model_len else min(self.slot_len, max_model_len)

    def new_sequence(self, token_ids: list[int], scope: bytes = b"") -> SlotSequence:
        """`Runner.new_sequence`. The sequence takes the free slot of `scope` (`blocks.scope_of`: a tenant
        and cache_salt) that holds the longest prefix of `token_ids`, and keeps that prefix cached; a slot
        freed in another scope is never read, only overwritten."""
        if not token_ids:
            raise InvalidArgument("a sequence needs at least one token")
        self._check_len(len(token_ids))
        with self._lock:
            if not self._free:
                raise ResourceExhausted(f"all {self._num_slots} KV cache slots are in use")
            slot, kept = self._take_slot(token_ids, scope)
        seq = SlotSequence(list(token_ids), self, slot)
        seq.cached_ids = kept
        self.prefix_cache_query_tokens += len(token_ids)
        self.prefix_cache_hit_tokens += len(kept)
        self._kept[slot] = (scope, kept)
        self._owners[slot] = weakref.ref(seq)
        return seq

    def _take_slot(self, token_ids: list[int], scope: bytes) -> tuple[int, list[int]]:
        """(the free slot to take, the prefix of `token_ids` whose KV it holds). Under the lock."""
        best, best_n = -1, 0
        first = token_ids[0]
        for slot in self._free:
            kept = self._kept[slot]
            if kept is None or kept[0] != scope or not kept[1] or kept[1][0] != first:
                continue
            n = common_prefix(kept[1], token_ids)
            if n > best_n:
                best, best_n = slot, n
        if best < 0:
            best = next(iter(self._free))
        del self._free[best]
        kept = self._kept[best]
        return best, kept[1][:best_n] if kept is not None and best_n else []

    def free(self, seq: SlotSequence) -> None:
        """Return the sequence's slot to the pool now; the sequence can no longer be run. Idempotent."""
        self._own(seq, allow_freed=True)
        seq.slot = -1
        seq.cached_ids = []
        seq._release()  # runs _release_slot once, and never again at garbage collection

    def _release_slot(self, slot: int) -> None:
        with self._lock:
            self._owners[slot] = None
            self._free[slot] = None  # freed last: its prefix is the last to be overwritten

    def _own(self, seq, allow_freed: bool = False) -> None:
        if not isinstance(seq, SlotSequence) or seq._runner is not self:
            raise InvalidArgument("the sequence does not belong to this runner")
        if seq.slot < 0 and not allow_freed:
            raise InvalidArgument("the sequence was freed")

    def _check_len(self, n: int) -> None:
        if n > self.slot_len:
            raise InvalidArgument(
                f"a sequence of {n} tokens exceeds this runner's limit of {self.slot_len} tokens per sequence"
            )

    def longest_cached_prefix(self, seq_or_ids) -> int:
        """For a sequence: how many of its committed tokens its slot holds. For token ids: the longest
        prefix of them held by any open sequence (a sequence continuing that one would reuse it)."""
        if isinstance(seq_or_ids, SlotSequence):
            self._own(seq_or_ids, allow_freed=True)
            return common_prefix(seq_or_ids.cached_ids, seq_or_ids.token_ids)
        ids = list(seq_or_ids)
        best = 0
        for ref in list(self._owners):
            seq = ref() if ref is not None else None
            if seq is not None and seq.slot >= 0:
                best = max(best, common_prefix(seq.cached_ids, ids))
        return best

    # forward --------------------------------------------------------------------------------------
    def _sync(self, seq: SlotSequence) -> int:
        """Move the valid length back to the prefix still valid for token_ids, leaving >= 1 token to feed: a
        slot's valid length is its cached ids' count, so the sequence's own sync is all there is to do."""
        return seq.sync()

    @torch.inference_mode()
    def step(
        self,
        seqs: list[SlotSequence],
        extra: list[list[int]] | None = None,
        num_logits: list[int] | None = None,
        prefill: Sequence[PrefillChunk[SlotSequence]] = (),
    ) -> StepResult:
        """`forward` over `seqs` and `prefill` chunks of other sequences, in ONE pass of the model.

        Nothing is counted or marked cached unless the whole pass succeeds; if it raises, every sequence's
        cache is its kept prefix (what its committed tokens still match), whatever was half written."""
        work, reused, left = self._plan(seqs, extra, num_logits, prefill)
        logits = self._run(work) if work else []
        # The pass succeeded: only now do its tokens count as cached.
        for w in work:
            w.seq.cached_ids.extend(w.feed)
        self.prefix_tokens_reused += sum(reused)
        return StepResult(logits[: len(seqs)], left, reused, sum(len(w.feed) for w in work))

    def _run(self, work: list[_Work]) -> list[torch.Tensor]:
        """One forward over every sequence's feed; per work item float32 logits [num_logits, V]."""
        if self.fused_step:
            # A slot is one block as long as the slot, numbered in blocks of [slot_len, D] from the pool's
            # start: slot s of a [slots, n_kv, slot_len, D] pool is block s * n_kv.
            k0, v0, nkv = self._k[0], self._v[0], self._dec.n_kv
            strides = (k0.stride(1), k0.stride(2), v0.stride(1), v0.stride(2))
            fused = self._fused_pass(work, lambda w: (w.seq.slot * nkv,), self.slot_len, strides)
            if fused is not None:
                return fused
        ids, pos, rows = self._batch(work)
        flat_slot: list[int] = []
        segments = []
        off = 0
        for w in work:
            n = len(w.feed)
            flat_slot += [w.seq.slot] * n
            segments.append((w.seq.slot, w.start, n, off))
            off += n
        dev = self.device
        slots = torch.tensor(flat_slot, dtype=torch.long, device=dev)  # [T]
        dec = self._dec
        dec.refresh_if_stale()
        with sdpa_context(self.attention_backend, dev):
            kv = _SlotAttention(dec, self._k, self._v, pos, slots, segments)
            out = dec.ragged(kv, ids, pos, rows)
        return self._logits(out, work)

    def _matches_hf(self) -> bool:
        """A ragged probe (two sequences, a chunked prefill, a decode block, a rollback) against the stock
        HF forward of each sequence's whole ids."""
        ids = [(7 * i + 3) % self.vocab_size for i in range(12)]
        seqs = [self.new_sequence(ids[:7])]
        if self._num_slots > 1:
            seqs.append(self.new_sequence(ids[3:6]))
        try:
            with torch.inference_mode():
                self.prefill(seqs[0], max_tokens=4)
                extra = [ids[7:10], [ids[1]]][: len(seqs)]
                got = self.forward(seqs, extra)
                seqs[0].commit(ids[7:8])  # rejects ids[8:10]: the next pass recomputes from there
                got += self.forward(seqs[:1], [ids[9:11]])
                seqs[0].commit(ids[9:10])
                got += self.forward(seqs[:1])  # one token of one sequence (the fused CPU step where it runs)
                fed = [
                    ids[:10],
                    *[s.token_ids + e for s, e in zip(seqs[1:], extra[1:], strict=True)],
                    ids[:8] + ids[9:11],
                    ids[:8] + ids[9:10],
                ]
                for logits, f in zip(got, fed, strict=True):
                    with sdpa_context(self.attention_backend, self.device):
                        out = self.model(input_ids=torch.tensor([f], device=self.device))
                    if not logits_agree(out.logits[0, -len(logits) :].float(), logits, self._dec.probe_dtype):
                        return False
            return True
        finally:
            for s in reversed(seqs):
                slot = s.slot
                self.free(s)
                if slot >= 0:  # the pool is as it was built: nothing cached
                    self._kept[slot] = None
            self.prefix_tokens_reused = 0
            self.prefix_cache_query_tokens = self.prefix_cache_hit_tokens = 0


class SlotAccount:
    """`BatchedRunner`'s KV accounting: a sequence holds a whole slot, whatever its length, until the slot is
    freed; the pool's slots cap the sequences."""

    def __init__(self, runner: BatchedRunner):
        self.runner = runner

    @property
    def pool_bytes(self) -> int:
        return self.runner.pool_bytes

    @property
    def max_sequences(self) -> int:
        return self.runner.num_slots

    def held(self, seq: SlotSequence) -> int:
        return 0 if seq.freed else self.runner.slot_bytes

    def needed(self, seq: SlotSequence | None, tokens: int) -> int:
        return self.runner.slot_bytes if seq is None or seq.freed else 0  # a new turn keeps its slot


def _no_logits(vocab: int, device) -> torch.Tensor:
    return torch.empty((0, vocab), dtype=torch.float32, device=device)
