"""Build a draft's rehearsal set: windows of the domain it was distilled on, with the target's top-k.

    python -m specmesh.training.rehearsal --target models/demo/target --draft models/demo/draft \
        [--windows 256] [--window 64] [--topk 8] [--seed 0]

The online trainer (`--online-distill`) learns the traffic's domain from the verifier's feedback; mixing a
share of these windows into each of its batches keeps the draft close to the target on the domain it was
built for (`specmesh.training.online.RehearsalSet`). The windows come from the standard library's training
files (never the held-out ones the benchmarks measure on): one window per file, files and offsets drawn
with `--seed`. The target runs once over each window. Writes `rehearsal.safetensors` into the draft's
directory (or `--out`).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch

from specmesh.models import load_model
from specmesh.training.corpus import read_text, stdlib_files
from specmesh.training.online import RehearsalSet


def stdlib_windows(tokenizer, windows: int, window: int, seed: int) -> list[list[int]]:
    """`windows` windows of `window` + 1 tokens, one per training file long enough, files and offsets drawn
    with `seed`."""
    train, _heldout = stdlib_files()
    rng = random.Random(seed)
    out: list[list[int]] = []
    for path in rng.sample(train, len(train)):
        text = read_text(path)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
        if len(ids) > window + 1:
            start = rng.randrange(len(ids) - window - 1)
            out.append(ids[start : start + window + 1])
        if len(out) == windows:
            break
    return out


@torch.inference_mode()
def build(model, rows: list[list[int]], topk: int, batch: int = 16, seed: int = 0) -> RehearsalSet:
    """The target's log-softmax top-k at every input position of each row (rows all of one length)."""
    device = next(model.parameters()).device
    tokens = torch.tensor(rows, dtype=torch.long)
    ids, lps = [], []
    for i in range(0, len(rows), batch):
        x = tokens[i : i + batch, :-1].to(device)
        logp = torch.log_softmax(model(input_ids=x).logits.float(), dim=-1)
        top = logp.topk(topk, dim=-1)
        ids.append(top.indices.cpu())
        lps.append(top.values.cpu())
    return RehearsalSet(tokens, torch.cat(ids), torch.cat(lps), seed=seed)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m specmesh.training.rehearsal",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--target", type=Path, required=True, help="the target checkpoint (teacher)")
    ap.add_argument("--draft", type=Path, required=True, help="the draft's directory (the file goes there)")
    ap.add_argument("--out", type=Path, default=None, help=f"default: DRAFT/{RehearsalSet.FILE}")
    ap.add_argument("--windows", type=int, default=256)
    ap.add_argument("--window", type=int, default=64, help="tokens per window (the online trainer's window)")
    ap.add_argument("--topk", type=int, default=8, help="target tokens per position (the online default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="torch device (default: cuda when available)")
    args = ap.parse_args(argv)
    if min(args.windows, args.window, args.topk) < 1:
        ap.error("--windows, --window and --topk must be >= 1")
    model, tokenizer = load_model(args.target, args.device)
    if tokenizer is None:
        ap.error(f"{args.target} has no tokenizer")
    rows = stdlib_windows(tokenizer, args.windows, args.window, args.seed)
    if not rows:
        raise SystemExit("no standard-library training file is long enough for one window")
    out = args.out or args.draft / RehearsalSet.FILE
    meta = {
        "target": str(args.target),
        "windows": str(len(rows)),
        "window": str(args.window),
        "topk": str(args.topk),
        "seed": str(args.seed),
        "corpus": "standard library training files (held-out files excluded), one window per file",
    }
    build(model, rows, args.topk, seed=args.seed).save(out, meta)
    print(json.dumps({"wrote": str(out), **meta}))


if __name__ == "__main__":
    main()
