"""In-process speculative generation: the loop with a local drafter and a local verifier.

The same loop the draft service runs against a remote verifier, here with the core's `LocalVerifier` and
rejection sampler in one process (tests, benchmarks, the training tool's evaluation). The difference
between the two is exactly the cost of the network.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import torch

from specmesh.drafters import Algorithm, DraftBatcher, make_drafter
from specmesh.errors import InvalidArgument
from specmesh.loop import GenerationResult, speculative_generate
from specmesh.models import eos_token_ids, load_model
from specmesh.rejection import MAX_SPEC_LEN, RejectionSampler
from specmesh.runtime import Runner
from specmesh.runtime.registry import build_runner
from specmesh.sampling import SamplingParams, StopChecker, check_token_ids
from specmesh.verifier import LocalVerifier

P = ParamSpec("P")
R = TypeVar("R")


def _blocking(coroutine_fn: Callable[P, Coroutine[Any, Any, R]]) -> Callable[P, R]:
    """The coroutine function as a plain one with the same arguments, for synchronous callers: each call runs
    it to completion on an event loop of its own, under inference mode."""

    @functools.wraps(coroutine_fn, assigned=("__module__",))
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch.inference_mode():
            return asyncio.run(coroutine_fn(*args, **kwargs))

    return run


class SpeculativeEngine:
    """prompt ids + SamplingParams -> tokens + stats. K = 0 (or no draft) is target-only decoding."""

    def __init__(
        self,
        target_runner: Runner[Any],
        draft_runner: Runner[Any] | None,
        sampler: RejectionSampler,
        tokenizer=None,
        draft_topk: int = 16,
    ):
        if draft_runner is not None and draft_runner.vocab_size != target_runner.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft_runner.vocab_size}) differs from the target's ({target_runner.vocab_size})"
            )
        self.target = target_runner
        self.draft = draft_runner
        self.sampler = sampler
        self.tokenizer = tokenizer
        self.draft_topk = draft_topk
        # In process the forwards run inline: one session, nothing to overlap with.
        self.batcher = DraftBatcher(draft_runner, draft_topk, tokenizer=tokenizer) if draft_runner is not None else None
        self._grammars: Any = None  # specmesh.structured.GrammarCompiler, built on first use

    @classmethod
    def from_models(
        cls,
        target_model,
        draft_model=None,
        sampler=None,
        tokenizer=None,
        sampler_backend: str = "auto",
        draft_topk: int = 16,
        draft_runner: str = "static",
    ) -> SpeculativeEngine:
        """draft_runner: "static" (StaticCacheRunner, as the draft service uses) or "hf" (ModelRunner)."""
        if sampler is None:
            sampler = RejectionSampler(sampler_backend, device=next(target_model.parameters()).device)
        if draft_runner not in ("static", "hf"):
            raise ValueError(f"draft_runner must be static or hf, got {draft_runner!r}")
        draft = build_runner(draft_model, draft_runner) if draft_model is not None else None
        return cls(build_runner(target_model, "hf"), draft, sampler, tokenizer, draft_topk)

    @classmethod
    def from_paths(
        cls, target_path: str | Path, draft_path: str | Path | None = None, device=None, **kw
    ) -> SpeculativeEngine:
        target, tokenizer = load_model(target_path, device)
        draft = load_model(draft_path, device)[0] if draft_path else None
        return cls.from_models(target, draft, tokenizer=tokenizer, **kw)

    async def agenerate(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        num_speculative_tokens: int = 4,
        algorithm: str = "standalone",
    ) -> GenerationResult:
        """Generate to completion, inside an event loop."""
        params.validate(self.target.vocab_size)
        check_token_ids(prompt_ids, self.target.vocab_size)
        if not 0 <= num_speculative_tokens <= MAX_SPEC_LEN:
            raise InvalidArgument(
                f"num_speculative_tokens must be in [0, {MAX_SPEC_LEN}], got {num_speculative_tokens}"
            )
        drafter = make_drafter(Algorithm.parse(algorithm), self.batcher)
        decode = (lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)) if self.tokenizer else None
        eos = eos_token_ids(self.target.model)
        stop = StopChecker(params, eos, decode)
        # No torch.inference_mode() around the await: the mode is per thread, so held across an await it
        # leaks into whatever else the event loop runs meanwhile, and two generations whose with-blocks
        # interleave restore each other's state, leaving the thread in inference mode for good. The
        # verifier and the drafters enter it around their own (synchronous) model work.
        result = await speculative_generate(
            LocalVerifier(self.target, self.sampler, eos, self._grammar_compiler(params, eos)),
            drafter,
            prompt_ids,
            params,
            num_speculative_tokens,
            stop,
        )
        if decode is not None:
            result.text = stop.text()
        return result

    def _grammar_compiler(self, params: SamplingParams, eos: frozenset[int]) -> Any:
        """The target's grammar compiler when a request has a grammar and there is a tokenizer (built once)."""
        if params.structured is None or self.tokenizer is None:
            return None
        if self._grammars is None:
            from specmesh.structured import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer, self.target.vocab_size, sorted(eos))
        return self._grammars

    # The same, from synchronous code.
    generate = _blocking(agenerate)
