"""The draft service's Prometheus metrics: requests, time to first token, inter-token latency, tokens,
vLLM's speculation metrics (per-position acceptance included), pipelining, draft speed and the size of
the batched draft forwards."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specmesh.telemetry import LATENCY_BUCKETS, FnCollector, RpcMetrics, StreamMetrics, spec_families

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


class DraftMetrics:
    """Built before the engine (which reports stream timings to `stream`); `watch` adds the engine's state."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.rpc = RpcMetrics(self.registry, "draft")
        self.stream = StreamMetrics(self.registry, "draft")
        self.batch_size = Histogram(
            "specmesh_draft_batch_size",
            "Sessions advanced by one batched draft forward",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "specmesh_draft_batch_duration_seconds",
            "One batched draft forward + sampling",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.engine = None

    def on_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def watch(self, engine) -> DraftMetrics:
        self.engine = engine
        self.registry.register(FnCollector(self.families))
        return self

    def families(self):
        e = self.engine
        active = GaugeMetricFamily("specmesh_draft_active_sessions", "Generations in progress")
        active.add_metric([], e.active)
        cached = GaugeMetricFamily("specmesh_draft_cached_sessions", "Per-session draft KV caches kept for later turns")
        cached.add_metric([], e.cached_sessions)
        per_token = GaugeMetricFamily("specmesh_draft_seconds_per_token", "Mean time to draft one token")
        per_token.add_metric([], e.draft_seconds_per_token())
        pipelined = CounterMetricFamily(
            "specmesh_draft_pipelined_blocks",
            "Blocks drafted while the previous one was verified, by outcome",
            labels=["outcome"],
        )
        pipelined.add_metric(["used"], e.totals.pipelined_used)
        pipelined.add_metric(["discarded"], e.totals.pipelined_discarded)
        return [active, cached, per_token, pipelined] + spec_families("specmesh_draft", e.totals)
