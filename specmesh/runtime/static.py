"""A single-sequence runner built for the draft model's per-token decode: `StaticCacheRunner`.

It is a drop-in replacement of `ModelRunner` for the way `ModelDrafter` uses it (one sequence per call,
one or a few tokens fed at a time) and keeps ModelRunner's semantics: the cache holds a prefix of the
sequence's ids, and each forward keeps the longest common prefix of the cached ids and the committed
`token_ids` and recomputes the rest. What differs is the cost per token:

* KV cache: one preallocated buffer per layer and sequence ([1, H_kv, capacity, D]), written in place;
  rolling back rejected drafts only moves the valid length back (no crop, no cat, no allocation); a
  sequence that outgrows its buffer gets one twice as large (amortised O(1) per token).
* Sync: `token_ids` is a list subclass that records the lowest index changed since the last sync, so the
  common prefix is found by comparing only the changed tail (ModelRunner walks every id on every call).
* Forward: for Llama, Qwen2 and Qwen3 (and Mistral without a sliding window) a short hand-written loop
  over fused copies of the projection weights stored [in, out] (see `_FastDecoder`: that layout, not
  Python overhead, is most of the gain on CPU); any other causal LM ModelRunner supports runs the stock
  HF forward over the same preallocated cache. The hand-written loop is checked against the HF forward
  on a probe when the runner is built and is not used (with a warning) if they disagree. On a CPU in float32
  (attention backend `auto`) a feed of up to the step's `max_seq_rows` tokens goes through the fused C
  step instead (`cpu_kernels.DecodeStep`, the buffer as one block): the demo draft's one-token step ~0.22 ms.

Logits equal ModelRunner's up to float rounding (~1e-5 absolute on the tests' tiny models; bitwise with
fast_path=False). torch.compile of the one-token step was measured on the 2-core dev machine and left out:
inductor (dynamic=True, also with freezing) compiled in 7-32 s and ran no faster than this eager loop
(~1.0-1.6 ms either way, the weight reads dominate).
"""

from __future__ import annotations

import operator
import sys
import threading
import warnings
from collections.abc import Callable, Iterable
from typing import Any, Self, SupportsIndex

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

from specmesh.runtime import cpu_kernels
from specmesh.runtime.attention import check_attention_backend, sdpa_context
from specmesh.runtime.base import SequentialRunner, plain_full_attention
from specmesh.runtime.sequence import SequenceBase

_NONE_CHANGED = sys.maxsize

# Architectures whose decoder the hand-written path reproduces op for op (pre-norm RMSNorm, rotary
# q/k, SwiGLU-style gated MLP, tied or untied lm_head). Anything else runs the HF forward.
_FAST_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
# Rotary types whose inverse frequencies do not depend on the sequence length (no dynamic update).
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}

# Smaller matrices stay with MKL: a tiny model's forwards got slower packed (oneDNN's fixed cost per call).
# 512 x 512: the demo target's smallest matrix is packed, the demo draft's lm_head is and its 256-wide
# projections are not.
_PACK_MIN_ELEMENTS = 512 * 512

# oneDNN packs a weight for an expected number of rows; the layout serves any count. 16 was fastest for
# every count from 1 to 300 on the demo target's matrices (2 threads, AVX2), against 1 and 5.
_PACK_ROWS = 16


def _can_pack(like: torch.Tensor) -> bool:
    """Whether fp32 weights on this tensor's device can go through oneDNN's packed linear (a CPU build with
    oneDNN; checked on a small probe against F.linear, so a build that lacks the op falls back)."""
    if like.device.type != "cpu" or like.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return False
    try:
        w, x = torch.randn(8, 4), torch.randn(3, 4)
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, 3), None, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    return bool(torch.allclose(got, F.linear(x, w), atol=1e-5))


class _TrackedIds(list[int]):
    """A list of token ids that records the lowest index changed since the runner last synced it.

    Every mutating list method is overridden; positions below `low` are known to be unchanged.
    """

    __slots__ = ("low",)

    def __init__(self, iterable: Iterable[int] = ()) -> None:
        super().__init__(iterable)
        self.low = 0

    def _touch(self, i: int) -> None:
        if i < self.low:
            self.low = i

    def _touch_at(self, i: SupportsIndex | slice) -> None:
        """Record a change at index or slice `i`, as the list method given `i` will see it."""
        if isinstance(i, slice):
            r = range(*i.indices(len(self)))
            self._touch(min(r.start, r[-1]) if r else min(r.start, len(self)))
        else:
            i = operator.index(i)
            self._touch(max(i + len(self) if i < 0 else i, 0))

    def append(self, x: int) -> None:
        self._touch(len(self))
        list.append(self, x)

    def extend(self, xs: Iterable[int]) -> None:
        self._touch(len(self))
        list.extend(self, xs)

    # mypy checks __iadd__ against __add__, which typeshed overloads for list: every list subclass's
    # __iadd__ fails that check (typeshed's own list.__iadd__ carries the same ignore).
    def __iadd__(self, xs: Iterable[int]) -> Self:  # type: ignore[misc,override]  # overloaded list.__add__ stub
        self.extend(xs)
        return self

    def __imul__(self, k: SupportsIndex) -> Self:
        self._touch(0)
        return list.__imul__(self, k)

    def insert(self, i: SupportsIndex, x: int) -> None:
        i, n = operator.index(i), len(self)
        self._touch(min(max(i + n if i < 0 else i, 0), n))
        list.insert(self, i, x)

    def pop(self, i: SupportsIndex = -1) -> int:
        self._touch_at(i)
        return list.pop(self, i)

    def remove(self, x: int) -> None:
        self._touch(self.index(x))
        list.remove(self, x)

    def __setitem__(self, i: SupportsIndex | slice, x: Any) -> None:
        self._touch_at(i)
        list.__setitem__(self, i, x)

    def __delitem__(self, i: SupportsIndex | slice) -> None:
        self._touch_at(i)
        list.__delitem__(self, i)

    def clear(self) -> None:
        self._touch(0)
        list.clear(self)

    def sort(self, *a: Any, **kw: Any) -> None:
        self._touch(0)
        list.sort(self, *a, **kw)

    def reverse(self) -> None:
        self._touch(0)
        list.reverse(self)


def _prefix_view(name: str, buffer: str) -> property:
    """`_PreallocLayer.keys` or `.values`: a view of the valid prefix of its buffer. Only None may be assigned
    (what DynamicLayer's own code assigns): anything else would bypass the buffer."""

    def view(layer):
        buf = getattr(layer, buffer)
        return None if buf is None else buf[:, :, : layer.length]

    def assign(layer, value):
        if value is not None:
            raise AttributeError(f"_PreallocLayer.{name} is a view of its buffer")

    return property(view, assign)


class _PreallocLayer(DynamicLayer):
    """A DynamicLayer over a preallocated buffer: `update` writes in place, `crop` moves the length back.

    `keys` / `values` are views of the valid prefix, so the stock HF forward and masks work unchanged.
    """

    def __init__(self, capacity: int):
        self.k_buf: torch.Tensor | None = None
        self.v_buf: torch.Tensor | None = None
        self.length = 0
        self.capacity = capacity
        super().__init__()

    keys = _prefix_view("keys", "k_buf")
    values = _prefix_view("values", "v_buf")

    def allocate(self, batch: int, kv_heads: int, k_dim: int, v_dim: int, dtype, device) -> None:
        self.device = device
        self.k_buf = torch.zeros((batch, kv_heads, self.capacity, k_dim), dtype=dtype, device=device)
        self.v_buf = torch.zeros((batch, kv_heads, self.capacity, v_dim), dtype=dtype, device=device)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.allocate(b, h, dk, value_states.shape[-1], key_states.dtype, key_states.device)

    def reserve(self, needed: int) -> None:
        """Make room for `needed` tokens, doubling the capacity (the valid prefix is copied over)."""
        if needed <= self.capacity:
            return
        cap = self.capacity
        while cap < needed:
            cap *= 2
        self.capacity = cap
        old_k, old_v, n = self.k_buf, self.v_buf, self.length
        if old_k is not None and old_v is not None:  # allocate() sets both; before it there is nothing to copy
            shape_k, shape_v = list(old_k.shape), list(old_v.shape)
            shape_k[2] = shape_v[2] = cap
            self.k_buf = old_k.new_zeros(shape_k)
            self.v_buf = old_v.new_zeros(shape_v)
            self.k_buf[:, :, :n].copy_(old_k[:, :, :n])
            self.v_buf[:, :, :n].copy_(old_v[:, :, :n])

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.length
        end = start + key_states.shape[-2]
        self.reserve(end)
        k_buf, v_buf = self.k_buf, self.v_buf
        assert k_buf is not None and v_buf is not None  # is_initialized: allocate() has run
        k_buf[:, :, start:end].copy_(key_states)
        v_buf[:, :, start:end].copy_(value_states)
        self.length = end
        return k_buf[:, :, :end], v_buf[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative number of tokens to remove")
        self.length = max(self.length + tokens_to_remove, 0)

    def reset(self) -> None:
        self.length = 0


class _PreallocCache(Cache):
    """One sequence's KV cache: a `_PreallocLayer` per decoder layer, all of the same length."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[_PreallocLayer(capacity) for _ in range(num_layers)])

    @property
    def length(self) -> int:
        return self.layers[0].length

    def set_length(self, n: int) -> None:
        for layer in self.layers:
            layer.length = n

    def reserve(self, needed: int) -> None:
        for layer in self.layers:
            layer.reserve(needed)


class TrackedSequence(SequenceBase):
    """A sequence whose committed ids are `_TrackedIds`, so that its runner compares only what changed."""

    __slots__ = ("_tokens", "cached_ids")

    def __init__(self, token_ids: list[int]):
        self._tokens = _TrackedIds(token_ids)
        self.cached_ids: list[int] = []

    @property
    def token_ids(self) -> list[int]:
        return self._tokens

    @token_ids.setter
    def token_ids(self, ids: list[int]) -> None:
        self._tokens = _TrackedIds(ids)  # low = 0: everything is compared again at the next sync

    def sync(self) -> int:
        """Drop the cached ids past the prefix still valid for token_ids, leaving >= 1 token to feed; return
        how many stay (the runner cuts its cache to that). Only ids at or after the lowest index changed
        since the last sync are compared."""
        tok, cached = self._tokens, self.cached_ids
        c, n = len(cached), len(tok)
        lim = c if c < n else n
        i = tok.low if tok.low < lim else lim
        while i < lim and cached[i] == tok[i]:
            i += 1
        keep = i if i < n else n - 1
        tok.low = _NONE_CHANGED
        if keep < c:
            del cached[keep:]
        return keep


class FastSequence(TrackedSequence):
    """ModelRunner's `Sequence` for StaticCacheRunner: committed ids, cached ids, a preallocated cache."""

    __slots__ = ("cache",)

    def __init__(self, token_ids: list[int], cache: _PreallocCache):
        super().__init__(token_ids)
        self.cache = cache


class _FastDecoder:
    """The decoder of a Llama-family model as one plain loop over its weights, on a `_PreallocCache`.

    Mirrors the HF modules (RMSNorm, rotary q/k, sdpa, gated MLP) with fewer, larger ops: q/k/v are one
    matmul, gate/up one matmul, rotary is applied to q and k at once from a table computed once by the
    model's own rotary module. The projection weights are copied once, fused and stored [in, out]: MKL's
    one-row GEMM over HF's [out, in] layout reads weights far below memory bandwidth on CPU (measured
    ~3.5x slower over the demo draft's 15 matrices). On a CPU with oneDNN, fp32 weights are also packed
    once into oneDNN's blocked layout (`packed`) for forwards of 2 or more rows: MKL's GEMM for 2-16 rows
    costs 2-3x its one-row GEMV, which made a K = 4 verify block cost ~2.6 one-token forwards; packed, 5 rows
    cost ~1.5x one row. Only matrices of 512 x 512 or more are packed unless `packed=True` packs all. One row
    keeps MKL's GEMV, so packing costs a second copy of those weights (CPU only). The copies track their
    sources' version counters and are rebuilt if the model's weights are modified in place. Logits differ
    from the HF forward by float rounding only (~1e-5 relative).
    """

    def __init__(self, model: PreTrainedModel, packed: bool | None = None, step_panels: torch.dtype = torch.float32):
        cfg = model.config
        base = model.model
        self.model = model
        self.step_panels = step_panels  # the fused step's panels (cpu_kernels.DecodeStep's panels_dtype)
        self.embed = base.embed_tokens.weight
        self.norm_w, self.norm_eps = base.norm.weight, base.norm.variance_epsilon
        self.rotary = base.rotary_emb
        self.dtype = self.embed.dtype
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.half = self.head_dim // 2
        self.gqa = self.n_heads != self.n_kv
        # None: matrices of at least _PACK_MIN_ELEMENTS, where the device allows it; True: every matrix.
        self.pack_all = bool(packed)
        self.packed = _can_pack(self.embed) if packed is None else bool(packed)
        self.linear = self._packed_linear if self.packed else F.linear
        # One row (a decode step) through specmesh's GEMV over both threads, where it builds (cpu_kernels).
        self.gemv = self.embed.device.type == "cpu" and self.dtype == torch.float32 and cpu_kernels.load() is not None
        if self.gemv:
            self.linear = self._one_row_gemv(self.linear)
            # A batch's RMSNorm in one call (torch's fp32 one is five operators, a pass over memory each)
            self._rms = self._rms_cpu  # type: ignore[method-assign]
        self.cos: torch.Tensor  # [pos, 1, D] rotary tables for positions [0, table_len), built by reserve()
        self.sin: torch.Tensor
        self.table_len = 0
        self._lock = threading.Lock()  # the draft service decodes several sessions on worker threads
        self.reserve(256)
        if self.cos.shape[-1] != self.head_dim:  # partial rotary: not what this loop implements
            raise ValueError(f"rotary dim {self.cos.shape[-1]} != head_dim {self.head_dim}")
        self.version = -1
        self._build()

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        cfg = model.config
        if type(model).__name__ not in _FAST_ARCHS:
            return False
        if getattr(cfg, "sliding_window", None) is not None and getattr(cfg, "use_sliding_window", True):
            return False
        rope = getattr(cfg, "rope_parameters", None) or {}
        if rope.get("rope_type", "default") not in _STATIC_ROPE:
            return False
        base = getattr(model, "model", None)
        return base is not None and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))

    def _t(self, *linears):
        """Weights of `linears` concatenated on the output dim, stored [in, out], as F.linear's [out, in]
        view; with `packed`, the pair (that, the same weights in oneDNN's packed layout)."""
        w = torch.cat([lin.weight.detach().t() for lin in linears], dim=1).contiguous().t()
        if self.packed and (self.pack_all or w.numel() >= _PACK_MIN_ELEMENTS):
            return (w, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS))
        return w

    @staticmethod
    def _b(*linears) -> torch.Tensor | None:
        if all(lin.bias is None for lin in linears):
            return None
        return torch.cat(
            [lin.bias.detach() if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in linears]
        )

    @staticmethod
    def _one_row_gemv(linear: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def one_row_first(
            x: torch.Tensor, w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], b: torch.Tensor | None
        ) -> torch.Tensor:
            if x.dim() == 2 and x.shape[0] == 1:
                rows = w[0] if isinstance(w, tuple) else w
                if cpu_kernels.gemv_fits(rows):
                    return cpu_kernels.gemv(x, rows, b)
            return linear(x, w, b)

        return one_row_first

    @staticmethod
    def _packed_linear(
        x: torch.Tensor, w: torch.Tensor | tuple[torch.Tensor, torch.Tensor], b: torch.Tensor | None
    ) -> torch.Tensor:
        # One row, or a matrix too small to pack: MKL over the [in, out] copy; oneDNN's fixed cost per call
        # (~25 us) outweighs its gain there.
        if not isinstance(w, tuple):
            return F.linear(x, w, b)
        m = x.shape[0]
        if m == 1:
            return F.linear(x, w[0], b)
        # oneDNN builds (~1.5 ms) and caches (1024 entries) a primitive per row count: padded to a few
        # buckets, a serving process meets ~70 row counts in all rather than every count up to its batch. Its
        # time grows with the rows from ~16 on (the demo target's gate-up: 20 rows 282 us, 32 rows 456), so
        # the buckets stay fine where verify batches of a few streams fall (4 x 5 = 20 rows, not 32).
        step = 1 if m <= 16 else 4 if m <= 64 else 16 if m <= 256 else 128
        padded = -(-m // step) * step
        if padded != m:
            x = F.pad(x, (0, 0, 0, padded - m))
        out = torch.ops.mkldnn._linear_pointwise(x, w[1], b, "none", [], "")
        return out[:m] if padded != m else out

    @torch.no_grad()
    def _build(self) -> None:
        base = self.model.model
        lm = self.model.get_output_embeddings()
        self.lm_w, self.lm_b = self._t(lm), self._b(lm)
        self.layers = []
        sources = [lm]
        for layer in base.layers:
            at, mlp = layer.self_attn, layer.mlp
            act = mlp.act_fn
            act = F.silu if type(act).__name__ in ("SiLUActivation", "SiLU") else act
            qkv = (at.q_proj, at.k_proj, at.v_proj)
            gate_up = (mlp.gate_proj, mlp.up_proj)
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    layer.input_layernorm.variance_epsilon,
                    self._t(*qkv),
                    self._b(*qkv),
                    self._t(at.o_proj),
                    self._b(at.o_proj),
                    at.scaling,
                    getattr(at, "q_norm", None),
                    getattr(at, "k_norm", None),
                    layer.post_attention_layernorm.weight,
                    layer.post_attention_layernorm.variance_epsilon,
                    self._t(*gate_up),
                    self._b(*gate_up),
                    mlp.gate_proj.out_features,
                    self._t(mlp.down_proj),
                    self._b(mlp.down_proj),
                    act,
                )
            )
            sources += [*qkv, at.o_proj, *gate_up, mlp.down_proj]
        # One token of one sequence: the whole forward in one C call where it builds (cpu_kernels.DecodeStep).
        usable = self.gemv and not cpu_kernels.DecodeStep.reason(self)
        self.step = cpu_kernels.DecodeStep(self, self.step_panels) if usable else None
        # The copies go stale when the model's weights change: remember what they were made from.
        self._sources = [p for lin in sources for p in (lin.weight, lin.bias) if p is not None]
        self._stamp = self._current_stamp()
        # Counts the builds: whatever holds the copies' addresses (a captured CUDA graph) is stale past it.
        self.version += 1

    @property
    def probe_dtype(self) -> torch.dtype:
        """The precision a probe against the HF forward holds this decoder to: its fused step's panels' where
        they are narrower than its weights."""
        if self.step is not None and self.step.panels_dtype == torch.bfloat16:
            return torch.bfloat16
        return self.dtype

    def _current_stamp(self) -> tuple:
        return tuple([(p._version, p.data_ptr()) for p in self._sources])

    def refresh_if_stale(self) -> None:
        """Rebuild the weight copies if a source weight was modified in place or re-pointed."""
        if self._current_stamp() != self._stamp:
            with self._lock:
                if self._current_stamp() != self._stamp:
                    self._build()

    @torch.no_grad()
    def reserve(self, needed: int) -> None:
        """Rotary cos / sin for positions [0, needed) as [pos, 1, D], rotate_half's sign folded into sin."""
        if needed <= self.table_len:
            return
        with self._lock:
            if needed > self.table_len:
                self._grow(needed)

    def _grow(self, needed: int) -> None:
        n = max(needed, 2 * self.table_len, 256)
        pos = torch.arange(n, device=self.embed.device)[None, :]
        cos, sin = self.rotary(self.embed[:1][None], pos)
        sin = sin[0].clone()
        sin[:, : self.half].neg_()  # rotate_half(x) * sin == roll(x, half) * (-sin_lo, sin_hi), exactly
        self.cos, self.sin, self.table_len = cos[0][:, None].contiguous(), sin[:, None].contiguous(), n

    @staticmethod
    def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, w.shape, w, eps)
        h = x.float()  # HF: normalise in fp32, cast back, then scale
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    @classmethod
    def _rms_cpu(cls, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        y = cpu_kernels.rms_norm(x, w, eps)
        return y if y is not None else cls._rms(x, w, eps)

    def _swiglu(self, act: Callable[[torch.Tensor], torch.Tensor], gu: torch.Tensor, inter: int) -> torch.Tensor:
        """act(gate) * up from the gate-up product's rows; SiLU's in one call where the CPU kernels build."""
        if self.gemv and act is F.silu:
            y = cpu_kernels.silu_mul(gu, inter)
            if y is not None:
                return y
        return act(gu[:, :inter]) * gu[:, inter:]

    def __call__(self, cache: _PreallocCache, feed: list[int], num_logits: int, fused: bool = True) -> torch.Tensor:
        """Logits [num_logits, V] of the last rows of `feed`, fed after the cache's tokens; `fused`: a feed of
        up to the step's `max_seq_rows` may go through the fused CPU step (`cpu_kernels.DecodeStep`)."""
        n = len(feed)
        start = cache.length
        end = start + n
        self.reserve(end)
        step = self.step if fused else None
        if step is not None and n <= step.max_seq_rows and min(feed) >= 0 and max(feed) < self.embed.shape[0]:
            first = cache.layers[0]
            pools = [layer.k_buf[0] for layer in cache.layers], [layer.v_buf[0] for layer in cache.layers]
            # The buffer is one block as long as its capacity: block 0 holds every position.
            out = step([(feed, start, (0,))], *pools, first.capacity, [num_logits])
            cache.set_length(end)
            return out if out is not None else self.embed.new_empty((0, step.vocab))
        dev = self.embed.device
        x = F.embedding(torch.tensor(feed, device=dev), self.embed)  # [n, hidden]
        cos, sin = self.cos[start:end], self.sin[start:end]  # [n, 1, D]
        mask = None
        if n > 1:
            mask = torch.arange(end, device=dev)[None, :] <= torch.arange(start, end, device=dev)[:, None]
        hd, half, nh, nkv, rms, gqa = self.head_dim, self.half, self.n_heads, self.n_kv, self._rms, self.gqa
        lin = self.linear
        nqk = nh + nkv
        for layer, (ln1, eps1, wqkv, bqkv, wo, bo, scale, qn, kn, ln2, eps2, wgu, bgu, inter, wd, bd, act) in zip(
            cache.layers, self.layers, strict=True
        ):
            h = rms(x, ln1, eps1)
            qkv = lin(h, wqkv, bqkv).view(n, nqk + nkv, hd)
            qk = qkv[:, :nqk]
            if qn is not None:
                assert kn is not None  # q_norm and k_norm come together (Qwen3)
                qk = torch.cat(
                    (rms(qk[:, :nh], qn.weight, qn.variance_epsilon), rms(qk[:, nh:], kn.weight, kn.variance_epsilon)),
                    dim=1,
                )
            qk = qk * cos + qk.roll(half, -1) * sin
            layer.k_buf[0, :, start:end] = qk[:, nh:].transpose(0, 1)
            layer.v_buf[0, :, start:end] = qkv[:, nqk:].transpose(0, 1)
            keys, values = layer.k_buf[:, :, :end], layer.v_buf[:, :, :end]
            q = qk[:, :nh].transpose(0, 1)[None]  # [1, nh, n, D]
            if mask is not None and gqa:
                keys = keys.repeat_interleave(nh // nkv, dim=1)
                values = values.repeat_interleave(nh // nkv, dim=1)
                a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
            else:
                a = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=gqa)
            x = x + lin(a[0].transpose(0, 1).reshape(n, nh * hd), wo, bo)
            h = rms(x, ln2, eps2)
            gu = lin(h, wgu, bgu)
            x = x + lin(self._swiglu(act, gu, inter), wd, bd)
        cache.set_length(end)
        x = rms(x[n - num_logits :], self.norm_w, self.norm_eps)
        return lin(x, self.lm_w, self.lm_b)


def logits_agree(ref: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a hand-written decoder's logits match the HF forward's on a probe, for a model in `dtype`.

    The probe is there to catch layout mistakes (rotary, heads, masks, cache positions), which move logits
    by their own scale. In fp32 the bound is tight. In bf16 or fp16 the two paths may run different attention
    kernels (HF's causal call against a masked one here), whose roundings differ by a few units of the
    format's epsilon over the layers (about 0.5% of the logits' scale for the demo pair in bf16).
    """
    if not bool(torch.isfinite(got).all()):
        return False
    rel = max(1e-3, 2 * torch.finfo(dtype).eps)
    return float((ref - got).abs().max()) <= rel * (1.0 + float(ref.abs().max()))


class StaticCacheRunner(SequentialRunner[FastSequence]):
    """ModelRunner's interface and semantics for single-sequence use, with a preallocated KV cache.

    `fast_path`: None = the hand-written decoder when the architecture allows it and it matches the HF
    forward on a probe; False = always the HF forward (over the preallocated cache); True = require it.
    `attention_backend`: which SDPA kernels a forward may use (`specmesh.runtime.attention`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        initial_capacity: int = 256,
        fast_path: bool | None = None,
        attention_backend: str = "auto",
    ):
        super().__init__(model)
        self.attention_backend = check_attention_backend(attention_backend)
        self.initial_capacity = max(int(initial_capacity), 1)
        layers = DynamicCache(config=self.config).layers
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            raise ValueError("models with sliding-window attention layers are not supported yet")
        if not plain_full_attention(self.config):
            raise ValueError("StaticCacheRunner supports plain full-attention caches only")
        self.num_layers = len(layers)
        self._fast: _FastDecoder | None = None
        if fast_path is not False:
            problem = None
            if not _FastDecoder.supports(model):
                problem = f"no hand-written decoder for {type(model).__name__} with this config"
            else:
                try:
                    self._fast = _FastDecoder(model)
                    if not self._fast_matches_hf():
                        problem = "the hand-written decoder disagrees with the HF forward for this model"
                except Exception as e:  # noqa: BLE001 - any surprise in the model's layout: use the HF forward
                    problem = f"the hand-written decoder failed on this model ({e!r})"
                if problem:
                    self._fast = None
            if problem and fast_path:
                raise ValueError(problem)
            if problem and _FastDecoder.supports(model):
                warnings.warn(f"StaticCacheRunner: {problem}; using the HF forward", stacklevel=2)

    @property
    def uses_fast_path(self) -> bool:
        return self._fast is not None

    def _new_cache(self, n_tokens: int) -> _PreallocCache:
        cap = self.initial_capacity
        while cap < n_tokens:
            cap *= 2
        cache = _PreallocCache(self.num_layers, cap)
        if self._fast is not None:
            f = self._fast
            for layer in cache.layers:
                layer.allocate(1, f.n_kv, f.head_dim, f.head_dim, f.dtype, self.device)
        return cache

    def new_sequence(self, token_ids: list[int], scope: bytes = b"") -> FastSequence:
        """`Runner.new_sequence`; `scope` does not apply (no sequence shares another's cache)."""
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        return FastSequence(list(token_ids), self._new_cache(len(token_ids) + 16))

    def _sync(self, seq: FastSequence) -> int:
        """Move the valid length back to the prefix still valid for token_ids, leaving >= 1 token to feed."""
        cached = len(seq.cached_ids)
        keep = seq.sync()
        if keep < cached:
            seq.cache.set_length(keep)
        return keep

    def _run(self, seqs: list[FastSequence], feeds: list[list[int]], num_logits: list[int]) -> list[torch.Tensor]:
        """Sequences run one after another."""
        return [self._run_one(s, f, n) for s, f, n in zip(seqs, feeds, num_logits, strict=True)]

    def _run_one(self, seq: FastSequence, feed: list[int], num_logits: int) -> torch.Tensor:
        cache = seq.cache
        start = cache.length
        try:
            with sdpa_context(self.attention_backend, self.device):
                if self._fast is not None:
                    self._fast.refresh_if_stale()
                    cache.reserve(start + len(feed))
                    # The fused CPU step under `auto` only, the C kernels being the CPU's choice there.
                    logits = self._fast(cache, feed, num_logits, self.attention_backend == "auto")
                else:
                    ids = torch.tensor([feed], dtype=torch.long, device=self.device)
                    pos = torch.arange(start, start + len(feed), device=self.device)[None, :]
                    logits = self.model(
                        input_ids=ids, position_ids=pos, cache=cache, use_cache=True, logits_to_keep=num_logits
                    ).logits[0]
        except BaseException:
            cache.set_length(start)  # some layers may already hold the new keys/values
            raise
        seq.cached_ids.extend(feed)
        return logits.float()

    def _fast_matches_hf(self) -> bool:
        """Run a probe (prefill, one-token decode, a multi-token feed) through both paths; compare logits."""
        fast, self._fast = self._fast, None
        assert fast is not None  # called only once a decoder is built
        try:
            with torch.inference_mode():
                ids = [(7 * i + 3) % self.vocab_size for i in range(12)]
                results = []
                for use in (None, fast):
                    self._fast = use
                    seq = self.new_sequence(ids[:6])
                    seq_out = []
                    self.prefill(seq)
                    seq_out.append(self.forward([seq])[0])
                    seq.commit(ids[6:8])
                    seq_out.append(self.forward([seq], [ids[8:11]])[0])
                    results.append(torch.cat(seq_out))
                ref, got = results
                return logits_agree(ref, got, fast.dtype)
        finally:
            self._fast = fast
            self.prefix_tokens_reused = 0
