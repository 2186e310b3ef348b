"""Per-token draft time on CPU: plain HF decode vs ModelRunner vs StaticCacheRunner (both via ModelDrafter).

    python -m bench.draft_speed [--draft models/demo/draft] [--tokens 200] [--k 4] [--trials 5]

Methods, all greedy, on the same held-out prompt, in this one process:

* ``hf_dynamic``: the plain HF forward, one token at a time, ``model(input_ids, cache=DynamicCache)``,
  feeding back the argmax (no runner, no rollback) — the reference the ratios are against;
* ``model_runner``: ``ModelDrafter(DraftBatcher(ModelRunner(draft))).propose(K)`` rounds;
* ``static_hf``: ``StaticCacheRunner(draft, fast_path=False)`` — the preallocated cache and incremental
  sync, but the stock HF forward (isolates what the cache alone is worth);
* ``static_cache``: ``StaticCacheRunner(draft)`` — the hand-written decoder over fused [in, out] weights;
* ``batched_pool``: ``BatchedRunner(draft)`` — the slot pool (one session here), its fused step in float32
  (the draft service's with ``--dtype float32``);
* ``batched_pool_bf16``: the same with the fused step's panels in bfloat16 (``step_panels``), the draft
  service's runner under ``--dtype auto`` on a CPU with AVX-512 or AVX2 (elsewhere the same as ``batched_pool``).

Drafter rounds replay one fixed verdict schedule (accept a seeded random prefix of each block, then one
correction token), so every runner drafts and rolls back exactly the same way; draft time per token is
the propose() time over the tokens drafted. ``drafts_equal_model_runner`` checks that a runner drafted
the very same tokens as ModelRunner (the bfloat16 step may not: its logits move by bfloat16's rounding of the
weights). Each method runs `trials` times, interleaved; the median is reported. Runs with
torch.set_num_threads(1) and with the default thread count. Writes bench/results/draft_speed.json and a PNG
beside it.

Left out, measured on the 2-core dev machine (see the JSON's "notes"): torch.compile of the decode step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache

from bench.output import write_json
from specmesh.drafters import ModelDrafter
from specmesh.drafters.batcher import DraftBatcher
from specmesh.models import load_model
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.hf import ModelRunner
from specmesh.runtime.static import StaticCacheRunner
from specmesh.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

NOTES = [
    "torch.compile (inductor, CPU) of the one-token decode step was tried and left out: see the module "
    "docstring of specmesh/fast_runner.py for the numbers.",
    "MKL's one-row GEMM over HF's [out, in] weight layout streams weights at a fraction of memory "
    "bandwidth; the fast path keeps fused [in, out] copies of the projection weights.",
]


def prompt_ids(tokenizer, length: int, vocab: int) -> list[int]:
    """The first `length` tokens of a held-out standard library file (as bench.inprocess uses)."""
    if tokenizer is None:  # a checkpoint without a tokenizer: a fixed pseudo-random prompt
        g = torch.Generator().manual_seed(0)
        return torch.randint(1, vocab, (length,), generator=g).tolist()
    try:
        from bench.inprocess import heldout_prompts

        prompts = heldout_prompts(tokenizer, 1, length)
        if prompts:
            return prompts[0]
    except Exception:  # noqa: BLE001 - any corpus trouble: fall back to this file's own text
        pass
    return tokenizer(Path(__file__).read_text(), add_special_tokens=False)["input_ids"][:length]


@torch.inference_mode()
def run_hf(model, prompt: list[int], tokens: int) -> dict:
    cache = DynamicCache(config=model.config)
    out = model(input_ids=torch.tensor([prompt]), cache=cache, use_cache=True)
    nxt = int(out.logits[0, -1].argmax())
    drafted = []
    t0 = time.perf_counter()
    for _ in range(tokens):
        drafted.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]]), cache=cache, use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
    seconds = time.perf_counter() - t0
    return {"ms_per_token": seconds / tokens * 1e3, "drafted": drafted}


def verdict_schedule(rounds: int, k: int, seed: int = 0) -> list[int]:
    """How many drafts each round accepts (uniform in [0, K]: rollbacks of every length)."""
    rng = random.Random(seed)
    return [rng.randint(0, k) for _ in range(rounds)]


def run_drafter(runner, prompt: list[int], tokens: int, k: int, warmup_rounds: int, vocab: int) -> dict:
    """ModelDrafter rounds through a DraftBatcher that runs its forwards inline (as in-process generation
    does): the time is the runner's forwards plus the drafter's and batcher's own work, no thread hand-off."""

    async def rounds_of_k() -> dict:
        batcher = DraftBatcher(runner)
        drafter = ModelDrafter(batcher)
        await drafter.start(prompt, SamplingParams(temperature=0.0, max_tokens=10**6))
        rounds = -(-tokens // k)
        schedule = verdict_schedule(warmup_rounds + rounds, k)
        seconds, n, drafted = 0.0, 0, []
        try:
            for r, accept in enumerate(schedule):
                t0 = time.perf_counter()
                block = (await drafter.propose(k)).token_ids
                dt = time.perf_counter() - t0
                if r >= warmup_rounds:
                    seconds += dt
                    n += len(block)
                    drafted.extend(block)
                # accepted prefix, then a correction (or, all accepted, a bonus) token
                fix = (block[accept] + 1) % vocab if accept < len(block) else block[-1]
                drafter.commit(block[:accept] + [fix])
        finally:
            drafter.release()
            await batcher.close()
        return {"ms_per_token": seconds / n * 1e3, "drafted": drafted}

    with torch.inference_mode():
        return asyncio.run(rounds_of_k())


def measure(model, prompt, args) -> dict:
    vocab = model.get_output_embeddings().weight.size(0)
    runners = {
        "model_runner": lambda: ModelRunner(model),
        "static_hf": lambda: StaticCacheRunner(model, fast_path=False),
        "static_cache": lambda: StaticCacheRunner(model),
        "batched_pool": lambda: BatchedRunner(model, num_slots=4, max_seq_len=1024),
        "batched_pool_bf16": lambda: BatchedRunner(model, num_slots=4, max_seq_len=1024, step_panels=torch.bfloat16),
    }
    plan = {"hf_dynamic": lambda: run_hf(model, prompt, args.tokens)}
    plan.update(
        {
            name: (lambda make=make: run_drafter(make(), prompt, args.tokens, args.k, args.warmup_rounds, vocab))
            for name, make in runners.items()
        }
    )
    for fn in plan.values():  # warm-up: allocator, MKL, rotary tables
        fn()
    times: dict[str, list[float]] = {name: [] for name in plan}
    drafted: dict[str, list[int]] = {}
    for _ in range(args.trials):
        for name, fn in plan.items():
            res = fn()
            times[name].append(res["ms_per_token"])
            drafted[name] = res["drafted"]
    base = statistics.median(times["hf_dynamic"])
    out = {}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {
            "ms_per_token": round(med, 4),
            "min_ms": round(min(ts), 4),
            "ratio_vs_hf_dynamic": round(med / base, 3),
            "speedup_vs_hf_dynamic": round(base / med, 3),
        }
        if name != "hf_dynamic":
            out[name]["drafts_equal_model_runner"] = drafted[name] == drafted["model_runner"]
    return out


def plot(runs: dict, path: Path) -> None:
    """ms per draft token of each method, a group of bars per thread count."""
    from bench.plots import label_bars, pyplot, save

    plt = pyplot()
    methods = list(next(iter(runs.values())))
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(runs)
    for i, (run, by_method) in enumerate(runs.items()):
        xs = [j + i * width for j in range(len(methods))]
        ms = [by_method[m]["ms_per_token"] for m in methods]
        label_bars(ax, ax.bar(xs, ms, width, label=run), [f"{v:.2f}" for v in ms], 7)
    ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(methods))], methods, fontsize=8)
    ax.set_ylabel("ms per draft token (median)")
    ax.set_title("draft time per token by runner (greedy rounds of K, the same verdicts)")
    ax.legend()
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", type=Path, default=ROOT / "models/demo/draft")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=200, help="draft tokens timed per trial")
    ap.add_argument("--k", type=int, default=4, help="draft block size")
    ap.add_argument("--warmup-rounds", type=int, default=5)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS / "draft_speed.json")
    args = ap.parse_args(argv)

    default_threads = torch.get_num_threads()
    model, tokenizer = load_model(args.draft, "cpu")
    prompt = prompt_ids(tokenizer, args.prompt_len, model.get_output_embeddings().weight.size(0))
    runs = {}
    for threads in dict.fromkeys([1, default_threads]):
        torch.set_num_threads(threads)
        runs[f"threads={threads}"] = measure(model, prompt, args)
    torch.set_num_threads(default_threads)

    results = {
        "bench": "draft_speed",
        "draft": str(args.draft),
        "dtype": str(next(model.parameters()).dtype),
        "draft_params": sum(p.numel() for p in model.parameters()),
        "prompt_len": len(prompt),
        "tokens": args.tokens,
        "k": args.k,
        "trials": args.trials,
        "warmup_rounds": args.warmup_rounds,
        "machine": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "default_threads": default_threads,
        "torch": torch.__version__,
        "runs": runs,
        "notes": NOTES,
    }
    write_json(args.out, results)
    plot(runs, args.out.with_suffix(".png"))
    print(
        f"draft {args.draft.name}: {results['draft_params'] / 1e6:.1f}M params, greedy, K={args.k}, "
        f"{args.tokens} tokens x {args.trials} trials (median)"
    )
    print(f"{'threads':<10} {'method':<18} {'ms/token':>9} {'vs hf':>7} {'speedup':>8}  same drafts")
    for run, methods in runs.items():
        for name, m in methods.items():
            same = m.get("drafts_equal_model_runner", "-")
            print(
                f"{run:<10} {name:<18} {m['ms_per_token']:9.3f} {m['ratio_vs_hf_dynamic']:7.3f} "
                f"{m['speedup_vs_hf_dynamic']:7.2f}x  {same}"
            )
    print(f"wrote {args.out}")
    return results


if __name__ == "__main__":
    main()
