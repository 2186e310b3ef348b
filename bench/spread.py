"""The spread of repeated bench.load runs: each level's ratio (speculative / target-only) run after run, against
the same levels of A/A runs (`bench.load --aa-control`: target-only on both sides), which measure what the
bench itself resolves there.

One bench.load run sends a one-stream level 8 requests a side, and on two shared cores a level's ratio then moves
by several per cent from run to run with nothing changed: a single run reading 0.96x or 1.03x says little of a
difference of 2 %. Given the JSON files of repeated runs (`--runs`, the A/B) and of A/A runs (`--control`), this
reports per level (sampling, concurrency) each group's ratios, mean, standard deviation and its standard error,
the runs below `--threshold`, and the A/B mean minus the A/A mean with the standard error of that difference:
a difference within about two of those is no difference this bench can see.

    python -m bench.spread --runs 'bench/results/spread-s24/ab-*.json' \
        --control 'bench/results/spread-s24/aa-*.json' --out bench/results/spread-s24.json

Writes the JSON and a PNG beside it (each run's ratio as a dot, each group's mean and +- one standard deviation),
and prints a markdown table.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import statistics
from pathlib import Path

from bench.output import write_json
from bench.plots import pyplot, save


def ratios(paths: list[str]) -> dict[tuple[str, int], list[float]]:
    """(sampling, concurrency) -> the level's speculative / target-only ratio in each file that has it."""
    out: dict[tuple[str, int], list[float]] = {}
    for p in paths:
        for lv in json.loads(Path(p).read_text())["levels"]:
            if lv.get("spec_vs_target_only") is not None:
                out.setdefault((lv["sampling"], lv["concurrency"]), []).append(lv["spec_vs_target_only"])
    return out


def summary(values: list[float], threshold: float) -> dict:
    """A group's ratios: mean, standard deviation (None for one run), standard error, extremes, runs below."""
    sd = statistics.stdev(values) if len(values) > 1 else None
    return {
        "runs": len(values),
        "ratios": values,
        "mean": round(statistics.fmean(values), 4),
        "sd": None if sd is None else round(sd, 4),
        "se": None if sd is None else round(sd / math.sqrt(len(values)), 4),
        "min": min(values),
        "max": max(values),
        "below_threshold": sum(v < threshold for v in values),
    }


def compare(ab: dict, aa: dict) -> dict:
    """The A/B mean minus the A/A mean, and that difference's standard error (None without two runs a side)."""
    diff = ab["mean"] - aa["mean"]
    se = math.sqrt(ab["se"] ** 2 + aa["se"] ** 2) if ab["se"] is not None and aa["se"] is not None else None
    return {"mean_difference": round(diff, 4), "se": None if se is None else round(se, 4)}


def spread(runs: list[str], control: list[str], threshold: float) -> dict:
    ab, aa = ratios(runs), ratios(control)
    levels = []
    for key in sorted(ab.keys() | aa.keys()):
        lv: dict = {"sampling": key[0], "concurrency": key[1]}
        if key in ab:
            lv["ab"] = summary(ab[key], threshold)
        if key in aa:
            lv["aa"] = summary(aa[key], threshold)
        if key in ab and key in aa:
            lv["ab_minus_aa"] = compare(lv["ab"], lv["aa"])
        levels.append(lv)
    return {
        "bench": "spread",
        "threshold": threshold,
        "runs": sorted(runs),
        "control": sorted(control),
        "levels": levels,
    }


def markdown(r: dict) -> str:
    def cell(s: dict | None) -> str:
        if not s:
            return "-"
        sd = "-" if s["sd"] is None else f"{s['sd']:.3f}"
        return f"{s['mean']:.3f} (sd {sd}, {s['min']:.3f}-{s['max']:.3f}, {s['below_threshold']} of {s['runs']} below)"

    lines = [
        f"| sampling | streams | A/B: mean (sd, range, runs < {r['threshold']}) | A/A: the same | A/B - A/A (se) |",
        "|---|---|---|---|---|",
    ]
    for lv in r["levels"]:
        d = lv.get("ab_minus_aa")
        diff = "-" if not d else f"{d['mean_difference']:+.3f}" + ("" if d["se"] is None else f" ({d['se']:.3f})")
        lines.append(
            f"| {lv['sampling']} | {lv['concurrency']} | {cell(lv.get('ab'))} | {cell(lv.get('aa'))} | {diff} |"
        )
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.6 * len(r["levels"]) + 2), 4.2))
    for i, lv in enumerate(r["levels"]):
        for side, dx, color in (("ab", -0.15, "#37c"), ("aa", 0.15, "#999")):
            s = lv.get(side)
            if not s:
                continue
            ax.plot([i + dx] * s["runs"], s["ratios"], "o", color=color, alpha=0.55, ms=5)
            ax.errorbar(i + dx, s["mean"], yerr=s["sd"] or 0.0, fmt="_", color="k", ms=16, capsize=4)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(r["threshold"], color="#c44", lw=0.8, ls="--", label=f"threshold {r['threshold']}")
    ax.plot([], [], "o", color="#37c", label="A/B (speculative / target-only), a run each")
    ax.plot([], [], "o", color="#999", label="A/A (target-only / target-only), a run each")
    names = [
        f"{lv['sampling']}\n{lv['concurrency']} stream{'s' if lv['concurrency'] != 1 else ''}" for lv in r["levels"]
    ]
    ax.set_xticks(range(len(r["levels"])), names)
    ax.set_ylabel("ratio of the level")
    ax.set_title("bench.load run to run: mean +- one standard deviation")
    ax.legend(fontsize=8, loc="best")
    save(fig, path)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", required=True, help="a glob of bench.load JSON files: the A/B runs")
    ap.add_argument("--control", default="", help="a glob of bench.load --aa-control JSON files: the A/A runs")
    ap.add_argument("--threshold", type=float, default=0.98, help="count the runs whose ratio falls below this")
    ap.add_argument("--out", type=Path, default=Path("bench/results/spread.json"))
    args = ap.parse_args(argv)
    runs = sorted(glob.glob(args.runs))
    control = sorted(glob.glob(args.control)) if args.control else []
    if not runs:
        ap.error(f"--runs {args.runs!r} matches no file")
    r = spread(runs, control, args.threshold)
    write_json(args.out, r)
    plot(r, args.out.with_suffix(".png"))
    print(markdown(r))
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}")
    return r


if __name__ == "__main__":
    main()
