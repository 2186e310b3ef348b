"""Which runner serves the target model, and how its KV memory is laid out.

`--runner auto` (the default) takes `PagedRunner` (one ragged forward, the KV in blocks of one shared pool)
when it has a decoder for the model, and `ModelRunner` (the stock HF forward, any causal LM) otherwise;
`paged` insists on the former, `hf` takes the latter, `batched` is the slot pool the blocks replaced (kept
to measure against). `gguf` runs the forward on llama.cpp's CPU kernels (`specmesh.runtime.gguf`, optional:
llama-cpp-python), its KV cells planned as the block pool is.

Sizing the block pool. The KV budget (`--kv-cache-budget-mb`) is cut into blocks of `--block-size` tokens
that every session draws on as its tokens need them, so a session may reach the model's whole context
(`max_model_len`: the model's `max_position_embeddings`, capped by `--max-model-len`), and how many run at
once is bounded by the tokens they hold, not by a slot each. A budget that cannot hold one sequence of
`max_model_len` tokens is a configuration error (`BudgetError`: the service exits 2 naming the flags).

Sizing the slot pool (`batched`). A slot holds one session's whole KV up to `slot_len` tokens, so the pool
is `num_slots x slot_len` tokens of the budget, and every admitted session (`--max-sessions`) must be sure
of a slot: with `--max-model-len N`, `slot_len = min(N, the model's context)`; without, the model's
context capped to `budget / (max_sessions x bytes per token)`, refused below `MIN_AUTO_SLOT_TOKENS`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedModel

from specmesh.config import KV_CACHE_DTYPES
from specmesh.errors import ConfigError
from specmesh.runtime import Runner, registry
from specmesh.runtime.base import kv_bytes_per_token

log = logging.getLogger("specmesh.verify")

RUNNERS = ("auto", "paged", "gguf", "batched", "hf")
MIN_AUTO_SLOT_TOKENS = 256


class BudgetError(ConfigError):
    """The KV budget and the lengths asked for do not fit together: a configuration error (exit 2)."""


@dataclass(frozen=True)
class SlotPlan:
    slot_len: int  # most tokens one session holds (prompt + output + a draft block in flight)
    num_slots: int  # sessions whose caches the pool holds at once, busy or idle


@dataclass(frozen=True)
class BlockPlan:
    num_blocks: int
    block_size: int
    max_model_len: int  # most tokens one session holds

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"KV: {self.num_blocks} blocks of {self.block_size} tokens = {self.tokens} tokens; "
            f"max_model_len {self.max_model_len}"
        )


def plan_blocks(
    model_len: int, bytes_per_token: int, budget_bytes: int, block_size: int, max_model_len: int = 0
) -> BlockPlan:
    """The block pool for a model of context `model_len` (0 = unknown); BudgetError when the budget cannot
    hold one sequence of the longest length a session may reach."""
    length = min(max_model_len, model_len) if max_model_len and model_len else (max_model_len or model_len)
    if not length:
        raise BudgetError("the model's config does not give its context length: set --max-model-len")
    num_blocks = budget_bytes // (bytes_per_token * block_size)
    if num_blocks * block_size < length:
        raise BudgetError(
            f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds {num_blocks} blocks of {block_size} tokens "
            f"({num_blocks * block_size} tokens), fewer than one sequence of max_model_len {length}: raise "
            f"--kv-cache-budget-mb to at least {-(-length * bytes_per_token // 2**20)} or lower --max-model-len"
        )
    return BlockPlan(num_blocks, block_size, length)


def plan_slots(
    model_len: int, bytes_per_token: int, budget_bytes: int, max_sessions: int, max_model_len: int = 0
) -> SlotPlan:
    """The slot pool for a model of context `model_len` (0 = unknown); BudgetError when the budget cannot
    hold `max_sessions` useful slots (see the module docstring)."""
    if max_model_len:
        slot_len = min(max_model_len, model_len) if model_len else max_model_len
    else:
        fit = budget_bytes // (max_sessions * bytes_per_token)
        slot_len = min(model_len, fit) if model_len else fit
        floor = min(MIN_AUTO_SLOT_TOKENS, model_len) if model_len else MIN_AUTO_SLOT_TOKENS
        if slot_len < floor:
            raise BudgetError(
                f"a KV budget of {budget_bytes / 2**20:.1f} MiB gives each of --max-sessions "
                f"{max_sessions} sessions {slot_len} tokens, fewer than {floor}"
            )
    num_slots = budget_bytes // (max(slot_len, 1) * bytes_per_token)
    if slot_len < 2 or num_slots < max_sessions:
        raise BudgetError(
            f"a KV budget of {budget_bytes / 2**20:.1f} MiB holds {num_slots} slots of {slot_len} "
            f"tokens, fewer than --max-sessions {max_sessions}: raise --kv-cache-budget-mb or lower "
            f"--max-model-len or --max-sessions"
        )
    return SlotPlan(slot_len, num_slots)


def build_runner(
    model: PreTrainedModel,
    runner: str = "auto",
    budget_bytes: int = 2**31,
    max_sessions: int = 64,
    max_model_len: int = 0,
    prefault: bool = False,
    attention_backend: str = "auto",
    block_size: int = 16,
    cuda_graph_max_bs: int = 0,
    graph_tokens_per_seq: int = 1,
    kv_cache_dtype: str = "auto",
) -> Runner[Any]:
    """The runner `--runner` asks for (see the module docstring); BudgetError when the budget does not fit,
    ConfigError naming --kv-cache-dtype when the runner cannot keep its KV in that dtype, ValueError when the
    runner cannot serve the model."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, not {runner!r}")
    kv_dtype = _kv_dtype(model, runner, kv_cache_dtype)
    if runner == "hf":
        return registry.build_runner(model, "hf")
    if runner == "gguf":
        _check_gguf(model)
    if not registry.batched_supported(model):
        if runner != "auto":
            raise ValueError(f"--runner {runner} has no decoder for {type(model).__name__}; use auto or hf")
        log.info("no batched decoder for %s: serving with the HF runner", type(model).__name__)
        return registry.build_runner(model, "hf")
    model_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    bpt = kv_bytes_per_token(model.config, kv_dtype or next(model.parameters()).dtype)
    if runner == "batched":
        plan = plan_slots(model_len, bpt, budget_bytes, max_sessions, max_model_len)
        batched = registry.build_runner(
            model,
            "batched",
            num_slots=plan.num_slots,
            max_seq_len=plan.slot_len,
            prefault=prefault,
            attention_backend=attention_backend,
        )
        pool = batched.kv_account().pool_bytes or 0
        log.info("batched runner: %d KV slots of %d tokens (%.1f MiB)", plan.num_slots, plan.slot_len, pool / 2**20)
        return batched
    blocks = plan_blocks(model_len, bpt, budget_bytes, block_size, max_model_len)
    paged = registry.build_runner(
        model,
        "gguf" if runner == "gguf" else "paged",
        num_blocks=blocks.num_blocks,
        block_size=blocks.block_size,
        max_seq_len=blocks.max_model_len,
        prefault=prefault,
        attention_backend=attention_backend,
        cuda_graph_max_bs=cuda_graph_max_bs,
        graph_tokens_per_seq=graph_tokens_per_seq,
        kv_cache_dtype=kv_dtype,
    )
    log.info("%s (%.1f MiB)", blocks.describe(), (paged.kv_account().pool_bytes or 0) / 2**20)
    return paged


def _check_gguf(model: PreTrainedModel) -> None:
    """ValueError naming --runner gguf where llama.cpp's runner cannot serve the model."""
    from specmesh.runtime.gguf import unsupported

    why = unsupported(model)
    if why is not None:
        raise ValueError(f"--runner gguf cannot serve this model: {why}")


def _kv_dtype(model: PreTrainedModel, runner: str, name: str) -> torch.dtype | None:
    """--kv-cache-dtype as the paged runner's `kv_cache_dtype`: None where the cache keeps the model's dtype;
    ConfigError naming the flag where the asked dtype cannot serve this model, runner and device."""
    if name not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {name!r}")
    wanted = KV_CACHE_DTYPES[name]
    param = next(model.parameters())
    if wanted is None or getattr(torch, wanted) == param.dtype:
        return None
    kv = getattr(torch, wanted)
    if kv != torch.bfloat16 or param.dtype != torch.float32 or param.device.type != "cpu":
        raise ConfigError(
            f"--kv-cache-dtype {name} with a {param.dtype} model on {param.device.type}: the cache keeps the "
            "model's dtype (--dtype), or bfloat16 for a float32 model on a CPU"
        )
    if runner not in ("auto", "paged") or not registry.batched_supported(model):
        raise ConfigError(f"--kv-cache-dtype {name}: only the paged runner keeps its KV in a dtype not the model's")
    return kv
