"""Which runner serves the target model, and how the KV slot pool is sized.

`--runner auto` (the default) takes `BatchedRunner` (one ragged forward over a preallocated slot pool)
when it has a decoder for the model, and `ModelRunner` (the stock HF forward, any causal LM) otherwise;
`batched` insists on the former, `hf` takes the latter (also the way to measure the old runtime).

Sizing the pool. A slot holds one session's whole KV up to `slot_len` tokens, so the pool is
`num_slots x slot_len` tokens of the KV budget (`--kv-cache-budget-mb`). Every admitted session
(`--max-sessions`) must be sure of a slot, so the budget has to hold at least `max_sessions` slots:

* `--max-model-len N` given: `slot_len = min(N, the model's context)`; a budget that holds fewer than
  `max_sessions` such slots is a configuration error.
* not given (0): the model's context, capped to `budget / (max_sessions x bytes per token)` so that it
  does. Slots beyond `max_sessions` keep idle sessions' caches for their next turn (evicted LRU).

A budget that leaves `auto` slots shorter than `MIN_AUTO_SLOT_TOKENS` (or than the model's context, if
that is shorter) is too small for a slot pool to be useful: `auto` then serves with `ModelRunner`, whose
caches grow token by token under the same budget; `batched` refuses to start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel

from specmesh.runtime import Runner, registry
from specmesh.runtime.base import kv_bytes_per_token

log = logging.getLogger("specmesh.verify")

RUNNERS = ("auto", "batched", "hf")
MIN_AUTO_SLOT_TOKENS = 256


@dataclass(frozen=True)
class SlotPlan:
    slot_len: int  # most tokens one session holds (prompt + output + a draft block in flight)
    num_slots: int  # sessions whose caches the pool holds at once, busy or idle


def plan_slots(
    model_len: int, bytes_per_token: int, budget_bytes: int, max_sessions: int, max_model_len: int = 0
) -> SlotPlan:
    """The pool for a model of context `model_len` (0 = unknown); ValueError when the budget cannot hold
    `max_sessions` useful slots (see the module docstring)."""
    if max_model_len:
        slot_len = min(max_model_len, model_len) if model_len else max_model_len
    else:
        fit = budget_bytes // (max_sessions * bytes_per_token)
        slot_len = min(model_len, fit) if model_len else fit
        floor = min(MIN_AUTO_SLOT_TOKENS, model_len) if model_len else MIN_AUTO_SLOT_TOKENS
        if slot_len < floor:
            raise ValueError(
                f"a KV budget of {budget_bytes / 2**20:.1f} MiB gives each of --max-sessions "
                f"{max_sessions} sessions {slot_len} tokens, fewer than {floor}"
            )
    num_slots = budget_bytes // (max(slot_len, 1) * bytes_per_token)
    if slot_len < 2 or num_slots < max_sessions:
        raise ValueError(
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
) -> Runner[Any]:
    """The runner `--runner` asks for (see the module docstring); ValueError when it cannot be had."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, not {runner!r}")
    if runner == "hf":
        return registry.build_runner(model, "hf")
    if not registry.batched_supported(model):
        if runner == "batched":
            raise ValueError(f"--runner batched has no decoder for {type(model).__name__}; use auto or hf")
        log.info("no batched decoder for %s: serving with the HF runner", type(model).__name__)
        return registry.build_runner(model, "hf")
    model_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
    bpt = kv_bytes_per_token(model.config, next(model.parameters()).dtype)
    try:
        plan = plan_slots(model_len, bpt, budget_bytes, max_sessions, max_model_len)
    except ValueError as e:
        if runner == "batched":
            raise
        log.warning("%s: serving with the HF runner, whose caches grow token by token", e)
        return registry.build_runner(model, "hf")
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
