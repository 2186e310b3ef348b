"""Where the verify forward's time goes against what the machine allows: the memory roofline and the compute
floor, measured here, beside the forward at decode shapes.

    python -m bench.roofline [--target DIR] [--dtype float32] [--kv-cache-dtype auto] [--runners paged,gguf]
        [--streams 16] [--k 4] [--context 128] [--repeats 40] [--threads N] [--out bench/results/roofline.json]

Measures, in this process, with the torch threads a verify service gets:
- the memory bandwidth: a read of a buffer far larger than the caches (the best of several passes, the fastest of
  torch's sum, the sum over huge pages and specmesh's GEMV), GB/s, at the start and again after each shape's
  forwards, and after each shape the same readers over a buffer of the bytes that shape's forward reads (the
  weights and the KV): where those fit in the last-level cache (300 MiB on some hosts of this VM, beside the
  demo target's 145 MB) a forward streams them from there, far faster than from memory; the fastest of the
  three makes that shape's floor;
- the compute floor: an fp32 (or --dtype) GEMM of 1024^3, GFLOP/s;
- each verify runner of `--runners` (`paged`: the torch default; `gguf`: llama.cpp's kernels) at two
  shapes: one token of one sequence (a target-only decode step) and S sequences x (K + 1) tokens (a verify
  batch), each sequence with `--context` tokens already cached; median ms over `--repeats` forwards, each
  rolled back so every forward sees the same shape;
- the floors of each shape: memory = (weight bytes the forward reads + the KV it reads) / bandwidth; compute
  = (2 x matmul parameters x rows + attention FLOPs) / GEMM rate; the ratio measured / the larger floor; and
  the same ratio in `--paired-rounds` rounds, each ten forwards followed by the GEMM measured again (its median
  over the rounds, `x_floor_paired`): the host's speed moves by 20-30 % within minutes, which a floor measured
  once at the start reads as the forward's;
- a breakdown of each shape's time by torch's profiler: matmuls, attention, KV writes and reads, norms and
  rotary (elementwise), everything else (the Python and dispatch between kernels shows as the gap between
  the wall time and the operators' own time). llama.cpp's kernels are invisible to torch's profiler: there
  the whole forward shows as the gap. Where the forward is specmesh's fused CPU step (one C call, one line in
  torch's profiler), the step's own clock splits it (`step_phases_ms`): the products, attention, the norms and
  sums between them, the wait at barriers, the logits; and the products' GFLOP/s against the GEMM's, and their
  time (the logits' included) against torch's own GEMM on the same matrices and rows (`library_products_ms`,
  `products_x_library`, for shapes the arithmetic bounds): the cube runs faster than a forward's shapes can,
  and this says how far from the library's best the products are.

Writes the JSON and a PNG beside it (measured against the floors, and the breakdown), prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from pathlib import Path

import torch

from bench.output import machine, write_json
from bench.plots import pyplot, save
from specmesh.config import KV_CACHE_DTYPES
from specmesh.models import load_model
from specmesh.runtime import Runner, cpu_kernels
from specmesh.runtime.registry import build_runner

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"

CATEGORIES = {  # profiler operator name fragments -> category, first match wins
    "fused decode step (C)": ("decode_step",),  # a whole one-token forward: its parts are not seen apart
    "matmul": ("mm", "linear", "matmul", "mkldnn", "addmm", "bmm", "gemv"),
    "attention": ("scaled_dot_product", "flash", "softmax", "block_attention"),
    "kv write/read": ("index_put", "index_select", "index", "copy_", "gather"),
    "norm, rotary, activation": ("rms", "mul", "add", "silu", "roll", "pow", "mean", "rsqrt", "neg", "cat", "div"),
}


def best_of(fn, n: int) -> float:
    best = float("inf")
    for _ in range(n):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def bandwidth_gbs(mib: int = 512, passes: int = 8) -> dict[str, float]:
    """Read bandwidth of `mib` MiB of fp32 (by default far larger than the caches), the best of several passes,
    by three readers: torch's sum, the same over memory in transparent huge pages (where the fused step keeps its
    weights: 10-35 % faster here), and where specmesh's CPU kernels build, its GEMV over a matrix that size
    (which streams weights the way a decode step does). The floors use the fastest: a floor we can beat is no
    floor."""
    buf = torch.ones(mib * 2**20 // 4)
    buf.sum()
    out = {"torch_sum": buf.numel() * 4 / best_of(buf.sum, passes) / 1e9}
    huge = cpu_kernels.huge_page_floats(buf.numel()).fill_(1.0)
    huge.sum()
    out["torch_sum_huge_pages"] = huge.numel() * 4 / best_of(huge.sum, passes) / 1e9
    del huge
    if cpu_kernels.load() is not None:
        w = buf.view(-1, 4096).t()  # [out, in] over [in, out] rows: the decoders' layout
        x = torch.ones(1, w.shape[1])
        cpu_kernels.gemv(x, w, None)
        out["specmesh_gemv"] = buf.numel() * 4 / best_of(lambda: cpu_kernels.gemv(x, w, None), passes) / 1e9
    return {k: round(v, 2) for k, v in out.items()}


def gemm_gflops(dtype: torch.dtype, n: int = 1024, passes: int = 8) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    return 2 * n**3 / best_of(lambda: a @ b, passes) / 1e9


def paired_rounds(
    forward, flops: float, mem_floor: float, dtype: torch.dtype, rounds: int, per_round: int = 10
) -> list[dict[str, float]]:
    """The forward against its floor in rounds, each a few forwards (their median) and then the GEMM's rate
    measured again: this VM's speed moves by 20-30 % within minutes, and a floor from the run's start against
    forwards timed minutes later measures the drift as much as the forward. Each round's ratio takes the larger
    of the memory floor and that round's compute floor (`flops` at that round's GEMM rate)."""
    out = []
    for _ in range(rounds):
        times = []
        for _ in range(per_round):
            t = time.perf_counter()
            forward()
            times.append((time.perf_counter() - t) * 1e3)
        gflops = gemm_gflops(dtype, passes=3)
        ms = statistics.median(times)
        floor = max(mem_floor, flops / (gflops * 1e9) * 1e3)
        out.append({"ms_p50": round(ms, 3), "gemm_gflops": round(gflops, 1), "x_floor": round(ms / floor, 3)})
    return out


def library_products_ms(model, rows: int, passes: int = 10) -> float:
    """ms torch's own GEMM (MKL / oneDNN on a CPU) takes for the forward's products at their shapes: each matrix
    a forward multiplies (as `weight_bytes_of` counts them) against `rows` rows, the best of `passes` each,
    summed. The 1024-cube GEMM the compute floor is taken at runs faster than these shapes do; this says what
    the library makes of them."""
    seen, total = set(), 0.0
    for name, p in model.named_parameters():
        if id(p) in seen or p.dim() != 2 or ("embed_tokens" in name and not model.config.tie_word_embeddings):
            continue
        seen.add(id(p))
        w = p.detach()
        x = torch.randn(rows, w.shape[1], dtype=w.dtype)
        torch.nn.functional.linear(x, w)
        total += best_of(lambda x=x, w=w: torch.nn.functional.linear(x, w), passes)
    return total * 1e3


def weight_bytes(runner: Runner) -> tuple[int, int]:
    return weight_bytes_of(runner.model)


def weight_bytes_of(model) -> tuple[int, int]:
    """(bytes a forward reads from weights, parameters in its matmuls): every layer's matrices once (as the
    decoder holds them, packed copies not counted twice) and the LM head; the embedding is a row lookup."""
    seen, total, params = set(), 0, 0
    for name, p in model.named_parameters():
        if id(p) in seen or ("embed_tokens" in name and not model.config.tie_word_embeddings):
            continue
        seen.add(id(p))
        total += p.numel() * p.element_size()
        if p.dim() == 2:
            params += p.numel()
    return total, params


def timed_forwards(runner: Runner, seqs, extra: list[list[int]], repeats: int) -> list[float]:
    """ms per forward of `seqs` fed `extra`, each rolled back (nothing committed) so the shape repeats."""
    out = []
    for i in range(repeats + 3):
        t = time.perf_counter()
        runner.forward(seqs, extra)
        dt = (time.perf_counter() - t) * 1e3
        if i >= 3:
            out.append(dt)
    return out


def breakdown(runner: Runner, seqs, extra: list[list[int]], n: int = 10) -> dict[str, float]:
    """ms per forward by category (CATEGORIES), from torch's profiler's self CPU time; `other` and the gap
    to the wall time (Python, dispatch, allocation) complete it."""
    from torch.profiler import ProfilerActivity, profile

    runner.forward(seqs, extra)
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(n):
            runner.forward(seqs, extra)
    wall = (time.perf_counter() - t) * 1e3 / n
    cats = dict.fromkeys([*CATEGORIES, "other"], 0.0)
    for ev in prof.key_averages():
        name = ev.key.lower()
        cat = next((c for c, keys in CATEGORIES.items() if any(k in name for k in keys)), "other")
        cats[cat] += ev.self_cpu_time_total / 1e3 / n
    ops = sum(cats.values())
    cats["python and dispatch (wall - operators)"] = max(0.0, wall - ops)
    return {k: round(v, 3) for k, v in cats.items()} | {"wall_ms_under_profiler": round(wall, 3)}


def step_phases(runner: Runner, seqs, extra: list[list[int]], n: int = 10) -> dict[str, float]:
    """ms per forward in each of the fused CPU step's phases (cpu_kernels.STEP_PHASES), {} where the forward
    makes no fused step call."""
    runner.forward(seqs, extra)
    with cpu_kernels.record_step_phases() as rec:
        for _ in range(n):
            runner.forward(seqs, extra)
    return {k: round(1e3 * v / n, 3) for k, v in rec.seconds.items()} if rec.calls else {}


def measure(args) -> dict:
    load = os.getloadavg()
    torch.set_num_threads(args.threads)
    model, _ = load_model(args.target, "cpu", args.dtype)
    dtype = next(model.parameters()).dtype
    readers = bandwidth_gbs()
    bw = max(readers.values())
    gflops = gemm_gflops(dtype)
    ctx, streams, k = args.context, args.streams, args.k
    cfg = model.config
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kv_dtype = None if args.kv_cache_dtype == "auto" else getattr(torch, KV_CACHE_DTYPES[args.kv_cache_dtype])
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * hd * (kv_dtype or dtype).itemsize
    runners = {}
    for kind in args.runners:
        if kv_dtype not in (None, dtype) and kind != "paged":
            print(f"{kind}: skipped, its KV keeps the model's dtype (--kv-cache-dtype is the paged runner's)")
            continue
        blocks = streams * (-(-(ctx + k + 2) // 16)) + 32
        runner = build_runner(
            model,
            kind,
            num_blocks=blocks,
            block_size=16,
            max_seq_len=ctx + 64,
            attention_backend=args.attention_backend,
            kv_cache_dtype=kv_dtype,
        )
        runners[kind] = measure_runner(args, runner, bw, gflops, kv_per_token, heads, hd)
        del runner
    return {
        "bench": "roofline",
        "target": str(args.target),
        "dtype": str(dtype).replace("torch.", ""),
        "kv_cache_dtype": str(kv_dtype or dtype).replace("torch.", ""),
        "threads": args.threads,
        "context": ctx,
        "attention_backend": args.attention_backend,
        "machine": machine("cpu", load, args.threads),
        "bandwidth_gbs": round(bw, 2),
        "bandwidth_by_reader_gbs": readers,
        "gemm_gflops": round(gflops, 1),
        "weight_bytes": weight_bytes_of(model)[0],
        "matmul_params": weight_bytes_of(model)[1],
        "kv_bytes_per_token": kv_per_token,
        "runners": runners,
    }


def measure_runner(args, runner: Runner, bw: float, gflops: float, kv_per_token: int, heads: int, hd: int) -> dict:
    """One runner's two shapes against the floors."""
    ctx, streams, k = args.context, args.streams, args.k
    cfg = runner.model.config
    layers = cfg.num_hidden_layers
    vocab = runner.vocab_size
    dtype = next(runner.model.parameters()).dtype
    seqs = [runner.new_sequence([(31 * s + 7 * i) % vocab for i in range(ctx)]) for s in range(streams)]
    for s in seqs:
        while runner.prefill(s, max_tokens=256):
            pass
        runner.forward([s])  # the last prompt token: every sequence now holds ctx cached positions
        # What a decode step or a verify round is fed: the token sampled last, not yet cached (re-feeding a
        # cached token that closed a full, registered block would move it to a new block on every forward).
        s.token_ids.append((11 * s.token_ids[-1] + 3) % vocab)
    wbytes, params = weight_bytes(runner)
    shapes = {}
    for name, batch, rows in (("1 x 1", seqs[:1], 1), (f"{streams} x {k + 1}", seqs, k + 1)):
        extra = [[(5 * j + 3) % vocab for j in range(rows - 1)] for _ in batch]
        times = timed_forwards(runner, batch, extra, args.repeats)
        # This VM's memory changes speed from minute to minute (25-50 GB/s): measured again right after the
        # shape's forwards, and the faster of that and the run's start taken.
        n_rows = len(batch) * rows
        kv_read = len(batch) * (ctx + rows) * kv_per_token
        in_place = bandwidth_gbs(mib=-(-(wbytes + kv_read) // 2**20))
        shape_bw = max(bw, *bandwidth_gbs().values(), *in_place.values())
        mem_floor = (wbytes + kv_read) / (shape_bw * 1e9) * 1e3
        attn_flops = 4 * n_rows * (ctx + rows) * heads * hd * layers
        compute_floor = (2 * params * n_rows + attn_flops) / (gflops * 1e9) * 1e3
        median = statistics.median(times)
        shapes[name] = {
            "sequences": len(batch),
            "rows": n_rows,
            "ms_p50": round(median, 3),
            "ms_min": round(min(times), 3),
            "ms_p90": round(sorted(times)[int(0.9 * (len(times) - 1))], 3),
            "bandwidth_gbs": round(shape_bw, 2),
            "bandwidth_at_forward_bytes_gbs": in_place,
            "memory_floor_ms": round(mem_floor, 3),
            "compute_floor_ms": round(compute_floor, 3),
            "x_floor": round(median / max(mem_floor, compute_floor), 3),
            "x_memory_floor": round(median / mem_floor, 3),
            "breakdown_ms": breakdown(runner, batch, extra),
        }
        flops = 2 * params * n_rows + attn_flops
        forward = functools.partial(runner.forward, batch, extra)
        rounds = paired_rounds(forward, flops, mem_floor, dtype, args.paired_rounds)
        if rounds:
            shapes[name]["paired_rounds"] = rounds
            shapes[name]["x_floor_paired"] = statistics.median(r["x_floor"] for r in rounds)
        phases = step_phases(runner, batch, extra)
        if phases:
            # the layers' products (the LM head is the logits phase's), against the GEMM's rate
            layer_params = params - vocab * cfg.hidden_size
            shapes[name]["step_phases_ms"] = phases
            shapes[name]["products_gflops"] = round(2 * layer_params * n_rows / (phases["products"] * 1e6), 1)
            # The step's products (the LM head's in the logits phase) against the library's at the same shapes,
            # where the arithmetic bounds them: each matrix timed alone, again and again, stays in the caches,
            # so a shape bound by the weights' read would compare against no read at all.
            if compute_floor > mem_floor:
                library = library_products_ms(runner.model, n_rows)
                shapes[name]["library_products_ms"] = round(library, 3)
                shapes[name]["products_x_library"] = round((phases["products"] + phases["logits"]) / library, 3)
        kind = type(runner).__name__
        paired = f"; {shapes[name]['x_floor_paired']:.2f}x in paired rounds" if rounds else ""
        print(
            f"{kind} {name}: {median:.2f} ms (floors: memory {mem_floor:.2f}, compute {compute_floor:.2f}){paired}",
            flush=True,
        )
    for s in seqs:
        runner.free(s)
    return shapes


def paired_cell(s: dict) -> str:
    rounds = s.get("paired_rounds")
    if not rounds:
        return "-"
    lo, hi = min(r["x_floor"] for r in rounds), max(r["x_floor"] for r in rounds)
    return f"{s['x_floor_paired']:.2f}x ({lo:.2f}-{hi:.2f})"


def markdown(r: dict) -> str:
    kv = r.get("kv_cache_dtype", r["dtype"])
    lines = [
        f"Memory {r['bandwidth_gbs']} GB/s, GEMM {r['gemm_gflops']} GFLOP/s ({r['dtype']}, KV {kv}, "
        f"{r['threads']} threads); weights {r['weight_bytes'] / 1e6:.1f} MB",
        "",
        "| shape | ms p50 | memory floor | compute floor | x floor | x floor, paired rounds | fused step (C) | matmul "
        "| attention | KV | elementwise | other | Python and dispatch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for kind, name, s in ((kind, name, s) for kind, shapes in r["runners"].items() for name, s in shapes.items()):
        b = s["breakdown_ms"]
        lines.append(
            f"| {kind} {name} | {s['ms_p50']:.2f} | {s['memory_floor_ms']:.2f} | {s['compute_floor_ms']:.2f} "
            f"| {s['x_floor']:.2f}x | {paired_cell(s)} | {b.get('fused decode step (C)', 0.0):.2f} "
            f"| {b['matmul']:.2f} | {b['attention']:.2f} | {b['kv write/read']:.2f} "
            f"| {b['norm, rotary, activation']:.2f} | {b['other']:.2f} "
            f"| {b['python and dispatch (wall - operators)']:.2f} |"
        )
    phased = [(kind, name, s) for kind, shapes in r["runners"].items() for name, s in shapes.items()]
    phased = [(kind, name, s) for kind, name, s in phased if s.get("step_phases_ms")]
    if phased:
        names = list(phased[0][2]["step_phases_ms"])
        lines += [
            "",
            f"The fused step's phases, ms (products' GFLOP/s against the GEMM's {r['gemm_gflops']}; the products "
            "and logits against torch's own GEMM on the same matrices and rows):",
            "",
            "| shape | " + " | ".join(names) + " | products GFLOP/s | library's products ms | x library |",
            "|---" * (len(names) + 4) + "|",
        ]
        for kind, name, s in phased:
            ph = s["step_phases_ms"]
            cells = " | ".join(f"{ph[k]:.2f}" for k in names)
            lib = (
                f"{s['library_products_ms']:.2f} | {s['products_x_library']:.2f}x"
                if "library_products_ms" in s
                else "- | -"
            )
            lines.append(f"| {kind} {name} | {cells} | {s['products_gflops']:.0f} | {lib} |")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    panels = [(f"{kind} {name}", s) for kind, shapes in r["runners"].items() for name, s in shapes.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    axes = axes[0]
    for ax, (name, s) in zip(axes, panels, strict=True):
        b = {k: v for k, v in s["breakdown_ms"].items() if k != "wall_ms_under_profiler"}
        bottom = 0.0
        for cat, v in b.items():
            ax.bar(["forward"], [v], bottom=bottom, label=cat)
            bottom += v
        bottom = 0.0
        shades = pyplot().get_cmap("Set2").colors
        for i, (cat, v) in enumerate(s.get("step_phases_ms", {}).items()):
            ax.bar(["C step,\nits phases"], [v], bottom=bottom, label=f"C step: {cat}", color=shades[i], hatch="//")
            bottom += v
        ax.bar(["memory\nfloor"], [s["memory_floor_ms"]], color="grey")
        ax.bar(["compute\nfloor"], [s["compute_floor_ms"]], color="silver")
        ax.set_title(f"{name}: {s['ms_p50']:.2f} ms = {s['x_floor']:.2f}x the floor", fontsize=8)
        ax.set_ylabel("ms")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    kv = r.get("kv_cache_dtype", r["dtype"])
    fig.suptitle(f"verify forward against the roofline ({r['dtype']}, KV {kv}, {r['threads']} threads)")
    save(fig, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--dtype", default="float32", help="--dtype of the verify service (float32, bfloat16, ...)")
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=tuple(KV_CACHE_DTYPES),
        help="--kv-cache-dtype of the verify service (bfloat16: the paged runner's pools under a float32 model)",
    )
    ap.add_argument(
        "--runners", type=lambda v: v.split(","), default=["paged", "gguf"], help="verify runners (registry kinds)"
    )
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per sequence of the verify batch")
    ap.add_argument("--context", type=int, default=128, help="tokens each sequence holds before the forward")
    ap.add_argument("--repeats", type=int, default=40)
    ap.add_argument(
        "--paired-rounds",
        type=int,
        default=8,
        help="rounds of 10 forwards each followed by the GEMM measured again (0: none): the ratio to the floor "
        "under the host's speed of that minute",
    )
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--attention-backend",
        default="auto",
        help="the services' --attention-backend (auto: the CPU block-table kernel in float32; default: SDPA)",
    )
    ap.add_argument("--out", type=Path, default=RESULTS / "roofline.json")
    args = ap.parse_args(argv)
    r = measure(args)
    write_json(args.out, r)
    plot(r, args.out.with_suffix(".png"))
    print(markdown(r))
    return r


if __name__ == "__main__":
    main()
