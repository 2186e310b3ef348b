"""What the runners share: the setup every runner takes from its model (`RunnerBase`), and the `Runner`
members of a runner with no ragged batched pass of its own (`SequentialRunner`, with `TokenAccount` for
caches that grow token by token).

A `SequentialRunner` step prefills each chunk in a pass of its own, in order, then runs one forward over
the decode sequences: what a caller of `prefill` then `forward` would do, so a scheduler can drive every
runner through `step` alone and ask `chunked_prefill` only to decide whether planning chunks into its passes
pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, NamedTuple

import torch
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from specmesh.errors import InvalidArgument
from specmesh.runtime import PrefillChunk, RunnerSequence, SeqT, StepResult


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys + values of one token over all layers."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * elem


def plain_full_attention(config) -> bool:
    """Whether every layer of the model's cache is a plain full-attention one (what preallocated caches
    and slot pools hold)."""
    layers = DynamicCache(config=config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class RunnerBase:
    """The setup every runner takes from its model."""

    blocks: Any = None  # `Runner.blocks`: a runner whose KV lives in a shared block pool sets it

    def __init__(self, model: PreTrainedModel):
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_output_embeddings().weight.size(0)
        self.prefix_tokens_reused = 0  # tokens whose KV was found in a cache instead of recomputed

    @property
    def model_len(self) -> int:
        """The model's context (`max_position_embeddings`), 0 when its config does not say."""
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)


class TokenAccount:
    """Caches that grow with the tokens they hold and are freed with their last reference: no pool, no cap."""

    pool_bytes: int | None = None
    max_sequences: int | None = None

    def __init__(self, bytes_per_token: int):
        self.bytes_per_token = bytes_per_token

    def held(self, seq: RunnerSequence) -> int:
        # The storages, not the cached token count: a cache cropped to a shorter prefix keeps its tensors'
        # full storage, which is what the process really holds.
        layers = getattr(getattr(seq, "cache", None), "layers", None)
        if layers is None:
            return len(seq.cached_ids) * self.bytes_per_token
        storages = {}
        for layer in layers:
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor) and t.numel():
                    st = t.untyped_storage()
                    storages[st.data_ptr()] = st.nbytes()
        return max(sum(storages.values()), len(seq.cached_ids) * self.bytes_per_token)

    def needed(self, seq: RunnerSequence | None, tokens: int) -> int:
        return max(0, tokens * self.bytes_per_token - (self.held(seq) if seq is not None else 0))


class _Prefilled(NamedTuple):
    left: int  # committed tokens still to prefill
    reused: int  # cached prefix found and counted (0 unless count_reuse)
    tokens: int  # tokens computed


class SequentialRunner(RunnerBase, Generic[SeqT]):
    """The `Runner` members of a runner without a ragged pass: prefill chunks run each in a pass of its own,
    before the decode forward. A subclass provides `new_sequence`, `_sync` and `_run`."""

    chunked_prefill = False

    def _sync(self, seq: SeqT) -> int:
        """Cut the cache back to the prefix still valid for token_ids, leaving >= 1 token to feed; return
        its length."""
        raise NotImplementedError

    def _run(self, seqs: list[SeqT], feeds: list[list[int]], num_logits: list[int]) -> list[torch.Tensor]:
        """Feed each (synced) sequence its `feeds[i]`; per sequence float32 logits [num_logits[i], V] of the
        last rows. Afterwards the cache holds everything fed."""
        raise NotImplementedError

    def free(self, seq: SeqT) -> None:
        """Nothing to give back: a sequence's cache is freed with its last reference."""

    def context_limit(self, max_model_len: int = 0) -> int:
        """The model's context (caches grow to any length), capped by `max_model_len`."""
        limit = self.model_len or 2**31 - 1
        return min(limit, max_model_len) if max_model_len else limit

    def kv_account(self, bytes_per_token: int | None = None) -> TokenAccount:
        dtype = next(self.model.parameters()).dtype
        return TokenAccount(bytes_per_token or kv_bytes_per_token(self.config, dtype))

    @torch.inference_mode()
    def prefill(self, seq: SeqT, max_tokens: int | None = None, count_reuse: bool = True) -> int:
        """`Runner.prefill`: each call computes its tokens in a forward of its own."""
        return self._prefill(PrefillChunk(seq, max_tokens, count_reuse)).left

    def _prefill(self, chunk: PrefillChunk[SeqT]) -> _Prefilled:
        keep = self._sync(chunk.seq)
        reused = keep if chunk.count_reuse else 0
        self.prefix_tokens_reused += reused
        todo = chunk.seq.token_ids[keep:-1]
        now = todo if chunk.max_tokens is None else todo[: chunk.max_tokens]
        if now:
            self._run([chunk.seq], [now], [1])
        return _Prefilled(len(todo) - len(now), reused, len(now))

    @torch.inference_mode()
    def forward(self, seqs: list[SeqT], extra: list[list[int]] | None = None) -> list[torch.Tensor]:
        """`Runner.forward`. Afterwards the cache holds everything fed; the next forward cuts what was not
        committed."""
        return self._forward(seqs, extra)[0]

    def _forward(self, seqs: list[SeqT], extra: list[list[int]] | None) -> tuple[list[torch.Tensor], int]:
        """(`forward`'s logits, tokens fed)."""
        if not seqs:
            return [], 0
        extra = extra if extra is not None else [[] for _ in seqs]
        feeds = []
        for seq, ext in zip(seqs, extra, strict=True):
            keep = self._sync(seq)
            feeds.append(seq.token_ids[keep:] + list(ext))
        return self._run(seqs, feeds, [len(e) + 1 for e in extra]), sum(map(len, feeds))

    @torch.inference_mode()
    def step(
        self,
        seqs: list[SeqT],
        extra: list[list[int]] | None = None,
        num_logits: list[int] | None = None,
        prefill: Sequence[PrefillChunk[SeqT]] = (),
    ) -> StepResult:
        """`Runner.step`: the chunks first, each in a pass of its own, then `forward` over `seqs`. A chunk
        stays cached if a later pass of the step raises."""
        wanted = logits_wanted(len(seqs), extra, num_logits)
        done = [self._prefill(PrefillChunk(*c)) for c in prefill]
        logits, tokens = self._forward(seqs, extra)
        if num_logits is not None:  # the last rows: those of the last extras
            logits = [rows[rows.shape[0] - n :] for rows, n in zip(logits, wanted, strict=True)]
        return StepResult(
            logits, [d.left for d in done], [d.reused for d in done], tokens + sum(d.tokens for d in done)
        )


def logits_wanted(num_seqs: int, extra: list[list[int]] | None, num_logits: list[int] | None) -> list[int]:
    """A step's logits rows per decode sequence (default: one per extra token + 1), its arguments checked."""
    if extra is not None and len(extra) != num_seqs:
        raise InvalidArgument(f"{len(extra)} extra token lists for {num_seqs} sequences")
    if num_logits is not None and len(num_logits) != num_seqs:
        raise InvalidArgument(f"{len(num_logits)} num_logits for {num_seqs} sequences")
    rows = [len(e) + 1 for e in extra] if extra is not None else [1] * num_seqs
    if num_logits is None:
        return rows
    for i, (n, most) in enumerate(zip(num_logits, rows, strict=True)):
        if not 0 <= int(n) <= most:
            raise InvalidArgument(f"num_logits[{i}] = {int(n)} is outside [0, {most}]")
    return [int(n) for n in num_logits]
