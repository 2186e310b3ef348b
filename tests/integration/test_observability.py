"""Traces across the three services, Prometheus metrics on each, JSON logs with trace and request ids."""

import io
import json
import logging
import re
import urllib.request

import grpc
import openai
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from specmesh import telemetry
from specmesh.v1 import common_pb2, draft_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.models import ROOT, demo_target, noisy_copy
from tests.support.services import GatewayServer, draft_stub, start_draft, start_verify

VLLM_SPEC = ("drafts", "draft_tokens", "accepted_tokens")


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    assert telemetry.setup_tracing("tests", exporter=exporter) is not None
    return exporter


@pytest.fixture(scope="module")
def stack(spans, tokenizer):
    target = demo_target(tokenizer, seed=41)
    verify = start_verify(target, tokenizer, metrics_port=0)
    draft = start_draft(noisy_copy(target, 0.03), verify.address, metrics_port=0)
    gw = GatewayServer([verify.address], [draft.address], tokenizer)
    yield gw, verify, draft
    gw.stop()
    draft.stop()
    verify.stop()


def scrape(url: str) -> dict:
    """name -> list of (labels, value) for every sample of a /metrics page (parsed by Prometheus' parser)."""
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def total(samples, name, **labels) -> float:
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == w for k, w in labels.items()))


def test_one_trace_spans_all_three_services(stack, spans):
    gw, _, _ = stack
    spans.clear()
    client = gw.openai()
    r = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 24
    import time

    for _ in range(200):  # the services end their spans just after the client has its answer
        finished = spans.get_finished_spans()
        root = next(s for s in finished if s.name == "gateway.chat")
        tid = root.context.trace_id
        in_trace = [s for s in finished if s.context.trace_id == tid]
        if {"draft/Generate", "verify/Verify"} <= {s.name for s in in_trace}:
            break
        time.sleep(0.01)
    scopes = {s.instrumentation_scope.name for s in in_trace}
    assert {"specmesh.gateway", "specmesh.draft", "specmesh.verify"} <= scopes, scopes
    names = {s.name for s in in_trace}
    assert {"draft/Generate", "verify/OpenSession", "verify/Verify", "draft.round", "verify.round"} <= names
    rounds = [s for s in in_trace if s.name == "draft.round"]
    assert sum(s.attributes["specmesh.committed"] for s in rounds) >= 24
    assert all("specmesh.k" in s.attributes and "specmesh.accepted" in s.attributes for s in rounds)
    vround = next(s for s in in_trace if s.name == "verify.round")
    assert vround.attributes["specmesh.batch_size"] >= 1 and "specmesh.queue_seconds" in vround.attributes
    # every span of the trace hangs off the gateway's request span
    by_id = {s.context.span_id: s for s in in_trace}
    for s in in_trace:
        node = s
        while node.parent is not None and node.parent.span_id in by_id:
            node = by_id[node.parent.span_id]
        assert node is root, s.name
    # verify batches are their own traces, linked to the sessions they served
    batches = [s for s in finished if s.name == "verify.batch" and any(ln.context.trace_id == tid for ln in s.links)]
    assert batches and all(b.attributes["specmesh.batch_size"] >= 1 for b in batches)


def test_metrics_on_every_service_move_with_requests(stack, tokenizer):
    gw, verify, draft = stack
    urls = {
        "gateway": gw.base_url + "/metrics",
        "verify": f"http://127.0.0.1:{verify.server.metrics_port}/metrics",
        "draft": f"http://127.0.0.1:{draft.server.metrics_port}/metrics",
    }
    before = {k: scrape(u) for k, u in urls.items()}
    client = gw.openai()
    prompts = ("import re\n", "class Node:\n")
    finishes = []
    for prompt in prompts:
        chunks = client.completions.create(model="demo", prompt=prompt, max_tokens=20, temperature=0, stream=True)
        finishes += [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    with pytest.raises(openai.BadRequestError):  # refused by the gateway's validation, before any routing
        client.completions.create(model="demo", prompt="x", max_tokens=-1)
    # and an error of the draft service's own: ids outside the vocabulary, sent to it directly
    with pytest.raises(grpc.RpcError) as refused:
        list(
            draft_stub(draft).Generate(
                draft_pb2.DraftServiceGenerateRequest(
                    prompt_ids=[1, 10**7], params=common_pb2.SamplingParams(max_tokens=2)
                ),
                timeout=30,
            )
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    import time

    def moved(service, name, **labels):
        return total(after[service], name, **labels) - total(before[service], name, **labels)

    for _ in range(100):  # the services count a request when its handler ends, just after the client's answer
        after = {k: scrape(u) for k, u in urls.items()}
        if (
            moved("draft", "specmesh_requests_total", method="Generate") >= 3
            and moved("verify", "specmesh_requests_total", method="Verify") >= 2
            and moved("gateway", "specmesh_requests_total", method="POST /v1/completions") >= 3
        ):
            break
        time.sleep(0.02)

    g = "gateway"
    assert moved(g, "specmesh_requests_total", method="POST /v1/completions", code="200") == 2
    assert moved(g, "specmesh_request_errors_total", method="POST /v1/completions", code="400") == 1
    # successes are not errors: the REST front's statuses are HTTP codes, only >= 400 count
    assert moved(g, "specmesh_request_errors_total", code="200") == 0
    assert moved(g, "specmesh_request_errors_total") == 1
    assert moved(g, "specmesh_time_to_first_token_seconds_count") == 2
    # one observation per token after each stream's first chunk (which counts in TTFT)
    assert 0 < moved(g, "specmesh_inter_token_latency_seconds_count") <= 38
    assert moved(g, "specmesh_generated_tokens_total") == 40
    assert moved(g, "specmesh_gateway_spec_draft_tokens_total") > 0
    assert total(after[g], "specmesh_gateway_replica_healthy", pool="verify") == 1
    assert moved(g, "specmesh_gateway_routing_decisions_total", pool="verify") == 2
    assert after[g]["specmesh_gateway_spec_accepted_tokens_per_pos_total"]  # per-position acceptance
    # vLLM's names, labelled with the served model name
    prompt_tokens = sum(len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts)
    assert moved(g, "vllm:prompt_tokens_total", model_name="demo") == prompt_tokens
    assert moved(g, "vllm:generation_tokens_total", model_name="demo") == 40
    assert len(finishes) == 2
    for reason in ("stop", "length", "abort"):
        want = finishes.count(reason)
        assert moved(g, "vllm:request_success_total", model_name="demo", finished_reason=reason) == want, reason
    assert total(after[g], "vllm:num_requests_running", model_name="demo") == 0

    d = "draft"
    assert moved(d, "specmesh_requests_total", method="Generate", code="OK") == 2
    assert moved(d, "specmesh_request_errors_total", method="Generate", code="INVALID_ARGUMENT") == 1
    assert moved(d, "specmesh_request_errors_total", code="OK") == 0
    assert moved(d, "specmesh_draft_spec_rounds_total") > 0
    assert moved(d, "specmesh_draft_spec_accepted_tokens_per_pos_total", position="0") > 0
    # mean accepted length over this window, from counters as PromQL would: 1 + accepted / rounds
    length = 1 + moved(d, "specmesh_draft_spec_accepted_tokens_total") / moved(d, "specmesh_draft_spec_rounds_total")
    assert 1 < length <= 5
    assert total(after[d], "specmesh_draft_seconds_per_token") > 0

    v = "verify"
    assert moved(v, "specmesh_requests_total", method="Verify", code="OK") == 2
    assert moved(v, "specmesh_request_errors_total") == 0
    assert moved(v, "specmesh_verify_batch_size_count") > 0
    assert moved(v, "specmesh_verify_spec_draft_tokens_total") == moved(d, "specmesh_draft_spec_draft_tokens_total")
    assert moved(v, "specmesh_verify_emitted_tokens_total") == 40
    assert total(after[v], "specmesh_verify_sessions", state="active") == 0
    assert "specmesh_verify_kv_cache_bytes" in after[v] and "specmesh_verify_queue_depth" in after[v]
    assert after[v]["specmesh_verify_spec_accepted_tokens_per_pos_total"]
    # vLLM's spec-decode counters: the verify service's own totals under vLLM's names (model_name: the
    # model path as given, vLLM's label without a served name)
    vllm = {m: moved(v, f"vllm:spec_decode_num_{m}_total", model_name="(in-memory)") for m in VLLM_SPEC}
    assert vllm["drafts"] == moved(v, "specmesh_verify_spec_rounds_total") > 0
    assert vllm["draft_tokens"] == moved(d, "specmesh_draft_spec_draft_tokens_total") > vllm["drafts"]
    assert 0 < vllm["accepted_tokens"] == moved(d, "specmesh_draft_spec_accepted_tokens_total")
    per_pos = [
        (int(lab["position"]), val - total(before[v], "vllm:spec_decode_num_accepted_tokens_per_pos_total", **lab))
        for lab, val in after[v]["vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    ]
    assert sum(n for _, n in per_pos) == vllm["accepted_tokens"]
    ordered = [n for _, n in sorted(per_pos)]
    assert ordered == sorted(ordered, reverse=True)  # position i is accepted only after 0..i-1 were
    assert 0 <= total(after[v], "vllm:kv_cache_usage_perc") <= 1


# PromQL words that are not metric names (aggregation modifiers, set operators)
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless", "offset"}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers, less function calls, keywords, label
    matchers, ranges and grouping labels."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}", "", expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", expr):
        if m.group(0) not in PROMQL_WORDS and not expr[m.end() :].lstrip().startswith("("):
            names.add(m.group(0))
    return names


def test_promql_metric_names():
    expr = 'histogram_quantile(0.99, sum by (le) (rate(a_bucket{service="x",le=~"1"}[$__rate_interval]))) / b:c_total'
    assert promql_metric_names(expr) == {"a_bucket", "b:c_total"}
    assert promql_metric_names("1 + sum(rate(x[5m])) / scalar(y) and on (position) z") == {"x", "y", "z"}


def test_every_dashboard_query_reads_live_metrics(stack):
    """The Grafana dashboard's queries name only metrics the services really export (after a request)."""
    gw, verify, draft = stack
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "specmesh.json").read_text())
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    exprs = [t["expr"] for p in panels for t in p["targets"]]
    assert all(p["targets"] and p["gridPos"] for p in panels)
    wanted = set().union(*map(promql_metric_names, exprs))
    assert {
        "vllm:spec_decode_num_drafts_total",
        "vllm:spec_decode_num_draft_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_total",
        "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "vllm:request_success_total",
        "vllm:prompt_tokens_total",
        "specmesh_request_errors_total",
    } <= wanted
    client = gw.openai()
    list(client.completions.create(model="demo", prompt="def f(x):\n", max_tokens=12, temperature=0, stream=True))
    with pytest.raises(openai.BadRequestError):  # so that the error counter has a sample
        client.completions.create(model="demo", prompt="x", max_tokens=-1)
    urls = [
        gw.base_url + "/metrics",
        f"http://127.0.0.1:{verify.server.metrics_port}/metrics",
        f"http://127.0.0.1:{draft.server.metrics_port}/metrics",
    ]
    live: set[str] = set()
    for url in urls:
        live |= set(scrape(url))
    assert not wanted - live, sorted(wanted - live)


def test_target_only_requests_never_reach_the_draft_service(stack):
    gw, _, draft = stack
    urls = {"gateway": gw.base_url + "/metrics", "draft": f"http://127.0.0.1:{draft.server.metrics_port}/metrics"}
    before = {k: scrape(u) for k, u in urls.items()}
    client = gw.openai()
    r = client.completions.create(
        model="demo", prompt="x = ", max_tokens=8, temperature=0, extra_body={"num_speculative_tokens": 0}
    )
    assert r.model_extra["specmesh"]["drafted"] == 0
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gw.grpc_address))
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=8)
    assert stub.Generate(
        gateway_pb2.GatewayServiceGenerateRequest(prompt="y = ", params=params, num_speculative_tokens=0)
    ).target_only
    # then one speculative request: the draft service counts a call when its handler ends, so by the time
    # this one is counted the earlier ones would have been too
    client.completions.create(model="demo", prompt="z = ", max_tokens=8, temperature=0)
    import time

    def moved(service, name, **labels):
        return total(after[service], name, **labels) - total(before[service], name, **labels)

    for _ in range(100):
        after = {k: scrape(u) for k, u in urls.items()}
        if moved("draft", "specmesh_requests_total", method="Generate") >= 1:
            break
        time.sleep(0.02)
    assert moved("draft", "specmesh_requests_total", method="Generate") == 1
    g = "gateway"
    assert moved(g, "specmesh_gateway_routing_decisions_total", pool="draft", decision="target_only_requested") == 2
    assert moved(g, "specmesh_gateway_target_only_total") == 0  # asked for: not a "no healthy draft" fallback


def test_json_logs_carry_trace_and_request_ids(spans):
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(telemetry.JsonFormatter("gateway"))
    log = logging.getLogger("specmesh.test.json")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    token = telemetry.REQUEST_ID.set("cmpl-123")
    try:
        with telemetry.tracer("gateway").start_as_current_span("work") as span:
            log.info("hello %s", "world")
        entry = json.loads(out.getvalue())
        assert entry["message"] == "hello world" and entry["service"] == "gateway" and entry["level"] == "INFO"
        assert entry["request_id"] == "cmpl-123"
        assert entry["trace_id"] == format(span.get_span_context().trace_id, "032x")
    finally:
        telemetry.REQUEST_ID.reset(token)
        log.removeHandler(handler)


def test_tracing_exporter_follows_otel_env(monkeypatch):
    for var in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(var, raising=False)
    assert telemetry.tracing_exporter_kind() == "none"  # off by default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4317")
    assert telemetry.tracing_exporter_kind() == "otlp"
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    assert telemetry.tracing_exporter_kind() == "console"
    assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider) is False


def test_otlp_and_console_exporters_install_from_env():
    import subprocess
    import sys

    code = (
        "from specmesh import telemetry\n"
        "p = telemetry.setup_tracing('verify')\n"
        "assert p is not None, 'tracing not set up'\n"
        "print(type(p._active_span_processor._span_processors[0].span_exporter).__name__)\n"
        "p.shutdown()\n"
    )
    for env, exporter in (
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1"}, "OTLPSpanExporter"),
        ({"OTEL_TRACES_EXPORTER": "console"}, "ConsoleSpanExporter"),
    ):
        import os

        clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        out = subprocess.run(
            [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert out.returncode == 0, out.stderr
        assert exporter in out.stdout
