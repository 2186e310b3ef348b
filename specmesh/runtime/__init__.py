"""Runners: a model and the KV caches of its sequences, behind one interface that knows nothing of
speculation or gRPC.

A sequence holds its committed `token_ids` and a cache of (a prefix of) them; a forward feeds each
sequence what its cache lacks plus optional extra (draft) tokens and returns logits for the positions
asked for. Rolling back is only committing fewer tokens: the next forward keeps the longest cached prefix
that still matches. `Runner.step` is the one pass a scheduler drives: decode blocks of some sequences and
prefill chunks of others. Implementations (built by `specmesh.runtime.registry`):

* `batched.BatchedRunner`: one ragged forward over a preallocated slot pool for the Llama family; prefill
  chunks ride in the step's pass (`chunked_prefill`);
* `hf.ModelRunner`: the stock HF forward over a DynamicCache per sequence, for any causal LM;
* `static.StaticCacheRunner`: a preallocated cache per sequence and a hand-written decoder for the
  Llama family (checked against the HF forward on a probe when built).

The last two share `base.SequentialRunner`: a step there prefills each chunk in a pass of its own, then
runs the decode forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@runtime_checkable
class RunnerSequence(Protocol):
    token_ids: list[int]  # committed ids (a caller may append assumed or drafted ones before a forward)
    cached_ids: list[int]  # ids whose KV the sequence's cache holds, in order

    def commit(self, tokens: list[int]) -> None:
        """Append accepted `tokens` to `token_ids` (the cache catches up at the next forward)."""
        ...

    def reset_tokens(self, token_ids: list[int]) -> None:
        """Replace the committed tokens (a new turn); the cache keeps whatever prefix still matches."""
        ...


# A runner takes only the sequences it made (their caches are its own kind): the type parameter says which.
SeqT = TypeVar("SeqT", bound=RunnerSequence)
SeqT_contra = TypeVar("SeqT_contra", bound=RunnerSequence, contravariant=True)


class PrefillChunk(NamedTuple, Generic[SeqT]):
    """A prefill request inside `Runner.step`: cache up to `max_tokens` (None: all) more of `seq`'s committed
    tokens (all but the last, which the next decode forward feeds). `count_reuse`: add the cached prefix
    found to `prefix_tokens_reused` (a turn's first chunk only, so chunks are not counted as reuse)."""

    seq: SeqT
    max_tokens: int | None = None
    count_reuse: bool = True


class StepResult(NamedTuple):
    logits: list[torch.Tensor]  # per decode sequence, float32 [num_logits[i], V]
    prefill_left: list[int]  # per prefill chunk, committed tokens still to prefill afterwards
    # Per prefill chunk, the cached prefix found and added to `prefix_tokens_reused` (0 unless count_reuse):
    # a scheduler running several sessions' chunks in one pass can tell each its own reuse.
    prefill_reused: list[int]
    tokens: int  # positions computed, decode and prefill together (the step's cost)


class KvAccount(Protocol[SeqT_contra]):
    """How a runner's KV memory is held: what a session store budgets and evicts by."""

    @property
    def pool_bytes(self) -> int | None:
        """A fixed pool's bytes, in use or not (None: caches grow on demand, no pool)."""
        ...

    @property
    def max_sequences(self) -> int | None:
        """Most sequences open at once (a pool's slots; None: no cap of its own)."""
        ...

    def held(self, seq: SeqT_contra) -> int:
        """Bytes `seq`'s cache holds now."""
        ...

    def needed(self, seq: SeqT_contra | None, tokens: int) -> int:
        """More bytes a turn of `tokens` committed tokens needs (seq: the session's, None for a new one)."""
        ...


class BlockBudget(Protocol[SeqT_contra]):
    """A runner's KV in blocks of one pool that every sequence draws on: what a scheduler plans a pass by
    (the blocks its steps and chunks need), evicts idle sequences for, and preempts running ones by."""

    block_size: int
    num_blocks: int

    def free_blocks(self) -> int:
        """Blocks an allocation may take now (free, or cached and evictable)."""
        ...

    def cached(self, seq: SeqT_contra) -> int:
        """Roll `seq`'s cache back to the prefix still valid for its committed tokens (taking the pool's
        cached blocks of its prompt where it can) and return how many positions that prefix holds."""
        ...

    def needed(self, seq: SeqT_contra, positions: int) -> int:
        """More blocks `seq` needs for its cache to cover `positions` (after `cached`)."""
        ...

    def held(self, seq: SeqT_contra) -> int:
        """Blocks `seq` holds (a shared block counts for each sequence holding it)."""
        ...

    def preempt(self, seq: SeqT_contra) -> int:
        """Give `seq`'s blocks back, keeping the sequence: its next forward recomputes what its cache lacks
        (vLLM's recompute preemption; committed full blocks stay findable in the pool until evicted).
        Returns the blocks that became free or evictable."""
        ...


@runtime_checkable
class Runner(Protocol[SeqT]):
    model: PreTrainedModel  # the HF model whose weights the runner serves (its config, a plain forward)
    device: torch.device  # where its weights, caches and returned logits live
    vocab_size: int  # V: the lm_head's rows (may exceed the tokenizer's)
    prefix_tokens_reused: int  # tokens whose KV was found in a cache instead of recomputed, ever
    # Whether `step` computes its prefill chunks inside its one pass with the decode blocks (so a scheduler
    # can fill a pass up to a token budget), rather than each in a pass of its own before it.
    chunked_prefill: bool

    # The KV held in blocks of a shared pool, which a scheduler admits and preempts by (None: a slot per
    # sequence, or caches that grow on demand).
    blocks: BlockBudget[SeqT] | None

    def new_sequence(self, token_ids: list[int], scope: bytes = b"") -> SeqT:
        """A sequence of the committed `token_ids` (>= 1). Nothing cached yet, except where the runner shares
        KV across sequences: then whatever of their prefix is cached in `scope` (`blocks.scope_of`: one
        tenant's prompts are never another's hits)."""
        ...

    def free(self, seq: SeqT) -> None:
        """Give `seq`'s cache back now (a fixed pool needs it back; growing caches go with their last
        reference); the sequence can no longer be run. Idempotent."""
        ...

    def prefill(self, seq: SeqT, max_tokens: int | None = None, count_reuse: bool = True) -> int:
        """Cache the committed tokens of `seq` but the last (the next forward feeds it), reusing a cached
        prefix; at most `max_tokens` of them (call again until it returns 0). Returns how many are still to
        prefill. `count_reuse`: as in `PrefillChunk`."""
        ...

    def forward(self, seqs: list[SeqT], extra: list[list[int]] | None = None) -> list[torch.Tensor]:
        """Feed each sequence its uncached committed tokens plus `extra[i]` (draft tokens). Per sequence,
        float32 logits [len(extra[i]) + 1, V]: row j predicts the token after the j-th of (last committed
        token, extra...)."""
        ...

    def step(
        self,
        seqs: list[SeqT],
        extra: list[list[int]] | None = None,
        num_logits: list[int] | None = None,
        prefill: Sequence[PrefillChunk[SeqT]] = (),
    ) -> StepResult:
        """`forward` over `seqs` keeping the last `num_logits[i]` rows of each (default all), and the
        `prefill` chunks of other sequences; see `chunked_prefill` for whether that is one pass."""
        ...

    def context_limit(self, max_model_len: int = 0) -> int:
        """Most tokens one sequence may reach: the model's context, capped by `max_model_len` (0: no cap)
        and by what the runner's cache of one sequence holds."""
        ...

    def kv_account(self, bytes_per_token: int | None = None) -> KvAccount[SeqT]:
        """The accounting of this runner's KV memory (`bytes_per_token`: override the model's, where
        caches grow by the token)."""
        ...
