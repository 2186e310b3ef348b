"""The run command until the services land: speculative generation in-process on the demo pair.

    python -m specmesh.demo [--prompt TEXT] [--max-tokens N] [-k K] [--temperature T]

Loads models/demo/{target,draft}, generates target-only (K = 0, the baseline) and speculatively, prints
both texts (identical under greedy decoding: that is the product's promise), the speculation stats and
the speedup.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"
DEFAULT_PROMPTS = [
    'def read_config(path):\n    """Read a configuration file and return a dict."""\n',
    "class LRUCache:\n    def __init__(self, maxsize=128):\n",
    "import os\nimport sys\n\n\ndef main(argv=None):\n",
]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=DEMO / "target", help="target checkpoint directory")
    ap.add_argument("--draft", type=Path, default=DEMO / "draft", help="draft checkpoint directory")
    ap.add_argument("--prompt", action="append", help="prompt text (repeatable); default: three code prompts")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("-k", "--speculative-num-steps", type=int, default=4, help="draft tokens per round (K)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    engine = SpeculativeEngine.from_paths(args.target, args.draft)
    tok = engine.tokenizer
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    totals = {"baseline_s": 0.0, "spec_s": 0.0, "tokens_baseline": 0, "tokens_spec": 0}
    for text in args.prompt or DEFAULT_PROMPTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        engine.generate(ids, params, args.speculative_num_steps)  # warm-up
        t0 = time.perf_counter()
        base = engine.generate(ids, params, 0)
        t1 = time.perf_counter()
        spec = engine.generate(ids, params, args.speculative_num_steps)
        t2 = time.perf_counter()
        totals["baseline_s"] += t1 - t0
        totals["spec_s"] += t2 - t1
        totals["tokens_baseline"] += len(base.token_ids)
        totals["tokens_spec"] += len(spec.token_ids)
        print("=" * 78)
        print(text + spec.text)
        print("-" * 78)
        same = "identical to" if spec.token_ids == base.token_ids else "differs from (sampling)"
        print(f"speculative output {same} target-only output; finish_reason={spec.finish_reason}")
        print(json.dumps(spec.stats.as_dict()))
        print(f"target-only {len(base.token_ids) / (t1 - t0):.1f} tok/s, "
              f"speculative {len(spec.token_ids) / (t2 - t1):.1f} tok/s, speedup {(t1 - t0) / (t2 - t1):.2f}x")
    tb = totals["tokens_baseline"] / totals["baseline_s"]
    ts = totals["tokens_spec"] / totals["spec_s"]
    print("=" * 78)
    print(f"overall: target-only {tb:.1f} tok/s, speculative (K={args.speculative_num_steps}) {ts:.1f} tok/s, "
          f"speedup {ts / tb:.2f}x")


if __name__ == "__main__":
    main()
