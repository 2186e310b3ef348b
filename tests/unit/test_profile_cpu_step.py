"""The profiler's split of the verify forward on the CPU (the fused step's phases, from the verify service's
counters): read per phase as differences, shown in the report and its JSON, and the advice it grounds: a
bfloat16 KV where attention takes a large share over a float32 cache, the cores where the threads wait on
each other."""

import json

import pytest

from specmesh.profile.analysis import STEP_ATTENTION, STEP_BARRIER, analyze, summarize
from specmesh.profile.collect import Endpoint, Phase, Result, Sample
from specmesh.profile.report import sections, write

VERIFY = [Endpoint("verify-0", "verify", "http://v0/metrics")]
PHASES = ("products", "attention", "norms and sums", "barrier wait", "logits")
CPU = {"plan": {"target": "T", "draft": "D", "algorithm": "standalone", "device": "cpu"}}


def step_page(calls: float, **seconds: float) -> Sample:
    """The verify service's step counters as collect.parse_metrics reads them (cumulative)."""
    page: Sample = {("specmesh_verify_cpu_step_calls_total", ()): calls}
    for p in PHASES:
        page[("specmesh_verify_cpu_step_seconds_total", (("phase", p),))] = seconds.get(p.replace(" ", "_"), 0.0)
    return page


def phase(before: Sample, after: Sample, concurrency=16, speculative=True) -> Phase:
    results = [Result(1.0, 16, {"rounds": 4, "drafts": 4, "drafted": 16, "accepted": 8})] * 8
    return Phase(
        f"{concurrency} streams",
        concurrency,
        speculative,
        wall=2.0,
        results=results,
        before={"verify-0": before},
        after={"verify-0": after},
        peak={},
        sent=8,
    )


def test_a_phase_reads_the_forwards_phases_as_differences():
    p = phase(
        step_page(100, products=1.0, attention=0.5),
        step_page(300, products=3.4, attention=1.3, norms_and_sums=0.1, barrier_wait=0.05, logits=0.35),
    )
    s = summarize(p, VERIFY)
    assert s.cpu_step_calls == 200
    assert s.cpu_step["products"] == pytest.approx(2.4) and s.cpu_step["attention"] == pytest.approx(0.8)
    assert sum(s.cpu_step_shares.values()) == pytest.approx(1.0)
    assert s.cpu_step_shares["products"] == pytest.approx(2.4 / 3.7)


@pytest.mark.parametrize(
    ("attention", "plan", "advised"),
    [
        (0.4, {}, True),  # float32 KV on a CPU, the paged runner: halve it
        (0.4, {"kv_cache_dtype": "bfloat16"}, False),  # already halved
        (0.1, {}, False),  # attention a small share: nothing to gain there
    ],
)
def test_attention_heavy_forwards_over_a_float32_kv_are_offered_bfloat16(attention, plan, advised):
    assert (attention >= STEP_ATTENTION) == (attention == 0.4)
    p = phase(step_page(0), step_page(100, products=1.0 - attention, attention=attention))
    record = {"plan": {**CPU["plan"], **plan}}
    recs = [r for r in analyze([p], VERIFY, record).recommendations if "attention is" in r.title]
    assert bool(recs) == advised
    if advised:
        assert "--kv-cache-dtype bfloat16" in recs[0].command and "40 %" in recs[0].title


def test_a_large_wait_at_the_barriers_points_at_the_cores():
    quiet = phase(step_page(0), step_page(100, products=0.9, barrier_wait=0.02))
    waiting = phase(step_page(0), step_page(100, products=0.7, barrier_wait=0.3))
    assert 0.3 / 1.0 >= STEP_BARRIER > 0.02 / 0.92
    assert not [r for r in analyze([quiet], VERIFY, CPU).recommendations if "wait on each other" in r.title]
    (rec,) = [r for r in analyze([waiting], VERIFY, CPU).recommendations if "wait on each other" in r.title]
    assert rec.kind == "contention" and "--verify-threads" in rec.command


def test_the_report_has_the_forwards_phases_and_the_json_its_seconds(tmp_path):
    p = phase(step_page(0), step_page(50, products=0.6, attention=0.3, logits=0.1))
    f = analyze([p], VERIFY, CPU)
    (lines,) = [lines for title, lines, _ in sections(f, {}) if title == "The verify forward on the CPU, by phase"]
    assert lines[2].startswith("| 16 streams | 50 | 20.00 | 60 % | 30 % | 0 % | 0 % | 10 % |")
    paths = write(f, tmp_path)
    (ph,) = json.loads(paths["json"].read_text())["phases"]
    assert ph["cpu_step_calls"] == 50 and ph["cpu_step_seconds"]["attention"] == pytest.approx(0.3)


def test_without_the_step_counters_there_is_no_section():
    p = phase({}, {})
    f = analyze([p], VERIFY, CPU)
    assert "The verify forward on the CPU, by phase" not in [title for title, _, _ in sections(f, {})]
