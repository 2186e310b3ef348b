"""Where the verify forward's time goes, shape by shape: the first time each shape is met against the second.

    python -m bench.verify_shapes [--device cuda] [--streams 1,16] [--k 4] [--tokens 64] [--prompt-len 64]
        [--backends default,no-cudnn,math] [--padded-attention auto|on|off] [--random-weights] [--profile BACKEND]
        [--runner batched|paged] [--cuda-graphs on|off]

The verify service's batched runner (`BatchedRunner`, in process, no services) replays a decode: S streams,
each verifying a block of K random drafts per round and committing a pre-drawn number of them (plus the
target's token), so cache lengths advance unevenly and streams finish at different rounds, as they do under
load. The same rounds run twice, on fresh sequences: pass 1 meets every (rows, cache length) shape for the
first time, pass 2 repeats exactly those shapes. A cost paid once per shape (an attention backend building a
plan for it, a kernel compiled for a new specialisation) shows as pass 1's tail over a flat pass 2. K = 0
rounds (target-only decode: one row per stream, no attention mask) run the same way for comparison.

Each SDPA backend setting (the runner's `attention_backend`, `specmesh.runtime.attention`) runs in its own
process, so that no backend's caches serve another's first pass: `default` (torch's own choice), `no-cudnn`
(flash, memory-efficient or math; what `auto` takes on CUDA), `math`. Every forward is timed between two
device synchronisations. `--random-weights` builds the target from its config alone (the shapes and the
kernels are the same), for a machine the checkpoint cannot be copied to. `--profile BACKEND` runs that
setting once more, in a process of its own, with torch's profiler over the first pass of the speculative
rounds at the most streams, and keeps its operator table (the timed passes run without the profiler).
`--padded-attention`: the runner's attention layout for every setting (auto: padded on CUDA, one call per
sequence on CPU; see `specmesh.runtime.batched`). `--runner paged`: the paged runner instead (the services'
default; on CUDA the block-table kernel), and with `--cuda-graphs on` its decode steps replayed from CUDA graphs
captured when it is built (`specmesh.runtime.graphs`; CUDA only), so the same rounds give ms per forward with
graphs and without.

Writes bench/results/verify-shapes.json (per backend, streams, mode and pass: forwards, p50 / p90 / p99 /
max ms, how many forwards took over 3x pass 2's p50, and every forward's time), a PNG of every forward's
time beside it, and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.load import git_info, parse_list
from bench.output import write_json
from specmesh.runtime.attention import ATTENTION_BACKENDS

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
BACKENDS = tuple(b for b in ATTENTION_BACKENDS if b != "auto")  # auto is one of these, by device
SLOW = 3.0  # a forward slower than this many times pass 2's p50 counts as slow


def schedule(streams: int, k: int, tokens: int, seed: int) -> list[list[tuple[int, int]]]:
    """Rounds of (stream, tokens committed): each stream commits until it has `tokens`; with K > 0 it
    commits 1 + a draw of accepted drafts in [0, K] (the demo pair accepts about two thirds)."""
    rng = random.Random(seed)
    done = [0] * streams
    rounds = []
    while any(d < tokens for d in done):
        now = []
        for s in range(streams):
            if done[s] < tokens:
                accepted = sum(rng.random() < 0.67 for _ in range(k))
                n = min(1 + accepted, tokens - done[s])
                now.append((s, n))
                done[s] += n
        rounds.append(now)
    return rounds


def percentiles(ms: list[float]) -> dict:
    xs = sorted(ms)

    def q(p: float) -> float:
        return round(xs[min(len(xs) - 1, int(p * len(xs)))], 3)

    return {"forwards": len(xs), "p50": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": round(xs[-1], 3)}


def child(args) -> dict:
    """One backend setting in this process: every (streams, mode), two passes each; or, with --profile, the
    first pass of the speculative rounds at the most streams under torch's profiler."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specmesh.models import default_dtype, load_model
    from specmesh.runtime.batched import BatchedRunner
    from specmesh.runtime.paged import PagedRunner

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if args.random_weights:
        config = AutoConfig.from_pretrained(args.target)
        model = AutoModelForCausalLM.from_config(config, dtype=default_dtype(device)).to(device).eval()
    else:
        model, _ = load_model(args.target, device)
    slots = max(args.streams)
    length = args.prompt_len + args.tokens + args.k + 2
    runner: Any  # BatchedRunner | PagedRunner: the same Runner protocol
    if args.runner == "paged":
        runner = PagedRunner(
            model,
            slots * -(-length // 16),
            16,
            length,
            check=False,
            attention_backend=args.child,
            cuda_graph_max_bs=slots if args.cuda_graphs == "on" else 0,
            graph_tokens_per_seq=args.k + 1,
        )
    else:
        runner = BatchedRunner(
            model,
            num_slots=slots,
            max_seq_len=length,
            check=False,
            attention_backend=args.child,
            padded_attention={"auto": None, "on": True, "off": False}[args.padded_attention],
        )
    vocab = runner.vocab_size

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    gen = random.Random(args.seed)
    prompts = [[gen.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(slots)]

    def one_pass(streams: int, k: int, rounds) -> tuple[list[float], list[tuple[int, int]]]:
        seqs = [runner.new_sequence(list(p)) for p in prompts[:streams]]
        for s in seqs:
            runner.prefill(s)
        sync()
        ms, shapes = [], []
        for rnd in rounds:
            batch = [seqs[s] for s, _ in rnd]
            drafts = [[gen.randrange(vocab) for _ in range(k)] for _ in rnd]
            t0 = time.perf_counter()
            runner.forward(batch, drafts)
            sync()
            ms.append((time.perf_counter() - t0) * 1e3)
            shapes.append((len(rnd) * (k + 1), max(len(seqs[s].token_ids) + k for s, _ in rnd)))
            for (s, n), d in zip(rnd, drafts, strict=True):
                seqs[s].commit((d + [gen.randrange(vocab)])[:n])
        for s in seqs:
            runner.free(s)
        return ms, shapes

    warm = runner.new_sequence([1, 2, 3, 4, 5, 6, 7, 8])  # CUDA context, BLAS handles: not any shape's cost
    runner.prefill(warm)
    for _ in range(3):
        runner.forward([warm], [[1, 2]])
    runner.free(warm)
    sync()
    if args.profile_child:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        streams = max(args.streams)
        rounds = schedule(streams, args.k, args.tokens, args.seed + streams)
        with profile(activities=activities) as prof:
            ms, _ = one_pass(streams, args.k, rounds)
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
        return {"profile": {"backend": args.child, "streams": streams, "ms": [round(m, 3) for m in ms], "table": table}}
    out = []
    for streams in args.streams:
        for mode, k in (("speculative", args.k), ("target-only", 0)):
            rounds = schedule(streams, k, args.tokens, args.seed + streams)
            passes = [one_pass(streams, k, rounds) for _ in range(2)]
            ref = percentiles(passes[1][0])["p50"]
            for i, (ms, shapes) in enumerate(passes):
                slow = [(round(m, 1), *shape) for m, shape in zip(ms, shapes, strict=True) if m > SLOW * ref]
                out.append(
                    {
                        "backend": args.child,
                        "padded": getattr(runner, "padded_attention", None),
                        "runner": args.runner,
                        "graphs": getattr(runner, "graphs", None) is not None,
                        "streams": streams,
                        "mode": mode,
                        "k": k,
                        "pass": i + 1,
                        **percentiles(ms),
                        "slow": len(slow),
                        "slowest": sorted(slow, reverse=True)[:5],  # (ms, rows, longest cache)
                        "ms": [round(m, 3) for m in ms],
                    }
                )
    return {"rows": out}


def markdown(rows: list[dict]) -> str:
    lines = [
        "| backend | runner | graphs | padded | streams | mode | pass | forwards | p50 ms | p90 ms | p99 ms | max ms "
        "| slow (> 3x pass 2 p50) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['backend']} | {r.get('runner', 'batched')} | {r.get('graphs', False)} | {r.get('padded')} | "
            f"{r['streams']} | {r['mode']} | {r['pass']} | {r['forwards']} | "
            f"{r['p50']} | "
            f"{r['p90']} | {r['p99']} | {r['max']} | {r['slow']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """One panel per backend: each forward's time in order, pass 1 against pass 2, per streams and mode."""
    from bench.plots import pyplot, save

    backends = list(dict.fromkeys(r["backend"] for r in rows))
    if not backends:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, len(backends), figsize=(5.2 * len(backends), 4), squeeze=False)
    for ax, backend in zip(axes[0], backends, strict=True):
        for r in (r for r in rows if r["backend"] == backend):
            style = "-" if r["pass"] == 1 else ":"
            label = f"{r['streams']} streams, {r['mode']}, pass {r['pass']}"
            ax.plot(range(1, len(r["ms"]) + 1), r["ms"], style, marker=".", markersize=3, label=label)
        ax.set_yscale("log")
        ax.set_title(f"SDPA: {backend}", fontsize=10)
        ax.set_xlabel("forward (round) in the pass")
        ax.set_ylabel("ms (between two synchronisations)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    save(fig, path)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.verify_shapes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target", help="target checkpoint (or config)")
    ap.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    ap.add_argument("--streams", type=parse_list(int), default=[1, 16], help="comma-separated batch sizes")
    ap.add_argument("--k", type=int, default=4, help="drafts per block in the speculative rounds")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each stream commits")
    ap.add_argument("--prompt-len", type=int, default=64, help="prompt tokens per stream")
    ap.add_argument("--backends", type=parse_list(str), default=None, help=f"SDPA settings: {', '.join(BACKENDS)}")
    ap.add_argument("--random-weights", action="store_true", help="the target built from its config alone")
    ap.add_argument(
        "--padded-attention", choices=["auto", "on", "off"], default="auto", help="the runner's attention layout"
    )
    ap.add_argument("--runner", choices=["batched", "paged"], default="batched", help="the runner measured")
    ap.add_argument(
        "--cuda-graphs",
        choices=["on", "off"],
        default="off",
        help="paged runner on CUDA: decode steps from CUDA graphs",
    )
    ap.add_argument("--profile", default=None, metavar="BACKEND", help="also profile this setting's first pass")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=300.0, help="per backend process")
    ap.add_argument("--out", type=Path, default=RESULTS / "verify-shapes.json")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-out", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.backends is None:
        args.backends = list(BACKENDS) if args.device.startswith("cuda") else ["default", "math"]
    for b in [*args.backends, *([args.profile] if args.profile else [])]:
        if b not in BACKENDS:
            ap.error(f"--backends: unknown setting {b!r} (expected one of {', '.join(BACKENDS)})")
    if args.cuda_graphs == "on" and (args.runner != "paged" or not args.device.startswith("cuda")):
        ap.error("--cuda-graphs on: the paged runner on CUDA (--runner paged --device cuda)")
    if args.k < 1 or args.tokens < 1 or args.prompt_len < 1 or not args.streams or min(args.streams) < 1:
        ap.error("--k, --tokens, --prompt-len and --streams must be >= 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.child:
        args.child_out.write_text(json.dumps(child(args)))
        return {}
    rows, failures, profile = [], {}, None
    passthrough = [
        *("--target", str(args.target), "--device", args.device, "--k", str(args.k), "--tokens", str(args.tokens)),
        *("--prompt-len", str(args.prompt_len), "--streams", ",".join(map(str, args.streams))),
        *("--seed", str(args.seed), *(["--random-weights"] if args.random_weights else [])),
        *("--padded-attention", args.padded_attention, "--runner", args.runner, "--cuda-graphs", args.cuda_graphs),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(b, False) for b in args.backends] + ([(args.profile, True)] if args.profile else [])
        for backend, profiled in runs:
            name = f"{backend} (profiled)" if profiled else backend
            part = Path(tmp) / f"{backend}{'-profile' if profiled else ''}.json"
            cmd = [sys.executable, "-m", "bench.verify_shapes", *passthrough, "--child", backend]
            cmd += ["--child-out", str(part), *(["--profile-child"] if profiled else [])]
            print(f"backend {name} ...", flush=True)
            try:
                done = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout_s, capture_output=True, text=True)
            except subprocess.TimeoutExpired:
                failures[name] = f"timed out after {args.timeout_s:.0f} s"
                continue
            if done.returncode != 0 or not part.exists():
                failures[name] = (done.stderr or done.stdout).strip()[-2000:]
                print(f"backend {name} failed:\n{failures[name]}", flush=True)
                continue
            got = json.loads(part.read_text())
            rows += got.get("rows", [])
            profile = got.get("profile", profile)
    import transformers

    result = {
        "bench": "verify_shapes",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_info(),
        "machine": {
            "device": args.device,
            "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "settings": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("out", "child", "child_out", "profile_child")
        },
        "rows": rows,
        "profile": profile,
        "failures": failures,
        "notes": [
            "each forward is timed between two device synchronisations; prefill is not timed",
            "slow = forwards over 3x pass 2's p50 of the same backend, streams and mode; slowest: (ms, rows, "
            "longest cache length)",
        ],
    }
    table = markdown(rows)
    result["markdown"] = table
    write_json(args.out, result)
    plot(rows, args.out.with_suffix(".png"))
    print("\n" + table + "\n")
    if profile:
        print(f"profile, {profile['backend']}, {profile['streams']} streams, speculative, first pass:")
        print(profile["table"])
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    if failures:
        sys.exit(1)
    return result


if __name__ == "__main__":
    main()
