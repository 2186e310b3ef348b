"""The shared metrics: what counts as an error, requests by finish reason, and vLLM's spec-decode names in
the Prometheus text format."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specmesh.domain import SpecStats
from specmesh.errors import InvalidArgument, Unavailable
from specmesh.telemetry import FnCollector, RpcMetrics, StreamMetrics, is_error, vllm_spec_decode_families


def samples(registry: CollectorRegistry) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


@pytest.mark.parametrize(
    "code, error",
    [
        ("200", False),
        ("204", False),
        ("304", False),
        ("400", True),
        ("404", True),
        ("413", True),
        ("429", True),
        ("499", True),
        ("500", True),
        ("503", True),
        ("OK", False),
        ("INVALID_ARGUMENT", True),
        ("CANCELLED", True),
        ("UNAVAILABLE", True),
    ],
)
def test_errors_are_http_4xx_5xx_and_grpc_non_ok(code, error):
    assert is_error(code) is error


def test_rpc_metrics_count_errors_only():
    registry = CollectorRegistry()
    rpc = RpcMetrics(registry, "gateway")
    for code in ("200", "200", "400", "OK", "INTERNAL"):
        rpc.observe("POST /v1/completions", code, 0.01)
    s = samples(registry)
    assert sum(v for _, v in s["specmesh_requests_total"]) == 5
    errors = {lab["code"]: v for lab, v in s["specmesh_request_errors_total"]}
    assert errors == {"400": 1, "INTERNAL": 1}


def test_stream_timer_counts_tokens_and_each_generation_once_by_finish_reason():
    m = StreamMetrics(CollectorRegistry(), "gateway")
    t = m.timer(prompt_tokens=7)
    t.tokens(3)
    t.tokens(0, "length")  # the last chunk may carry no tokens
    t.end()  # and the end after a finish reason counts nothing more
    t = m.timer(prompt_tokens=5)
    t.tokens(2, "stop")
    t.end()
    t = m.timer(prompt_tokens=4)
    t.tokens(1)
    t.end()  # no finish reason and no exception: the stream just stopped
    m.timer(1).tokens(1, "cancelled")  # the wire's word; vLLM says abort
    assert m.prompt_tokens == 17 and m.generated_tokens == 7
    assert m.finished == {"length": 1, "stop": 1, "abort": 2}


@pytest.mark.parametrize(
    "exc, reason",
    [
        (GeneratorExit(), "abort"),  # the stream was closed: the client went away
        (asyncio.CancelledError(), "abort"),
        (Unavailable("no healthy verify replica"), "error"),
        (RuntimeError("bug"), "error"),
        (InvalidArgument("the prompt is too long for the context"), None),  # refused, not finished
    ],
)
def test_a_generation_ended_by_an_exception_counts_by_what_ended_it(exc, reason):
    m = StreamMetrics(CollectorRegistry(), "gateway")
    t = m.timer(3)
    t.tokens(2)
    with pytest.raises(type(exc)):
        try:
            raise exc
        finally:  # where the gateway ends the timer
            t.end()
    assert m.finished == ({reason: 1} if reason else {})


def test_vllm_spec_decode_families_in_the_text_format():
    stats = SpecStats()
    stats.record(3, 2)
    stats.record(3, 0)
    stats.record(0, 0)  # a target-only step is no draft
    stats.record(2, 2)
    registry = CollectorRegistry()
    registry.register(FnCollector(lambda: vllm_spec_decode_families(stats, "org/model")))
    s = samples(registry)

    def one(name):
        ((labels, value),) = s[name]
        assert labels == {"model_name": "org/model"}
        return value

    assert one("vllm:spec_decode_num_drafts_total") == 3
    assert one("vllm:spec_decode_num_draft_tokens_total") == 8
    assert one("vllm:spec_decode_num_accepted_tokens_total") == 4
    per_pos = {lab["position"]: v for lab, v in s["vllm:spec_decode_num_accepted_tokens_per_pos_total"]}
    assert per_pos == {"0": 2, "1": 2, "2": 0}
    assert all(lab["model_name"] == "org/model" for lab, _ in s["vllm:spec_decode_num_accepted_tokens_per_pos_total"])
