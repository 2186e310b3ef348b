"""The draft service's side of the predict-verify-optimize loop (`--online-distill`).

Each generation's verifier is wrapped: the session asks the verify replica for the target's top-k at every
committed token (SamplingParams.logprobs), the verdicts feed `specmesh.training.online` (replay buffer,
trainer, versions), and each verified block is counted against the weight version that drafted it. What the
caller asked for is all it sees: feedback it did not ask for is removed from the verdicts before they go
on. Metrics and a trace event per weight swap make the loop visible.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specmesh.domain import DraftBlock, TokenLogprob, Verdict
from specmesh.loop import Verifier
from specmesh.sampling import SamplingParams
from specmesh.telemetry import tracer
from specmesh.training.online import OnlineConfig, OnlineDistiller, RehearsalSet, SessionFeedback


class OnlineLoop:
    """One per draft service: the distiller over the serving draft model and the metrics of the loop."""

    def __init__(self, model, config: OnlineConfig, model_thread: ThreadPoolExecutor):
        self.tracer = tracer("draft")
        self.distiller = OnlineDistiller(model, config, self._on_model_thread(model_thread), self._swapped)

    @staticmethod
    def _on_model_thread(pool: ThreadPoolExecutor) -> Callable[[Callable[[], None]], Future]:
        return lambda fn: pool.submit(fn)

    def _swapped(self, version: int, reason: str) -> None:
        span = self.tracer.start_span("draft.weights_swap", attributes={"specmesh.weights_version": version})
        span.add_event("swap", {"specmesh.weights_version": version, "specmesh.reason": reason})
        span.end()

    def start(self) -> None:
        self.distiller.start()

    def stop(self) -> None:
        self.distiller.stop()
        self.distiller.save_all()

    def wrap(self, verifier: Verifier) -> FeedbackVerifier:
        return FeedbackVerifier(verifier, self)

    def families(self) -> list:
        d = self.distiller
        g, c = GaugeMetricFamily, CounterMetricFamily
        by_version = d.acceptance_by_version()
        drafted = c(
            "specmesh_draft_online_drafted_tokens", "Draft tokens verified, by weight version", labels=["version"]
        )
        accepted = c(
            "specmesh_draft_online_accepted_tokens", "Draft tokens accepted, by weight version", labels=["version"]
        )
        for n, (dr, ac) in sorted(by_version.items()):
            drafted.add_metric([str(n)], dr)
            accepted.add_metric([str(n)], ac)
        return [
            g("specmesh_draft_online_weights_version", "The draft weight version serving now", value=d.serving_version),
            c("specmesh_draft_online_updates", "Weight versions published by the online trainer", value=d.updates),
            c("specmesh_draft_online_rollbacks", "Versions rolled back for a worse live acceptance", value=d.rollbacks),
            c("specmesh_draft_online_train_steps", "Distillation steps taken", value=d.steps),
            g("specmesh_draft_online_buffer_windows", "Training windows in the replay buffer", value=len(d.buffer)),
            g("specmesh_draft_online_train_share", "The trainer's share of wall time", value=d.train_share),
            g(
                "specmesh_draft_online_model_draft_share",
                "The draft model's share of the drafted tokens lately (the rest the suffix trees'): the trainer's "
                "duty follows it",
                value=d.model_share,
            ),
            drafted,
            accepted,
        ]


class FeedbackVerifier:
    """A generation's verifier with the loop around it (see the module's docstring)."""

    def __init__(self, inner: Verifier, loop: OnlineLoop):
        self.inner, self.loop = inner, loop
        self.feedback: SessionFeedback | None = None
        self.asked: int | None = None  # the caller's own logprobs request

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.asked = params.logprobs
        k = self.loop.distiller.config.topk
        await self.inner.start(prompt_ids, replace(params, logprobs=max(params.logprobs or 0, k)))
        self.feedback = self.loop.distiller.session(prompt_ids)

    @property
    def chains(self) -> bool:
        return getattr(self.inner, "chains", False)

    async def submit(
        self, proposal: DraftBlock, then: tuple[DraftBlock, int] | None = None, sent: bool = False
    ) -> Verdict:
        version = self.loop.distiller.serving_version  # the block was drafted by the weights live now
        if then is None and not sent:
            return self._learn(await self.inner.submit(proposal), proposal, version)
        chained = self.inner.submit(proposal, then, sent)  # type: ignore[call-arg]  # chains: see the property
        return self._learn(await chained, proposal, version)

    async def target_only(self, steps: int) -> AsyncGenerator[Verdict, None]:
        # Target-only steps teach the draft as much as verified blocks: the target's distribution at each.
        empty = DraftBlock([])
        async with contextlib.aclosing(self.inner.target_only(steps)) as verdicts:
            async for verdict in verdicts:
                yield self._learn(verdict, empty, self.loop.distiller.serving_version)

    def _learn(self, verdict: Verdict, proposal: DraftBlock, version: int) -> Verdict:
        if verdict.stale:
            return verdict
        assert self.feedback is not None  # start() comes first
        self.feedback.extend(verdict.tokens, verdict.logprobs)
        if verdict.finish_reason is not None:  # the last verdict: a short generation still makes a window
            self.feedback.flush()
        drafted = proposal.k if verdict.num_drafted is None else verdict.num_drafted
        by_model = proposal.method != "suffix"
        self.loop.distiller.record_draft(by_model, drafted)
        if by_model:  # a weight version is judged by the model's drafts alone
            self.loop.distiller.record_round(version, drafted, verdict.num_accepted)
        verdict.logprobs = _as_asked(verdict.logprobs, self.asked)
        return verdict


def _as_asked(logprobs: list[TokenLogprob] | None, asked: int | None) -> list[TokenLogprob] | None:
    if logprobs is None or asked is None:
        return None
    return [replace(t, top=t.top[:asked]) for t in logprobs]


def online_config(config) -> OnlineConfig:
    """The OnlineConfig a DraftConfig's online_distill_* fields describe."""
    return OnlineConfig(
        topk=config.online_distill_topk,
        buffer_windows=config.online_distill_buffer,
        lr=config.online_distill_lr,
        kl_weight=config.online_distill_kl_weight,
        steps_per_version=config.online_distill_steps_per_version,
        cpu_share=config.online_distill_cpu_share,
        rollback_window=config.online_distill_rollback_window,
        dir=Path(config.online_distill_dir) if config.online_distill_dir else None,
        rehearsal=rehearsal_file(config.online_distill_rehearsal, config.model_path),
        rehearsal_share=config.online_distill_rehearsal_share,
    )


def rehearsal_file(setting: str, model_path: str) -> Path | None:
    """--online-distill-rehearsal: "auto" finds the draft's own set if it ships one, "none" is off, anything
    else must be a file."""
    if setting.lower() in ("", "none"):
        return None
    if setting.lower() == "auto":
        own = Path(model_path) / RehearsalSet.FILE if model_path else None
        return own if own is not None and own.is_file() else None
    path = Path(setting)
    if not path.is_file():
        raise ValueError(f"--online-distill-rehearsal {setting}: no such file")
    return path
