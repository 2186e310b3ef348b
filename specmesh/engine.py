"""In-process speculative generation: the loop with a local drafter and a local verifier.

This is the composition root for one process (tests, benchmarks, the training tool's evaluation, the
demo run command): it wires the core's loop and runners to verify_service's verifier and rejection
sampler, imported lazily here and only here — the core's other modules never import a service.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specmesh.drafting import ModelDrafter, NgramDrafter
from specmesh.loop import GenerationResult, speculative_generate
from specmesh.fast_runner import StaticCacheRunner
from specmesh.models import ModelRunner, load_model
from specmesh.sampling import SamplingParams, StopChecker, check_token_ids


def eos_token_ids(model) -> frozenset[int]:
    """Every EOS id of the model's config and generation config (Llama 3 and Qwen chat models list several)."""
    ids: set[int] = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    return frozenset(ids)


class SpeculativeEngine:
    """prompt ids + SamplingParams -> tokens + stats. K = 0 (or no draft) is target-only decoding."""

    def __init__(self, target_runner: ModelRunner, draft_runner: ModelRunner | None, sampler, tokenizer=None,
                 draft_topk: int = 16):
        if draft_runner is not None and draft_runner.vocab_size != target_runner.vocab_size:
            raise ValueError(f"draft vocabulary ({draft_runner.vocab_size}) differs from the target's "
                             f"({target_runner.vocab_size})")
        self.target = target_runner
        self.draft = draft_runner
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.draft_topk = draft_topk

    @classmethod
    def from_models(cls, target_model, draft_model=None, sampler=None, tokenizer=None, sampler_backend: str = "auto",
                    draft_topk: int = 16, draft_runner: str = "static") -> "SpeculativeEngine":
        """draft_runner: "static" (StaticCacheRunner, as the draft service uses) or "hf" (ModelRunner)."""
        if sampler is None:
            from verify_service.rejection import RejectionSampler

            sampler = RejectionSampler(sampler_backend, device=next(target_model.parameters()).device)
        if draft_runner not in ("static", "hf"):
            raise ValueError(f"draft_runner must be static or hf, got {draft_runner!r}")
        runner_cls = StaticCacheRunner if draft_runner == "static" else ModelRunner
        draft = runner_cls(draft_model) if draft_model is not None else None
        return cls(ModelRunner(target_model), draft, sampler, tokenizer, draft_topk)

    @classmethod
    def from_paths(cls, target_path: str | Path, draft_path: str | Path | None = None, device=None,
                   **kw) -> "SpeculativeEngine":
        target, tokenizer = load_model(target_path, device)
        draft = load_model(draft_path, device)[0] if draft_path else None
        return cls.from_models(target, draft, tokenizer=tokenizer, **kw)

    def generate(self, prompt_ids: list[int], params: SamplingParams, num_speculative_tokens: int = 4,
                 algorithm: str = "standalone") -> GenerationResult:
        params.validate(self.target.vocab_size)
        check_token_ids(prompt_ids, self.target.vocab_size)
        from verify_service.rejection import MAX_SPEC_LEN

        if not 0 <= num_speculative_tokens <= MAX_SPEC_LEN:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_SPEC_LEN}], got {num_speculative_tokens}")
        if algorithm == "standalone":
            drafter = ModelDrafter(self.draft, self.draft_topk) if self.draft is not None else None
        elif algorithm == "ngram":
            drafter = NgramDrafter()
        else:
            raise ValueError(f"unknown speculative algorithm {algorithm!r} (standalone | ngram)")
        decode = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)) if self.tokenizer else None
        stop = StopChecker(params, eos_token_ids(self.target.model), decode)
        from verify_service.verifier import LocalVerifier

        with torch.inference_mode():
            result = speculative_generate(LocalVerifier(self.target, self.sampler), drafter, prompt_ids, params,
                                          num_speculative_tokens, stop)
        if decode is not None:
            result.text = stop.text()
        return result
