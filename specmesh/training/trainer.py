"""One training loop for every model specmesh trains (the demo target, distilled drafts).

The loop is deliberately small: AdamW, linear warm-up then cosine decay (a pure function of the step,
so no scheduler state), gradient clipping, a progress bar with loss and tokens/s, periodic atomic
checkpoints holding model + optimizer + step, and `resume`. Batches are a pure function of the step
(see `TokenWindows`), so a resumed run reproduces an uninterrupted one.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 200
    out_dir: Path = Path("out")
    desc: str = "train"

    @classmethod
    def from_args(cls, args, out_dir: Path, desc: str) -> TrainConfig:
        """The schedule a training CLI's --steps, --lr, --warmup and --checkpoint-every ask for."""
        return cls(
            steps=args.steps,
            lr=args.lr,
            warmup=args.warmup,
            checkpoint_every=args.checkpoint_every,
            out_dir=out_dir,
            desc=desc,
        )


def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def save_checkpoint(path: Path, model, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)  # atomic: a crash mid-save never leaves a torn checkpoint


def load_checkpoint(path: Path, model, optimizer) -> int:
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return int(state["step"])


def train(
    model: torch.nn.Module,
    loss_fn: Callable[[int], tuple[torch.Tensor, int]],
    cfg: TrainConfig,
    resume: bool = False,
    stop_after: int | None = None,
    on_checkpoint: Callable[[int], None] | None = None,
) -> list[float]:
    """Run `cfg.steps` optimizer steps; `loss_fn(step)` returns (loss, tokens in the batch).

    `stop_after` ends the run early at that step (after checkpointing), which is how tests simulate an
    interruption. Returns the loss of each step run in this call.
    """
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    ckpt = cfg.out_dir / CHECKPOINT
    optimizer = make_optimizer(model, cfg)
    start = load_checkpoint(ckpt, model, optimizer) if resume and ckpt.exists() else 0
    end = min(cfg.steps, stop_after) if stop_after is not None else cfg.steps
    model.train()
    losses: list[float] = []
    bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc=cfg.desc, dynamic_ncols=True, mininterval=2.0)
    t0, tokens = time.perf_counter(), 0
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        loss, n_tokens = loss_fn(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        losses.append(loss.item())
        tokens += n_tokens
        # refresh=False lets tqdm's mininterval throttle redraws (one line per step in a log file otherwise)
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tokens / (time.perf_counter() - t0):.0f}", refresh=False)
        done = step + 1
        if done % cfg.checkpoint_every == 0 or done == end:
            save_checkpoint(ckpt, model, optimizer, done)
            if on_checkpoint:
                on_checkpoint(done)
    bar.close()
    model.eval()
    return losses
