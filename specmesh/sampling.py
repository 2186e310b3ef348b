"""Sampling parameters and the one function that turns logits into the processed distribution.

Draft and target both call `process_logits`, so the distribution the draft samples from and the one the
verifier checks against are built by identical code: temperature, then top-k, then top-p (the order vLLM
and HF use). Temperature 0 means greedy: the processed distribution is a point mass on the argmax.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specmesh.errors import InvalidArgument
from specmesh.text import IncrementalDetokenizer, find_stop

MAX_STOP_STRINGS = 16
DEFAULT_MAX_TOKENS = 16
GREEDY_TEMPERATURE = 1e-5  # below this, temperature scaling overflows fp32 logits: treated as greedy (as vLLM)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = whole vocabulary
    top_p: float = 1.0
    seed: int | None = None  # per-request generator: a seeded request replays exactly
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the output text ends before the first one
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def draft_budget(self, emitted: int) -> int:
        """Most draft tokens worth verifying after `emitted` output tokens: a round always emits one token
        of its own, so drafts beyond max_tokens - emitted - 1 could never be kept."""
        return max(0, self.max_tokens - emitted - 1)

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Raise InvalidArgument naming the offending field; returns self so it chains."""
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise InvalidArgument(f"temperature must be in [0, 100], got {self.temperature}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < 2**31:
            raise InvalidArgument(f"top_k must be an integer in [0, 2**31) (0 disables it), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgument(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens < 1:
            raise InvalidArgument(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise InvalidArgument(f"seed must be in [0, 2**63), got {self.seed}")
        if len(self.stop) > MAX_STOP_STRINGS or any(not s for s in self.stop):
            raise InvalidArgument(f"stop must hold at most {MAX_STOP_STRINGS} non-empty strings")
        if vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidArgument(f"stop_token_ids out of range [0, {vocab_size}): {bad}")
        return self


def check_token_ids(ids, vocab_size: int, what: str = "prompt_ids") -> list[int]:
    """The ids as a list; InvalidArgument (a ValueError) if there are none or any lies outside the vocabulary."""
    ids = list(ids)
    if not ids:
        raise InvalidArgument(f"{what} must hold at least one token")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"{what}: token ids out of range [0, {vocab_size}): {bad[:8]}")
    return ids


@dataclass(frozen=True)
class BatchSamplingParams:
    """Per-row parameters of a batch of logits rows (rows of one request repeat its values)."""

    temperature: torch.Tensor  # [N] float32; 0 marks a greedy row
    top_k: torch.Tensor  # [N] int64; 0 = off
    top_p: torch.Tensor  # [N] float32; 1 = off

    @staticmethod
    def from_params(params: list[SamplingParams], rows_per_request: list[int], device=None) -> BatchSamplingParams:
        rep = torch.tensor(rows_per_request, device=device)

        def col(values, dtype):
            return torch.tensor(values, dtype=dtype, device=device).repeat_interleave(rep)

        return BatchSamplingParams(
            temperature=col([0.0 if p.greedy else p.temperature for p in params], torch.float32),
            top_k=col([p.top_k for p in params], torch.int64),
            top_p=col([p.top_p for p in params], torch.float32),
        )


def process_logits(logits: torch.Tensor, sp: BatchSamplingParams) -> torch.Tensor:
    """logits [N, V] -> processed probabilities [N, V] float32 (each row sums to 1).

    Greedy rows become a one-hot on the argmax. Top-k keeps exactly k entries (ties broken by sort
    order, identically in draft and target); top-p keeps the smallest prefix of the sorted distribution
    whose mass reaches top_p (at least one entry).
    """
    logits = logits.float()
    greedy = sp.temperature == 0
    temp = torch.where(greedy, torch.ones_like(sp.temperature), sp.temperature)
    scaled = logits / temp[:, None]
    use_k = sp.top_k > 0
    use_p = sp.top_p < 1.0
    if bool(use_k.any()) or bool(use_p.any()):
        scaled = _apply_top_k_top_p(scaled, sp.top_k, sp.top_p, use_k, use_p)
    probs = torch.softmax(scaled, dim=-1)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _apply_top_k_top_p(scaled, top_k, top_p, use_k, use_p) -> torch.Tensor:
    vocab = scaled.size(-1)
    sorted_logits, sorted_idx = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=scaled.device)[None, :]
    k = torch.where(use_k, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    remove = ranks >= k[:, None]
    if bool(use_p.any()):
        sorted_probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        remove |= (mass_before >= top_p[:, None]) & use_p[:, None]
    remove[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(scaled).scatter_(1, sorted_idx, sorted_logits)


def make_generator(seed: int | None, device="cpu") -> torch.Generator | None:
    """A per-request generator for a seeded request; None (the shared stream) otherwise."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)


@dataclass
class StopChecker:
    """Applies max_tokens, EOS, stop token ids and stop strings to committed tokens, as they arrive.

    `extend` returns how many of the new tokens are kept and sets `finish_reason` once generation ends.
    Stop tokens (EOS included) are kept in the token ids; stop strings are cut from the text by
    `text()`. `decode` turns ids into text (needed only for stop strings); with stop strings the text is
    decoded incrementally, one new token at a time (`specmesh.text`).
    """

    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()  # every id that ends a turn (chat models list several)
    decode: Callable[[Sequence[int]], str] | None = None
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _stop_text_at: int | None = field(default=None, init=False)
    _detokenizer: IncrementalDetokenizer | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.params.stop:
            if self.decode is None:
                raise ValueError("stop strings need a tokenizer to decode with")
            self._detokenizer = IncrementalDetokenizer(self.decode)
        stops = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stops |= set(self.eos_token_ids)
        self._stop_ids = frozenset(stops)

    def extend(self, new_tokens: list[int]) -> int:
        kept = 0
        detok = self._detokenizer
        for tok in new_tokens:
            if self.finish_reason is not None:
                break
            self.token_ids.append(tok)
            kept += 1
            if tok in self._stop_ids or (detok is not None and self._ends_a_stop_string(detok, tok)):
                self.finish_reason = "stop"
            elif len(self.token_ids) >= self.params.max_tokens:
                self.finish_reason = "length"
        return kept

    def _ends_a_stop_string(self, detok: IncrementalDetokenizer, tok: int) -> bool:
        searched = len(detok.text)
        detok.add([tok])
        at = find_stop(detok.text, self.params.stop, searched)
        if at >= 0:
            self._stop_text_at = at
            return True
        return False

    def finish(self, reason: str) -> None:
        """End generation for a reason decided elsewhere (a remote verifier's stop rules, a cancel)."""
        if self.finish_reason is None:
            self.finish_reason = reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def text(self) -> str:
        detok = self._detokenizer
        if detok is None:
            return self.decode(self.token_ids) if self.decode else ""
        # A token that ended generation by its id was never searched for stop strings; its text still counts.
        detok.add(self.token_ids[len(detok.token_ids) :])
        text = detok.text + detok.tail()
        return text[: self._stop_text_at] if self._stop_text_at is not None else text
