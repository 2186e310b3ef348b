"""In-process benchmark: target-only vs transformers assisted generation vs specmesh's speculative engine.

    python -m bench.inprocess [--prompts 8] [--max-tokens 96] [--ks 2 4 6]

All methods run in this one process on the same held-out prompts (the first tokens of held-out standard
library files), greedy, after a warm-up; ratios are against target-only decoding measured here. Writes
bench/results/inprocess.json and bench/results/inprocess.png.
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

from bench.output import write_json
from bench.plots import label_bars, pyplot, save
from specmesh.domain import SpecStats
from specmesh.engine import SpeculativeEngine
from specmesh.runtime.hf import ModelRunner
from specmesh.sampling import SamplingParams
from specmesh.training.corpus import read_text, stdlib_files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def heldout_prompts(tokenizer, n: int, length: int, per_file: int = 1) -> list[list[int]]:
    """Up to n prompts of `length` tokens from the held-out standard-library files: the first `length`
    tokens of each file; with per_file > 1, also the windows starting every 2 x length tokens further in,
    taken file by file in rounds (every file's first window, then every file's second...), so the first
    prompts are always the same whatever n asks for."""
    rounds: list[list[list[int]]] = [[] for _ in range(per_file)]
    for path in stdlib_files()[1]:
        text = read_text(path)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        for r in range(per_file):
            start = 2 * length * r
            if len(ids) >= start + length:
                rounds[r].append(ids[start : start + length])
        if per_file == 1 and len(rounds[0]) == n:
            break
    return [p for r in rounds for p in r][:n]


def run_engine(engine, prompts, params, k, algorithm="standalone"):
    tokens, seconds, outputs, stats = 0, 0.0, [], SpecStats()
    for p in prompts:
        t0 = time.perf_counter()
        r = engine.generate(p, params, k, algorithm)
        seconds += time.perf_counter() - t0
        tokens += len(r.token_ids)
        outputs.append(r.token_ids)
        stats.merge(r.stats)
    d = stats.as_dict()
    return {
        "tokens": tokens,
        "seconds": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 2),
        "rounds": d["rounds"],
        "drafts": d["drafts"],
        "drafted": d["drafted"],
        "accepted": d["accepted"],
        "acceptance_rate": d["acceptance_rate"] if stats.drafted else None,
        "mean_accepted_length": d["mean_accepted_length"] if stats.drafts else None,
    }, outputs


def run_hf(target, prompts, max_tokens, assistant=None):
    tokens, seconds, outputs = 0, 0.0, []
    for p in prompts:
        ids = torch.tensor([p], device=target.device)
        kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        if assistant is not None:
            kw["assistant_model"] = assistant
        t0 = time.perf_counter()
        out = target.generate(ids, **kw)[0, len(p) :].tolist()
        seconds += time.perf_counter() - t0
        tokens += len(out)
        outputs.append(out)
    return {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2)}, outputs


@torch.inference_mode()
def decode_ms(model, context: int = 64, steps: int = 50) -> float:
    """Milliseconds of one plain HF one-token decode forward (DynamicCache), after a warm-up."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(input_ids=torch.zeros((1, context), dtype=torch.long), cache=cache, use_cache=True)
    x = torch.zeros((1, 1), dtype=torch.long)
    for _ in range(5):
        model(input_ids=x, cache=cache, use_cache=True)
    t0 = time.perf_counter()
    for _ in range(steps):
        model(input_ids=x, cache=cache, use_cache=True)
    return (time.perf_counter() - t0) / steps * 1e3


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    methods = results["methods"]
    names = list(methods)
    fig, ax = plt.subplots(figsize=(9, 4))
    bars = ax.bar(names, [methods[n]["tokens_per_s"] for n in names], color=["#888"] * 2 + ["#4a7"] * (len(names) - 2))
    label_bars(ax, bars, [f"{methods[n]['speedup_vs_target_only']:.2f}x" for n in names], fontsize=9)
    ax.set_ylabel("tokens / s (greedy)")
    ax.set_title(f"in-process decoding, {results['prompts']} held-out prompts x {results['max_tokens']} tokens")
    plt.xticks(rotation=20, ha="right")
    save(fig, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--draft", type=Path, default=ROOT / "models/demo/draft")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--ks", type=int, nargs="+", default=[2, 4, 6])
    ap.add_argument("--out", type=Path, default=RESULTS / "inprocess.json")
    args = ap.parse_args(argv)

    engine = SpeculativeEngine.from_paths(args.target, args.draft)
    target, draft = engine.target.model, engine.draft.model
    prompts = heldout_prompts(engine.tokenizer, args.prompts, args.prompt_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine.generate(prompts[0], params, 4)  # warm-up
    run_hf(target, prompts[:1], 8, draft)

    plan = [
        ("target-only", lambda: run_engine(engine, prompts, params, 0)),
        ("hf generate", lambda: run_hf(target, prompts, args.max_tokens)),
        ("hf assisted", lambda: run_hf(target, prompts, args.max_tokens, draft)),
    ]
    plan += [(f"specmesh K={k}", lambda k=k: run_engine(engine, prompts, params, k)) for k in args.ks]
    plan += [("specmesh ngram K=4", lambda: run_engine(engine, prompts, params, 4, "ngram"))]
    # the same K = 4 with the stock HF forward as the draft's runner: what StaticCacheRunner buys
    hf_draft = SpeculativeEngine(engine.target, ModelRunner(draft), engine.sampler, engine.tokenizer)
    plan += [("specmesh K=4, HF draft runner", lambda: run_engine(hf_draft, prompts, params, 4))]
    methods, outputs = {}, {}
    for name, fn in tqdm(plan, desc="bench", unit="method"):
        methods[name], outputs[name] = fn()
    base = methods["target-only"]["tokens_per_s"]
    for name, m in methods.items():
        m["speedup_vs_target_only"] = round(m["tokens_per_s"] / base, 3)
        m["speedup_vs_hf_generate"] = round(m["tokens_per_s"] / methods["hf generate"]["tokens_per_s"], 3)
        m["output_equals_target_only"] = outputs[name] == outputs["target-only"]
    t_ms, d_ms = decode_ms(target), decode_ms(draft)
    results = {
        "bench": "inprocess",
        "decode_ms": {"target": round(t_ms, 3), "draft": round(d_ms, 3), "ratio": round(t_ms / d_ms, 2)},
        "draft_runner": type(engine.draft).__name__,
        "target": str(args.target),
        "draft": str(args.draft),
        "target_params": sum(p.numel() for p in target.parameters()),
        "draft_params": sum(p.numel() for p in draft.parameters()),
        "prompts": len(prompts),
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "device": str(engine.target.device),
        "torch_threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "methods": methods,
    }
    write_json(args.out, results)
    plot(results, args.out.with_suffix(".png"))
    width = max(map(len, methods))
    print(f"{'method':<{width}}  tok/s   speedup  accept  mean_len  equal")
    for name, m in methods.items():
        print(
            f"{name:<{width}}  {m['tokens_per_s']:6.1f}  {m['speedup_vs_target_only']:6.2f}x  "
            f"{m.get('acceptance_rate') or '-':>6}  {m.get('mean_accepted_length') or '-':>8}  "
            f"{m['output_equals_target_only']}"
        )
    print(f"one-token HF decode: target {t_ms:.2f} ms, draft {d_ms:.2f} ms ({t_ms / d_ms:.1f}x)")
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
