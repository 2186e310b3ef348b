"""Draft methods, one module each, behind one registry: a new method is a module plus one line here.

`Algorithm` names the methods as clients and flags spell them (SGLang's `--speculative-algorithm`, vLLM's
`method`); `Algorithm.method` is how metrics label the drafts each produces.
"""

from __future__ import annotations

import enum

from specmesh.drafters.batcher import DraftBatcher
from specmesh.drafters.hybrid import HybridChooser, HybridDrafter
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramDrafter
from specmesh.drafters.suffix import SuffixCache, SuffixDrafter, SuffixParams
from specmesh.errors import InvalidArgument
from specmesh.loop import Drafter


class Algorithm(str, enum.Enum):
    STANDALONE = "standalone"  # a separate draft model
    NGRAM = "ngram"  # prompt lookup
    SUFFIX = "suffix"  # suffix trees over the prompt, the output and recent generations (vLLM's suffix)

    @property
    def needs_model(self) -> bool:
        return self is Algorithm.STANDALONE

    @property
    def method(self) -> str:
        """The drafts' method label: model, ngram or suffix."""
        return "model" if self is Algorithm.STANDALONE else self.value

    @classmethod
    def parse(cls, name: str) -> Algorithm:
        try:
            return cls(name)
        except ValueError:
            raise InvalidArgument(f"unknown speculative algorithm {name!r} ({' | '.join(ALGORITHMS)})") from None


ALGORITHMS = tuple(a.value for a in Algorithm)


def make_drafter(
    algorithm: Algorithm | str,
    batcher: DraftBatcher | None = None,
    suffix_cache: SuffixCache | None = None,
    cache_scope: str = "",
) -> Drafter | None:
    """A fresh drafter for one generation; None when the method needs a model and there is none.
    `suffix_cache`: the replica's global suffix trees, `cache_scope` the request's partition of them (the
    suffix method without a cache drafts from the request's own tokens only) and of the draft's KV (a new
    sequence reuses a cached prompt prefix of its own scope only)."""
    algorithm = Algorithm.parse(algorithm) if isinstance(algorithm, str) else algorithm
    if algorithm is Algorithm.NGRAM:
        return NgramDrafter()
    if algorithm is Algorithm.SUFFIX:
        return SuffixDrafter(suffix_cache, cache_scope)
    return ModelDrafter(batcher, cache_scope.encode()) if batcher is not None else None


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "DraftBatcher",
    "HybridChooser",
    "HybridDrafter",
    "ModelDrafter",
    "NgramDrafter",
    "SuffixCache",
    "SuffixDrafter",
    "SuffixParams",
    "make_drafter",
]
