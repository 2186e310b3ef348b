"""Text corpora for training: the Python standard library's own sources, or user files.

The demo models are trained on the `.py` files of the running interpreter's standard library: a
corpus present on every machine. Files are listed in a fixed (sorted) order and the held-out split is
a pure function of each file's relative path, so every machine builds the same split.
"""

from __future__ import annotations

import glob
import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

# Directories whose files are tests or vendored code rather than library code.
_EXCLUDED_PARTS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
HELDOUT_MODULUS = 50  # ~2% of files are held out


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return zlib.crc32(relpath.encode()) % HELDOUT_MODULUS == 0


def stdlib_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train, heldout) `.py` files of the standard library, sorted by relative path."""
    root = root or stdlib_root()
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        rel = path.relative_to(root)
        if _EXCLUDED_PARTS.intersection(rel.parts[:-1]):
            continue
        (heldout if is_heldout(rel.as_posix()) else train).append(path)
    return train, heldout


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def load_texts(specs: list[str]) -> list[str]:
    """Texts from files, globs or JSONL files (one JSON object per line with a "text" field)."""
    texts: list[str] = []
    for spec in specs:
        paths = sorted(glob.glob(spec, recursive=True)) or [spec]
        for p in map(Path, paths):
            if not p.is_file():
                raise FileNotFoundError(f"corpus entry {spec!r} matches no file")
            if p.suffix == ".jsonl":
                with p.open(encoding="utf-8") as f:
                    texts.extend(json.loads(line)["text"] for line in f if line.strip())
            elif (t := read_text(p)) is not None:
                texts.append(t)
    return texts


def encode_texts(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    """One flat int32 stream: each text's ids followed by EOS."""
    ids: list[int] = []
    batch = 256
    for i in range(0, len(texts), batch):
        for enc in tokenizer(texts[i : i + batch], add_special_tokens=False)["input_ids"]:
            ids.extend(enc)
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


@dataclass(frozen=True)
class TokenWindows:
    """Random fixed-length windows of a token stream, a pure function of (seed, step).

    Deterministic per step, so a resumed run sees exactly the batches an uninterrupted run would.
    """

    stream: torch.Tensor  # [n_tokens] int32
    seq_len: int
    batch_size: int
    seed: int

    def batch(self, step: int) -> torch.Tensor:
        """[batch_size, seq_len + 1] int64: inputs are [:, :-1], labels [:, 1:]."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        hi = self.stream.numel() - self.seq_len - 1
        starts = torch.randint(0, hi, (self.batch_size,), generator=g)
        idx = starts[:, None] + torch.arange(self.seq_len + 1)[None, :]
        return self.stream[idx].long()

    def sequential(self, max_batches: int | None = None):
        """Non-overlapping windows in order (evaluation)."""
        n = (self.stream.numel() - 1) // self.seq_len
        rows = [self.stream[i * self.seq_len : i * self.seq_len + self.seq_len + 1].long() for i in range(n)]
        for b, i in enumerate(range(0, len(rows), self.batch_size)):
            if max_batches is not None and b >= max_batches:
                return
            yield torch.stack(rows[i : i + self.batch_size])
