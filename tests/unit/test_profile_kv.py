"""The profiler's KV section: the verify replicas' block metrics read into a phase's KV state (peaks from the
samples taken during it), what the phase's own prompts could hit in the prefix cache, and the advice on
preemptions and lost prefixes."""

import json

import pytest

from specmesh.profile.analysis import analyze, kv_state, prompt_sharing
from specmesh.profile.collect import Endpoint, Phase, Result, Sample
from specmesh.profile.report import sections, write

MiB = 2**20
M = (("model_name", "demo"),)


def verify_page(
    used=0, free=0, cached=0, shared=0, preemptions=0, queries=0, hits=0, evictions=0, budget=64 * MiB, block_size=16
) -> Sample:
    """A verify service's block metrics as collect.parse_metrics reads them (counters cumulative)."""
    total = used + free + cached
    page: Sample = {
        ("specmesh_verify_kv_block_size", ()): block_size,
        ("vllm:kv_cache_usage_perc", M): used / total if total else 0.0,
        ("vllm:num_preemptions_total", M): preemptions,
        ("vllm:prefix_cache_queries_total", M): queries,
        ("vllm:prefix_cache_hits_total", M): hits,
        ("specmesh_verify_kv_block_evictions_total", ()): evictions,
        ("specmesh_verify_kv_cache_budget_bytes", ()): budget,
    }
    for state, n in (("used", used), ("free", free), ("cached", cached), ("shared", shared)):
        page[("specmesh_verify_kv_blocks", (("state", state),))] = n
    return page


def phase(name="4 streams", concurrency=4, sent=8, before=None, after=None, peak=None) -> Phase:
    results = [Result(1.0, 16, {"rounds": 4, "drafts": 4, "drafted": 16, "accepted": 8})] * sent
    return Phase(
        name,
        concurrency,
        True,
        wall=2.0,
        results=results,
        before=before or {},
        after=after or {},
        peak=peak or {},
        sent=sent,
    )


VERIFY = [Endpoint("verify-0", "verify", "http://v0/metrics")]


def test_a_phase_kv_state_takes_peaks_from_the_samples_and_counters_as_differences():
    p = phase(
        before={"verify-0": verify_page(free=100, preemptions=1, queries=160, hits=32)},
        after={"verify-0": verify_page(used=4, free=60, cached=36, shared=2, preemptions=3, queries=800, hits=512)},
        peak={"verify-0": verify_page(used=70, free=30, shared=9)},
    )
    k = kv_state(p, VERIFY)
    assert k is not None and k.replicas == 1 and k.block_size == 16 and k.num_blocks == 100
    assert (k.used_peak, k.shared_peak, k.cached, k.free) == (70, 9, 36, 60)
    assert k.usage_peak == pytest.approx(0.7)
    assert (k.preemptions, k.prefix_queries, k.prefix_hits) == (2, 640, 480)
    assert k.hit_rate == pytest.approx(0.75)


def test_replicas_without_a_block_pool_give_no_kv_state_and_a_note():
    slots = {("specmesh_verify_kv_cache_bytes", ()): 1.0, ("vllm:kv_cache_usage_perc", M): 0.1}
    p = phase(before={"verify-0": slots}, after={"verify-0": slots})
    assert kv_state(p, VERIFY) is None
    f = analyze([p], VERIFY, {})
    assert any("no KV block metrics" in n for n in f.notes)
    assert not [r for r in f.recommendations if r.kind == "kv"]
    assert "KV cache" not in [title for title, _, _ in sections(f, {})]


def test_what_the_prompts_could_hit_counts_repeats_and_shared_prefixes():
    # The warm-up sent "SYS: abc" already: in the first phase it repeats (7 of 7 characters), "SYS: xyz"
    # shares "SYS: " (5 of 8); in the second phase both repeat.
    prompts = ["SYS: ab", "SYS: xyz"]
    assert prompt_sharing(prompts, [phase(sent=2), phase(sent=2)]) == pytest.approx([12 / 15, 1.0])
    assert prompt_sharing(["abc", "xyz"], [phase(sent=2)]) == pytest.approx([3 / 6])
    assert prompt_sharing([], [phase()]) == [None]


def test_preemptions_advise_a_larger_kv_budget():
    p = phase(
        after={"verify-0": verify_page(used=100, shared=4, preemptions=5, budget=64 * MiB)},
        peak={"verify-0": verify_page(used=100)},
    )
    f = analyze([p], VERIFY, {})
    (rec,) = [r for r in f.recommendations if r.kind == "kv"]
    assert "5 session(s) preempted at 4 stream(s)" in rec.title and "--max-sessions" in rec.title
    assert "--kv-cache-budget-mb=128" in rec.command and "100 % of 100 blocks" in rec.why
    assert rec.gain is None
    # A CPU stack's float32 target may keep its KV in bfloat16 instead; one on CUDA, or already so, is not told.
    cpu = {"plan": {"target": "T", "draft": "D", "algorithm": "standalone", "device": "cpu"}}
    (rec,) = [r for r in analyze([p], VERIFY, cpu).recommendations if r.kind == "kv"]
    assert "--kv-cache-dtype bfloat16" in rec.why
    others = ({"device": "cuda"}, {"device": "cpu", "kv_cache_dtype": "bfloat16"}, {"dtype": "bfloat16"})
    for plan in (*others, {"verify_args": ["--runner", "batched"]}, {"verify_args": ["--runner=gguf"]}):
        record = {"plan": {**cpu["plan"], **plan}}
        (rec,) = [r for r in analyze([p], VERIFY, record).recommendations if r.kind == "kv"]
        assert "kv-cache-dtype" not in rec.why
        # the command it suggests is the profiled stack's, its cache dtype included
        assert ("--kv-cache-dtype bfloat16" in rec.command) == ("kv_cache_dtype" in plan)


def prefix_phase(replicas: int, evictions: int = 0, hits: int = 64) -> tuple[Phase, list[Endpoint]]:
    endpoints = [Endpoint(f"verify-{i}", "verify", f"http://v{i}/metrics") for i in range(replicas)]
    page = verify_page(used=10, free=90, queries=640, hits=hits, evictions=evictions)
    return phase(sent=8, after={e.name: page for e in endpoints}), endpoints


@pytest.mark.parametrize(
    "replicas, evictions, advice",
    [
        (2, 0, "route requests that share a prefix to one verify replica"),
        (1, 30, "evicted before they are reused"),
        (1, 0, "tenants and cache_salt"),
    ],
)
def test_a_prefix_cache_missing_what_the_prompts_share_gets_advice_by_its_cause(replicas, evictions, advice):
    p, endpoints = prefix_phase(replicas, evictions)
    # eight requests of two prompts behind one long shared prefix: nearly all of their text was sent before
    prompts = ["You are a careful assistant. " * 8 + "Q1", "You are a careful assistant. " * 8 + "Q2"]
    f = analyze([p], endpoints, {}, prompts)
    assert f.summaries[0].kv is not None and f.summaries[0].kv.expected_hit_rate > 0.9
    (rec,) = [r for r in f.recommendations if r.kind == "kv"]
    assert advice in rec.title and "served 10 %" in rec.title
    # the same cache hitting most of what it could: nothing to say
    p, endpoints = prefix_phase(replicas, evictions, hits=600)
    assert not [r for r in analyze([p], endpoints, {}, prompts).recommendations if r.kind == "kv"]
    # prompts that share nothing and never repeat: a low hit rate is all they can get
    p, endpoints = prefix_phase(replicas, evictions)
    unshared = [f"{chr(65 + i)} is a prompt of its own" for i in range(9)]
    assert not [r for r in analyze([p], endpoints, {}, unshared).recommendations if r.kind == "kv"]


def test_the_report_has_a_kv_section_and_the_json_its_numbers(tmp_path):
    p = phase(
        after={"verify-0": verify_page(used=96, free=2, cached=2, shared=12, queries=320, hits=160)},
        peak={"verify-0": verify_page(used=97, free=2, cached=1, shared=20)},
    )
    f = analyze([p], VERIFY, {}, ["def f(x):\n"])
    kv = dict((title, lines) for title, lines, _ in sections(f, {}))["KV cache"]
    assert kv[2].startswith("| 4 streams | 97 of 100 | 20 | 2 / 2 | 97 % | 0 | 50 % of 320 tokens |")
    assert any("97 % in use at the peak with no preemption yet" in line for line in kv)
    files = write(f, tmp_path)
    (data,) = json.loads(files["json"].read_text())["phases"]
    assert data["kv"]["used_peak"] == 97 and data["kv"]["hit_rate"] == 0.5
    assert "## KV cache" in files["md"].read_text()
