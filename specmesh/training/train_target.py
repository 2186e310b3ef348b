"""Train the demo tokenizer and target model on the Python standard library's own sources.

    python -m specmesh.training.train_target --out models/demo/target --work-dir .work/target

Reproducible: fixed seed, files in sorted order, a held-out split decided by each file's path, batches a
pure function of (seed, step). Resumable with `--resume` (the checkpoint lives in --work-dir).
The tokenizer is a byte-level BPE, so any text (and any file of the standard library) round-trips.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specmesh.training.corpus import TokenWindows, encode_texts, read_text, stdlib_files
from specmesh.training.trainer import TrainConfig, train

EOS = "<|endoftext|>"


def train_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=EOS)


def llama_config(tokenizer, layers: int, hidden: int, intermediate: int, heads: int, max_pos: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), batch[:, 1:].reshape(-1))


@torch.inference_mode()
def heldout_loss(model, windows: TokenWindows, max_batches: int | None = None) -> float:
    model.eval()
    total, n = 0.0, 0
    device = next(model.parameters()).device
    for batch in windows.sequential(max_batches):
        batch = batch.to(device)
        total += lm_loss(model, batch).item() * batch.size(0)
        n += batch.size(0)
    return total / max(n, 1)


def prepare_corpus(work: Path, vocab_size: int, root: Path | None = None):
    """Tokenizer and token streams, built once and cached in `work`."""
    tok_dir, cache = work / "tokenizer", work / "tokens.pt"
    train_files, heldout_files = stdlib_files(root)
    if not tok_dir.exists():
        texts = [t for t in map(read_text, train_files) if t]
        train_tokenizer(texts, vocab_size).save_pretrained(tok_dir)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tok_dir)
    if not cache.exists():
        streams: dict[str, torch.Tensor | dict[str, int]] = {
            name: encode_texts(tokenizer, [t for t in map(read_text, files) if t], tokenizer.eos_token_id)
            for name, files in (("train", train_files), ("heldout", heldout_files))
        }
        streams["files"] = {"train": len(train_files), "heldout": len(heldout_files)}
        torch.save(streams, cache)
    streams = torch.load(cache, weights_only=True)
    return tokenizer, streams


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--out",
        type=Path,
        default=Path("models/demo/target"),
        help="where the fp16 model and tokenizer are saved (default models/demo/target)",
    )
    ap.add_argument(
        "--work-dir",
        type=Path,
        default=Path(".work/target"),
        help="tokenizer, token cache and checkpoints (default .work/target)",
    )
    ap.add_argument(
        "--stdlib-root",
        type=Path,
        default=None,
        help="corpus root (default: this interpreter's standard library; a sub-folder for quick trials)",
    )
    ap.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary size (default 8192)")
    ap.add_argument("--layers", type=int, default=10, help="decoder layers (default 10)")
    ap.add_argument("--hidden", type=int, default=512, help="hidden size (default 512)")
    ap.add_argument("--intermediate", type=int, default=1408, help="MLP size (default 1408)")
    ap.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    ap.add_argument("--max-position-embeddings", type=int, default=2048, help="longest context (default 2048)")
    ap.add_argument("--seq-len", type=int, default=256, help="tokens per training window (default 256)")
    ap.add_argument("--batch-size", type=int, default=16, help="windows per step (default 16)")
    ap.add_argument(
        "--steps", type=int, default=850, help="optimizer steps; the cosine schedule ends here (default 850)"
    )
    ap.add_argument("--lr", type=float, default=1.5e-3, help="peak learning rate (default 1.5e-3)")
    ap.add_argument("--warmup", type=int, default=50, help="linear warm-up steps (default 50)")
    ap.add_argument(
        "--checkpoint-every", type=int, default=50, help="steps between checkpoints and held-out checks (default 50)"
    )
    ap.add_argument("--seed", type=int, default=0, help="initialisation and batch order (default 0)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument(
        "--autocast",
        choices=["bf16", "none"],
        default="bf16",
        help="mixed precision for the forward pass (bf16 halves step time on CPUs with avx512_bf16/AMX)",
    )
    ap.add_argument("--resume", action="store_true", help="continue from --work-dir/checkpoint.pt")
    ap.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="checkpoint and exit at this step without exporting (continue later with --resume)",
    )
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    tokenizer, streams = prepare_corpus(args.work_dir, args.vocab_size, args.stdlib_root)
    print(
        f"corpus: {streams['files']} files, {streams['train'].numel():,} train / "
        f"{streams['heldout'].numel():,} held-out tokens, vocab {len(tokenizer)}",
        flush=True,
    )

    model = LlamaForCausalLM(
        llama_config(tokenizer, args.layers, args.hidden, args.intermediate, args.heads, args.max_position_embeddings)
    )
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    windows = TokenWindows(streams["train"], args.seq_len, args.batch_size, args.seed)
    heldout = TokenWindows(streams["heldout"], args.seq_len, args.batch_size, args.seed)

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        model.cuda()

    def loss_fn(step: int):
        batch = windows.batch(step).to(device_type)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.autocast == "bf16"):
            return lm_loss(model, batch), batch[:, 1:].numel()

    def on_checkpoint(step: int):
        loss = heldout_loss(model, heldout, max_batches=4)
        model.train()
        print(f"\nstep {step}: held-out loss (4 batches) {loss:.4f}", flush=True)

    cfg = TrainConfig.from_args(args, args.work_dir, "target")
    t0 = time.time()
    losses = train(model, loss_fn, cfg, resume=args.resume, stop_after=args.stop_after, on_checkpoint=on_checkpoint)
    if args.stop_after is not None and args.stop_after < args.steps:
        print(f"stopped at step {args.stop_after}; continue with --resume", flush=True)
        return
    report = {
        "heldout_loss": heldout_loss(model, heldout),
        "heldout_tokens": int(streams["heldout"].numel()),
        "train_tokens_seen": args.steps * args.batch_size * args.seq_len,
        "steps": args.steps,
        "steps_this_run": len(losses),
        "parameters": sum(p.numel() for p in model.parameters()),
        "wall_seconds_this_run": round(time.time() - t0, 1),
        "args": {k: str(v) for k, v in vars(args).items()},
    }
    print(json.dumps(report, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    model.cpu().to(torch.float16).save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    (args.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
