"""Tracing, metrics and logs, set up once per process.

**Tracing** (OpenTelemetry). `setup_tracing(service)` installs the process's TracerProvider; the exporter
follows the standard variables: `OTEL_TRACES_EXPORTER` = `otlp` | `console` | `none`; when it is unset,
OTLP (gRPC) is used if `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is set, and
tracing is off otherwise. The service name is `OTEL_SERVICE_NAME`, else `specmesh-<service>`. Trace
context crosses services in gRPC metadata (W3C `traceparent`), injected by `outgoing_metadata()` and
extracted by `incoming_context()`.

**Metrics** (Prometheus). Each service owns a `CollectorRegistry`; gRPC services serve it over a small HTTP
server (`serve_metrics`), the gateway on its REST port at `/metrics`. `RpcMetrics` counts requests by
method and status code and their latency; `ServiceMetrics` holds them with a service's stream latencies and
builds its live families at scrape time; services add their own histograms (`BatchMetrics`) and families.

**Logs**. `setup_logging(level, fmt)`: plain text, or one JSON object per line (`--log-format json`) with
the trace and span ids of the current span and the request id (`x-request-id`, set by the gateway and
passed downstream in metadata).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import os
import sys
import time
from collections.abc import Iterable
from typing import Self
from wsgiref.simple_server import WSGIServer

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector, start_http_server

REQUEST_ID = contextvars.ContextVar("specmesh_request_id", default="")
REQUEST_ID_KEY = "x-request-id"


# tracing -----------------------------------------------------------------------------------------------
def tracing_exporter_kind() -> str:
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if kind:
        return kind.split(",")[0]
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        return "otlp"
    return "none"


def setup_tracing(service: str, exporter=None) -> TracerProvider | None:
    """Install the global TracerProvider once. `exporter` (tests: an in-memory one) overrides the env."""
    kind = "custom" if exporter is not None else tracing_exporter_kind()
    if kind == "none":
        return None
    current = trace.get_tracer_provider()
    if isinstance(current, TracerProvider):  # already set up in this process
        if exporter is not None:
            current.add_span_processor(SimpleSpanProcessor(exporter))
        return current
    name = os.environ.get("OTEL_SERVICE_NAME") or f"specmesh-{service}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    elif kind == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif kind == "otlp":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    else:
        logging.getLogger("specmesh.telemetry").warning("unknown OTEL_TRACES_EXPORTER %r: tracing off", kind)
        return None
    trace.set_tracer_provider(provider)
    return provider


def tracer(service: str) -> trace.Tracer:
    return trace.get_tracer(f"specmesh.{service}")


def outgoing_metadata(extra: Iterable[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
    """gRPC metadata carrying the current trace context and request id."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    rid = REQUEST_ID.get()
    if rid:
        carrier[REQUEST_ID_KEY] = rid
    return tuple(carrier.items()) + tuple(extra)


def incoming_context(context):
    """The trace context sent by the caller (or the current one), and set the request id from metadata."""
    md = {k: v for k, v in (context.invocation_metadata() or ())}
    if md.get(REQUEST_ID_KEY):
        REQUEST_ID.set(md[REQUEST_ID_KEY])
    return propagate.extract(md)


def wall_ns(perf: float, now_perf: float | None = None) -> int:
    """A perf_counter() instant as wall-clock ns (spans recorded after the fact)."""
    now_perf = time.perf_counter() if now_perf is None else now_perf
    return time.time_ns() - int((now_perf - perf) * 1e9)


# metrics -----------------------------------------------------------------------------------------------
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _latency(registry: CollectorRegistry, name: str, doc: str, labels: list[str]) -> Histogram:
    return Histogram(name, doc, labels, buckets=LATENCY_BUCKETS, registry=registry)


class RpcMetrics:
    """Requests by method and final status code, and their duration, for one service."""

    def __init__(self, registry: CollectorRegistry, service: str):
        self.service = service
        counter = functools.partial(Counter, labelnames=["service", "method", "code"], registry=registry)
        self.requests = counter("specmesh_requests", "Requests handled, by method and status code")
        self.errors = counter("specmesh_request_errors", "Requests that ended with an error, by status code")
        duration_doc = "Time from request to its last response"
        self.duration = _latency(registry, "specmesh_request_duration_seconds", duration_doc, ["service", "method"])

    def observe(self, method: str, code: str, seconds: float) -> None:
        self.requests.labels(self.service, method, code).inc()
        if is_error(code):
            self.errors.labels(self.service, method, code).inc()
        self.duration.labels(self.service, method).observe(seconds)


def is_error(code: str) -> bool:
    """Whether a final status is an error: the REST front reports HTTP statuses ("200", "400", "499"), the
    gRPC services status code names ("OK", "INVALID_ARGUMENT"); a client that went away (499) counts too."""
    return int(code) >= 400 if code.isdigit() else code != "OK"


class BatchMetrics:
    """How much work each batched forward of a service took (`size`: rows, sessions or blocks) and how long it
    ran; `observe(size, seconds)` is the `on_batch` a batcher reports to."""

    def __init__(self, registry: CollectorRegistry, prefix: str, size_doc: str, seconds_doc: str, size_buckets):
        self.size = Histogram(f"{prefix}_batch_size", size_doc, buckets=size_buckets, registry=registry)
        self.seconds = Histogram(
            f"{prefix}_batch_duration_seconds", seconds_doc, buckets=LATENCY_BUCKETS, registry=registry
        )

    def observe(self, size: int, seconds: float) -> None:
        self.size.observe(size)
        self.seconds.observe(seconds)


def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """Serve /metrics over HTTP on its own thread; returns the server (port 0 = any free port)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server


# logs --------------------------------------------------------------------------------------------------
class JsonFormatter(logging.Formatter):
    def __init__(self, service: str):
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            entry["trace_id"] = format(ctx.trace_id, "032x")
            entry["span_id"] = format(ctx.span_id, "016x")
        rid = REQUEST_ID.get()
        if rid:
            entry["request_id"] = rid
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str, service: str) -> None:
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


class FnCollector:
    """A Prometheus collector whose metric families are built by `fn()` at scrape time, from live state."""

    def __init__(self, fn):
        self.fn = fn

    def collect(self):
        yield from self.fn()


def spec_families(prefix: str, stats) -> list:
    """A service's speculation counters from a SpecStats-like total (rounds, drafted, accepted, per position).
    Counters only: acceptance over any window is a ratio of rates in PromQL (accepted / draft tokens, and
    1 + accepted / rounds for the mean accepted length), which lifetime gauges could not give."""
    from prometheus_client.core import CounterMetricFamily as C

    table = [  # a list value: one sample per draft position
        ("rounds", "Speculation rounds that verified a draft block", stats.drafts),
        ("draft_tokens", "Draft tokens verified", stats.drafted),
        ("accepted_tokens", "Draft tokens accepted", stats.accepted),
        ("draft_tokens_per_pos", "Rounds that drafted position i", stats.drafted_per_pos),
        ("accepted_tokens_per_pos", "Rounds that accepted the draft token at position i", stats.accepted_per_pos),
    ]
    families = []
    for metric, doc, value in table:
        if isinstance(value, list):
            family = C(f"{prefix}_spec_{metric}", doc, labels=["position"])
            for i, v in enumerate(value):
                family.add_metric([str(i)], v)
        else:
            family = C(f"{prefix}_spec_{metric}", doc, value=value)
        families.append(family)
    return families


def vllm_spec_decode_families(stats, model_name: str) -> list:
    """vLLM's spec-decode counters (its names, its `model_name` label) from a SpecStats-like total, so that
    dashboards and scripts written for vLLM read them unchanged: mean accepted length is
    1 + rate(accepted) / rate(drafts), acceptance rate rate(accepted) / rate(draft tokens)."""
    from prometheus_client.core import CounterMetricFamily as C

    out = []
    for metric, doc, value in (
        ("num_drafts", "Draft blocks verified (rounds with at least one draft token)", stats.drafts),
        ("num_draft_tokens", "Draft tokens verified", stats.drafted),
        ("num_accepted_tokens", "Draft tokens accepted", stats.accepted),
    ):
        family = C(f"vllm:spec_decode_{metric}", doc, labels=["model_name"])
        family.add_metric([model_name], value)
        out.append(family)
    per_pos = C(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at position i of their block",
        labels=["model_name", "position"],
    )
    for i, v in enumerate(stats.accepted_per_pos):
        per_pos.add_metric([model_name, str(i)], v)
    return [*out, per_pos]


class StreamMetrics:
    """Latency of streamed generations: time to first token, inter-token latency, tokens generated; and the
    totals a service exports under vLLM's names (prompt and generated tokens, requests by finish reason)."""

    def __init__(self, registry: CollectorRegistry, service: str):
        self.service = service
        self.ttft = _latency(
            registry, "specmesh_time_to_first_token_seconds", "From the request to its first token", ["service"]
        ).labels(service)
        itl_doc = "Time between tokens of a stream (a chunk's gap spread over its tokens)"
        self.itl = _latency(registry, "specmesh_inter_token_latency_seconds", itl_doc, ["service"]).labels(service)
        self.tokens = Counter(
            "specmesh_generated_tokens", "Tokens generated (rate() gives tokens/s)", ["service"], registry=registry
        ).labels(service)
        self.prompt_tokens = 0
        self.generated_tokens = 0
        self.finished: dict[str, int] = {}  # generations by finish reason (vLLM's: stop, length, abort, error)

    def timer(self, prompt_tokens: int = 0) -> StreamTimer:
        self.prompt_tokens += prompt_tokens
        return StreamTimer(self)

    def finish(self, reason: str) -> None:
        reason = "abort" if reason == "cancelled" else reason  # vLLM's word for it
        self.finished[reason] = self.finished.get(reason, 0) + 1


class StreamTimer:
    """One generation's stream: `tokens(n, finish)` per chunk, then `end()` on every exit path."""

    def __init__(self, metrics: StreamMetrics):
        self.m = metrics
        self.start = self.last = time.perf_counter()
        self.first = True
        self.finish: str | None = None

    def tokens(self, n: int, finish: str | None = None) -> None:
        if finish is not None and self.finish is None:
            self.finish = finish
            self.m.finish(finish)
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first:
            self.m.ttft.observe(now - self.start)
            self.first = False
        else:
            gap = (now - self.last) / n
            for _ in range(n):
                self.m.itl.observe(gap)
        self.last = now
        self.m.tokens.inc(n)
        self.m.generated_tokens += n

    def end(self) -> None:
        """The generation is over. One that never got a finish reason counts as vLLM counts it: `abort` when
        the client went away (the stream closed or cancelled), `error` when it failed; one refused as the
        caller's mistake (a 4xx from downstream) is no finished request, as vLLM rejects such before its
        engine. Called from the generation's `finally`, where the exception in flight says which."""
        if self.finish is not None:
            return
        exc = sys.exc_info()[1]
        if exc is None or isinstance(exc, (GeneratorExit, asyncio.CancelledError)):
            self.finish = "abort"
        elif getattr(exc, "http_status", 500) < 500:
            self.finish = "refused"
            return
        else:
            self.finish = "error"
        self.m.finish(self.finish)


class ServiceMetrics:
    """A service's registry with its RPC metrics and (`streams`) its stream latencies. `watch(source)` adds, at
    every scrape, the families a subclass builds from the live state of what it reports on (`families`)."""

    def __init__(self, service: str, registry: CollectorRegistry | None = None, streams: bool = True):
        self.registry = registry or CollectorRegistry()
        ProcessCollector(registry=self.registry)  # CPU seconds and memory: how busy the process is
        self.rpc = RpcMetrics(self.registry, service)
        self.stream = StreamMetrics(self.registry, service) if streams else None

    def watch(self, source) -> Self:
        self.registry.register(FnCollector(lambda: self.families(source)))
        return self

    def families(self, source) -> list:
        raise NotImplementedError
