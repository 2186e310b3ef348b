"""Batched drafting: one draft-model forward advances every session that is drafting by one token.

Each session's drafter awaits `DraftBatcher.draft(state, k)`; the batcher's tick takes every request waiting
(and every prompt waiting to be prefilled) to the model executor and runs forwards over all of them back to
back, each advancing every session still short of its k by one token sampled under that session's own
parameters. A session that has its k leaves the run and its block goes out when the run ends; a session
whose block is being verified drafts ahead a token at a time (it stops when the verdict arrives), in the
same forwards. Sessions join between runs.

Sampling is exact per session: row i is processed by `apply_context_processing` (penalties, bans, bias,
the session's drafted tokens counted as output, as the verifier counts them) and `process_logits` with
session i's parameters, and sampled from the top `draft_topk` entries renormalised, with session i's
generator; that sparse q is what the block carries, so the verifier's test is exact whatever the batch looked like.

The executor decides where forwards run: inline (in-process generation, one session) or a single model
thread (the draft service), so the event loop never blocks on torch there.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specmesh.futures import settle
from specmesh.models import eos_token_ids
from specmesh.runtime import PrefillChunk, Runner, RunnerSequence
from specmesh.sampling import (
    BatchSamplingParams,
    LogitsContext,
    SamplingParams,
    apply_context_processing,
    output_start,
    process_logits,
    row_argmax,
)

DRAFT_SEED_SALT = 0x5EED_D4AF7  # the draft's stream must differ from the verifier's for the same seed

Executor = Callable[..., Awaitable[Any]]  # run_on_model(fn, *args) -> fn(*args), wherever models run


async def run_inline(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


@dataclass
class DraftState:
    """One session's drafting state: its sequence in the draft runner and how it samples."""

    seq: RunnerSequence
    params: SamplingParams
    generator: torch.Generator
    output_start: int = 0  # where the output begins in seq.token_ids (context-dependent processing)
    grammar: Any = None  # structured output's matcher state (specmesh.structured.Grammar); None = unmasked
    tokens_drafted: int = 0  # including tokens drafted ahead and thrown away
    draft_seconds: float = 0.0  # this session's share of the forwards it took part in

    @classmethod
    def new(cls, seq: RunnerSequence, params: SamplingParams, device) -> DraftState:
        generator = torch.Generator(device=device)
        if params.seed is not None:
            generator.manual_seed(params.seed ^ DRAFT_SEED_SALT)
        else:
            generator.seed()
        return cls(seq, params, generator, output_start(len(seq.token_ids), params))


@dataclass(frozen=True)
class DraftToken:
    token_id: int
    q_ids: torch.Tensor | None  # [S] int64: the support sampled from; None for greedy (a point mass)
    q_probs: torch.Tensor | None  # [S] float32


@dataclass
class _Request:
    state: DraftState
    future: asyncio.Future
    prefill_only: bool = False
    want: int = 1  # draft tokens asked for: drafted in consecutive forwards without leaving the model thread
    drafted: list[DraftToken] = field(default_factory=list)


@dataclass
class BatcherStats:
    forwards: int = 0
    rows: int = 0  # sessions advanced, summed over forwards (rows / forwards = mean draft batch)
    prefills: int = 0
    seconds: float = 0.0
    batch_size_hist: dict[int, int] = field(default_factory=dict)

    @property
    def mean_batch(self) -> float:
        return self.rows / self.forwards if self.forwards else 0.0


class DraftBatcher:
    def __init__(
        self,
        runner: Runner[Any],
        draft_topk: int = 16,
        execute: Executor = run_inline,
        on_batch: Callable[[int, float], None] | None = None,
        tokenizer: Any = None,
    ):
        """`tokenizer` lets drafts follow a request's grammar (structured output); without one they are
        drafted unmasked, still lossless (the verifier masks the target and rejects what the grammar
        refuses), only accepted less often."""
        if draft_topk < 1:
            raise ValueError("draft_topk must be >= 1")
        self.runner = runner
        self.draft_topk = draft_topk
        self.execute = execute
        self.on_batch = on_batch  # (sessions advanced, seconds) per forward, for metrics
        model = getattr(runner, "model", None)
        self.eos_token_ids = eos_token_ids(model) if model is not None else frozenset()  # for min_tokens
        self.tokenizer = tokenizer
        self._grammars: Any = None  # specmesh.structured.GrammarCompiler, built on first use
        self.stats = BatcherStats()
        self._waiting: list[_Request] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    # session side ---------------------------------------------------------------------------------
    def new_state(
        self, prompt_ids: list[int], params: SamplingParams, reuse: DraftState | None = None, scope: bytes = b""
    ) -> DraftState:
        """A session's state for a new turn; `reuse` keeps the previous turn's cache (its common prefix), else
        the runner opens a sequence in `scope` (which may find a cached prefix there)."""
        if reuse is None:
            seq = self.runner.new_sequence(prompt_ids, scope)
        else:
            seq = reuse.seq
            seq.reset_tokens(prompt_ids)
        state = DraftState.new(seq, params, self.runner.device)
        if params.structured is not None and self.tokenizer is not None:
            if self._grammars is None:
                from specmesh.structured import GrammarCompiler

                self._grammars = GrammarCompiler(self.tokenizer, self.runner.vocab_size, sorted(self.eos_token_ids))
            state.grammar = self._grammars.grammar(params.structured)
        if reuse is not None:
            state.tokens_drafted, state.draft_seconds = reuse.tokens_drafted, reuse.draft_seconds
        return state

    async def prefill(self, state: DraftState) -> None:
        """Cache the session's committed tokens, in the next forward with everyone else's work."""
        await self._submit(_Request(state, self._loop().create_future(), prefill_only=True))

    async def draft(self, state: DraftState, n: int) -> list[DraftToken]:
        """The next `n` draft tokens after the state's sequence (committed + assumed tokens), each appended to
        `state.seq.token_ids` as it is drafted (the next forward feeds it).

        The n forwards run back to back on the model thread, each with every other session drafting then:
        one hand-off to the model thread per block rather than per token (each costs the event loop, the
        thread switch and every waiting session's wake-up), and sessions that start a block together draft
        it together, so their blocks reach the verifier together and share its batch. A session asking in
        the middle of a run joins the next one, at most n forwards later.

        Not cancellable half-way: the model thread owns the sequence's ids until the run ends, so a caller
        that is cancelled still waits for it (at most n forwards) before it lets go of them."""
        inner = asyncio.ensure_future(self._submit(_Request(state, self._loop().create_future(), want=n)))
        try:
            return await asyncio.shield(inner)
        except asyncio.CancelledError:
            await asyncio.wait([inner])
            raise

    # the tick -------------------------------------------------------------------------------------
    def _loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done() or self._task.get_loop() is not loop:
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="draft-batcher")
        return loop

    async def _submit(self, request: _Request):
        self._waiting.append(request)
        assert self._wake is not None  # made by _loop() with the request's future
        self._wake.set()
        return await request.future

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            # One turn of the event loop: sessions answered by the last tick ask for their next token now.
            await asyncio.sleep(0)
            batch = [r for r in self._waiting if not r.future.done()]
            self._waiting = []
            if not batch:
                continue
            try:
                results = await self.execute(self._step, batch)
            except asyncio.CancelledError:  # closing: nobody may wait for these forever
                for request in batch:
                    settle(request.future, RuntimeError("the draft batcher was closed"))
                raise
            except Exception as e:  # noqa: BLE001 - every waiting session gets the error, the batcher lives on
                results = [e] * len(batch)
            for request, result in zip(batch, results, strict=True):
                settle(request.future, result)

    @torch.inference_mode()
    def _step(self, batch: list[_Request]) -> list[list[DraftToken] | None]:
        """Forwards until every request has the tokens it asked for; a request that has them leaves the
        batch (its block is complete), the prefills ride along in the first."""
        decode = [r for r in batch if not r.prefill_only]
        prefill = [r for r in batch if r.prefill_only]
        while True:
            t0 = time.perf_counter()
            logits = self._forward([r.state.seq for r in decode], [r.state.seq for r in prefill])
            tokens = self._sample(logits, [r.state for r in decode]) if decode else []
            for r, t in zip(decode, tokens, strict=True):
                r.state.seq.token_ids.append(t.token_id)
                r.drafted.append(t)
            self._account(decode, prefill, time.perf_counter() - t0)
            decode, prefill = [r for r in decode if len(r.drafted) < r.want], []
            if not decode:
                return [None if r.prefill_only else r.drafted for r in batch]

    def _forward(self, seqs: list[RunnerSequence], prefill: list[RunnerSequence]) -> torch.Tensor:
        """Last-position logits [len(seqs), V] of each sequence, prefills riding along in the same step (in
        its one pass where the runner has `chunked_prefill`)."""
        rows = self.runner.step(seqs, num_logits=[1] * len(seqs), prefill=[PrefillChunk(s) for s in prefill]).logits
        if not seqs:
            return torch.empty(0)
        return torch.cat([r[-1:] for r in rows])

    def _sample(self, logits: torch.Tensor, states: list[DraftState]) -> list[DraftToken]:
        """Row i from session i's processed distribution, truncated to its top draft_topk, renormalised."""
        greedy = [s.params.greedy for s in states]
        out: list[DraftToken | None] = [None] * len(states)
        # seq.token_ids holds the committed tokens, those assumed and those drafted so far: the context the
        # verifier will process this position under.
        contexts = [LogitsContext(s.seq.token_ids, s.output_start, (), self.eos_token_ids, s.grammar) for s in states]
        logits = apply_context_processing(logits, [s.params for s in states], contexts)
        argmax = row_argmax(logits).tolist()
        for i, g in enumerate(greedy):
            if g:
                out[i] = DraftToken(int(argmax[i]), None, None)
        sampled = [i for i, g in enumerate(greedy) if not g]
        if sampled:
            rows = logits[sampled]
            probs = process_logits(
                rows,
                BatchSamplingParams.from_params([states[i].params for i in sampled], [1] * len(sampled), rows.device),
            )
            top_p, top_i = probs.topk(min(self.draft_topk, probs.size(-1)), dim=-1)
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
            for row, i in enumerate(sampled):
                j = int(torch.multinomial(top_p[row], 1, generator=states[i].generator))
                out[i] = DraftToken(int(top_i[row, j]), top_i[row].cpu(), top_p[row].float().cpu())
        return [t for t in out if t is not None]

    def _account(self, decode: list[_Request], prefill: list[_Request], seconds: float) -> None:
        st = self.stats
        st.prefills += len(prefill)
        if not decode:
            return
        st.forwards += 1
        st.rows += len(decode)
        st.seconds += seconds
        st.batch_size_hist[len(decode)] = st.batch_size_hist.get(len(decode), 0) + 1
        for r in decode:
            r.state.tokens_drafted += 1
            r.state.draft_seconds += seconds / len(decode)
        if self.on_batch is not None:
            self.on_batch(len(decode), seconds)
