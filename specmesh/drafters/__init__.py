"""Draft methods, one module each, behind one registry: a new method is a module plus one line here.

`Algorithm` names the methods as clients and flags spell them (SGLang's `--speculative-algorithm`).
"""

from __future__ import annotations

import enum

from specmesh.drafters.batcher import DraftBatcher
from specmesh.drafters.model import ModelDrafter
from specmesh.drafters.ngram import NgramDrafter
from specmesh.errors import InvalidArgument
from specmesh.loop import Drafter


class Algorithm(str, enum.Enum):
    STANDALONE = "standalone"  # a separate draft model
    NGRAM = "ngram"  # prompt lookup

    @property
    def needs_model(self) -> bool:
        return self is Algorithm.STANDALONE

    @classmethod
    def parse(cls, name: str) -> Algorithm:
        try:
            return cls(name)
        except ValueError:
            raise InvalidArgument(f"unknown speculative algorithm {name!r} ({' | '.join(ALGORITHMS)})") from None


ALGORITHMS = tuple(a.value for a in Algorithm)


def make_drafter(algorithm: Algorithm | str, batcher: DraftBatcher | None = None) -> Drafter | None:
    """A fresh drafter for one generation; None when the method needs a model and there is none."""
    algorithm = Algorithm.parse(algorithm) if isinstance(algorithm, str) else algorithm
    if algorithm is Algorithm.NGRAM:
        return NgramDrafter()
    return ModelDrafter(batcher) if batcher is not None else None


__all__ = ["ALGORITHMS", "Algorithm", "DraftBatcher", "ModelDrafter", "NgramDrafter", "make_drafter"]
