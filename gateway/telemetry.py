"""The gateway's Prometheus metrics: requests by endpoint and status, time to first token, inter-token
latency, tokens, speculation totals (per-position acceptance included), queue, replica health and load,
routing decisions, failovers and target-only fallbacks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specmesh.telemetry import FnCollector, RpcMetrics, StreamMetrics, spec_families


class GatewayMetrics:
    """Built before the gateway (which reports stream timings to `stream`); `watch` adds the gateway's
    state: its pools, queue and totals."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        self.rpc = RpcMetrics(self.registry, "gateway")
        self.stream = StreamMetrics(self.registry, "gateway")
        self.gateway = None

    def watch(self, gateway) -> GatewayMetrics:
        self.gateway = gateway
        self.registry.register(FnCollector(self.families))
        return self

    def families(self):
        gw = self.gateway
        g, c = GaugeMetricFamily, CounterMetricFamily
        running = g("specmesh_gateway_running_requests", "Generations running")
        running.add_metric([], gw.inflight)
        queued = g("specmesh_gateway_queue_depth", "Generations waiting for a concurrency slot")
        queued.add_metric([], gw.waiting)
        healthy = g("specmesh_gateway_replica_healthy", "1 if the replica is in its pool", labels=["pool", "replica"])
        load = g("specmesh_gateway_replica_inflight", "Calls in flight to the replica", labels=["pool", "replica"])
        decisions = c("specmesh_gateway_routing_decisions", "Replica choices by kind", labels=["pool", "decision"])
        for pool in (gw.verify_pool, gw.draft_pool):
            for r in pool.replicas.values():
                healthy.add_metric([pool.name, r.address], 1.0 if r.healthy else 0.0)
                load.add_metric([pool.name, r.address], r.inflight)
            for kind, n in pool.decisions.items():
                decisions.add_metric([pool.name, kind], n)
        failovers = c("specmesh_gateway_failovers", "Generations moved to another replica mid-stream")
        failovers.add_metric([], gw.failovers)
        target_only = c("specmesh_gateway_target_only", "Generations decoded target-only (no healthy draft replica)")
        target_only.add_metric([], gw.target_only_fallbacks)
        return [
            running,
            queued,
            healthy,
            load,
            decisions,
            failovers,
            target_only,
            *spec_families("specmesh_gateway", gw.totals),
        ]
