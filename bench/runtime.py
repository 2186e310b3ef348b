"""Time of one batched target forward (a verify tick): ModelRunner (HF forward + padded batch cache)
vs BatchedRunner (slot KV pool, ragged forward, no cache copies).

    python -m bench.runtime [--model models/demo/target] [--context 200] [--threads 2] [--reps 10]

Each case opens `batch` sequences of about `context` prompt tokens (ragged: lengths context-8 .. context+7),
prefills them, then times `forward(seqs, extra)` with `new - 1` draft tokens per sequence (so `new` tokens
are fed per sequence). Nothing is committed between repetitions, so every forward after the first also
rolls back the previous one's draft tokens — as a verify tick that rejected them would. The runners
alternate repetition by repetition so machine noise hits both alike; the median is reported. Writes
bench/results/runtime.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from specmesh.models import load_model
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.hf import ModelRunner

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CASES = [(16, 5), (16, 1), (1, 1)]  # (sequences, tokens fed per sequence)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "demo" / "target"))
    ap.add_argument("--context", type=int, default=200, help="prompt tokens per sequence (about)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--reps", type=int, default=10, help="timed forwards per runner and case")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. 'machine shared')")
    ap.add_argument("--out", default=str(RESULTS / "runtime.json"))
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, _ = load_model(args.model, args.device)
    vocab = model.get_output_embeddings().weight.size(0)
    max_batch = max(b for b, _ in CASES)
    max_new = max(n for _, n in CASES)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (args.context - 8 + i % 16,), generator=g).tolist() for i in range(max_batch)]
    drafts = [torch.randint(1, vocab, (max_new - 1,), generator=g).tolist() for _ in range(max_batch)]
    runners = {
        "model_runner": ModelRunner(model),
        "batched_runner": BatchedRunner(model, num_slots=max_batch, max_seq_len=args.context + 8 + max_new + 16),
    }

    rows = []
    load_before = os.getloadavg()[0]
    with torch.inference_mode():
        for batch, new in CASES:
            seqs = {}
            for name, runner in runners.items():
                seqs[name] = [runner.new_sequence(p) for p in prompts[:batch]]
                for s in seqs[name]:
                    runner.prefill(s)
            extra = [d[: new - 1] for d in drafts[:batch]]
            times = {name: [] for name in runners}
            for rep in range(args.reps + 2):  # two warm-up forwards each
                for name, runner in runners.items():
                    t0 = time.perf_counter()
                    runner.forward(seqs[name], extra)
                    if args.device != "cpu":
                        torch.cuda.synchronize()
                    if rep >= 2:
                        times[name].append(time.perf_counter() - t0)
            row = {"batch": batch, "new_tokens": new, "context": args.context}
            for name in runners:
                row[f"{name}_ms"] = round(1000 * statistics.median(times[name]), 2)
            row["speedup"] = round(row["model_runner_ms"] / row["batched_runner_ms"], 2)
            rows.append(row)
            for s in seqs["batched_runner"]:
                runners["batched_runner"].free(s)

    print(f"{'batch x new':>12} {'context':>8} {'ModelRunner ms':>15} {'BatchedRunner ms':>17} {'speedup':>8}")
    for r in rows:
        print(
            f"{r['batch']:>7} x {r['new_tokens']:<2} {r['context']:>8} {r['model_runner_ms']:>15} "
            f"{r['batched_runner_ms']:>17} {r['speedup']:>8}"
        )
    result = {
        "model": os.path.relpath(args.model, ROOT) if args.model.startswith(str(ROOT)) else args.model,
        "device": args.device,
        "threads": args.threads,
        "reps": args.reps,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "note": args.note,
        # Other processes' load (1-minute average) before and after: a busy machine slows both runners.
        "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "rows": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
