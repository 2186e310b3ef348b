"""The stock HF forward as a runner, for any causal LM: a DynamicCache per sequence.

A `Sequence` records which token ids its cache holds (`cached_ids`). Committing tokens never edits the
cache directly: the next forward keeps the longest common prefix of `cached_ids` and the committed
`token_ids` and crops the rest. One mechanism therefore covers rejected draft tokens, the draft's own
speculative tokens, and multi-turn prefix reuse (a new turn shares its prefix with the cached one).

`forward` runs several sequences with different cached lengths and different numbers of new tokens in
one batched pass: caches are left-padded into one batch cache, new tokens left-padded too, with a 2D
attention mask and explicit position ids; the new keys/values are then appended back to each sequence.
The padding copy is the price of using stock HF caches (a paged cache would avoid it).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel

from specmesh.runtime.base import SequentialRunner
from specmesh.runtime.sequence import SequenceBase, common_prefix


@dataclass
class Sequence(SequenceBase):
    """One sequence's committed tokens and the KV cache of (a prefix of) them."""

    token_ids: list[int]
    cache: DynamicCache
    cached_ids: list[int] = field(default_factory=list)  # ids whose KV the cache holds, in order


class ModelRunner(SequentialRunner[Sequence]):
    """Runs one HF causal LM over `Sequence`s. Knows nothing of speculation or gRPC."""

    def __init__(self, model: PreTrainedModel):
        super().__init__(model)
        if any(getattr(layer, "is_sliding", False) for layer in DynamicCache(config=self.config).layers):
            # Sliding-window layers keep only the window: cropping and padded batching assume full caches.
            raise ValueError("models with sliding-window attention layers are not supported yet")

    def new_sequence(self, token_ids: list[int], scope: bytes = b"") -> Sequence:
        """`Runner.new_sequence`; `scope` does not apply (no sequence shares another's cache)."""
        if not token_ids:
            raise ValueError("a sequence needs at least one token")
        return Sequence(list(token_ids), DynamicCache(config=self.config))

    def _sync(self, seq: Sequence) -> int:
        """Crop the cache to the prefix still valid for token_ids, leaving >= 1 token to feed."""
        keep = min(common_prefix(seq.cached_ids, seq.token_ids), len(seq.token_ids) - 1)
        drop = len(seq.cached_ids) - keep
        if drop:
            seq.cache.crop(-drop)
            del seq.cached_ids[keep:]
        return keep

    def _run(self, seqs: list[Sequence], feeds: list[list[int]], num_logits: list[int]) -> list[torch.Tensor]:
        """Several sequences run in one HF forward over a padded batch cache (see the module docstring)."""
        if len(seqs) == 1 or any(not s.cached_ids for s in seqs):
            # A fresh sequence (nothing cached) would leave its padded queries nothing to attend to.
            return [self._run_one(s, f, n) for s, f, n in zip(seqs, feeds, num_logits, strict=True)]
        return self._run_batch(seqs, feeds, num_logits)

    def _run_one(self, seq: Sequence, feed: list[int], num_logits: int) -> torch.Tensor:
        ids = torch.tensor([feed], dtype=torch.long, device=self.device)
        start = seq.num_cached
        pos = torch.arange(start, start + len(feed), device=self.device)[None, :]
        try:
            out = self.model(
                input_ids=ids, position_ids=pos, cache=seq.cache, use_cache=True, logits_to_keep=num_logits
            )
        except BaseException:
            # Some layers may already hold the new keys/values: cut every layer back to cached_ids.
            for layer in seq.cache.layers:
                extra = layer.get_seq_length() - start
                if extra > 0:
                    layer.crop(-extra)
            raise
        seq.cached_ids.extend(feed)
        return out.logits[0].float()

    def _run_batch(self, seqs: list[Sequence], feeds: list[list[int]], nlog: list[int]) -> list[torch.Tensor]:
        n_seq = len(seqs)
        lens = [s.num_cached for s in seqs]
        l_max, n_max = max(lens), max(map(len, feeds))
        dev = self.device
        ids = torch.zeros((n_seq, n_max), dtype=torch.long, device=dev)
        pos = torch.zeros((n_seq, n_max), dtype=torch.long, device=dev)
        mask = torch.zeros((n_seq, l_max + n_max), dtype=torch.long, device=dev)
        for i, (f, length) in enumerate(zip(feeds, lens, strict=True)):
            n = len(f)
            ids[i, n_max - n :] = torch.tensor(f, device=dev)
            pos[i, n_max - n :] = torch.arange(length, length + n, device=dev)
            pos[i, : n_max - n] = length
            mask[i, l_max - length : l_max] = 1
            mask[i, l_max + n_max - n :] = 1
        batch_cache = DynamicCache(config=self.config)
        for layer_idx in range(len(seqs[0].cache.layers)):
            ks, vs = [], []
            for seq, length in zip(seqs, lens, strict=True):
                layer = seq.cache.layers[layer_idx]
                k, v = layer.keys, layer.values  # [1, H, length, D]
                pad = l_max - length
                ks.append(torch.nn.functional.pad(k, (0, 0, pad, 0)))
                vs.append(torch.nn.functional.pad(v, (0, 0, pad, 0)))
            batch_cache.update(torch.cat(ks), torch.cat(vs), layer_idx)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            cache=batch_cache,
            use_cache=True,
            logits_to_keep=n_max,
        )
        logits = out.logits.float()
        results = []
        for i, (seq, f) in enumerate(zip(seqs, feeds, strict=True)):
            n = len(f)
            for layer_idx, layer in enumerate(batch_cache.layers):
                seq.cache.update(
                    layer.keys[i : i + 1, :, l_max + n_max - n :],
                    layer.values[i : i + 1, :, l_max + n_max - n :],
                    layer_idx,
                )
            seq.cached_ids.extend(f)
            results.append(logits[i, n_max - nlog[i] :])
        return results
