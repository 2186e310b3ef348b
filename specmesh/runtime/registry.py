"""The one place runners are built and their classes named: the services and the in-process engine ask for
a kind, and everything after that goes through the `Runner` protocol (`specmesh.runtime`).

Kinds:

* `batched`: `BatchedRunner`, one ragged forward over a preallocated pool of `num_slots` KV slots of
  `max_seq_len` tokens (None: the model's context); the Llama family only (`batched_supported`);
* `static`: `StaticCacheRunner`, a preallocated cache per sequence, sequences one after another (the
  hand-written decoder where the architecture allows it, the HF forward otherwise);
* `paged`: `PagedRunner`, `batched`'s forward with the KV in `num_blocks` blocks of `block_size` tokens
  (prefix caching by block, each sequence up to the model's context capped by `max_seq_len`); the models
  `batched` serves;
* `gguf`: `GgufRunner`, llama.cpp's CPU kernels over one pool of `num_blocks * block_size` KV cells
  (llama-cpp-python installed; Llama architecture, CPU);
* `hf`: `ModelRunner`, the stock HF forward, any causal LM;
* `auto`: `batched` where the model allows it, else `hf`.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from specmesh.runtime import Runner
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.hf import ModelRunner
from specmesh.runtime.paged import PagedRunner
from specmesh.runtime.static import StaticCacheRunner

KINDS = ("auto", "batched", "paged", "gguf", "static", "hf")


def batched_supported(model: PreTrainedModel) -> bool:
    """Whether the `batched` kind has a decoder for `model` (the Llama family, full attention only)."""
    return BatchedRunner.supports(model)


def build_runner(
    model: PreTrainedModel,
    kind: str = "auto",
    *,
    num_slots: int = 0,
    max_seq_len: int | None = None,
    num_blocks: int = 0,
    block_size: int = 16,
    prefault: bool = False,
    attention_backend: str = "auto",
    cuda_graph_max_bs: int = 0,
    graph_tokens_per_seq: int = 1,
    kv_cache_dtype: torch.dtype | None = None,
    step_panels: torch.dtype = torch.float32,
) -> Runner[Any]:
    """A runner of `kind` for `model` (see the module docstring); ValueError for an unknown kind or a model
    the kind cannot serve. `num_slots`, `max_seq_len` and `prefault` size the batched runner's pool
    (`num_blocks`, `block_size`, `max_seq_len` and `prefault` the paged runner's);
    `attention_backend` (`specmesh.runtime.attention`) applies to the hand-written decoders;
    `cuda_graph_max_bs` and `graph_tokens_per_seq` bound the paged runner's CUDA graphs on CUDA
    (`specmesh.runtime.graphs`; 0: none; the other kinds have none); `kv_cache_dtype` the paged runner's KV
    element (None: the model's dtype; the other kinds keep the model's); `step_panels` the batched runner's
    fused CPU step's panels (bfloat16 for a draft: `cpu_kernels.DecodeStep`)."""
    if kind not in KINDS:
        raise ValueError(f"runner kind must be one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "auto":
        kind = "batched" if batched_supported(model) else "hf"
    if kv_cache_dtype not in (None, model.dtype) and kind != "paged":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype}: only the paged runner keeps its KV in another dtype")
    if kind == "batched":
        return BatchedRunner(
            model,
            num_slots,
            max_seq_len,
            prefault=prefault,
            attention_backend=attention_backend,
            step_panels=step_panels,
        )
    if kind == "paged":
        if not PagedRunner.supports(model):
            raise ValueError(f"runner kind 'paged' has no decoder for {type(model).__name__}; use 'hf' (ModelRunner)")
        return PagedRunner(
            model,
            num_blocks,
            block_size,
            max_seq_len,
            prefault=prefault,
            attention_backend=attention_backend,
            cuda_graph_max_bs=cuda_graph_max_bs,
            graph_tokens_per_seq=graph_tokens_per_seq,
            kv_cache_dtype=kv_cache_dtype,
        )
    if kind == "gguf":
        from specmesh.runtime.gguf import GgufRunner  # optional: llama-cpp-python

        # Cells: the block plan's, or (a caller that sizes slots, as the draft service) a slot's worth each.
        length = max_seq_len or int(getattr(model.config, "max_position_embeddings", 0) or 0)
        cells = num_blocks * block_size or num_slots * length
        return GgufRunner(model, cells, max_seq_len, block_size)
    if kind == "static":
        return StaticCacheRunner(model, attention_backend=attention_backend)
    return ModelRunner(model)
