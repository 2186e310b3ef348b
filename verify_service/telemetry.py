"""The verify service's Prometheus metrics: requests (RpcMetrics), batches, queue, KV cache, sessions,
and the speculation counters over every verified block, also under vLLM's spec-decode names with its
`model_name` label: the service sees every block verified, whichever gateway or client sent it, so the
vLLM-named counters are exported here alone (never summed twice across services).

With a runner that keeps the KV in blocks (it has a `pool`, a `BlockPool`) the pool's state is exported
too: the blocks by state, the block size, evictions, and vLLM's prefix-cache counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from specmesh.runtime import cpu_kernels
from specmesh.telemetry import LATENCY_BUCKETS, FnCollector, RpcMetrics, spec_families, vllm_spec_decode_families

if TYPE_CHECKING:
    from specmesh.runtime.blocks import BlockPool
    from verify_service.engine import VerifyEngine

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class VerifyMetrics:
    """Built before the engine (whose scheduler reports each batch to `on_batch`); `watch` adds its state."""

    def __init__(self, registry: CollectorRegistry | None = None, model_name: str = ""):
        """`model_name` labels the vLLM-named families; by default the --model-path as given, which is what
        vLLM labels with when it has no served name."""
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        ProcessCollector(registry=self.registry)  # CPU seconds and memory: how busy the process is
        self.rpc = RpcMetrics(self.registry, "verify")
        self.batch_size = Histogram(
            "specmesh_verify_batch_size",
            "Blocks (sessions) verified per batched forward",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.batch_seconds = Histogram(
            "specmesh_verify_batch_duration_seconds",
            "One batched target forward + rejection sampling",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.engine: VerifyEngine | None = None
        self.step_phases = False

    def watch(self, engine: VerifyEngine) -> VerifyMetrics:
        self.engine = engine
        # The fused CPU step's phases (where a verify forward's time goes: `specmesh profile` reads them) where
        # the runner may call it, on a CPU with the kernels built: a few clock reads a layer per call.
        self.step_phases = engine.runner.device.type == "cpu" and cpu_kernels.load() is not None
        if self.step_phases:
            cpu_kernels.count_step_phases()
        self.registry.register(FnCollector(self.families))
        return self

    def on_batch(self, size: int, seconds: float) -> None:
        self.batch_size.observe(size)
        self.batch_seconds.observe(seconds)

    def families(self) -> list[Metric]:
        e = self.engine
        if e is None:
            return []
        st = e.scheduler.stats
        g = GaugeMetricFamily
        c = CounterMetricFamily
        queue = g("specmesh_verify_queue_depth", "Blocks waiting for the next batch")
        queue.add_metric([], e.scheduler.queue_depth)
        kv = g("specmesh_verify_kv_cache_bytes", "KV cache held by all sessions")
        kv.add_metric([], e.sessions.kv_bytes())
        budget = g("specmesh_verify_kv_cache_budget_bytes", "The KV cache budget (--kv-cache-budget-mb)")
        budget.add_metric([], e.sessions.budget_bytes)
        sessions = g("specmesh_verify_sessions", "Sessions by state (cached = holding a KV cache)", labels=["state"])
        sessions.add_metric(["cached"], len(e.sessions))
        sessions.add_metric(["active"], e.sessions.attached)
        pool: BlockPool | None = getattr(e.runner, "pool", None)
        # vLLM's gauge is a fraction despite its name. With blocks: blocks held by sequences / all blocks, as
        # vLLM counts it (cached blocks nobody holds are free to take). Otherwise the bytes the sessions hold
        # of the budget (a slot pool: whole slots; growing caches: what they have grown to).
        usage = g("vllm:kv_cache_usage_perc", "KV cache in use, as a fraction (1 = full)", labels=["model_name"])
        if pool is not None:
            usage.add_metric([self.label(e)], pool.usage)
        else:
            usage.add_metric(
                [self.label(e)], e.sessions.kv_bytes() / e.sessions.budget_bytes if e.sessions.budget_bytes else 0.0
            )
        # Present whatever the runner, as vLLM's is: 0 where the KV is not in blocks (a slot or a growing
        # cache is never taken back from a running session, so nothing is preempted).
        preempted = c(
            "vllm:num_preemptions",
            "Sessions preempted (blocks taken back, recomputed on resume)",
            labels=["model_name"],
        )
        preempted.add_metric([self.label(e)], getattr(st, "preemptions", 0))
        out: list[Metric] = [queue, kv, budget, sessions, usage, preempted]
        for name, doc, value in self.counters(e):
            f = c(name, doc)
            f.add_metric([], value)
            out.append(f)
        if pool is not None:
            out += block_families(pool, self.label(e))
        if self.step_phases:
            out += step_phase_families()
        return out + spec_families("specmesh_verify", st.spec) + vllm_spec_decode_families(st.spec, self.label(e))

    @staticmethod
    def counters(e: VerifyEngine) -> list[tuple[str, str, float]]:
        """(name, help, value) of every counter family."""
        st = e.scheduler.stats
        return [
            ("specmesh_verify_batches", "Scheduler ticks that ran a batch", st.batches),
            ("specmesh_verify_steps", "Session steps verified (target-only steps included)", st.steps),
            ("specmesh_verify_emitted_tokens", "Tokens committed and emitted", st.tokens),
            (
                "specmesh_verify_deadline_steps",
                "Target-only steps taken because a draft block was late",
                e.counters.deadline_steps,
            ),
            (
                "specmesh_verify_run_steps",
                "Target-only steps of runs a draft asked for, taken without a block each",
                e.counters.run_steps,
            ),
            ("specmesh_verify_stale_blocks", "Blocks that arrived for a past epoch", e.counters.stale_blocks),
            (
                "specmesh_verify_chained_blocks",
                "Blocks a draft sent ahead of the verdict before them (chained_after)",
                e.counters.chained_blocks,
            ),
            (
                "specmesh_verify_chained_stale_blocks",
                "Chained blocks whose guess of the verdict before them failed: answered stale, not verified",
                e.counters.chained_stale,
            ),
            (
                "specmesh_verify_superseded_streams",
                "Silent Verify streams whose session a newer turn took over",
                e.counters.superseded_streams,
            ),
            ("specmesh_verify_evicted_sessions", "Sessions evicted (LRU under the budget, or TTL)", e.sessions.evicted),
            (
                "specmesh_verify_prefix_tokens_reused",
                "Prompt tokens whose KV came from a session's cache",
                e.runner.prefix_tokens_reused,
            ),
            ("specmesh_verify_prefill_tokens", "Prompt tokens prefilled", st.prefill_tokens),
            (
                "specmesh_verify_mixed_batches",
                "Batched forwards that also prefilled sessions being opened",
                st.mixed_batches,
            ),
            # A verified step's time, summed over steps: / specmesh_verify_steps is the mean per round.
            ("specmesh_verify_queue_wait_seconds", "Blocks' wait from arrival to their batch", st.queue_wait_seconds),
            ("specmesh_verify_step_forward_seconds", "Steps' batch target forward", st.step_forward_seconds),
            ("specmesh_verify_step_sample_seconds", "Steps' batch rejection sampling", st.step_sample_seconds),
            ("specmesh_verify_batch_tokens", "Positions verified by batches (K + 1 per step)", st.batch_tokens),
            ("specmesh_verify_busy_seconds", "Time the model thread spent in forwards", st.busy_seconds),
        ]

    def label(self, e: VerifyEngine) -> str:
        """The `model_name` of the vLLM-named families."""
        return self.model_name or e.config.model_path or "specmesh"


def step_phase_families() -> list[Metric]:
    """The fused CPU step's time by phase (cpu_kernels.STEP_PHASES: each call's team mean) and its calls."""
    totals = cpu_kernels.step_phase_totals()
    seconds = CounterMetricFamily(
        "specmesh_verify_cpu_step_seconds",
        "The fused CPU forward's time by phase: products, attention, norms and sums, barrier wait, logits",
        labels=["phase"],
    )
    for phase, value in totals.seconds.items():
        seconds.add_metric([phase], value)
    calls = CounterMetricFamily("specmesh_verify_cpu_step_calls", "Calls of the fused CPU forward")
    calls.add_metric([], totals.calls)
    return [seconds, calls]


def block_families(pool: BlockPool, model_name: str) -> list[Metric]:
    """A block pool's families. Absent, not zero, with a runner that has no pool: a pool of 0 blocks would read
    as a service with no KV at all, and a prefix-cache hit rate of 0/0 as a cache that never hits.

    `specmesh_verify_kv_blocks{state}`: used (held by a sequence, shared ones included), free (holding nothing)
    and cached (held by no sequence, still findable by its content hash, taken LRU when no free block is
    left) add up to the pool; shared (held by two sequences or more) is a part of used. The pool's own
    `num_free` is free + cached: what an allocation may take.

    vLLM's prefix-cache counters are in tokens: the pool counts blocks looked up and found, times the block
    size here. vLLM's queries are every prompt token of a request; ours only the full blocks before a prompt's
    last token (the rest can never hit), so for a like workload our hit rate is a little above vLLM's."""
    g, c = GaugeMetricFamily, CounterMetricFamily
    blocks = g(
        "specmesh_verify_kv_blocks",
        "KV blocks by state: used + free + cached = all; shared (held by several sessions) is part of used",
        labels=["state"],
    )
    blocks.add_metric(["used"], pool.num_used)
    blocks.add_metric(["free"], pool.num_free - pool.num_cached)
    blocks.add_metric(["cached"], pool.num_cached)
    blocks.add_metric(["shared"], pool.num_shared)
    size = g("specmesh_verify_kv_block_size", "Tokens per KV block", value=pool.block_size)
    evictions = c(
        "specmesh_verify_kv_block_evictions",
        "Cached blocks taken for new KV (their prefix is lost)",
        value=pool.evictions,
    )
    out: list[Metric] = [blocks, size, evictions]
    for name, doc, value in (
        ("queries", "Prompt tokens looked up in the prefix cache", pool.prefix_queries),
        ("hits", "Prompt tokens whose KV the prefix cache held", pool.prefix_hits),
    ):
        f = c(f"vllm:prefix_cache_{name}", doc, labels=["model_name"])
        f.add_metric([model_name], value * pool.block_size)
        out.append(f)
    return out
