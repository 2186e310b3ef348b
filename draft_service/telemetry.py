"""The draft service's Prometheus metrics: requests, time to first token, inter-token latency, tokens,
vLLM's speculation metrics (per-position acceptance included) by the method that drafted, pipelining,
draft speed, the size of the batched draft forwards, and the suffix method's global trees."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specmesh.telemetry import BatchMetrics, ServiceMetrics, spec_families

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class DraftMetrics(ServiceMetrics):
    """Built before the engine (which reports stream timings to `stream`, batches to `on_batch`); `watch`
    adds the engine's state."""

    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__("draft", registry)
        self.batches = BatchMetrics(
            self.registry,
            "specmesh_draft",
            "Sessions advanced by one batched draft forward",
            "One batched draft forward + sampling",
            BATCH_BUCKETS,
        )
        self.on_batch = self.batches.observe

    def families(self, e) -> list:
        g = GaugeMetricFamily
        pipelined = CounterMetricFamily(
            "specmesh_draft_pipelined_blocks",
            "Blocks drafted while the previous one was verified, by outcome",
            labels=["outcome"],
        )
        pipelined.add_metric(["used"], e.totals.pipelined_used)
        pipelined.add_metric(["discarded"], e.totals.pipelined_discarded)
        chained = CounterMetricFamily(
            "specmesh_draft_chained_blocks",
            "Blocks of the suffix trees sent right behind the block before them, before its verdict, by outcome "
            "(used: the verdict took that block whole and ended as guessed; discarded: answered stale)",
            labels=["outcome"],
        )
        chained.add_metric(["used"], e.totals.chained_used)
        chained.add_metric(["discarded"], e.totals.chained_discarded)
        cached_doc = "Per-session draft KV caches kept for later turns"
        goodput = g(
            "specmesh_draft_goodput_tokens_per_second",
            "Tokens committed per second of a session's wall time, as the goodput guard of its kind (greedy or "
            "sampled, and the verify batch by powers of two: 1, 2, 4, ... 32 sessions and up) measures them: "
            "target-only steps, rounds the model drafted (speculative), rounds with a block that cost no draft "
            "forward (free_block: the suffix trees')",
            labels=["mode", "sampling", "batch"],
        )
        guards = e.goodput_guards.guards if e.goodput_guards is not None else {}
        for (greedy, batch), guard in sorted(guards.items()):
            for mode, speculative, free in (
                ("speculative", True, False),
                ("target_only", False, False),
                ("free_block", True, True),
            ):
                rate = guard.rate(speculative, free)
                if rate is not None:
                    goodput.add_metric([mode, "greedy" if greedy else "sampled", str(batch)], rate)
        return [
            goodput,
            g("specmesh_draft_active_sessions", "Generations in progress", value=e.active),
            g("specmesh_draft_cached_sessions", cached_doc, value=e.cached_sessions),
            g("specmesh_draft_seconds_per_token", "Mean time to draft one token", value=e.draft_seconds_per_token()),
            pipelined,
            chained,
            # Finished generations' rounds and where their time went (`specmesh profile`'s round budget).
            CounterMetricFamily("specmesh_draft_generation_rounds", "Rounds, K = 0 included", value=e.totals.rounds),
            CounterMetricFamily(
                "specmesh_draft_round_draft_seconds",
                "Rounds' time drafting (ahead included)",
                value=e.totals.draft_seconds,
            ),
            CounterMetricFamily(
                "specmesh_draft_round_verify_wait_seconds",
                "Rounds' wait from sending a block to its verdict",
                value=e.totals.verify_seconds,
            ),
            *method_spec_families("specmesh_draft", e.by_method),
            *suffix_families(e.suffix),
            *prefix_families(e.runner),
        ]


def prefix_families(runner) -> list:
    """The draft KV's prefix cache (a new sequence's prompt found in a freed slot or in shared blocks of its
    scope), as vLLM counts its own: tokens looked up and tokens found. Nothing for a runner without one."""
    if not hasattr(runner, "prefix_cache_hit_tokens"):
        return []
    return [
        CounterMetricFamily(
            "specmesh_draft_prefix_cache_queries",
            "Prompt tokens of new draft sequences looked up in the draft KV cache",
            value=runner.prefix_cache_query_tokens,
        ),
        CounterMetricFamily(
            "specmesh_draft_prefix_cache_hits",
            "Prompt tokens whose draft KV a new sequence found cached (not prefilled again)",
            value=runner.prefix_cache_hit_tokens,
        ),
    ]


def method_spec_families(prefix: str, by_method: dict) -> list:
    """`spec_families` with a `method` label (model, ngram, suffix): one sample per method that drafted."""
    merged: dict[str, Metric] = {}
    for method, stats in by_method.items():
        for family in spec_families(prefix, stats):
            samples = [s._replace(labels={**s.labels, "method": method}) for s in family.samples]
            if family.name in merged:  # one family per metric, every method's samples in it
                merged[family.name].samples += samples
            else:
                family.samples = samples
                merged[family.name] = family
    return list(merged.values())


def suffix_families(cache) -> list:
    """The suffix method's global trees (nothing without them)."""
    if cache is None:
        return []
    g = GaugeMetricFamily
    proposals = CounterMetricFamily(
        "specmesh_draft_suffix_proposals",
        "Suffix proposals, by the tree whose continuation won (local: the request's own, global: recent "
        "generations', none: no continuation)",
        labels=["source"],
    )
    for source, n in cache.proposals.items():
        proposals.add_metric([source or "none"], n)
    tokens = CounterMetricFamily(
        "specmesh_draft_suffix_proposed_tokens", "Tokens of suffix proposals, by their tree", labels=["source"]
    )
    for source, n in cache.proposed_tokens.items():
        tokens.add_metric([source], n)
    return [
        g("specmesh_draft_suffix_cache_bytes", "Memory of the global suffix trees", value=cache.nbytes()),
        g(
            "specmesh_draft_suffix_cached_requests",
            "Generations whose outputs the global trees hold",
            value=cache.cached_requests,
        ),
        g("specmesh_draft_suffix_cache_tokens", "Tokens the global trees hold", value=cache.tokens()),
        g(
            "specmesh_draft_suffix_cache_scopes",
            "Prefix-cache scopes (tenant, cache_salt) with a global tree",
            value=cache.scopes,
        ),
        CounterMetricFamily(
            "specmesh_draft_suffix_evicted_requests", "Generations evicted from the global trees", value=cache.evicted
        ),
        proposals,
        tokens,
    ]
