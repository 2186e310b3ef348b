"""`GgufRunner`: the `Runner` protocol on llama.cpp's CPU kernels (ggml), through llama-cpp-python's bindings
of its C API. Optional: `pip install 'specmesh[gguf]'` (llama-cpp-python builds llama.cpp from source).

Why: on a CPU a decode forward is bound by reading the weights, and torch's one-row GEMV plus a few hundred
small operators per forward (dispatch, allocation) leave the torch runners at ~2.5x the memory roofline on
the demo target, where ggml's fused kernels run near it (`bench/roofline.py`, `bench/load.py`'s llama.cpp
peer). The torch runners stay the reference and the GPU path; this one serves the same protocol on the CPU.

* The model: written once at start into a GGUF file (fp32, bf16 or fp16 as the model is) by `export_gguf`
  with the `gguf` package: Llama-family weights, q/k rows permuted to ggml's interleaved rotary pairs, no
  tokenizer (the services speak token ids), loaded into memory and the file deleted.
* The KV cache: llama.cpp's unified cache, one pool of `num_tokens` cells that every sequence draws on
  token by token, in the model's dtype (fp32 KV for an fp32 model: greedy output stays the target's token
  for token). Each `GgufSequence` is one of llama.cpp's sequence ids (at most `LLAMA_MAX_SEQ` open), so the
  pool is shared as the paged runner's is, without prefix sharing across sequences.
* `blocks`: the pool in virtual blocks of `block_size` cells, each sequence holding ceil(positions /
  block_size) of them: what the verify scheduler admits, evicts and preempts by, as with the paged runner
  (the rounding keeps its accounting at or above llama.cpp's own, so a planned pass always finds its cells).
* A step: per sequence, sync (the tokens past the prefix still valid are removed from its cells:
  `llama_memory_seq_rm`), then one `llama_decode` over every sequence's feed and prefill chunk (split in
  pieces of `max_batch_tokens` when longer), logits only for the rows asked for.
* Threads: llama.cpp's own pool (`threads`, default torch's thread count).
* Checked against the stock HF forward on a probe when built (a chunked prefill, drafts, a rollback, a second
  sequence), like the torch runners; a model it cannot reproduce is refused.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import importlib.util
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence

import numpy as np
import torch
from transformers import PreTrainedModel

from specmesh.errors import InvalidArgument, ResourceExhausted
from specmesh.runtime import PrefillChunk, StepResult
from specmesh.runtime.base import plain_full_attention
from specmesh.runtime.batched import _RaggedRunner, _Work
from specmesh.runtime.blocks import OutOfBlocks
from specmesh.runtime.static import TrackedSequence, logits_agree

LLAMA_MAX_SEQ = 256  # llama.cpp's bound on sequence ids per context
DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
GGML_TYPE_BF16 = 30  # ggml.h (the bindings name F32 and F16 only)
# llama.cpp's CPU flash attention rounds through fp16 (logits ~2e-3 relative off the HF forward's in fp32,
# enough to flip greedy near-ties); the plain attention path keeps the model's precision.
FLASH_ATTN = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED


def available() -> bool:
    """Whether llama-cpp-python and the gguf package are installed."""
    return importlib.util.find_spec("llama_cpp") is not None and importlib.util.find_spec("gguf") is not None


def unsupported(model: PreTrainedModel) -> str | None:
    """Why this runner cannot serve `model`, or None."""
    cfg = model.config
    if not available():
        return "llama-cpp-python is not installed (pip install 'specmesh[gguf]')"
    if getattr(cfg, "model_type", None) != "llama":
        return f"only the Llama architecture, not {getattr(cfg, 'model_type', '?')}"
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") != "default":
        return f"rope type {rope.get('rope_type')!r} (only the default)"
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        return "attention or MLP biases"
    if getattr(cfg, "hidden_act", "silu") != "silu" or not plain_full_attention(cfg):
        return "an activation or attention other than SiLU and full attention"
    p = next(model.parameters())
    if p.device.type != "cpu" or p.dtype not in DTYPES:
        return f"{p.dtype} on {p.device.type} (fp32, bf16 or fp16 on the CPU)"
    return None


def _rope_theta(cfg) -> float:
    rope = getattr(cfg, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF's rotary layout (halves) to ggml's (adjacent pairs), as llama.cpp's own converter does."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def export_gguf(model: PreTrainedModel, path: str) -> None:
    """Write `model` (a Llama) as a GGUF file llama.cpp loads, in the model's dtype, without a tokenizer."""
    import gguf

    cfg = model.config
    dtype = next(model.parameters()).dtype
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_context_length(int(cfg.max_position_embeddings))
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(_rope_theta(cfg))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(model.get_output_embeddings().weight.shape[0])
    w.add_file_type(getattr(gguf.LlamaFileType, f"MOSTLY_{DTYPES[dtype]}", gguf.LlamaFileType.ALL_F32))
    w.add_tokenizer_model("none")
    qtype = getattr(gguf.GGMLQuantizationType, DTYPES[dtype])

    def add(name: str, t: torch.Tensor) -> None:
        t = t.detach().cpu()
        if t.dim() == 1 or dtype == torch.float32:
            w.add_tensor(name, t.float().numpy())  # norms stay fp32, as llama.cpp's converter writes them
        elif dtype == torch.bfloat16:
            w.add_tensor(name, t.view(torch.int16).numpy().view(np.uint16), raw_dtype=qtype)
        else:
            w.add_tensor(name, t.numpy())

    base = model.model
    add("token_embd.weight", base.embed_tokens.weight)
    add("output_norm.weight", base.norm.weight)
    lm = model.get_output_embeddings().weight
    if lm.data_ptr() != base.embed_tokens.weight.data_ptr():
        add("output.weight", lm)
    for i, layer in enumerate(base.layers):
        at, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.attn_q.weight", _permute(at.q_proj.weight, heads))
        add(f"blk.{i}.attn_k.weight", _permute(at.k_proj.weight, kv_heads))
        add(f"blk.{i}.attn_v.weight", at.v_proj.weight)
        add(f"blk.{i}.attn_output.weight", at.o_proj.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight)
        add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight)
        add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


class GgufSequence(TrackedSequence):
    """One sequence: committed ids, the ids its cells hold, and its llama.cpp sequence id (-1 once freed)."""

    __slots__ = ("__weakref__", "_release", "_runner", "seq_id")

    def __init__(self, token_ids: list[int], runner: GgufRunner, seq_id: int):
        super().__init__(token_ids)
        self.seq_id = seq_id
        self._runner = runner
        self._release = weakref.finalize(self, runner._release, seq_id)


class GgufRunner(_RaggedRunner):
    """The `Runner` protocol over llama.cpp (see the module docstring).

    `num_tokens`: KV cells shared by every sequence; `max_seq_len`: most tokens one sequence may reach (the
    model's context by default); `block_size`: the virtual block of `blocks`; `max_batch_tokens`: most tokens
    one llama_decode call takes (longer steps are split); `threads`: llama.cpp's threads.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        num_tokens: int,
        max_seq_len: int | None = None,
        block_size: int = 16,
        max_batch_tokens: int = 1024,
        threads: int | None = None,
        check: bool = True,
    ):
        why = unsupported(model)
        if why is not None:
            raise ValueError(f"runner kind 'gguf' cannot serve this model: {why}")
        super().__init__(model)
        import llama_cpp

        self._lc = lc = llama_cpp
        cfg = model.config
        self.dtype = next(model.parameters()).dtype
        self.max_len = self._limit(self.model_len, max_seq_len, "max_seq_len")
        self.block_size = block_size
        self.num_tokens = max(int(num_tokens), block_size)
        # llama.cpp sizes its logits buffer for at least one output per sequence id: a batch below that asserts.
        self.max_batch_tokens = max(max_batch_tokens, LLAMA_MAX_SEQ)
        self.threads = threads or torch.get_num_threads()
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * self.dtype.itemsize
        lc.llama_backend_init()
        if _QUIET is not None:
            lc.llama_log_set(_QUIET, ctypes.c_void_p())
        with tempfile.TemporaryDirectory(prefix="specmesh-gguf-") as tmp:
            path = os.path.join(tmp, "model.gguf")
            export_gguf(model, path)
            mp = lc.llama_model_default_params()
            mp.n_gpu_layers = 0
            mp.use_mmap = False  # read into memory: the file goes with the directory
            self._model = lc.llama_model_load_from_file(path.encode(), mp)
        if not self._model:
            raise ValueError("llama.cpp could not load the exported model")
        # llama.cpp caps a batch at its context: a context under LLAMA_MAX_SEQ cells gets some slack beyond
        # `num_tokens`, which `blocks` never hands out.
        self._cells = max(self.num_tokens, self.max_batch_tokens)
        self._ctx = self._context(self._cells)
        self._lbatch = lc.llama_batch_init(self.max_batch_tokens, 0, 1)
        self._lock = threading.Lock()  # llama.cpp's context is used by one thread at a time
        self._orphans: list[int] = []  # sequence ids given back, their cells not yet removed
        self._free_ids = list(range(LLAMA_MAX_SEQ - 1, -1, -1))
        self._live: dict[int, weakref.ref[GgufSequence]] = {}
        self.blocks = GgufBlocks(self)
        if check and not self._matches_hf():
            raise ValueError(f"llama.cpp's forward disagrees with the HF forward for {type(model).__name__}")
        self._finalizer = weakref.finalize(self, _free_native, lc, self._ctx, self._model, self._lbatch)

    def _context(self, n_ctx: int):
        lc = self._lc
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = cp.n_ubatch = self.max_batch_tokens
        cp.n_seq_max = LLAMA_MAX_SEQ
        cp.n_outputs_max_per_seq = 0  # logits at every verified position, not only a sequence's last
        cp.flash_attn_type = FLASH_ATTN
        cp.n_threads = cp.n_threads_batch = self.threads
        cp.kv_unified = True  # one pool of cells for every sequence
        kv_type = {torch.float32: lc.GGML_TYPE_F32, torch.float16: lc.GGML_TYPE_F16}.get(self.dtype, GGML_TYPE_BF16)
        cp.type_k = cp.type_v = kv_type
        cp.no_perf = True
        ctx = lc.llama_init_from_model(self._model, cp)
        if not ctx:
            raise ValueError(f"llama.cpp could not make a context of {n_ctx} cells")
        return ctx

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        return unsupported(model) is None

    # sequences ------------------------------------------------------------------------------------
    @property
    def pool_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token

    def kv_account(self, bytes_per_token: int | None = None) -> GgufAccount:
        return GgufAccount(self)

    def context_limit(self, max_model_len: int = 0) -> int:
        limit = min(self.max_len, self.num_tokens)
        return limit if not max_model_len else min(limit, max_model_len)

    def new_sequence(self, token_ids: list[int], scope: bytes = b"") -> GgufSequence:
        """`Runner.new_sequence`: nothing is cached across sequences (`scope` does not apply)."""
        if not token_ids:
            raise InvalidArgument("a sequence needs at least one token")
        self._check_len(len(token_ids))
        with self._locked():
            if not self._free_ids:
                raise ResourceExhausted(f"all {LLAMA_MAX_SEQ} llama.cpp sequence ids are in use")
            sid = self._free_ids.pop()
        seq = GgufSequence(list(token_ids), self, sid)
        self._live[sid] = weakref.ref(seq)
        return seq

    def free(self, seq: GgufSequence) -> None:
        self._own(seq, allow_freed=True)
        seq.seq_id = -1
        seq.cached_ids = []
        seq._release()

    def _release(self, sid: int) -> None:
        """Give a sequence id back; a finalizer too, so it never waits for the lock (see PagedRunner)."""
        self._live.pop(sid, None)
        self._orphans.append(sid)
        if self._lock.acquire(blocking=False):
            try:
                self._free_orphans()
            finally:
                self._lock.release()

    def _free_orphans(self) -> None:
        mem = self._lc.llama_get_memory(self._ctx)
        while self._orphans:
            sid = self._orphans.pop()
            self._lc.llama_memory_seq_rm(mem, sid, -1, -1)
            self._free_ids.append(sid)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._free_orphans()
            yield

    def _own(self, seq, allow_freed: bool = False) -> None:
        if not isinstance(seq, GgufSequence) or seq._runner is not self:
            raise InvalidArgument("the sequence does not belong to this runner")
        if seq.seq_id < 0 and not allow_freed:
            raise InvalidArgument("the sequence was freed")

    def _check_len(self, n: int) -> None:
        if n > self.max_len:
            raise InvalidArgument(
                f"a sequence of {n} tokens exceeds this runner's limit of {self.max_len} tokens per sequence"
            )

    def _held_tokens(self) -> int:
        """Cells the open sequences hold, each rounded up to whole virtual blocks."""
        bs = self.block_size
        total = 0
        for ref in list(self._live.values()):
            seq = ref()
            if seq is not None and seq.seq_id >= 0:
                total += -(-len(seq.cached_ids) // bs) * bs
        return total

    # forward --------------------------------------------------------------------------------------
    def _sync(self, seq: GgufSequence) -> int:
        """Cut the sequence's cells back to the prefix still valid for its committed tokens."""
        before = len(seq.cached_ids)
        keep = seq.sync()
        if keep < before:
            with self._locked():
                self._lc.llama_memory_seq_rm(self._lc.llama_get_memory(self._ctx), seq.seq_id, keep, -1)
        return keep

    @torch.inference_mode()
    def step(
        self,
        seqs: list[GgufSequence],
        extra: list[list[int]] | None = None,
        num_logits: list[int] | None = None,
        prefill: Sequence[PrefillChunk[GgufSequence]] = (),
    ) -> StepResult:
        """`Runner.step`: every sequence's feed and chunk in one llama_decode (or pieces of it). OutOfBlocks
        before anything is written when the cells cannot hold what is fed; if the pass fails, every sequence's
        cells are cut back to its kept prefix."""
        work, reused, left = self._plan(seqs, extra, num_logits, prefill)
        if work:
            ids, _, _ = self._batch(work)  # token ids checked against the vocabulary before anything runs
            with self._locked():
                need = sum(self.blocks.needed_for(w.seq, w.start + len(w.feed)) for w in work)
                free = self.blocks.num_blocks - self._held_tokens() // self.block_size
                if need > free:
                    raise OutOfBlocks(f"KV cache out of blocks: {need} needed, {free} of {self.blocks.num_blocks} free")
                try:
                    logits = self._decode(work, ids)
                except BaseException:
                    mem = self._lc.llama_get_memory(self._ctx)
                    for w in work:
                        self._lc.llama_memory_seq_rm(mem, w.seq.seq_id, w.start, -1)
                    raise
        else:
            logits = []
        for w in work:
            w.seq.cached_ids.extend(w.feed)
        self.prefix_tokens_reused += sum(reused)
        return StepResult(logits[: len(seqs)], left, reused, sum(len(w.feed) for w in work))

    def _decode(self, work: list[_Work], ids: torch.Tensor) -> list[torch.Tensor]:
        lc, b, cap = self._lc, self._lbatch, self.max_batch_tokens
        tokens = ids.tolist()
        rows: list[tuple[int, int, bool]] = []  # (seq id, position, logits wanted) per token, in batch order
        for w in work:
            n = len(w.feed)
            rows += [(w.seq.seq_id, w.start + j, j >= n - w.num_logits) for j in range(n)]
        out: list[np.ndarray] = []
        vocab = self.vocab_size
        for first in range(0, len(rows), cap):
            piece = rows[first : first + cap]
            for i, (sid, pos, want) in enumerate(piece):
                b.token[i] = tokens[first + i]
                b.pos[i] = pos
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = sid
                b.logits[i] = want
            b.n_tokens = len(piece)
            rc = lc.llama_decode(self._ctx, b)
            if rc == 1:
                raise OutOfBlocks("llama.cpp found no KV cells for the batch")
            if rc != 0:
                raise RuntimeError(f"llama_decode failed ({rc})")
            n_out = sum(1 for _, _, want in piece if want)
            if n_out:
                ptr = lc.llama_get_logits(self._ctx)
                out.append(np.ctypeslib.as_array(ptr, shape=(n_out * vocab,)).copy())
        flat = torch.from_numpy(np.concatenate(out)).view(-1, vocab) if out else torch.empty(0, vocab)
        return list(flat.split([w.num_logits for w in work]))

    def _matches_hf(self) -> bool:
        """A probe against the stock HF forward: a chunked prefill, drafts, a rollback, two sequences.

        In 16 bits the reference is the HF forward in fp32 over the same weights: llama.cpp keeps activations
        in fp32 and rounds only a matmul's inputs, so it sits between the model's own 16-bit forward and fp32
        (on a tiny random model: 2% of the logits' scale off fp32, HF's bf16 forward 5%); the bound, 4 units
        of the format's epsilon, is far below what a layout mistake moves (the logits' own scale)."""
        v = self.vocab_size
        ids = [(7 * i + 3) % v for i in range(41)]
        seqs = []
        pool = self.blocks.num_blocks
        self.blocks.num_blocks = self._cells // self.block_size  # the probe may use the slack cells too
        try:
            with torch.inference_mode():
                a = self.new_sequence(ids[:20])
                seqs.append(a)
                self.prefill(a, max_tokens=8)
                got = self.forward([a], [ids[20:24]])
                fed = [ids[:24]]
                a.commit(ids[20:21])
                b = self.new_sequence(ids[5:30])
                seqs.append(b)
                got += self.forward([a, b], [[ids[30], ids[31]], [ids[1]]])
                fed += [ids[:21] + [ids[30], ids[31]], ids[5:30] + [ids[1]]]
                wide = self.dtype == torch.float32
                ref_model = self.model if wide else copy.deepcopy(self.model).float()
                for logits, f in zip(got, fed, strict=True):
                    ref = ref_model(input_ids=torch.tensor([f])).logits[0, -len(logits) :].float()
                    if wide and not logits_agree(ref, logits, self.dtype):
                        return False
                    bound = 4 * torch.finfo(self.dtype).eps * (1.0 + float(ref.abs().max()))
                    if not wide and not (bool(torch.isfinite(logits).all()) and (ref - logits).abs().max() <= bound):
                        return False
            return True
        finally:
            for s in seqs:
                self.free(s)
            self.blocks.num_blocks = pool
            self.prefix_tokens_reused = 0


def _free_native(lc, ctx, model, batch) -> None:
    lc.llama_batch_free(batch)
    lc.llama_free(ctx)
    lc.llama_model_free(model)


def _quiet(level, text, user_data) -> None:
    pass


try:  # llama.cpp logs every load to stderr; the service's own log says what matters
    import llama_cpp as _lc

    _QUIET = None if os.environ.get("SPECMESH_GGUF_LOG") else _lc.llama_log_callback(_quiet)
except ImportError:  # pragma: no cover - the runner refuses to build without it
    _QUIET = None


class GgufBlocks:
    """`Runner.blocks` of a `GgufRunner`: llama.cpp's cells in virtual blocks (see the module docstring)."""

    def __init__(self, runner: GgufRunner):
        self.runner = runner
        self.block_size = runner.block_size
        self.num_blocks = runner.num_tokens // runner.block_size

    def free_blocks(self) -> int:
        with self.runner._locked():
            return self.num_blocks - self.runner._held_tokens() // self.block_size

    def cached(self, seq: GgufSequence) -> int:
        return 0 if seq.seq_id < 0 else self.runner._sync(seq)

    def needed_for(self, seq: GgufSequence, positions: int) -> int:
        bs = self.block_size
        return max(0, -(-positions // bs) - -(-len(seq.cached_ids) // bs))

    def needed(self, seq: GgufSequence, positions: int) -> int:
        return self.needed_for(seq, positions)

    def held(self, seq: GgufSequence) -> int:
        return 0 if seq.seq_id < 0 else -(-len(seq.cached_ids) // self.block_size)

    def preempt(self, seq: GgufSequence) -> int:
        r = self.runner
        r._own(seq)
        held = self.held(seq)
        with r._locked():
            r._lc.llama_memory_seq_rm(r._lc.llama_get_memory(r._ctx), seq.seq_id, -1, -1)
            seq.cached_ids = []
        return held


class GgufAccount:
    """`GgufRunner`'s KV accounting: whole virtual blocks; admission and preemption go by `GgufBlocks`."""

    max_sequences: int | None = LLAMA_MAX_SEQ

    def __init__(self, runner: GgufRunner):
        self.runner = runner

    @property
    def pool_bytes(self) -> int:
        return self.runner.pool_bytes

    def held(self, seq: GgufSequence) -> int:
        return self.runner.blocks.held(seq) * self.runner.block_size * self.runner.bytes_per_token

    def needed(self, seq: GgufSequence | None, tokens: int) -> int:
        return 0
