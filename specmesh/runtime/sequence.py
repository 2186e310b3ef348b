"""What every runner's sequence is besides its cache: the committed `token_ids` and the `cached_ids` whose
KV the cache holds. Runners differ in how they keep the ids (a plain list, or one that tracks what changed)
and in the cache; committing, starting a new turn and counting what is cached are the same for all."""

from __future__ import annotations


class SequenceBase:
    __slots__ = ()

    token_ids: list[int]
    cached_ids: list[int]  # ids whose KV the cache holds, in order

    def commit(self, tokens: list[int]) -> None:
        self.token_ids.extend(tokens)

    def reset_tokens(self, token_ids: list[int]) -> None:
        """Replace the committed tokens (a new turn); the cache keeps whatever prefix still matches."""
        # A subclass holds token_ids (a dataclass field, a slot or a property): mypy sees only the empty slots.
        self.token_ids = list(token_ids)  # type: ignore[misc]

    @property
    def num_cached(self) -> int:
        return len(self.cached_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids `a` and `b` share: by slice comparisons (C speed) in a binary search, since a
    runner compares long prompts with every cached prefix it could reuse."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
