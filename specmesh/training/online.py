"""Online distillation: the draft learns from the verifier's feedback while it serves.

The verify service already computes the target's distribution at every position it verifies. A session
that opts in asks for its top-k (`SamplingParams.logprobs`: the log-softmax of the target's raw logits at
each committed token); `SessionFeedback` lays those next to the session's tokens, and every `window`
committed tokens becomes one training window in a bounded `ReplayBuffer`. An `OnlineDistiller` thread runs
knowledge-distillation steps (`distill_loss`, the offline distiller's loss, here over the positions that
have feedback) on its own copy of the draft's weights, at most `cpu_share` of one core's time (scaled by the
model's share of the drafted tokens where suffix trees draft beside it), and every
`steps_per_version` steps publishes a new version:

- saved under `dir/v{n}/` (weights + meta.json with its live acceptance, rewritten as it is measured);
- swapped into the serving model on the draft's model thread, between two runs of draft forwards, so a
  block is always drafted by one version (the runner sees the in-place update and refreshes its copies);
- rolled back when its live acceptance over its first `rollback_window` drafted tokens is below its
  predecessor's over that predecessor's last `rollback_window` by more than `rollback_margin`.

Rehearsal: with a `RehearsalSet` (windows of the domain the draft was distilled on, with the target's top-k,
made offline and shipped beside the draft), `rehearsal_share` of every batch comes from it, so that learning
the traffic's domain does not wear away the one the draft was built for (experience replay).

Lossless whatever the weights: a block carries the q its tokens were sampled from, and the verifier's test
is exact for any q. Swapping weights only changes which q the next block is sampled from.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from specmesh.training.distill import TeacherTargets, distill_loss

log = logging.getLogger("specmesh.online")


@dataclass(frozen=True)
class OnlineConfig:
    topk: int = 8  # target tokens per position asked of the verifier (1-20)
    window: int = 64  # tokens per training window (its inputs; one more token is its last label)
    buffer_windows: int = 1024  # replay buffer size; the oldest windows go first
    min_windows: int = 16  # no training before the buffer holds this many
    batch_size: int = 8
    # Small: AdamW moves every weight by about lr per step whatever its gradient, and at 5e-4 fifty steps of
    # English traffic cost the demo draft 0.17 of its acceptance on the code it was distilled on (teacher-forced
    # agreement -0.066), while 5e-5 learnt as much of the new domain in 300 steps (+0.062) for -0.006 there.
    # With a quarter of each batch rehearsing the original domain (rehearsal_share), 1.5e-4 learns the new
    # domain faster live (bench.online: +0.089 against +0.067-0.070 at 5e-5) and the original domain holds.
    lr: float = 1.5e-4
    # Half KL to the target's top-k, half cross-entropy on the committed token (the target's own choice: its
    # argmax under greedy traffic, a sample of it otherwise). Acceptance is decided by the target's choice, and
    # the CE term pulls the draft's argmax there harder than the KL alone: offline at lr 1.5e-4 on bench.online's
    # English corpus, teacher-forced agreement after 300 / 600 steps was 0.674 / 0.677 with pure KL, 0.692 /
    # 0.703 at 0.5 and 0.678 / 0.681 with CE alone; live (bench.online) the gain went from +0.085-0.094 to +0.13.
    kl_weight: float = 0.5
    steps_per_version: int = 50
    cpu_share: float = 0.3  # the trainer's share of one core's wall time (it sleeps the rest)
    # Beside suffix trees (the hybrid draft) the model drafts only the rounds the trees lose, and a better model
    # is worth that share of the rounds: the trainer runs for cpu_share x the model's share of drafted tokens,
    # never less than this fraction of cpu_share (a model drafting little still learns, and may win rounds
    # back). Measured (bench.online, hybrid): at the full share the loop cost the hybrid 3-5 % of its tokens/s
    # against the trees alone, for no acceptance it could show.
    min_share_factor: float = 0.25
    # Drafted tokens a version is judged on, and the acceptance it may lose against its predecessor before it
    # is rolled back. A block's tokens are not independent draws: acceptance varies from prompt to prompt,
    # and over 30 s slices of bench.online's traffic (~5,000 drafted tokens) the same draft's acceptance has a
    # standard deviation of 0.022-0.024, about three times the binomial 0.5 / sqrt(n). The difference of two
    # 6,000-token windows then has a standard deviation of ~0.03, so a 0.05 margin rolls back an equal
    # version about 5% of the time (at 1,500 tokens and 0.03 it was ~30%: 2-5 of 12-15 versions, each one
    # discarding its steps), and still catches a draft that got clearly worse.
    rollback_window: int = 6000
    rollback_margin: float = 0.05
    dir: Path | None = None  # where every version is saved (None: kept in memory only)
    rehearsal: Path | None = None  # a RehearsalSet file (None: every batch is live traffic)
    rehearsal_share: float = 0.25  # of each batch's windows, the share drawn from the rehearsal set

    def __post_init__(self):
        for name in ("topk", "window", "buffer_windows", "batch_size", "steps_per_version", "rollback_window"):
            if getattr(self, name) < 1:
                raise ValueError(f"online distillation: {name} must be >= 1")
        if not 1 <= self.topk <= 20:
            raise ValueError("online distillation: topk must be in [1, 20] (the verifier's logprobs limit)")
        if not 0 < self.cpu_share <= 1:
            raise ValueError("online distillation: cpu_share must be in (0, 1]")
        if not 0 < self.min_share_factor <= 1:
            raise ValueError("online distillation: min_share_factor must be in (0, 1]")
        if not 0 <= self.kl_weight <= 1:
            raise ValueError("online distillation: kl_weight must be in [0, 1]")
        if not 0 <= self.rehearsal_share < 1:
            raise ValueError("online distillation: rehearsal_share must be in [0, 1)")


@dataclass
class Window:
    """One training example: tokens [T + 1] and, at each input position whose next token the verifier
    committed, the target's top-k there (mask False elsewhere: prompt positions, padding)."""

    tokens: torch.Tensor  # [T + 1] int64
    top_ids: torch.Tensor  # [T, k] int64
    top_logprobs: torch.Tensor  # [T, k] float32 (log-softmax of the target's raw logits, not renormalised)
    mask: torch.Tensor  # [T] bool


class ReplayBuffer:
    """The most recent windows of live traffic, thread-safe (the event loop adds, the trainer samples)."""

    def __init__(self, capacity: int, seed: int = 0):
        self._items: deque[Window] = deque(maxlen=capacity)
        self._lock = threading.Lock()
        self._rng = torch.Generator().manual_seed(seed)
        self.added = 0

    def __len__(self) -> int:
        return len(self._items)

    def add(self, window: Window) -> None:
        with self._lock:
            self._items.append(window)
            self.added += 1

    def sample(self, n: int) -> list[Window]:
        with self._lock:
            idx = torch.randint(len(self._items), (n,), generator=self._rng).tolist()
            return [self._items[i] for i in idx]


class RehearsalSet:
    """Windows of the draft's original domain with the target's top-k at every position: made offline
    (`python -m specmesh.training.rehearsal`), saved as `FILE` beside the draft, sampled by the trainer."""

    FILE = "rehearsal.safetensors"

    def __init__(self, tokens: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor, seed: int = 0):
        n, t1 = tokens.shape
        if t1 < 2 or n < 1 or top_ids.shape[:2] != (n, t1 - 1) or top_logprobs.shape != top_ids.shape:
            raise ValueError(
                f"rehearsal set: tokens {tuple(tokens.shape)}, top_ids {tuple(top_ids.shape)} and top_logprobs "
                f"{tuple(top_logprobs.shape)} do not describe [N, T + 1], [N, T, k] and [N, T, k]"
            )
        self.tokens, self.top_ids, self.top_logprobs = tokens.long(), top_ids.long(), top_logprobs.float()
        self._rng = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.tokens.size(0)

    @property
    def max_id(self) -> int:
        return int(max(self.tokens.max(), self.top_ids.max()))

    @classmethod
    def load(cls, path: Path | str) -> RehearsalSet:
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            t = load_file(str(path))
        except (OSError, SafetensorError) as e:
            raise ValueError(f"rehearsal set {path}: {e}") from None
        missing = {"tokens", "top_ids", "top_logprobs"} - t.keys()
        if missing:
            raise ValueError(f"rehearsal set {path}: no {', '.join(sorted(missing))} tensor")
        return cls(t["tokens"], t["top_ids"], t["top_logprobs"])

    def save(self, path: Path | str, metadata: dict[str, str] | None = None) -> None:
        from safetensors.torch import save_file

        tensors = {
            "tokens": self.tokens.int(),
            "top_ids": self.top_ids.int(),
            "top_logprobs": self.top_logprobs.half(),  # fp16: ample for a KD target, half the bytes
        }
        save_file(tensors, str(path), metadata=metadata)

    def sample(self, n: int, topk: int) -> list[Window]:
        """n windows, their top-k cut or padded (ids 0, log-prob -1e4) to `topk` like live windows."""
        idx = torch.randint(len(self), (n,), generator=self._rng).tolist()
        k = self.top_ids.size(2)
        out = []
        for i in idx:
            ids, lps = self.top_ids[i, :, :topk], self.top_logprobs[i, :, :topk]
            if k < topk:
                ids = torch.cat((ids, ids.new_zeros((ids.size(0), topk - k))), 1)
                lps = torch.cat((lps, lps.new_full((lps.size(0), topk - k), -1e4)), 1)
            out.append(Window(self.tokens[i], ids, lps, torch.ones(ids.size(0), dtype=torch.bool)))
        return out


class SessionFeedback:
    """One session's committed tokens and the target's top-k at each, turned into windows as they fill."""

    def __init__(self, prompt_ids: Sequence[int], config: OnlineConfig, sink: Callable[[Window], None]):
        self.config, self.sink = config, sink
        self.ids: list[int] = list(prompt_ids)
        self.first = len(self.ids)  # index of the first committed token
        self.top: dict[int, tuple[list[int], list[float]]] = {}  # token index -> the target's top-k there
        self.emitted = len(self.ids)  # windows cover tokens up to here

    def extend(self, tokens: Sequence[int], logprobs: Sequence | None) -> None:
        """Tokens the verifier committed, with their TokenLogprob entries (None: no feedback for them)."""
        for i, t in enumerate(tokens):
            if logprobs is not None and i < len(logprobs) and logprobs[i].top:
                top = logprobs[i].top[: self.config.topk]
                self.top[len(self.ids)] = ([tid for tid, _ in top], [lp for _, lp in top])
            self.ids.append(int(t))
        if len(self.ids) - self.emitted >= self.config.window:
            self.flush()

    def flush(self) -> None:
        """The last `window` + 1 tokens as a window, if any of them has feedback not yet in a window."""
        n = len(self.ids)
        if n < 2 or not any(j >= self.emitted for j in self.top):
            return
        t = min(self.config.window, n - 1)
        start = n - 1 - t
        k = self.config.topk
        tokens = torch.tensor(self.ids[start:], dtype=torch.long)
        top_ids = torch.zeros((t, k), dtype=torch.long)
        top_lp = torch.full((t, k), -1e4, dtype=torch.float32)
        mask = torch.zeros(t, dtype=torch.bool)
        for p in range(t):
            entry = self.top.get(start + p + 1)  # input position p predicts token start + p + 1
            if entry is None:
                continue
            ids, lps = entry
            top_ids[p, : len(ids)] = torch.tensor(ids)
            top_lp[p, : len(lps)] = torch.tensor(lps)
            mask[p] = True
        self.top = {j: v for j, v in self.top.items() if j > start}
        self.emitted = n
        self.sink(Window(tokens, top_ids, top_lp, mask))


def collate(windows: list[Window]) -> tuple[torch.Tensor, TeacherTargets, torch.Tensor]:
    """Right-padded batch [B, T + 1], teacher targets [B, T, k] and mask [B, T] (padding masked out)."""
    t = max(w.mask.numel() for w in windows)
    k = windows[0].top_ids.size(1)
    batch = torch.zeros((len(windows), t + 1), dtype=torch.long)
    ids = torch.zeros((len(windows), t, k), dtype=torch.long)
    lps = torch.full((len(windows), t, k), -1e4, dtype=torch.float32)
    mask = torch.zeros((len(windows), t), dtype=torch.bool)
    for b, w in enumerate(windows):
        n = w.mask.numel()
        batch[b, : n + 1] = w.tokens
        ids[b, :n], lps[b, :n], mask[b, :n] = w.top_ids, w.top_logprobs, w.mask
    return batch, TeacherTargets(ids, lps), mask


@dataclass
class Version:
    number: int
    parent: int | None
    state: dict[str, torch.Tensor] = field(repr=False)
    drafted: int = 0  # live draft tokens verified while this version served
    accepted: int = 0
    recent: deque = field(default_factory=deque, repr=False)  # (drafted, accepted) of its latest rounds
    rolled_back: bool = False
    created: float = field(default_factory=time.time)

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def _window_rate(rounds: Sequence[tuple[int, int]], limit: int, first: bool) -> tuple[float | None, int]:
    """Acceptance over the first (or last) `limit` drafted tokens of `rounds`, and how many that was."""
    drafted = accepted = 0
    for d, a in rounds if first else reversed(rounds):
        if drafted >= limit:
            break
        drafted, accepted = drafted + d, accepted + a
    return (accepted / drafted if drafted else None), drafted


# The trainer thread's nice value: the lowest priority. Its duty bounds how much of a core it takes; at the
# lowest priority that share comes out of time the serving threads leave idle, not out of their forwards
# (on 2 cores, the verify forward's two threads, the draft's and the gateway's all want the CPU at once).
TRAINER_NICE = 19


def lowest_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: a thread's nice value is its own; raising it
    needs no privilege). Elsewhere, or if the OS refuses, the thread keeps its priority."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), TRAINER_NICE)
    except (AttributeError, OSError) as e:  # no setpriority (Windows), or refused
        log.debug("online distillation: the trainer keeps its priority (%s)", e)


class OnlineDistiller:
    """Trains a copy of the serving draft on the replay buffer, publishes versions, rolls bad ones back.

    `apply(fn)` runs fn() on the draft's model thread and returns a Future (the swap must not race a
    forward). `on_swap(version, reason)` is told of every swap (metrics, traces)."""

    def __init__(
        self,
        serving_model: torch.nn.Module,
        config: OnlineConfig,
        apply: Callable[[Callable[[], None]], Future],
        on_swap: Callable[[int, str], None] | None = None,
    ):
        self.config = config
        self.serving = serving_model
        self.apply = apply
        self.on_swap = on_swap
        self.buffer = ReplayBuffer(config.buffer_windows)
        self.rehearsal = RehearsalSet.load(config.rehearsal) if config.rehearsal is not None else None
        if self.rehearsal is not None:
            vocab = cast(Any, serving_model).get_output_embeddings().weight.size(0)  # a PreTrainedModel
            if self.rehearsal.max_id >= vocab:
                raise ValueError(
                    f"rehearsal set {config.rehearsal}: token id {self.rehearsal.max_id} is outside the draft's "
                    f"vocabulary of {vocab}"
                )
        self.student = copy.deepcopy(serving_model).float().train()
        for p in self.student.parameters():
            p.requires_grad_(True)
        self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=config.lr, weight_decay=0.0)
        self.versions: dict[int, Version] = {0: Version(0, None, self._snapshot(serving_model))}
        self.serving_version = 0
        self.steps = 0
        self.updates = 0  # versions published
        self.rollbacks = 0
        self.train_seconds = 0.0
        self.started = time.monotonic()
        # Draft tokens verified, the model's and everyone's (the suffix trees' too), decayed over the last
        # ~1,000 blocks: the model's share of the drafting the trainer's duty follows.
        self._drafted_by_model = 0.0
        self._drafted_by_all = 0.0
        self.last_loss: float | None = None
        # Two locks, so that the event loop (record_round) never waits for a training step: `_lock` guards
        # the versions' statistics, `_train_lock` the student and its optimizer.
        self._lock = threading.Lock()
        self._train_lock = threading.Lock()
        self._reset_to: Version | None = None  # a rollback's weights, for the trainer to restart from
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._save(self.versions[0])

    # serving side ---------------------------------------------------------------------------------
    def session(self, prompt_ids: Sequence[int]) -> SessionFeedback:
        return SessionFeedback(prompt_ids, self.config, self.buffer.add)

    def record_round(self, version: int, drafted: int, accepted: int) -> None:
        """A verified block drafted by `version`: its live acceptance, and a rollback if it is worse."""
        if drafted <= 0:
            return
        with self._lock:
            v = self.versions.get(version)
            if v is None:
                return
            v.drafted += drafted
            v.accepted += accepted
            v.recent.append((drafted, accepted))
            while len(v.recent) > 4 * self.config.rollback_window:
                v.recent.popleft()
            verdict = self._judge(v)
        if verdict is not None:
            self._rollback(v, verdict)

    def record_draft(self, by_model: bool, drafted: int) -> None:
        """A verified block of `drafted` tokens, drafted by the model or not (the suffix trees)."""
        if drafted <= 0:
            return
        decay = 0.999
        self._drafted_by_all = self._drafted_by_all * decay + drafted
        self._drafted_by_model = self._drafted_by_model * decay + (drafted if by_model else 0)

    @property
    def model_share(self) -> float:
        """The model's share of the drafted tokens lately (1.0 before any block: a model drafting alone)."""
        return self._drafted_by_model / self._drafted_by_all if self._drafted_by_all > 0 else 1.0

    @property
    def duty(self) -> float:
        """The trainer's share of one core's wall time now: cpu_share, scaled by the model's share of drafting."""
        c = self.config
        return c.cpu_share * max(c.min_share_factor, self.model_share)

    def _judge(self, v: Version) -> str | None:
        if v.rolled_back or v.parent is None or v.number != self.serving_version:
            return None
        parent = self.versions[v.parent]
        limit = self.config.rollback_window
        mine, n = _window_rate(v.recent, limit, first=True)
        theirs, m = _window_rate(parent.recent, limit, first=False)
        if mine is None or theirs is None or n < limit or m < limit:
            return None
        if mine < theirs - self.config.rollback_margin:
            return f"acceptance {mine:.3f} over its first {n} drafted tokens < v{parent.number}'s {theirs:.3f}"
        return None

    def _rollback(self, v: Version, why: str) -> None:
        assert v.parent is not None  # judged versions have one
        parent = self.versions[v.parent]
        log.warning("online distillation: rolling back v%d to v%d: %s", v.number, parent.number, why)
        with self._lock:
            v.rolled_back = True
            self.rollbacks += 1
            self._reset_to = parent  # the trainer restarts from it before its next step
        self._swap(parent, "rollback")

    # the trainer ----------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="online-distill", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def train_share(self) -> float:
        """The trainer's share of wall time since it started."""
        return self.train_seconds / max(1e-9, time.monotonic() - self.started)

    def _run(self) -> None:
        torch.set_num_threads(1)  # one core at most, and only `duty` of it
        lowest_priority()
        while not self._stop.is_set():
            if len(self.buffer) < max(self.config.min_windows, 1):
                self._stop.wait(0.5)
                continue
            t0 = time.monotonic()
            try:
                self.step()
            except Exception:  # a failed step must never take serving down (logged, then retried)
                log.exception("online distillation step failed")
                self._stop.wait(5.0)
                continue
            dt = time.monotonic() - t0
            self.train_seconds += dt
            duty = self.duty
            self._stop.wait(dt * (1 - duty) / duty)

    def step(self) -> float:
        """One KD step on a batch from the buffer; every `steps_per_version`, a new version goes live."""
        b = self.config.batch_size
        # at least one live window per batch: the traffic is what the loop is for
        old = min(b - 1, round(b * self.config.rehearsal_share)) if self.rehearsal is not None else 0
        windows = self.buffer.sample(b - old)
        if old:
            assert self.rehearsal is not None
            windows += self.rehearsal.sample(old, self.config.topk)
        batch, teacher, mask = collate(windows)
        with self._train_lock:
            with self._lock:
                reset, self._reset_to = self._reset_to, None
            if reset is not None:
                self._save(self.versions[max(self.versions)])  # the rolled-back version's record
                self._load(self.student, reset.state)
                self.optimizer = torch.optim.AdamW(self.student.parameters(), lr=self.config.lr, weight_decay=0.0)
            self.student.train()
            out = distill_loss(self.student, batch, teacher, self.config.kl_weight, mask=mask)
            self.optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
            self.optimizer.step()
            self.steps += 1
            self.last_loss = float(out.loss.detach())
            publish = self.steps % self.config.steps_per_version == 0
            if publish:
                # The copy outside the lock the serving side takes each round: this thread runs at the
                # lowest priority and may be preempted mid-copy.
                weights = self._snapshot(self.student)
                with self._lock:
                    number = max(self.versions) + 1
                    v = Version(number, self.serving_version, weights)
                    self.versions[number] = v
                    self.updates += 1
        if publish:
            self._save(v)
            self._swap(v, "update").result()
        return self.last_loss

    # weights --------------------------------------------------------------------------------------
    @staticmethod
    def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {k: t.detach().clone() for k, t in model.state_dict().items()}

    @staticmethod
    @torch.no_grad()
    def _load(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        # In place: every holder of these tensors sees the new values (the fast runners notice the version
        # bump and refresh their fused copies before their next forward).
        for k, t in model.state_dict().items():
            t.copy_(state[k].to(t.dtype))

    def _swap(self, v: Version, reason: str) -> Future:
        """Put `v` into the serving model on the model thread, between two runs of forwards (not waited
        for: the event loop calls this on a rollback)."""

        def swap() -> None:
            self._load(self.serving, v.state)
            self.serving_version = v.number
            log.info("online distillation: draft weights v%d live (%s)", v.number, reason)
            if self.on_swap is not None:
                self.on_swap(v.number, reason)

        return self.apply(swap)

    def _save(self, v: Version) -> None:
        if self.config.dir is None:
            return
        d = Path(self.config.dir) / f"v{v.number}"
        d.mkdir(parents=True, exist_ok=True)
        weights = d / "weights.pt"
        if not weights.exists():
            torch.save(v.state, weights)
        meta = {
            "version": v.number,
            "parent": v.parent,
            "created": v.created,
            "drafted": v.drafted,
            "accepted": v.accepted,
            "acceptance": v.acceptance,
            "rolled_back": v.rolled_back,
        }
        (d / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")

    def save_all(self) -> None:
        """Rewrite every version's meta.json with its live acceptance so far."""
        for v in list(self.versions.values()):
            self._save(v)

    def acceptance_by_version(self) -> dict[int, tuple[int, int]]:
        with self._lock:
            return {n: (v.drafted, v.accepted) for n, v in self.versions.items()}
