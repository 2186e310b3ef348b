"""The verify service's KV metrics as a scrape reads them: with the paged runner, the block pool by state,
vLLM's usage gauge, preemption and prefix-cache counters (in tokens, as vLLM counts them); with the slot pool,
no block families and vLLM's gauges still there."""

import asyncio

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from specmesh.runtime import cpu_kernels
from specmesh.sampling import SamplingParams
from tests.support.models import tiny_model
from verify_service.engine import VerifyConfig, VerifyEngine
from verify_service.telemetry import VerifyMetrics

BPT = 512  # KV bytes per token of tiny_model (as tests/unit/test_verify_engine.py)
BLOCK = 16
NUM_BLOCKS = 64
BLOCK_FAMILIES = (
    "specmesh_verify_kv_blocks",
    "specmesh_verify_kv_block_size",
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab=128, seed=5)


def engine_with_metrics(model, runner: str) -> tuple[VerifyEngine, VerifyMetrics]:
    config = VerifyConfig(
        model_path="(in-memory)",
        runner=runner,
        max_model_len=256,
        max_sessions=4,
        kv_cache_budget_mb=NUM_BLOCKS * BLOCK * BPT / 2**20,
        batch_wait_ms=0,
        kv_cache_prefault=False,
    )
    metrics = VerifyMetrics(CollectorRegistry(), model_name="org/model")
    return VerifyEngine(config, model), metrics


def scrape(metrics: VerifyMetrics) -> dict[str, list[tuple[dict, float]]]:
    out: dict[str, list[tuple[dict, float]]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def one(samples, name: str, **labels) -> float:
    (value,) = [v for lab, v in samples[name] if all(lab.get(k) == w for k, w in labels.items())]
    return value


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_the_block_pool_as_a_scrape_reads_it(model, monkeypatch):
    engine, metrics = engine_with_metrics(model, "paged")
    metrics.watch(engine)
    pool = engine.runner.pool
    assert pool.block_size == BLOCK and pool.num_blocks == NUM_BLOCKS
    prefix = [(7 * i) % 120 + 1 for i in range(5 * BLOCK)]  # five full blocks, then a suffix of its own each
    opened = []

    async def body():
        await engine.start()
        try:
            for i in range(2):  # one after the other: the second finds the first's committed blocks
                opened.append(await engine.open(f"s{i}", prefix + [100 + i, 101 + i, 102 + i], greedy(4)))
            # An open is answered as the pass computing its prompt's last chunk begins: read the pool once
            # that pass is done with it.
            while engine.scheduler._in_pass:
                await asyncio.sleep(0.01)
            return scrape(metrics)
        finally:
            await engine.close()

    s = asyncio.run(body())
    assert opened[0].cached_prompt_tokens == 0 and opened[1].cached_prompt_tokens == 5 * BLOCK
    states = {lab["state"]: v for lab, v in s["specmesh_verify_kv_blocks"]}
    assert states["used"] + states["free"] + states["cached"] == NUM_BLOCKS
    assert states["shared"] == 5  # the prefix's blocks, held by both sessions
    assert states["used"] == pool.num_used > 5 and states["cached"] == pool.num_cached
    assert one(s, "specmesh_verify_kv_block_size") == BLOCK
    # in tokens: both prompts' five full prefix blocks looked up (the suffix never fills a block), five found
    assert one(s, "vllm:prefix_cache_queries_total", model_name="org/model") == 2 * 5 * BLOCK
    assert one(s, "vllm:prefix_cache_hits_total", model_name="org/model") == 5 * BLOCK
    assert one(s, "vllm:kv_cache_usage_perc", model_name="org/model") == pytest.approx(states["used"] / NUM_BLOCKS)
    assert one(s, "specmesh_verify_kv_block_evictions_total") == 0
    assert one(s, "vllm:num_preemptions_total", model_name="org/model") == 0
    # the scheduler's count of preemptions, read at scrape time
    monkeypatch.setattr(engine.scheduler.stats, "preemptions", 3, raising=False)
    assert one(scrape(metrics), "vllm:num_preemptions_total", model_name="org/model") == 3


def test_a_slot_pool_has_no_block_families_and_vllms_gauges_still(model):
    engine, metrics = engine_with_metrics(model, "batched")
    metrics.watch(engine)
    assert getattr(engine.runner, "pool", None) is None
    s = scrape(metrics)
    assert not set(BLOCK_FAMILIES) & set(s)
    assert one(s, "vllm:num_preemptions_total", model_name="org/model") == 0
    assert one(s, "vllm:kv_cache_usage_perc", model_name="org/model") == 0


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here: the fused step cannot be built")
@pytest.mark.parametrize("runner", ["paged", "batched"])
def test_the_fused_steps_phases_as_a_scrape_reads_them(model, runner):
    """On a CPU with the kernels built, the fused step's time by phase and its calls are counters (what
    `specmesh profile` splits the verify forward with): they grow with a generation, products, attention
    and logits among what it spent."""
    engine, metrics = engine_with_metrics(model, runner)
    metrics.watch(engine)
    before = scrape(metrics)
    phases = {lab["phase"] for lab, _ in before["specmesh_verify_cpu_step_seconds_total"]}
    assert phases == set(cpu_kernels.STEP_PHASES)

    async def body():
        await engine.start()
        try:
            return [e async for e in engine.generate("", [(5 * i) % 120 + 1 for i in range(20)], greedy(6))]
        finally:
            await engine.close()

    asyncio.run(body())
    after = scrape(metrics)
    calls = one(after, "specmesh_verify_cpu_step_calls_total") - one(before, "specmesh_verify_cpu_step_calls_total")
    assert calls >= 5  # a step per token past the first, at least
    for phase in ("products", "attention", "logits"):
        grew = one(after, "specmesh_verify_cpu_step_seconds_total", phase=phase) - one(
            before, "specmesh_verify_cpu_step_seconds_total", phase=phase
        )
        assert grew > 0, phase
