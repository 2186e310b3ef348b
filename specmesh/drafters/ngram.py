"""Prompt-lookup drafting: no model, no probabilities (the verifier's point-mass rule keeps it lossless)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from specmesh.domain import DraftBlock
from specmesh.sampling import SamplingParams


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens, propose what followed.

    No model, no probabilities (the verifier's point-mass rule keeps it lossless).
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.tokens = list(prompt_ids)

    async def propose(
        self, k: int, after: Sequence[int] = (), should_stop: Callable[[], bool] | None = None
    ) -> DraftBlock:
        toks = self.tokens + list(after) if after else self.tokens
        for n in range(min(self.max_ngram, len(toks) - 1), self.min_ngram - 1, -1):
            tail = toks[-n:]
            for start in range(len(toks) - n - 1, -1, -1):
                if toks[start : start + n] == tail:
                    follow = toks[start + n : start + n + k]
                    if follow:
                        return DraftBlock(follow)
        return DraftBlock([])

    def commit(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)
