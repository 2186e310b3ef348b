"""Load a local HF causal LM checkpoint (weights, tokenizer) and read what serving needs from its config."""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# vLLM's --dtype names (and its aliases).
DTYPES = {
    "auto": None,
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def default_dtype(device: torch.device) -> torch.dtype:
    """`--dtype auto`: bf16 on CUDA, fp32 on a CPU. Native bf16 (AVX-512 BF16) does not pay on a CPU at serving
    shapes: on a 2-core AMD EPYC with it, the paged runner's one-token step over a 512-token context measured
    the same in bf16 as in fp32 (its matmuls 1.3x faster, its flash attention 3x slower) and a 16 x 5 verify
    batch 6 % faster, while bf16's greedy output is no longer fp32's token for token; elsewhere oneDNN
    emulates bf16 through fp32 and it is slower. `--dtype bfloat16` asks for it."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """A --dtype value (a name of `DTYPES`, a torch dtype, or None for auto) as the dtype to load in."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    return DTYPES.get(dtype or "auto") or default_dtype(device)


def load_model(path: str | Path, device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
    """(model, tokenizer) from a local checkpoint, in `dtype` (`resolve_dtype`: auto by default).
    The tokenizer is None when the directory has none (token-id APIs still work; stop strings do not)."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no HF checkpoint at {path} (config.json missing)")
    device = torch.device(device) if device is not None else default_device()
    dtype = resolve_dtype(dtype, device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    check_cache_argument(model)
    has_tokenizer = any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
    tokenizer = AutoTokenizer.from_pretrained(path) if has_tokenizer else None
    return model, tokenizer


def check_cache_argument(model) -> None:
    """The runtimes hand the KV cache to the HF forward as `cache=` (transformers >= 5.24). Earlier 5.x
    releases name it `past_key_values` and take an unknown `cache=` into **kwargs without a word, so every
    forward would run without its context: refuse such a model at load instead."""
    if "cache" not in inspect.signature(model.forward).parameters:
        raise RuntimeError(
            f"{type(model).__name__}.forward takes no `cache` argument (transformers {transformers.__version__}): "
            "specmesh needs transformers >= 5.24, where the KV cache argument is `cache=`"
        )


def eos_token_ids(model) -> frozenset[int]:
    """Every EOS id of the model's config and generation config (Llama 3 and Qwen chat models list several)."""
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return frozenset(ids)
