"""The gateway's Prometheus metrics: requests by endpoint and status, time to first token, inter-token
latency, tokens, speculation totals (per-position acceptance included), queue, replica health and load,
routing decisions, failovers and target-only fallbacks; and, under vLLM's names with its `model_name`
label (the served name), what vLLM's API server counts: prompt and generated tokens, finished requests by
reason, requests running and waiting. vLLM's spec-decode counters come from the verify service, which
sees every verified block (a gateway's totals would count only its own requests, once they end)."""

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
        handoffs_doc = "Goodput probes whose draft replica measured speculation losing and handed the rest back"
        return [
            g("specmesh_gateway_running_requests", "Generations running", value=gw.inflight),
            g("specmesh_gateway_queue_depth", "Generations waiting for a concurrency slot", value=gw.waiting),
            healthy,
            load,
            decisions,
            c("specmesh_gateway_failovers", "Generations moved to another replica mid-stream", value=gw.failovers),
            c("specmesh_gateway_target_only", target_only_doc, value=gw.target_only_fallbacks),
            c("specmesh_gateway_handoffs", handoffs_doc, value=gw.handoffs),
            *spec_families("specmesh_gateway", gw.totals),
            *self.vllm_families(gw),
        ]

    def vllm_families(self, gw) -> list:
        g, c = GaugeMetricFamily, CounterMetricFamily
        model = [gw.config.model_name]
        s = self.stream
        assert s is not None  # the gateway's metrics always time streams
        running = g("vllm:num_requests_running", "Generations running", labels=["model_name"])
        running.add_metric(model, gw.inflight)
        waiting = g("vllm:num_requests_waiting", "Generations waiting for a concurrency slot", labels=["model_name"])
        waiting.add_metric(model, gw.waiting)
        prompt = c("vllm:prompt_tokens", "Prompt tokens of the generations admitted", labels=["model_name"])
        prompt.add_metric(model, s.prompt_tokens)
        generated = c("vllm:generation_tokens", "Tokens generated", labels=["model_name"])
        generated.add_metric(model, s.generated_tokens)
        success_doc = "Generations finished, by finish reason (abort: the client went away; error: it failed)"
        success = c("vllm:request_success", success_doc, labels=["model_name", "finished_reason"])
        for reason in sorted({"stop", "length", "abort", "error"} | s.finished.keys()):
            success.add_metric([*model, reason], s.finished.get(reason, 0))
        return [running, waiting, prompt, generated, success]
