"""The target runtimes compared: ModelRunner (HF forward + padded batch cache) vs BatchedRunner (slot KV
pool, ragged forward, no cache copies), as one forward and as the verify service's throughput.

    python -m bench.runtime [--model models/demo/target] [--context 200] [--threads 2] [--reps 10]
    python -m bench.runtime --mode service [--streams 16] [--tokens 64] [--context 128] [--reps 2]

`--mode forward` (the default) times one batched target forward (a verify tick). Each case opens `batch`
sequences of about `context` prompt tokens (ragged: lengths context-8 .. context+7), prefills them, then
times `forward(seqs, extra)` with `new - 1` draft tokens per sequence (so `new` tokens are fed per
sequence). Nothing is committed between repetitions, so every forward after the first also rolls back
the previous one's draft tokens — as a verify tick that rejected them would. The runners alternate
repetition by repetition so machine noise hits both alike; the median is reported. Writes
bench/results/runtime.json.

`--mode service` measures what the runtime buys a user: target-only aggregate throughput of the verify
service at `streams` concurrent sessions. For each runner it starts `python -m verify_service --runner
{batched,hf}` as a subprocess (its own GIL and `--threads`), then `streams` client threads each call
`VerifyService.Generate` once at the same moment (greedy, `tokens` new tokens after a prompt of about
`context` tokens); aggregate tokens/s = all tokens / wall time from the start to the last stream's end
(prefill included). `--runner hf` is the old runtime, measured in the same run. Writes
bench/results/runtime_service.json.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import threading
import time
from pathlib import Path

import grpc
import torch
from transformers import AutoConfig

from bench.output import write_json
from specmesh.models import load_model
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.hf import ModelRunner
from specmesh.stack import start
from specmesh.v1 import common_pb2, verify_pb2, verify_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
CASES = [(16, 5), (16, 1), (1, 1)]  # (sequences, tokens fed per sequence)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["forward", "service"], default="forward")
    ap.add_argument("--model", default=str(ROOT / "models" / "demo" / "target"))
    ap.add_argument("--context", type=int, default=None, help="prompt tokens per sequence (about; 200, service 128)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the service's --threads)")
    ap.add_argument("--reps", type=int, default=None, help="timed forwards per runner and case (10); service runs (2)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--streams", type=int, default=16, help="service: concurrent Generate calls")
    ap.add_argument("--tokens", type=int, default=64, help="service: new tokens per stream")
    ap.add_argument("--note", default="", help="free text stored in the JSON (e.g. 'machine shared')")
    ap.add_argument("--out", default=None, help="default bench/results/runtime.json (service: runtime_service.json)")
    args = ap.parse_args()
    if args.mode == "service":
        service_mode(args)
    else:
        forward_mode(args)


def forward_mode(args: argparse.Namespace) -> None:
    args.context = args.context or 200
    args.reps = args.reps or 10
    args.out = args.out or str(RESULTS / "runtime.json")
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
    write_json(out, result)
    print(f"wrote {out}")


def service_mode(args: argparse.Namespace) -> None:
    context, reps = args.context or 128, args.reps or 2
    vocab = AutoConfig.from_pretrained(args.model).vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, vocab, (context - 8 + i % 16,), generator=g).tolist() for i in range(args.streams)]
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {"batched": [], "hf": []}
    for rep in range(reps):  # the runners alternate, so machine noise hits both alike
        for runner in runs:
            runs[runner].append(_service_run(args, runner, prompts))
            r = runs[runner][-1]
            print(
                f"run {rep + 1}/{reps} {runner:>8}: {r['aggregate_tokens_per_s']:8.1f} tok/s aggregate, "
                f"mean batch {r['mean_batch_size']:.1f}, {r['wall_s']:.1f} s"
            )
    best = {k: max(v, key=lambda r: r["aggregate_tokens_per_s"]) for k, v in runs.items()}
    speedup = best["batched"]["aggregate_tokens_per_s"] / best["hf"]["aggregate_tokens_per_s"]
    print(
        f"target-only aggregate at {args.streams} streams: batched {best['batched']['aggregate_tokens_per_s']:.1f} "
        f"tok/s, hf {best['hf']['aggregate_tokens_per_s']:.1f} tok/s: {speedup:.2f}x"
    )
    result = {
        "mode": "service",
        "model": os.path.relpath(args.model, ROOT) if args.model.startswith(str(ROOT)) else args.model,
        "device": args.device,
        "threads": args.threads,
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "context": context,
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "note": args.note,
        "loadavg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "runs": runs,
        "best_speedup": round(speedup, 2),
    }
    out = Path(args.out or RESULTS / "runtime_service.json")
    write_json(out, result)
    print(f"wrote {out}")


def _service_run(args: argparse.Namespace, runner: str, prompts: list[list[int]]) -> dict:
    """One verify service with `--runner runner`, every stream's Generate at once; its figures."""
    flags = [
        "--model-path",
        args.model,
        "--port",
        "0",
        "--metrics-port",
        "-1",
        "--runner",
        runner,
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--log-level",
        "WARNING",
    ]
    proc, address = start(f"verify-{runner}", "verify_service", flags)
    try:
        stub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(address))
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        _generate(stub, prompts[0][:16], common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        before = stub.Info(verify_pb2.VerifyServiceInfoRequest())
        counts = [0] * len(prompts)
        go = threading.Barrier(len(prompts) + 1)

        def stream(i: int) -> None:
            go.wait()
            counts[i] = _generate(stub, prompts[i], params)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        go.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        after = stub.Info(verify_pb2.VerifyServiceInfoRequest())
    finally:
        proc.terminate()
        proc.wait(30)
    batches = after.batches - before.batches
    return {
        "runner": runner,
        "tokens": sum(counts),
        "wall_s": round(wall, 3),
        "aggregate_tokens_per_s": round(sum(counts) / wall, 1),
        "per_stream_tokens_per_s": round(sum(counts) / wall / len(prompts), 2),
        "mean_batch_size": round((after.batched_blocks - before.batched_blocks) / max(batches, 1), 2),
        "max_context_length": after.max_context_length,
    }


def _generate(stub, prompt: list[int], params) -> int:
    """Tokens one target-only Generate call returned."""
    request = verify_pb2.VerifyServiceGenerateRequest(prompt_ids=prompt, params=params)
    return sum(len(c.tokens.token_ids) for c in stub.Generate(request, timeout=600))


if __name__ == "__main__":
    main()
