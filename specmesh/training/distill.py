"""Distil a small draft model from a target model, for speculative decoding.

    python -m specmesh.training.distill --target models/demo/target --stdlib --out models/demo/draft

What decides how many draft tokens the target accepts is how close the draft's next-token distribution
q is to the target's p, so the draft learns p itself, not only the corpus:

    loss = kl_weight * KL(p || q) + (1 - kl_weight) * CE(corpus next token, q)

p is the target's distribution at --teacher-temperature truncated to its top-k ids and renormalised; q is
the draft's full-vocabulary distribution read at those ids. --kl-weight 0 is plain data-only training,
the baseline to compare against.

The teacher runs once per batch (online), or, with --cache-dir, once ahead of training into a cache on
disk (offline) that any later draft run with the same corpus / seq-len / batch size / seed / teacher
reuses without running the target; a cache built with other settings is refused. Both paths round the
teacher's log-probs to float16, so they train on identical numbers.

At the end (or alone with --eval-only) the draft is measured on held-out text and the result written to
--out/eval.json: greedy agreement alpha with the target (teacher-forced), the expected accepted length
(1 - alpha^(K+1)) / (1 - alpha) for K = 1..8, the held-out KL to the target, and the mean accepted
length measured with the in-process speculative engine at K = 4 (greedy, 64-token held-out prompts,
64 new tokens each). Any Hugging Face causal-LM pair that shares a tokenizer works.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

from specmesh.training.corpus import TokenWindows, encode_texts, load_texts, read_text, stdlib_files
from specmesh.training.train_target import llama_config
from specmesh.training.trainer import TrainConfig, train

# float16 halves the cache on disk, and its ~5e-4 relative error on a log-prob is far below what
# distillation can resolve; the online path rounds the same way so both train on identical numbers.
LOGPROB_DTYPE = torch.float16
# float16 overflows to -inf below -65504 and 0 * -inf is NaN in the loss; exp(-60) ~ 1e-26 is zero anyway.
LOGPROB_FLOOR = -60.0
CACHE_FORMAT = 1
HELDOUT_DIVISOR = 50  # without --heldout, the last ~2% of the texts are held out (as corpus.HELDOUT_MODULUS)
PROMPT_LEN = 64  # measured acceptance: prompt = a 64-token slice of held-out text,
NEW_TOKENS = 64  # 64 new tokens, greedy,
MEASURE_K = 4  # at K = 4
EXPECTED_KS = range(1, 9)


@dataclass(frozen=True)
class TeacherTargets:
    """The target's truncated next-token distribution p at every position of a batch."""

    ids: torch.Tensor  # [B, T, k] int32: the target's top-k token ids, most probable first
    logprobs: torch.Tensor  # [B, T, k] float16: their log p at the teacher temperature, renormalised over the k


Teacher = Callable[[int, torch.Tensor], TeacherTargets]  # (step, inputs [B, T]) -> targets


@dataclass(frozen=True)
class DistillLoss:
    loss: torch.Tensor  # scalar: kl_weight * kl + (1 - kl_weight) * ce, what is minimised
    kl: torch.Tensor  # scalar: truncated KL(p || q) in nats per position (0 when no teacher was asked)
    ce: torch.Tensor  # scalar: cross-entropy of the corpus' next token under q, nats per position


def _autocast(device: torch.device | str, enabled: bool):
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=enabled)


def vocab_width(model) -> int:
    """Width of the model's logits, which may exceed len(tokenizer) (vocabularies padded for speed)."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.get_text_config().vocab_size)


@torch.no_grad()  # no_grad rather than inference_mode: the results later enter the draft's autograd graph
def teacher_targets(
    target, inputs: torch.Tensor, topk: int, temperature: float, autocast: bool = False
) -> TeacherTargets:
    """The target's top-k log-probs at every position of `inputs` [B, T] (on the target's device)."""
    with _autocast(inputs.device, autocast):
        logits = target(input_ids=inputs, use_cache=False).logits
    top = torch.log_softmax(logits.float() / temperature, dim=-1).topk(topk, dim=-1)
    logprobs = top.values - torch.logsumexp(top.values, dim=-1, keepdim=True)
    return TeacherTargets(top.indices.to(torch.int32), logprobs.clamp_min(LOGPROB_FLOOR).to(LOGPROB_DTYPE))


def online_teacher(target, topk: int, temperature: float, autocast: bool = False) -> Teacher:
    return lambda step, inputs: teacher_targets(target, inputs, topk, temperature, autocast)


def distill_loss(
    draft,
    batch: torch.Tensor,
    teacher: TeacherTargets | None,
    kl_weight: float,
    autocast: bool = False,
    mask: torch.Tensor | None = None,
    labels: torch.Tensor | None = None,
) -> DistillLoss:
    """Loss of the draft on `batch` [B, T + 1] (inputs [:, :-1], corpus labels [:, 1:]); `mask` [B, T]: the
    positions that count (online distillation has the target's feedback only where tokens were committed);
    `labels` [B, T]: the cross-entropy's targets instead of the corpus's next tokens."""
    inputs = batch[:, :-1]
    labels = batch[:, 1:] if labels is None else labels
    with _autocast(batch.device, autocast):
        logits = draft(input_ids=inputs, use_cache=False).logits
    logq = torch.log_softmax(logits.float(), dim=-1)  # full vocabulary: mass outside the top-k is penalised too
    weights = None if mask is None else mask.to(logq.device, torch.float32) / mask.sum().clamp_min(1)
    nll = F.nll_loss(logq.reshape(-1, logq.size(-1)), labels.reshape(-1), reduction="none").view_as(labels)
    ce = nll.mean() if weights is None else (nll * weights).sum()
    if teacher is None:
        if kl_weight:
            raise ValueError("kl_weight > 0 needs the teacher's targets")
        return DistillLoss(ce, torch.zeros((), device=ce.device), ce)
    logp = teacher.logprobs.to(logq.device, torch.float32)
    logp = logp - torch.logsumexp(logp, dim=-1, keepdim=True)  # exactly normalised again after float16 rounding
    logq_at_p = logq.gather(-1, teacher.ids.to(logq.device).long())
    kl_pos = (logp.exp() * (logp - logq_at_p)).sum(-1)
    kl = kl_pos.mean() if weights is None else (kl_pos * weights).sum()
    return DistillLoss(kl_weight * kl + (1 - kl_weight) * ce, kl, ce)


def model_fingerprint(model) -> str:
    """A cheap identity for a loaded model: its config, and a strided sample of every tensor.

    Hashing every weight of a large target on each run would cost more than the check is worth; a
    retrained or differently loaded (dtype) model changes the sampled values all the same.
    """
    h = hashlib.sha256()
    config = model.config.to_dict()
    for volatile in ("_name_or_path", "transformers_version"):
        config.pop(volatile, None)
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)][:4096].float().cpu()
        h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


def stream_fingerprint(stream: torch.Tensor) -> str:
    return hashlib.sha256(stream.contiguous().numpy().tobytes()).hexdigest()


class CacheMismatch(ValueError):
    """A teacher cache built with other settings than the run's."""


class TeacherCache:
    """The target's top-k log-probs for the batches of a run: one file per step under `root`.

    `meta.json` records everything the numbers depend on; opening a cache with different settings is an
    error rather than a silent mix of two teachers. Each step's file is written atomically, so an
    interrupted build resumes where it stopped, and a longer run only computes its extra steps.
    """

    def __init__(self, root: Path, meta: dict):
        self.root = Path(root)
        self.meta = {"format": CACHE_FORMAT, "logprob_dtype": str(LOGPROB_DTYPE).removeprefix("torch."), **meta}
        self.meta = json.loads(json.dumps(self.meta))  # compare as JSON sees it (tuples become lists, ...)
        self.root.mkdir(parents=True, exist_ok=True)
        meta_path = self.root / "meta.json"
        if meta_path.exists():
            old = json.loads(meta_path.read_text())
            diff = {
                k: (old.get(k), self.meta.get(k))
                for k in sorted(old.keys() | self.meta.keys())
                if old.get(k) != self.meta.get(k)
            }
            if diff:
                lines = "\n".join(f"  {k}: cache has {a!r}, this run has {b!r}" for k, (a, b) in diff.items())
                raise CacheMismatch(
                    f"teacher cache {self.root} was built with other settings:\n{lines}\n"
                    "use another --cache-dir, or delete this one to rebuild it"
                )
        else:
            _atomic_write_text(meta_path, json.dumps(self.meta, indent=2) + "\n")

    @staticmethod
    def settings(
        target, stream: torch.Tensor, windows: TokenWindows, topk: int, temperature: float, autocast: bool
    ) -> dict:
        """The settings a cache's numbers depend on (the number of steps is not one: steps are files)."""
        return {
            "target": model_fingerprint(target),
            "target_dtype": str(next(target.parameters()).dtype).removeprefix("torch."),
            "vocab": vocab_width(target),
            "corpus_sha256": stream_fingerprint(stream),
            "corpus_tokens": int(stream.numel()),
            "seq_len": windows.seq_len,
            "batch_size": windows.batch_size,
            "seed": windows.seed,
            "topk": topk,
            "temperature": float(temperature),
            "autocast": bool(autocast),
        }

    def path(self, step: int) -> Path:
        return self.root / f"step_{step:07d}.pt"

    def missing(self, steps: int) -> list[int]:
        return [s for s in range(steps) if not self.path(s).exists()]

    def build(self, teacher: Teacher, windows: TokenWindows, steps: int, device: torch.device | str) -> int:
        """Compute and store the teacher's targets for steps [0, steps) not yet cached; returns how many."""
        todo = self.missing(steps)
        if todo:
            k = self.meta["topk"]
            size = len(todo) * windows.batch_size * windows.seq_len * k * (4 + LOGPROB_DTYPE.itemsize)
            print(
                f"teacher cache {self.root}: computing {len(todo)} of {steps} steps ({size / 2**30:.2f} GiB)",
                flush=True,
            )
        for step in tqdm(todo, desc="teacher cache", dynamic_ncols=True, mininterval=2.0, disable=not todo):
            targets = teacher(step, windows.batch(step)[:, :-1].to(device))
            tmp = self.path(step).with_suffix(".tmp")
            torch.save({"ids": targets.ids.cpu(), "logprobs": targets.logprobs.cpu()}, tmp)
            os.replace(tmp, self.path(step))  # atomic: an interrupted build never leaves a torn step
        return len(todo)

    def load(self, step: int) -> TeacherTargets:
        path = self.path(step)
        if not path.exists():
            raise FileNotFoundError(f"teacher cache {self.root} has no step {step}: build it first")
        state = torch.load(path, map_location="cpu", weights_only=True)
        shape = (self.meta["batch_size"], self.meta["seq_len"], self.meta["topk"])
        if tuple(state["ids"].shape) != shape or tuple(state["logprobs"].shape) != shape:
            raise CacheMismatch(f"{path} holds {tuple(state['ids'].shape)}, expected {shape}")
        return TeacherTargets(state["ids"], state["logprobs"])

    def teacher(self) -> Teacher:
        return lambda step, inputs: self.load(step)


def distill(
    draft,
    windows: TokenWindows,
    teacher: Teacher | None,
    cfg: TrainConfig,
    kl_weight: float,
    autocast: bool = False,
    resume: bool = False,
    stop_after: int | None = None,
    on_checkpoint: Callable[[int], None] | None = None,
) -> list[float]:
    """Train `draft` (in place, on its device) for `cfg.steps`; returns the loss of each step run."""
    if kl_weight > 0 and teacher is None:
        raise ValueError("kl_weight > 0 needs a teacher")
    device = next(draft.parameters()).device

    def loss_fn(step: int):
        batch = windows.batch(step).to(device)
        # kl_weight > 0 implies a teacher (checked above); the test is repeated for the type checker.
        targets = teacher(step, batch[:, :-1]) if kl_weight > 0 and teacher is not None else None
        return distill_loss(draft, batch, targets, kl_weight, autocast).loss, batch[:, 1:].numel()

    return train(draft, loss_fn, cfg, resume=resume, stop_after=stop_after, on_checkpoint=on_checkpoint)


def new_draft(target, tokenizer, layers: int, hidden: int, intermediate: int, heads: int) -> LlamaForCausalLM:
    """A fresh Llama draft whose vocabulary (ids and logit width) is the target's."""
    text_config = target.config.get_text_config()
    cfg = llama_config(
        tokenizer, layers, hidden, intermediate, heads, getattr(text_config, "max_position_embeddings", None) or 2048
    )
    cfg.vocab_size = vocab_width(target)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(text_config, name, None) is not None:
            setattr(cfg, name, getattr(text_config, name))
    return LlamaForCausalLM(cfg)


def check_pair(target, draft, tokenizer) -> None:
    """A draft must score the same token ids as the target, else acceptance is meaningless."""
    t, d = vocab_width(target), vocab_width(draft)
    if t != d:
        raise ValueError(
            f"the draft's vocabulary ({d} logits) differs from the target's ({t}): "
            "a draft must share the target's tokenizer"
        )
    if len(tokenizer) > t:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens but the target only {t} logits")


def expected_accepted_length(alpha: float, k: int) -> float:
    """E[tokens per round] = (1 - alpha^(K+1)) / (1 - alpha), if each draft token is accepted w.p. alpha."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@torch.inference_mode()
def heldout_metrics(
    target, draft, windows: TokenWindows, max_batches: int | None = None, autocast: bool = False
) -> dict:
    """Teacher-forced comparison of draft and target on held-out windows (full vocabulary, temperature 1)."""
    was_training = draft.training
    draft.eval()
    device = next(draft.parameters()).device
    agree = kl = draft_ce = target_ce = 0.0
    n = 0
    for batch in windows.sequential(max_batches):
        batch = batch.to(device)
        inputs = batch[:, :-1]
        with _autocast(device, autocast):
            t_logits, d_logits = (m(input_ids=inputs, use_cache=False).logits for m in (target, draft))
        # one row at a time: [T, V] float32 copies
        for t_row, d_row, y in zip(t_logits, d_logits, batch[:, 1:], strict=True):
            logp, logq = torch.log_softmax(t_row.float(), -1), torch.log_softmax(d_row.float(), -1)
            agree += (logp.argmax(-1) == logq.argmax(-1)).sum().item()
            kl += (logp.exp() * (logp - logq)).sum().item()
            draft_ce += F.nll_loss(logq, y, reduction="sum").item()
            target_ce += F.nll_loss(logp, y, reduction="sum").item()
            n += y.numel()
    draft.train(was_training)
    if n == 0:
        raise ValueError(f"held-out text is too short for one window of {windows.seq_len + 1} tokens")
    return {
        "greedy_agreement": agree / n,
        "kl_to_target": kl / n,
        "draft_ce": draft_ce / n,
        "target_ce": target_ce / n,
        "positions": n,
    }


def heldout_prompts(stream: torch.Tensor, n: int, length: int = PROMPT_LEN) -> list[list[int]]:
    """`n` slices of `length` tokens, evenly spaced over the held-out stream."""
    if stream.numel() < length:
        raise ValueError(f"held-out text has {stream.numel()} tokens, fewer than one {length}-token prompt")
    span = stream.numel() - length
    return [stream[i * span // n : i * span // n + length].tolist() for i in range(n)]


def require_engine(target, draft) -> None:
    """Fail now, not after hours of training, if the engine (or what it imports) is missing."""
    try:
        from specmesh.engine import SpeculativeEngine

        SpeculativeEngine.from_models(target, draft)  # cheap: imports the rejection sampler, allocates nothing
    except ImportError as e:
        raise SystemExit(
            f"measuring acceptance needs the in-process engine (specmesh.engine): {e}; "
            "pass --no-measure to skip the measured part"
        ) from e


@torch.inference_mode()
def measure_acceptance(
    target, draft, prompts: list[list[int]], k: int = MEASURE_K, new_tokens: int = NEW_TOKENS
) -> dict:
    """Greedy speculative generation with the in-process engine; vLLM's metric definitions, over all prompts."""
    from specmesh.domain import SpecStats
    from specmesh.engine import SpeculativeEngine
    from specmesh.sampling import SamplingParams

    target.eval()
    draft.eval()
    engine = SpeculativeEngine.from_models(target, draft)
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    total = SpecStats()
    tokens = 0
    per_prompt = []
    t0 = time.perf_counter()
    for prompt in prompts:
        result = engine.generate(prompt, params, num_speculative_tokens=k)
        total.merge(result.stats)
        tokens += len(result.token_ids)
        per_prompt.append(result.stats.mean_accepted_length)
    return {
        "k": k,
        "prompts": len(prompts),
        "prompt_tokens": PROMPT_LEN,
        "new_tokens": new_tokens,
        "rounds": total.rounds,
        "drafts": total.drafts,
        "drafted": total.drafted,
        "accepted": total.accepted,
        "mean_accepted_length": total.mean_accepted_length,
        "acceptance_rate": total.acceptance_rate,
        "acceptance_per_pos": total.acceptance_per_pos[:k],
        "per_prompt_mean_accepted_length": per_prompt,
        "tokens_per_second": tokens / (time.perf_counter() - t0),
    }


def evaluate(
    target,
    draft,
    heldout: torch.Tensor,
    seq_len: int,
    batch_size: int,
    max_tokens: int = 0,
    n_prompts: int = 8,
    measure: bool = True,
    autocast: bool = False,
) -> dict:
    """Everything eval.json reports, on the held-out token stream."""
    windows = TokenWindows(heldout, seq_len, batch_size, seed=0)
    max_batches = math.ceil(max_tokens / (seq_len * batch_size)) if max_tokens else None
    report = heldout_metrics(target, draft, windows, max_batches, autocast)
    alpha = report["greedy_agreement"]
    report["expected_accepted_length"] = {str(k): expected_accepted_length(alpha, k) for k in EXPECTED_KS}
    if measure and n_prompts > 0:
        report["measured"] = measure_acceptance(target, draft, heldout_prompts(heldout, n_prompts))
        report["measured"]["expected_from_alpha"] = expected_accepted_length(alpha, MEASURE_K)
    return report


def split_heldout(texts: list[str]) -> tuple[list[str], list[str]]:
    """Deterministic split: the last ~2% of the texts, or of the one text's lines, are held out."""
    if not texts:
        raise ValueError("the corpus is empty")
    if len(texts) >= 2:
        n = max(1, len(texts) // HELDOUT_DIVISOR)
        return texts[:-n], texts[-n:]
    text = texts[0]
    cut = text.rfind("\n", 0, len(text) * (HELDOUT_DIVISOR - 1) // HELDOUT_DIVISOR) + 1 or len(text) * 49 // 50
    return [text[:cut]], [text[cut:]]


def token_streams(tokenizer, train_texts: list[str], heldout_texts: list[str], work_dir: Path) -> dict:
    """{"train", "heldout"} int32 token streams, cached in `work_dir` by a hash of tokenizer and texts."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no EOS token to separate texts with")
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update((backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)).encode())
    for name, texts in (("train", train_texts), ("heldout", heldout_texts)):
        h.update(f"{name}:{len(texts)}".encode())
        for t in texts:
            h.update(hashlib.sha256(t.encode()).digest())
    path = work_dir / f"tokens-{h.hexdigest()[:16]}.pt"
    if path.exists():
        return torch.load(path, weights_only=True)
    streams = {
        name: encode_texts(tokenizer, texts, tokenizer.eos_token_id)
        for name, texts in (("train", train_texts), ("heldout", heldout_texts))
    }
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.save(streams, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)
    return streams


def corpus_texts(stdlib: bool, corpus: list[str] | None, heldout: list[str] | None) -> tuple[list[str], list[str]]:
    if stdlib:
        train_files, heldout_files = stdlib_files()
        train_texts = [t for t in map(read_text, train_files) if t]
        default_heldout = [t for t in map(read_text, heldout_files) if t]
    else:
        if corpus is None:
            raise ValueError("corpus_texts needs corpus specs unless stdlib is set")
        train_texts, default_heldout = split_heldout(load_texts(corpus)) if not heldout else (load_texts(corpus), [])
    return train_texts, (load_texts(heldout) if heldout else default_heldout)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))


# Settings that must not change between an interrupted run and its --resume.
_RUN_KEYS = (
    "target",
    "draft",
    "draft_layers",
    "draft_hidden",
    "draft_intermediate",
    "draft_heads",
    "corpus",
    "stdlib",
    "heldout",
    "teacher_topk",
    "teacher_temperature",
    "kl_weight",
    "steps",
    "lr",
    "batch_size",
    "seq_len",
    "warmup",
    "seed",
    "autocast",
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m specmesh.training.distill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = ap.add_argument_group("models")
    g.add_argument(
        "--target",
        type=Path,
        required=True,
        metavar="DIR",
        help="local Hugging Face causal-LM checkpoint (the teacher)",
    )
    g.add_argument(
        "--draft",
        type=Path,
        metavar="DIR",
        help="existing draft checkpoint to continue from (or to evaluate, with --eval-only); "
        "default: a new Llama draft over the target's vocabulary",
    )
    g.add_argument("--draft-layers", type=int, default=2, help="new draft: decoder layers (default 2)")
    g.add_argument("--draft-hidden", type=int, default=256, help="new draft: hidden size (default 256)")
    g.add_argument("--draft-intermediate", type=int, default=512, help="new draft: MLP size (default 512)")
    g.add_argument("--draft-heads", type=int, default=4, help="new draft: attention heads (default 4)")

    g = ap.add_argument_group("data")
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--corpus",
        nargs="+",
        metavar="SPEC",
        help='training text: files, globs, or .jsonl files with a "text" field per line',
    )
    src.add_argument(
        "--stdlib",
        action="store_true",
        help="train on the Python standard library's train split, evaluate on its held-out split",
    )
    g.add_argument(
        "--heldout",
        nargs="+",
        metavar="SPEC",
        help="held-out text (same forms as --corpus); default: the --stdlib held-out split, or "
        "the last ~2%% of the --corpus texts",
    )

    g = ap.add_argument_group("distillation")
    g.add_argument(
        "--teacher-topk",
        type=int,
        default=64,
        help="keep the target's k most probable tokens per position, renormalised (default 64)",
    )
    g.add_argument(
        "--teacher-temperature",
        type=float,
        default=1.0,
        help="temperature of the target's distribution; the draft's is taken at 1 (default 1.0)",
    )
    g.add_argument(
        "--kl-weight",
        type=float,
        default=0.9,
        help="loss = w * KL(target || draft) + (1 - w) * corpus CE; 0 = data-only baseline (default 0.9)",
    )
    g.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help="offline teacher: compute the target's top-k log-probs for every step once, store them "
        "here (batch x seq-len x topk x 6 bytes per step) and reuse them in later runs with the "
        "same corpus, seq-len, batch size, seed and teacher; default: run the target per batch",
    )

    g = ap.add_argument_group("training")
    g.add_argument("--steps", type=int, default=2000, help="optimizer steps (default 2000)")
    g.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default 2e-3)")
    g.add_argument("--warmup", type=int, default=100, help="linear warm-up steps, then cosine decay (default 100)")
    g.add_argument("--batch-size", type=int, default=16, help="windows per step (default 16)")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per window (default 256)")
    g.add_argument("--seed", type=int, default=0, help="draft initialisation and batch order (default 0)")
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=200,
        help="checkpoint (and print a quick held-out alpha / KL) every N steps (default 200)",
    )
    g.add_argument(
        "--work-dir",
        type=Path,
        metavar="DIR",
        help="checkpoints, token cache, run settings (default: .work/distill/<name of --out>)",
    )
    g.add_argument("--resume", action="store_true", help="continue from --work-dir/checkpoint.pt")
    g.add_argument(
        "--autocast",
        choices=["bf16", "none"],
        help="bf16 mixed precision for the forward passes (default: bf16 on CUDA, none on CPU)",
    )
    g.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")

    g = ap.add_argument_group("output and evaluation")
    g.add_argument(
        "--out",
        type=Path,
        default=Path("models/demo/draft"),
        metavar="DIR",
        help="where the draft (save_pretrained), the target's tokenizer and eval.json go (default models/demo/draft)",
    )
    g.add_argument(
        "--save-dtype",
        choices=["float16", "float32"],
        default="float16",
        help="dtype of the saved draft weights (default float16)",
    )
    g.add_argument(
        "--eval-only",
        action="store_true",
        help="no training: evaluate --draft (default: the draft in --out) and write --out/eval.json",
    )
    g.add_argument(
        "--eval-tokens",
        type=int,
        default=65536,
        help="held-out positions for alpha and KL, rounded up to whole batches; 0 = all (default 65536)",
    )
    g.add_argument(
        "--eval-prompts",
        type=int,
        default=8,
        help=f"held-out prompts for the measured acceptance at K={MEASURE_K} (default 8)",
    )
    g.add_argument(
        "--no-measure",
        action="store_true",
        help="skip the measured acceptance (which needs specmesh.engine); alpha-based numbers only",
    )
    return ap


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if not 0.0 <= args.kl_weight <= 1.0:
        raise SystemExit("--kl-weight must be in [0, 1]")
    if args.teacher_temperature <= 0:
        raise SystemExit("--teacher-temperature must be > 0")
    if args.teacher_topk < 1:
        raise SystemExit("--teacher-topk must be >= 1")
    measure = not args.no_measure
    if args.threads:
        torch.set_num_threads(args.threads)
    work_dir = args.work_dir or Path(".work/distill") / args.out.name
    work_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    autocast = (args.autocast or ("bf16" if device.type == "cuda" else "none")) == "bf16"

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    target_dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(args.target, dtype=target_dtype).to(device).eval()
    target.requires_grad_(False)

    draft_dir = args.draft or (args.out if args.eval_only else None)
    if draft_dir is not None:
        if not (draft_dir / "config.json").exists():
            raise SystemExit(f"no draft checkpoint in {draft_dir}")
        if _has_tokenizer(draft_dir) and AutoTokenizer.from_pretrained(draft_dir).get_vocab() != tokenizer.get_vocab():
            raise SystemExit(f"the draft in {draft_dir} has another tokenizer than the target in {args.target}")
        draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)  # fp32 master weights
    else:
        torch.manual_seed(args.seed)
        draft = new_draft(
            target, tokenizer, args.draft_layers, args.draft_hidden, args.draft_intermediate, args.draft_heads
        )
    try:
        check_pair(target, draft, tokenizer)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    if args.teacher_topk > vocab_width(target):
        raise SystemExit(f"--teacher-topk {args.teacher_topk} exceeds the vocabulary ({vocab_width(target)})")
    draft.to(device)
    if measure:
        require_engine(target, draft)
    print(
        f"target: {sum(p.numel() for p in target.parameters()) / 1e6:.1f}M parameters ({target_dtype}), "
        f"draft: {sum(p.numel() for p in draft.parameters()) / 1e6:.2f}M, vocab {vocab_width(target)}, "
        f"device {device}",
        flush=True,
    )

    train_texts, heldout_texts = corpus_texts(args.stdlib, args.corpus, args.heldout)
    streams = token_streams(tokenizer, [] if args.eval_only else train_texts, heldout_texts, work_dir)
    print(f"corpus: {streams['train'].numel():,} train / {streams['heldout'].numel():,} held-out tokens", flush=True)

    train_report = None
    if not args.eval_only:
        train_report = _train(args, work_dir, device, autocast, target, draft, tokenizer, streams)

    report = evaluate(
        target,
        draft,
        streams["heldout"],
        args.seq_len,
        args.batch_size,
        args.eval_tokens,
        args.eval_prompts,
        measure,
        autocast,
    )
    report["draft"] = str(draft_dir or args.out)
    report["target"] = str(args.target)
    args.out.mkdir(parents=True, exist_ok=True)
    _atomic_write_text(args.out / "eval.json", json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return {"eval": report, "train": train_report}


def _train(args, work_dir: Path, device, autocast: bool, target, draft, tokenizer, streams) -> dict:
    if streams["train"].numel() <= args.seq_len + 1:
        raise SystemExit(
            f"the training text has {streams['train'].numel()} tokens, too few for --seq-len {args.seq_len}"
        )
    settings = {
        k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
        for k, v in vars(args).items()
        if k in _RUN_KEYS
    }
    run_path = work_dir / "run.json"
    if args.resume and run_path.exists():
        old = json.loads(run_path.read_text())
        diff = [f"  {k}: {old.get(k)!r} -> {settings.get(k)!r}" for k in _RUN_KEYS if old.get(k) != settings.get(k)]
        if diff:
            raise SystemExit(f"--resume with other settings than the run in {work_dir}:\n" + "\n".join(diff))

    windows = TokenWindows(streams["train"], args.seq_len, args.batch_size, args.seed)
    heldout = TokenWindows(streams["heldout"], args.seq_len, args.batch_size, seed=0)
    teacher, mode = None, "none (data only)"
    if args.kl_weight > 0:
        teacher, mode = online_teacher(target, args.teacher_topk, args.teacher_temperature, autocast), "online"
        if args.cache_dir:
            try:
                cache = TeacherCache(
                    args.cache_dir,
                    TeacherCache.settings(
                        target, streams["train"], windows, args.teacher_topk, args.teacher_temperature, autocast
                    ),
                )
            except CacheMismatch as e:
                raise SystemExit(str(e)) from e
            cache.build(teacher, windows, args.steps, device)
            teacher, mode = cache.teacher(), f"offline ({args.cache_dir})"
    detail = f", top-{args.teacher_topk} at temperature {args.teacher_temperature}, kl weight {args.kl_weight}"
    print(f"teacher: {mode}{detail if teacher is not None else ''}", flush=True)

    def on_checkpoint(step: int):
        m = heldout_metrics(target, draft, heldout, max_batches=2, autocast=autocast)
        print(f"\nstep {step}: held-out alpha {m['greedy_agreement']:.4f}, KL {m['kl_to_target']:.4f}", flush=True)

    cfg = TrainConfig.from_args(args, work_dir, "draft")
    _atomic_write_text(run_path, json.dumps(settings, indent=2) + "\n")  # describes the checkpoint beside it
    t0 = time.time()
    losses = distill(
        draft, windows, teacher, cfg, args.kl_weight, autocast, resume=args.resume, on_checkpoint=on_checkpoint
    )
    args.out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(draft).to(getattr(torch, args.save_dtype)).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    report = {
        "teacher": mode,
        "steps": args.steps,
        "steps_this_run": len(losses),
        "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
        "train_tokens_seen": args.steps * args.batch_size * args.seq_len,
        "parameters": sum(p.numel() for p in draft.parameters()),
        "wall_seconds_this_run": round(time.time() - t0, 1),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    _atomic_write_text(args.out / "distill_report.json", json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
