"""The gateway's Prometheus metrics: requests by endpoint and status, time to first token, inter-token
latency, tokens, speculation totals (per-position acceptance included), queue, replica health and load,
routing decisions, failovers and target-only fallbacks."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from specmesh.telemetry import ServiceMetrics, spec_families


class GatewayMetrics(ServiceMetrics):
    """Built before the gateway (which reports stream timings to `stream`); `watch` adds the gateway's
    state: its pools, queue and totals."""

    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__("gateway", registry)

    def families(self, gw) -> list:
        g, c = GaugeMetricFamily, CounterMetricFamily
        healthy = g("specmesh_gateway_replica_healthy", "1 if the replica is in its pool", labels=["pool", "replica"])
        load = g("specmesh_gateway_replica_inflight", "Calls in flight to the replica", labels=["pool", "replica"])
        decisions = c("specmesh_gateway_routing_decisions", "Replica choices by kind", labels=["pool", "decision"])
        for pool in (gw.verify_pool, gw.draft_pool):
            for r in pool.replicas.values():
                healthy.add_metric([pool.name, r.address], 1.0 if r.healthy else 0.0)
                load.add_metric([pool.name, r.address], r.inflight)
            for kind, n in pool.decisions.items():
                decisions.add_metric([pool.name, kind], n)
        target_only_doc = "Generations decoded target-only (no healthy draft replica)"
        return [
            g("specmesh_gateway_running_requests", "Generations running", value=gw.inflight),
            g("specmesh_gateway_queue_depth", "Generations waiting for a concurrency slot", value=gw.waiting),
            healthy,
            load,
            decisions,
            c("specmesh_gateway_failovers", "Generations moved to another replica mid-stream", value=gw.failovers),
            c("specmesh_gateway_target_only", target_only_doc, value=gw.target_only_fallbacks),
            *spec_families("specmesh_gateway", gw.totals),
        ]
