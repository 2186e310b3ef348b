"""What offline distillation reaches on bench.online's English corpus: the ceiling for the online loop.

    python -m bench.online_ceiling [--lr 1.5e-4] [--kl-weight 1,0.5] [--steps 600] [--every 100]

bench.online asks the predict-verify-optimize loop for +0.10 acceptance within 10 minutes of traffic on the
demo pair. This measures how far the same training can move the draft when it has the corpus up front: the
target's top-k on every position of the English windows (what the verifier would feed back), the online
trainer's batch (8 windows of 64 tokens), loss (`specmesh.training.distill.distill_loss`: `kl_weight` x the KL
to the target's top-k + the rest x cross-entropy on the target's argmax, which is what greedy traffic commits
and the online trainer's labels are) and optimiser (AdamW, gradient norm clipped to 1), no serving and no CPU
cap. Figure: teacher-forced greedy agreement of draft and target (the acceptance rate of greedy speculation on
the target's own text) on held-out windows, every `--every` steps, for each learning rate and KL weight.

Writes bench/results/online_ceiling.json.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from bench.load import git_info, parse_list
from bench.online import english_prompts
from bench.output import write_json
from bench.services import RESULTS, ROOT
from specmesh.models import load_model
from specmesh.training.distill import TeacherTargets, distill_loss, teacher_targets
from specmesh.training.online import OnlineConfig

WINDOW = 64  # the online trainer's window (tokens of input; one more is the last label)
BATCH = 8  # the online trainer's batch
TOPK = 8  # the verifier's feedback per position (--online-distill-topk's default)


@torch.inference_mode()
def agreement(target, draft, windows: torch.Tensor) -> float:
    """Share of positions where draft and target agree on the most likely next token (teacher-forced)."""
    draft.eval()
    agree = total = 0
    for i in range(0, len(windows), 16):
        batch = windows[i : i + 16, :-1]
        t = target(input_ids=batch, use_cache=False).logits.argmax(-1)
        d = draft(input_ids=batch, use_cache=False).logits.argmax(-1)
        agree += int((t == d).sum())
        total += t.numel()
    draft.train()
    return agree / total


def run(args) -> dict:
    torch.manual_seed(0)
    target, tokenizer = load_model(args.target, device="cpu")
    draft0, _ = load_model(args.draft, device="cpu")
    target.eval()
    windows = torch.tensor(english_prompts(tokenizer, WINDOW + 1))
    windows = windows[torch.randperm(len(windows))]
    held, train = windows[: args.heldout], windows[args.heldout :]
    with torch.inference_mode():
        feedback = [teacher_targets(target, train[i : i + 32, :-1], TOPK, 1.0) for i in range(0, len(train), 32)]
    ids = torch.cat([f.ids for f in feedback])
    logprobs = torch.cat([f.logprobs for f in feedback])
    before = agreement(target, draft0, held)
    print(f"{len(train)} training windows, {len(held)} held out; agreement before {before:.4f}", flush=True)
    curves = {}
    for lr, kl_weight in [(lr, w) for lr in args.lr for w in args.kl_weight]:
        draft = copy.deepcopy(draft0)
        draft.train()
        opt = torch.optim.AdamW(draft.parameters(), lr=lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(1)
        t0, points = time.perf_counter(), []
        for step in range(1, args.steps + 1):
            idx = torch.randint(len(train), (BATCH,), generator=gen)
            teacher = TeacherTargets(ids[idx], logprobs[idx])
            # the cross-entropy's labels: the target's own choice, as greedy traffic commits it
            loss = distill_loss(draft, train[idx], teacher, kl_weight, labels=ids[idx][..., 0].long()).loss
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
            opt.step()
            if step % args.every == 0:
                a = agreement(target, draft, held)
                points.append({"step": step, "loss": round(loss.item(), 4), "agreement": round(a, 4)})
                print(f"lr {lr:g} kl {kl_weight:g} step {step}: loss {loss.item():.3f}, agreement {a:.4f}", flush=True)
        curves[f"lr={lr:g} kl_weight={kl_weight:g}"] = {"points": points, "seconds": round(time.perf_counter() - t0, 1)}
    best = max(p["agreement"] for c in curves.values() for p in c["points"])
    return {
        "bench": "online_ceiling",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_info(),
        "settings": {
            "target": str(args.target),
            "draft": str(args.draft),
            "window": WINDOW,
            "batch": BATCH,
            "topk": TOPK,
            "steps": args.steps,
            "lr": args.lr,
            "kl_weight": args.kl_weight,
            "ce_labels": "the target's argmax (what greedy traffic commits)",
            "threads": torch.get_num_threads(),
        },
        "corpus": {"training_windows": len(train), "heldout_windows": len(held)},
        "agreement_before": round(before, 4),
        "best_agreement": best,
        "best_gain": round(best - before, 4),
        "curves": curves,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench.online_ceiling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, default=ROOT / "models" / "demo" / "target")
    ap.add_argument("--draft", type=Path, default=ROOT / "models" / "demo" / "draft")
    ap.add_argument("--lr", type=parse_list(float), default=[OnlineConfig.lr], help="comma-separated learning rates")
    ap.add_argument(
        "--kl-weight", type=parse_list(float), default=[1.0, OnlineConfig.kl_weight], help="comma-separated KL weights"
    )
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--heldout", type=int, default=96, help="windows held out for the agreement figure")
    ap.add_argument("--out", type=Path, default=RESULTS / "online_ceiling.json")
    args = ap.parse_args(argv)
    result = run(args)
    write_json(args.out, result, indent=1)
    print(f"best agreement {result['best_agreement']} (gain {result['best_gain']:+.4f}); wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
