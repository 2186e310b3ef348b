"""`specmesh profile`: measure a running stack and write an optimization report.

    specmesh profile --url http://127.0.0.1:8000 [--duration 60] [--concurrency 1,4,16] [--prompts FILE]
                     [--out DIR] [--metrics-url verify=URL ...]

A short target-only phase (num_speculative_tokens 0: the baseline every speedup is measured against),
then one speculative phase per concurrency, with the services' /metrics read around each (collect.py).
analysis.py turns the numbers into a round's time budget, acceptance per position, α and the cost ratio,
the speedup model against K, utilisation, the KV cache (with the paged runner's block pool: blocks in use,
preemptions, the prefix cache's hits), the bottleneck and ranked recommendations; report.py writes
report.md, report.html, report.json and the PNG plots. The profiler should have the stack to itself while
it runs: other traffic would count as the phases' own.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
from pathlib import Path

from specmesh.profile.analysis import analyze
from specmesh.profile.collect import Client, Phase, discover, first_model, load_prompts, run_phase
from specmesh.profile.report import write

BASELINE_SHARE = 0.15  # of --duration, for the target-only phase (at least 3 s)


def _levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {text}: expected positive integers like 1,4,16")
    return sorted(set(levels))


def run_profile(args: argparse.Namespace, api_key: str = "") -> int:
    try:
        levels = _levels(args.concurrency)
        prompts = load_prompts(args.prompts)
        endpoints, record = discover(args.url, args.metrics_url)
    except (OSError, ValueError) as e:
        print(f"specmesh profile: error: {e}", file=sys.stderr)
        return 2
    client = Client(args.url, args.model, api_key)
    try:
        client.model = args.model or first_model(client)
        client.complete(prompts[0], 8, None)  # warm-up: the first request of a stack pays one-off costs
    except (OSError, KeyError, ValueError) as e:
        detail = f"HTTP {e.code}" if isinstance(e, urllib.error.HTTPError) else str(e)
        print(f"specmesh profile: error: the stack at {args.url} does not answer: {detail}", file=sys.stderr)
        return 1
    found = ", ".join(f"{e.name} {e.url}" for e in endpoints)
    print(f"profiling {args.url} (model {client.model!r}); metrics: {found}", flush=True)
    baseline_s = max(3.0, args.duration * BASELINE_SHARE) if args.baseline else 0.0
    per_level = max(2.0, (args.duration - baseline_s) / len(levels))
    plan = ([Phase("target-only", 1, False)] if args.baseline else []) + [
        Phase(f"{c} stream{'s' if c > 1 else ''}", c, True) for c in levels
    ]
    for phase in plan:
        seconds = baseline_s if not phase.speculative else per_level
        run_phase(client, endpoints, phase, prompts, seconds, args.max_tokens)
        tokens = sum(r.completion_tokens for r in phase.results)
        print(
            f"  {phase.name:<12} {len(phase.results):4d} requests, {tokens / phase.wall:7.1f} tokens/s"
            + (f", {len(phase.errors)} failed ({phase.errors[0]})" if phase.errors else ""),
            flush=True,
        )
        if not phase.results:
            print(f"specmesh profile: error: no request of phase {phase.name!r} succeeded", file=sys.stderr)
            return 1
    findings = analyze(plan, endpoints, record, prompts)
    files = write(findings, Path(args.out))
    print(f"\nbottleneck: {findings.bottleneck} — {findings.bottleneck_text}")
    for i, r in enumerate(findings.recommendations[:5], 1):
        print(f"  {i}. {r.title}: {r.gain_text}\n     {r.command}")
    print(f"report: {files['md']} and {files['html']}")
    return 0
