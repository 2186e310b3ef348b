"""Runners: a model and the KV caches of its sequences, behind one interface that knows nothing of
speculation or gRPC.

A sequence holds its committed `token_ids` and a cache of (a prefix of) them; a forward feeds each
sequence what its cache lacks plus optional extra (draft) tokens and returns logits for the positions
asked for. Rolling back is only committing fewer tokens: the next forward keeps the longest cached prefix
that still matches. Implementations:

* `hf.ModelRunner`: the stock HF forward over a DynamicCache per sequence, for any causal LM;
* `static.StaticCacheRunner`: a preallocated cache per sequence and a hand-written decoder for the
  Llama family (checked against the HF forward on a probe when built).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@runtime_checkable
class RunnerSequence(Protocol):
    token_ids: list[int]
    cached_ids: list[int]

    def commit(self, tokens: list[int]) -> None: ...

    def reset_tokens(self, token_ids: list[int]) -> None: ...


# A runner takes only the sequences it made (their caches are its own kind): the type parameter says which.
SeqT = TypeVar("SeqT", bound=RunnerSequence)


@runtime_checkable
class Runner(Protocol[SeqT]):
    model: PreTrainedModel
    device: torch.device
    vocab_size: int
    prefix_tokens_reused: int

    def new_sequence(self, token_ids: list[int]) -> SeqT: ...

    def prefill(self, seq: SeqT) -> int | None:
        """Cache every committed token of `seq` but the last (the next forward feeds it), reusing a cached
        prefix.

        Runners that prefill in chunks take two more, optional, arguments and return how many tokens are
        still to prefill: `max_tokens`, compute at most that many (call again until it returns 0), and
        `count_reuse`, add the cached prefix to `prefix_tokens_reused` (only on a turn's first call, so
        chunks are not counted as reuse)."""
        ...

    def forward(self, seqs: list[SeqT], extra: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Per sequence, float32 logits [len(extra[i]) + 1, V] for the last committed token and the extras."""
        ...
