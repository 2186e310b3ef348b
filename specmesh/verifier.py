"""Verification without transport: one batched target forward + one rejection-sampler call per step.

`verify_batch` is what the in-process `LocalVerifier` runs for its one sequence. The verify service's
scheduler runs the same two halves, but its pass may carry other sessions' prefill chunks as well
(`Runner.step`), so it calls the step itself and then `sample_and_commit`: one sampling and
commit path for both.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Any

import torch

from specmesh.domain import DraftBlock, Verdict
from specmesh.errors import InvalidArgument
from specmesh.rejection import RejectionInput, RejectionSampler
from specmesh.runtime import Runner, RunnerSequence, SeqT
from specmesh.sampling import LogitsContext, SamplingParams, make_generator, output_start


def verify_batch(
    runner: Runner[SeqT], sampler: RejectionSampler, seqs: list[SeqT], blocks: list[RejectionInput]
) -> list[Verdict]:
    """Verify each sequence's block; commit the results to the sequences. Blocks must be validated."""
    logits = runner.forward(seqs, [b.token_ids for b in blocks])
    return sample_and_commit(sampler, logits, seqs, blocks)


def sample_and_commit(
    sampler: RejectionSampler,
    logits: Sequence[torch.Tensor],
    seqs: Sequence[RunnerSequence],
    blocks: list[RejectionInput],
) -> list[Verdict]:
    """One sampler launch over the target's logits of every block (per sequence [k_i + 1, V], as a runner's
    forward returns them); commit each sequence's accepted tokens and its recovered or bonus token."""
    if not blocks:
        return []
    out = sampler(logits[0] if len(logits) == 1 else torch.cat(list(logits)), blocks)  # one: no copy
    verdicts = []
    for i, seq in enumerate(seqs):
        tokens = out.tokens(i)
        seq.commit(tokens)
        verdicts.append(Verdict(tokens, out.num_accepted[i], blocks[i].k, logprobs=out.logprobs[i]))
    return verdicts


class LocalVerifier:
    """The `Verifier` of in-process generation: one sequence, verified in this process."""

    def __init__(
        self,
        runner: Runner[Any],
        sampler: RejectionSampler,
        eos_token_ids: frozenset[int] = frozenset(),
        grammars: Any = None,
    ):
        self.runner = runner
        self.sampler = sampler
        self.eos_token_ids = eos_token_ids  # held back by min_tokens
        self.grammars = grammars  # specmesh.structured.GrammarCompiler, for structured output
        self.grammar: Any = None
        self.seq: RunnerSequence | None = None

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.params = params
        self.output_start = output_start(len(prompt_ids), params)
        self.generator = make_generator(params.seed, self.runner.device)
        self.grammar = None
        if params.structured is not None:
            if self.grammars is None:
                raise InvalidArgument(f"{params.structured.field_name}: structured output needs a tokenizer")
            self.grammar = self.grammars.grammar(params.structured)
        with torch.inference_mode():  # never across an await: the mode is the thread's, not this task's
            if self.seq is None:
                self.seq = self.runner.new_sequence(prompt_ids)
            else:
                self.seq.reset_tokens(prompt_ids)  # a new turn: the cached common prefix is reused
            self.runner.prefill(self.seq)

    async def submit(self, proposal: DraftBlock) -> Verdict:
        assert self.seq is not None  # start() comes first
        context = LogitsContext(self.seq.token_ids, self.output_start, (), self.eos_token_ids, self.grammar)
        block = RejectionInput(proposal, self.params, self.generator, context)
        with torch.inference_mode():
            return verify_batch(self.runner, self.sampler, [self.seq], [block])[0]

    async def target_only(self, steps: int) -> AsyncGenerator[Verdict, None]:
        for _ in range(steps):
            yield await self.submit(DraftBlock([]))
