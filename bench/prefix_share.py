"""Prefix sharing benchmark: what the verify service's prefix cache does for time to first token.

    python -m bench.prefix_share [--sessions 64] [--prefix-tokens 1000] [--suffix-tokens 20] [--max-tokens 8]

Starts the local stack as bench.load does (verify service, draft service and gateway on loopback, the demo pair),
then sends two bursts of `--sessions` concurrent requests through the gateway's REST API (`POST
/v1/completions`, streaming, token-id prompts, temperature 0, `--max-tokens` tokens each with ignore_eos),
timing each request's first text chunk (TTFT):

1. shared: every prompt is one `--prefix-tokens` prefix followed by a `--suffix-tokens` suffix of its own (a
   system prompt before each user's text);
2. unshared: every prompt is `--prefix-tokens + --suffix-tokens` tokens of its own (no two start alike).

The text is the CPython standard library's (held-out files first, the demo models never trained on them), cut
into token windows with the target's tokenizer, so every prompt has exactly its length; no window is used twice,
so nothing of one burst is cached for the other. Both bursts arrive all at once: the shared prefix is not in the
cache when the first burst starts (`--prime` sends it once first, for a service that has already seen its
system prompt).

Around each burst the verify service's /metrics are read (and sampled while it runs, for the peaks): its KV
blocks used and shared, the prefix cache's queries and hits (tokens), evictions and preemptions. A verify runner
without a block pool (`--verify-arg=--runner=batched`) exports no block metrics: those figures are then null.

Writes bench/results/prefix_share.json and bench/results/prefix_share.png.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import signal
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

from bench.load import MODEL_NAME, Stack, git_info
from bench.output import machine, write_json
from bench.plots import pyplot, save
from specmesh.placement import add_thread_flags, cores, service_threads, speculation_batch_limit
from specmesh.profile.collect import Sample, diff, parse_metrics, total
from specmesh.training.corpus import read_text, stdlib_files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RUNS = ("shared", "unshared")
PEAK_INTERVAL_S = 0.25


# ---------------------------------------------------------------------------------------------------------
# prompts


def token_windows(tokenizer, sizes: list[int]) -> list[list[int]]:
    """Windows of the standard library's text of the given sizes, in order, none overlapping: file by file
    (held-out files first), each file cut from its start into consecutive windows."""
    train, heldout = stdlib_files()
    out: list[list[int]] = []
    want = iter(sizes)
    n = next(want, None)
    for path in [*heldout, *train]:
        text = read_text(path)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        start = 0
        while n is not None and start + n <= len(ids):
            out.append(ids[start : start + n])
            start += n
            n = next(want, None)
        if n is None:
            return out
    raise RuntimeError(f"the standard library holds only {len(out)} of the {len(sizes)} windows asked for")


def make_prompts(tokenizer, sessions: int, prefix: int, suffix: int) -> dict[str, list[list[int]]]:
    """The shared run's prompts (one prefix, a suffix each), the unshared run's (as long, each its own) and the
    warm-up's (one more, shared with neither)."""
    windows = token_windows(tokenizer, [prefix] + [suffix] * sessions + [prefix + suffix] * (sessions + 1))
    shared_prefix, suffixes, unshared = windows[0], windows[1 : 1 + sessions], windows[1 + sessions :]
    return {"shared": [shared_prefix + s for s in suffixes], "unshared": unshared[:-1], "warm": unshared[-1:]}


# ---------------------------------------------------------------------------------------------------------
# the verify service's metrics


def scrape(port: str | None) -> Sample:
    if not port:
        return {}
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


class PeakSampler:
    """The verify service's /metrics read every PEAK_INTERVAL_S while a burst runs: the highest value of each
    series (blocks in use fall back as soon as the requests end)."""

    def __init__(self, port: str | None):
        self.port = port
        self.peak: Sample = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(PEAK_INTERVAL_S):
            try:
                page = scrape(self.port)
            except OSError:
                continue
            for k, v in page.items():
                self.peak[k] = max(v, self.peak.get(k, v))

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def kv_figures(before: Sample, after: Sample, peak: Sample) -> dict:
    """The burst's KV figures: counters as differences, blocks at the end and at the sampled peak; null where
    the verify service has no block pool."""
    d = diff(after, before)
    has_blocks = bool(total(after, "specmesh_verify_kv_block_size"))

    def blocks(sample: Sample, state: str) -> int | None:
        return int(total(sample, "specmesh_verify_kv_blocks", state=state)) if has_blocks else None

    queries = total(d, "vllm:prefix_cache_queries_total")
    hits = total(d, "vllm:prefix_cache_hits_total")
    highest = {k: max(v, after.get(k, v)) for k, v in peak.items()} or after
    return {
        "block_pool": has_blocks,
        "block_size": int(total(after, "specmesh_verify_kv_block_size")) if has_blocks else None,
        "blocks_total": sum(blocks(after, s) or 0 for s in ("used", "free", "cached")) if has_blocks else None,
        "blocks_used_end": blocks(after, "used"),
        "blocks_shared_end": blocks(after, "shared"),
        "blocks_cached_end": blocks(after, "cached"),
        "blocks_used_peak": blocks(highest, "used"),
        "blocks_shared_peak": blocks(highest, "shared"),
        "kv_usage_peak": round(total(highest, "vllm:kv_cache_usage_perc"), 4),
        "prefix_cache_query_tokens": int(queries) if has_blocks else None,
        "prefix_cache_hit_tokens": int(hits) if has_blocks else None,
        "prefix_cache_hit_rate": round(hits / queries, 4) if has_blocks and queries else None,
        "evicted_blocks": int(total(d, "specmesh_verify_kv_block_evictions_total")) if has_blocks else None,
        "preemptions": int(total(d, "vllm:num_preemptions_total")),
        "prefill_tokens": int(total(d, "specmesh_verify_prefill_tokens_total")),
    }


# ---------------------------------------------------------------------------------------------------------
# the client


async def one_request(client, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    """One streamed greedy completion: its time to the first text chunk, and the cached prompt tokens its
    usage reports."""
    rec: dict = {"ttft": None, "e2e": None, "cached_tokens": None, "error": None}
    t0 = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            timeout=timeout,
        )
        async for chunk in stream:
            if rec["ttft"] is None and chunk.choices and chunk.choices[0].text:
                rec["ttft"] = time.perf_counter() - t0
            if chunk.usage is not None:
                details = getattr(chunk.usage, "prompt_tokens_details", None)
                rec["cached_tokens"] = getattr(details, "cached_tokens", None)
        rec["e2e"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 — one failed request is recorded, the burst goes on
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def pct_ms(values: list[float]) -> dict | None:
    if not values:
        return None
    a = np.asarray(values) * 1e3
    return {q: round(float(np.percentile(a, p)), 1) for q, p in (("p50", 50), ("p90", 90))} | {
        "mean": round(float(a.mean()), 1)
    }


async def burst(client, prompts: list[list[int]], max_tokens: int, timeout: float) -> tuple[list[dict], float]:
    t0 = time.perf_counter()
    records = await asyncio.gather(*(one_request(client, p, max_tokens, timeout) for p in prompts))
    return list(records), time.perf_counter() - t0


async def measure(args, stack: Stack, prompts: dict[str, list[list[int]]]) -> dict:
    from openai import AsyncOpenAI

    base = stack.start_gateway("gateway", with_draft=not args.target_only)
    # No retries: a retried request would hide an error and inflate its TTFT.
    client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=args.request_timeout_s)
    port = stack.metrics_ports.get("verify")
    runs: dict[str, dict] = {}
    (warm,) = prompts["warm"]
    try:
        # Warm-up on text used by neither burst: the first requests of a stack pay one-off costs.
        for n in (1, 4):
            records, _ = await burst(client, [warm] * n, 4, args.request_timeout_s)
            if any(r["error"] for r in records):
                raise RuntimeError(f"warm-up request failed: {records[0]['error']}")
        stack.check_alive()
        for name in RUNS:
            if name == "shared" and args.prime:
                await burst(client, [prompts["shared"][0][: args.prefix_tokens] + warm[:4]], 4, args.request_timeout_s)
            before = scrape(port)
            with PeakSampler(port) as sampler:
                records, wall = await burst(client, prompts[name], args.max_tokens, args.request_timeout_s)
            after = scrape(port)
            stack.check_alive()
            ok = [r for r in records if r["error"] is None]
            if not ok:
                raise RuntimeError(f"every request of the {name} burst failed: {records[0]['error']}")
            cached = [r["cached_tokens"] for r in ok if r["cached_tokens"] is not None]
            runs[name] = {
                "requests": len(records),
                "errors": len(records) - len(ok),
                "error_examples": sorted({r["error"] for r in records if r["error"]})[:3],
                "wall_s": round(wall, 3),
                "ttft_ms": pct_ms([r["ttft"] for r in ok if r["ttft"] is not None]),
                "e2e_ms": pct_ms([r["e2e"] for r in ok]),
                "ttft_s_per_request": [None if r["ttft"] is None else round(r["ttft"], 4) for r in records],
                "cached_tokens_reported": sum(cached) if cached else None,
                "kv": kv_figures(before, after, sampler.peak),
            }
    finally:
        await client.close()
    return runs


# ---------------------------------------------------------------------------------------------------------
# report


def ratio(runs: dict, q: str) -> float | None:
    s, u = (runs[r]["ttft_ms"] for r in RUNS)
    return round(s[q] / u[q], 3) if s and u and u[q] else None


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    colors = {"shared": "#37c", "unshared": "#c84"}
    for name in RUNS:
        ttft = sorted(t * 1e3 for t in r["runs"][name]["ttft_s_per_request"] if t is not None)
        if ttft:
            ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), "-", color=colors[name], label=name)
    s = r["settings"]
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(
        f"{s['sessions']} concurrent requests, {s['prefix_tokens']} + {s['suffix_tokens']}-token prompts\n"
        f"shared / unshared TTFT: p50 {r['ttft_ratio_p50']}x, p90 {r['ttft_ratio_p90']}x",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    kv = {name: r["runs"][name]["kv"] for name in RUNS}
    if kv["shared"]["block_pool"]:
        labels = ["used (peak)", "shared (peak)", "prefix hits (blocks)"]
        x = np.arange(len(labels))
        for i, name in enumerate(RUNS):
            k = kv[name]
            hits = (k["prefix_cache_hit_tokens"] or 0) / (k["block_size"] or 1)
            ax2.bar(x + (i - 0.5) * 0.4, [k["blocks_used_peak"], k["blocks_shared_peak"], hits], 0.4,
                    color=colors[name], label=name)  # fmt: skip
        ax2.set_xticks(x, labels, fontsize=8)
        ax2.set_ylabel("KV blocks")
        ax2.set_title(f"verify KV blocks ({kv['shared']['block_size']} tokens each)", fontsize=9)
        ax2.legend(fontsize=8)
    else:
        ax2.text(0.5, 0.5, "the verify runner has no block pool", ha="center", va="center")
        ax2.set_axis_off()
    save(fig, path)


def print_report(r: dict) -> None:
    print(f"\n{'run':<9} {'TTFT p50 ms':>11} {'p90 ms':>8} {'errors':>6} {'used peak':>9} {'shared peak':>11} "
          f"{'hit tokens':>10} {'hit rate':>8} {'preempted':>9}")  # fmt: skip
    for name in RUNS:
        run, k = r["runs"][name], r["runs"][name]["kv"]
        t = run["ttft_ms"] or {"p50": float("nan"), "p90": float("nan")}
        print(
            f"{name:<9} {t['p50']:>11.1f} {t['p90']:>8.1f} {run['errors']:>6} {k['blocks_used_peak']!s:>9} "
            f"{k['blocks_shared_peak']!s:>11} {k['prefix_cache_hit_tokens']!s:>10} {k['prefix_cache_hit_rate']!s:>8} "
            f"{k['preemptions']:>9}"
        )
    print(f"shared / unshared TTFT: p50 {r['ttft_ratio_p50']}x, p90 {r['ttft_ratio_p90']}x")


# ---------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.prefix_share", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target", help="target checkpoint")
    ap.add_argument("--draft", type=Path, default=ROOT / "models/demo/draft", help="draft checkpoint")
    ap.add_argument("--sessions", type=int, default=64, help="concurrent requests per burst")
    ap.add_argument("--prefix-tokens", type=int, default=1000, help="tokens of the shared prefix")
    ap.add_argument("--suffix-tokens", type=int, default=20, help="tokens of each request's own suffix")
    ap.add_argument("--max-tokens", type=int, default=8, help="completion tokens per request (ignore_eos)")
    ap.add_argument("--prime", action="store_true", help="send the shared prefix once before the shared burst")
    ap.add_argument("--target-only", action="store_true", help="no draft service: the gateway decodes target-only")
    ap.add_argument(
        "--verify-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the verify service (repeatable), e.g. --verify-arg=--kv-cache-budget-mb=4096",
    )
    add_thread_flags(ap)
    ap.add_argument("--request-timeout-s", type=float, default=600.0, help="client timeout per request")
    ap.add_argument("--device", default=None, help="torch device of the services (default: cuda when available)")
    ap.add_argument("--out", type=Path, default=RESULTS / "prefix_share.json", help="JSON results (the PNG beside)")
    args = ap.parse_args(argv)
    if args.sessions < 1 or args.prefix_tokens < 1 or args.suffix_tokens < 1 or args.max_tokens < 1:
        ap.error("--sessions, --prefix-tokens, --suffix-tokens and --max-tokens must be >= 1")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the teardown below on SIGTERM too

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = make_prompts(tokenizer, args.sessions, args.prefix_tokens, args.suffix_tokens)

    args.verify_threads = service_threads("verify", args.verify_threads)
    args.draft_threads = service_threads("draft", args.draft_threads)
    # The gateway turns speculation off past this many running requests, as the local stack sets it.
    limit = ["--speculative-disable-by-batch-size", str(speculation_batch_limit(args.device.startswith("cuda")))]
    stack = Stack(
        args.target,
        args.draft,
        args.verify_threads,
        args.draft_threads,
        limit,
        verify_args=args.verify_arg,
        draft_args=limit,
        device=args.device,
    )
    atexit.register(stack.close)
    try:
        stack.start_services(with_draft=not args.target_only)
        runs = asyncio.run(measure(args, stack, prompts))
    finally:
        stack.close()

    results = {
        "bench": "prefix_share",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_info(),
        "machine": machine(args.device, load_start, cores()),
        "settings": {
            "target": str(args.target),
            "draft": None if args.target_only else str(args.draft),
            "sessions": args.sessions,
            "prefix_tokens": args.prefix_tokens,
            "suffix_tokens": args.suffix_tokens,
            "max_tokens": args.max_tokens,
            "primed": args.prime,
            "verify_args": args.verify_arg,
            "verify_torch_threads": args.verify_threads,
            "draft_torch_threads": None if args.target_only else args.draft_threads,
            "api": "POST /v1/completions, streaming, openai client, token-id prompts, temperature 0, ignore_eos",
            "text": "CPython standard library source (held-out files first), cut into token windows",
        },
        "runs": runs,
        "ttft_ratio_p50": ratio(runs, "p50"),
        "ttft_ratio_p90": ratio(runs, "p90"),
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    write_json(args.out, results)
    plot(results, args.out.with_suffix(".png"))
    print_report(results)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({results['total_seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the stack is already stopped (main's finally); no traceback for a Ctrl-C
        sys.exit(130)
