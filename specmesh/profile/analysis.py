"""From measurements to findings: a round's time budget, acceptance, the cost model, bottleneck, advice.

The model is DESIGN.md's: a round of K drafts commits E(K) tokens, E(K) = 1 + sum over i < K of P_i, where
P_i is the measured chance that the first i + 1 draft tokens are all accepted (beyond the positions
measured, the pooled per-token acceptance α carries it on); it takes K·t_draft + o + t_fwd(K + 1), t_fwd
being the verify forward, fitted as a + b·T over the positions T it computes (two measured points: the
target-only baseline and the speculative run), and o what a round costs besides (network, queueing,
sampling). A request of N tokens also pays a fixed cost outside its rounds (prefill, gateway). So one
stream makes N / ((N / E(K))·round(K) + fixed) tokens per second; target-only decoding is measured.
Every recommendation's gain comes from this model with measured inputs, or from measured utilisation.

The KV cache is read apart from the model, where the verify runner keeps it in blocks: blocks in use (their
peak, sampled during each phase), preemptions, and the prefix cache's hit rate against what the phase's own
prompts could hit (the profiler knows what it sent: prompts repeat as it cycles them, and may share a prefix).
Its advice carries no gain estimate.
"""

from __future__ import annotations

import bisect
import math
import os
import shlex
from dataclasses import dataclass, field

from specmesh.domain import AcceptanceRates
from specmesh.loop import expected_tokens
from specmesh.profile.collect import Endpoint, Phase, by_label, total

BUDGET_PARTS = ("drafting", "network", "verify queue", "verify forward", "sampling", "other")
BUSY = 0.85  # a service this busy (fraction of wall time) is saturated: more load only queues
DRAFT_CEILING = 1.5  # a draft whose cost alone caps speculation below 1.5x target-only is the bottleneck
K_RANGE = range(1, 17)
KV_FULL = 0.95  # blocks this full at a phase's peak: a little more load and sessions are preempted
KV_SHARED = 0.2  # a workload whose prompts could hit the prefix cache for at least this share of their tokens ...
KV_SHORT = 0.5  # ... and hits under half of that is losing its prefixes
# The verify service's fused CPU forward, by phase (specmesh_verify_cpu_step_seconds): attention this large a
# share of it, over a float32 KV, is worth halving the bytes it reads; a wait at barriers this large means the
# step's threads do not have their cores to themselves.
STEP_ATTENTION = 0.25
STEP_BARRIER = 0.1


@dataclass
class PhaseSummary(AcceptanceRates):
    name: str
    concurrency: int
    speculative: bool
    wall: float
    requests: int
    errors: int
    tokens: int
    throughput: float  # tokens/s over all streams
    stream_rate: float  # tokens/s of one stream (tokens / summed latency)
    mean_latency: float
    rounds: int = 0
    drafts: int = 0
    drafted: int = 0
    accepted: int = 0
    budget: dict[str, float] = field(default_factory=dict)  # seconds per round (per token target-only)
    verify_batch: float = 0.0  # mean blocks per verify forward
    draft_batch: float = 0.0  # mean sessions per draft forward
    verify_tokens_per_step: float = 0.0
    verify_forward_per_step: float = 0.0
    busy: dict[str, float] = field(default_factory=dict)  # model threads' busy fraction, per replica
    cpu: dict[str, float] = field(default_factory=dict)  # cores used, per process
    deadline_steps: float = 0.0
    steps: float = 0.0
    draft_seconds: float = 0.0  # drafting time of the phase's rounds (draft metrics)
    draft_tokens: float = 0.0  # tokens those rounds drafted
    # requests of a speculative phase (K left to the stack) that the stack decoded target-only: the gateway's
    # --speculative-disable-by-batch-size, a draft replica that reports speculation loses, no healthy draft
    # replica, or the rest of a stream after a stalled draft
    target_only_requests: int = 0
    handed_off_requests: int = 0  # goodput probes that speculated, then decoded the rest target-only
    kv: KvState | None = None  # None: no verify replica reported a block pool
    # (drafted, accepted) by the method that drafted (model, ngram, suffix), from the draft metrics
    by_method: dict[str, tuple[float, float]] = field(default_factory=dict)
    # the verify replicas' fused CPU forward: seconds by phase (products, attention, ...) and its calls
    cpu_step: dict[str, float] = field(default_factory=dict)
    cpu_step_calls: float = 0.0

    @property
    def cpu_step_shares(self) -> dict[str, float]:
        whole = sum(self.cpu_step.values())
        return {k: v / whole for k, v in self.cpu_step.items()} if whole > 0 else {}

    @property
    def mean_k(self) -> float:
        return self.drafted / self.drafts if self.drafts else 0.0


@dataclass
class KvState:
    """A phase's KV blocks over the verify replicas that keep them in a block pool: blocks and counters summed
    over replicas, usage the fullest replica's; peaks as sampled during the phase (collect.PEAK_INTERVAL_S)."""

    replicas: int
    num_blocks: float
    block_size: int
    used_peak: float  # held by sessions (shared ones once)
    shared_peak: float  # held by two sessions or more (part of used)
    cached: float  # at the phase's end: held by none, still findable by content (evictable)
    free: float  # at the phase's end
    usage_peak: float  # vllm:kv_cache_usage_perc, a fraction
    preemptions: float
    prefix_queries: float  # prompt tokens looked up in the prefix cache (whole blocks)
    prefix_hits: float  # ... and found
    evictions: float  # cached blocks taken for new KV
    budget_bytes: float  # the largest replica's KV budget
    expected_hit_rate: float | None = None  # what the phase's own prompts could hit (`prompt_sharing`)

    @property
    def hit_rate(self) -> float | None:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else None


def kv_state(phase: Phase, endpoints: list[Endpoint]) -> KvState | None:
    """The phase's KV blocks from the verify replicas' block metrics; None where none exports them (a slot
    pool or the HF runner)."""
    pooled = [
        e
        for e in endpoints
        if e.role == "verify" and total(phase.after.get(e.name, {}), "specmesh_verify_kv_block_size")
    ]
    if not pooled:
        return None
    end = lambda name, **lab: sum(total(phase.after[e.name], name, **lab) for e in pooled)
    peak = lambda name, **lab: sum(total(phase.highest(e.name), name, **lab) for e in pooled)
    moved = lambda name: sum(total(phase.delta(e.name), name) for e in pooled)
    blocks = "specmesh_verify_kv_blocks"
    return KvState(
        replicas=len(pooled),
        num_blocks=sum(end(blocks, state=state) for state in ("used", "free", "cached")),
        block_size=int(max(total(phase.after[e.name], "specmesh_verify_kv_block_size") for e in pooled)),
        used_peak=peak(blocks, state="used"),
        shared_peak=peak(blocks, state="shared"),
        cached=end(blocks, state="cached"),
        free=end(blocks, state="free"),
        usage_peak=max(total(phase.highest(e.name), "vllm:kv_cache_usage_perc") for e in pooled),
        preemptions=moved("vllm:num_preemptions_total"),
        prefix_queries=moved("vllm:prefix_cache_queries_total"),
        prefix_hits=moved("vllm:prefix_cache_hits_total"),
        evictions=moved("specmesh_verify_kv_block_evictions_total"),
        budget_bytes=max(total(phase.after[e.name], "specmesh_verify_kv_cache_budget_bytes") for e in pooled),
    )


def prompt_sharing(prompts: list[str], phases: list[Phase]) -> list[float | None]:
    """Per phase, the share of its prompts' characters that begin a prompt sent before it (in the phase, an
    earlier one, or the warm-up request of prompts[0]): what a prefix cache that kept everything could serve.
    Each phase cycles the prompts from the first (collect.run_phase); characters stand in for tokens."""
    if not prompts:
        return [None for _ in phases]
    seen = [prompts[0]]  # sorted: a string's longest common prefix with a set is with a neighbour in order
    out: list[float | None] = []
    for ph in phases:
        shared = chars = 0
        for i in range(ph.sent):
            p = prompts[i % len(prompts)]
            j = bisect.bisect_left(seen, p)
            near = (seen[k] for k in (j - 1, j) if 0 <= k < len(seen))
            shared += max(len(os.path.commonprefix([p, q])) for q in near)  # noqa: RUF071 (text, not paths)
            chars += len(p)
            if j == len(seen) or seen[j] != p:
                seen.insert(j, p)
        out.append(shared / chars if chars else None)
    return out


def _role_total(phase: Phase, endpoints: list[Endpoint], role: str, name: str, **labels: str) -> float:
    return sum(total(phase.delta(e.name), name, **labels) for e in endpoints if e.role == role)


def summarize(phase: Phase, endpoints: list[Endpoint]) -> PhaseSummary:
    res = phase.results
    tokens = sum(r.completion_tokens for r in res)
    latency = sum(r.latency for r in res)
    s = PhaseSummary(
        name=phase.name,
        concurrency=phase.concurrency,
        speculative=phase.speculative,
        wall=phase.wall,
        requests=len(res),
        errors=len(phase.errors),
        tokens=tokens,
        throughput=tokens / phase.wall if phase.wall else 0.0,
        stream_rate=tokens / latency if latency else 0.0,
        mean_latency=latency / len(res) if res else 0.0,
        rounds=sum(int(r.stats.get("rounds", 0)) for r in res),
        drafts=sum(int(r.stats.get("drafts", 0)) for r in res),
        drafted=sum(int(r.stats.get("drafted", 0)) for r in res),
        accepted=sum(int(r.stats.get("accepted", 0)) for r in res),
        target_only_requests=sum(bool(r.stats.get("target_only")) for r in res) if phase.speculative else 0,
        handed_off_requests=sum(bool(r.stats.get("handed_off")) for r in res),
        kv=kv_state(phase, endpoints),
    )
    t = lambda role, name, **lab: _role_total(phase, endpoints, role, name, **lab)
    steps = t("verify", "specmesh_verify_steps_total")
    s.steps = steps
    s.deadline_steps = t("verify", "specmesh_verify_deadline_steps_total")
    if steps:
        forward = t("verify", "specmesh_verify_step_forward_seconds_total") / steps
        sampling = t("verify", "specmesh_verify_step_sample_seconds_total") / steps
        queue = t("verify", "specmesh_verify_queue_wait_seconds_total") / steps
        s.verify_forward_per_step = forward
        s.verify_tokens_per_step = t("verify", "specmesh_verify_batch_tokens_total") / steps
    else:
        forward = sampling = queue = 0.0
    batches = t("verify", "specmesh_verify_batch_size_count")
    s.verify_batch = t("verify", "specmesh_verify_batch_size_sum") / batches if batches else 0.0
    draft_forwards = t("draft", "specmesh_draft_batch_size_count")
    s.draft_batch = t("draft", "specmesh_draft_batch_size_sum") / draft_forwards if draft_forwards else 0.0
    if phase.speculative:
        rounds = t("draft", "specmesh_draft_generation_rounds_total") or s.rounds
        drafting = t("draft", "specmesh_draft_round_draft_seconds_total")
        wait = t("draft", "specmesh_draft_round_verify_wait_seconds_total")
        s.draft_seconds, s.draft_tokens = drafting, t("draft", "specmesh_draft_spec_draft_tokens_total")
        for e in endpoints:
            if e.role != "draft":
                continue
            d = phase.delta(e.name)
            drafted = by_label(d, "specmesh_draft_spec_draft_tokens_total", "method")
            accepted = by_label(d, "specmesh_draft_spec_accepted_tokens_total", "method")
            for m, n in drafted.items():
                if n:
                    a, b = s.by_method.get(m, (0.0, 0.0))
                    s.by_method[m] = (a + n, b + accepted.get(m, 0.0))
        if rounds and (drafting or wait):
            s.budget = {
                "drafting": drafting / rounds,
                "network": max(0.0, wait / rounds - queue - forward - sampling),
                "verify queue": queue,
                "verify forward": forward,
                "sampling": sampling,
                "other": max(0.0, latency - drafting - wait) / rounds,
            }
    elif tokens and steps:  # target-only: per token, no draft and no round trip
        s.budget = {
            "drafting": 0.0,
            "network": 0.0,
            "verify queue": queue,
            "verify forward": forward,
            "sampling": sampling,
            "other": max(0.0, latency / tokens - queue - forward - sampling),
        }
    s.cpu_step_calls = t("verify", "specmesh_verify_cpu_step_calls_total")
    if s.cpu_step_calls:
        for e in endpoints:
            if e.role == "verify":
                for k, v in by_label(phase.delta(e.name), "specmesh_verify_cpu_step_seconds_total", "phase").items():
                    s.cpu_step[k] = s.cpu_step.get(k, 0.0) + v
    for e in endpoints:
        d = phase.delta(e.name)
        if not phase.wall or not d:
            continue
        cpu = total(d, "process_cpu_seconds_total")
        if cpu:
            s.cpu[e.name] = cpu / phase.wall
        busy_name = {
            "verify": "specmesh_verify_busy_seconds_total",
            "draft": "specmesh_draft_batch_duration_seconds_sum",
        }.get(e.role)
        if busy_name:
            s.busy[e.name] = total(d, busy_name) / phase.wall
    return s


# --- acceptance ---------------------------------------------------------------------------------------------
@dataclass
class Acceptance:
    drafted: list[float]  # per position, rounds that drafted it
    accepted: list[float]  # per position, rounds that accepted it (and so every position before it)

    @property
    def cumulative(self) -> list[float]:
        """P_i: the chance a round accepts its first i + 1 draft tokens (vLLM's per-position acceptance)."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted, self.drafted, strict=True)]

    @property
    def conditional(self) -> list[float]:
        """Acceptance at position i given the ones before it were accepted."""
        p, out = self.cumulative, []
        for i, v in enumerate(p):
            prev = 1.0 if i == 0 else p[i - 1]
            out.append(min(1.0, v / prev) if prev > 0 else 0.0)
        return out

    @property
    def alpha(self) -> float:
        """Pooled per-token acceptance: accepted tokens / tokens that had the chance (their predecessors all
        accepted), the censored geometric estimate that stays exact for a fixed K."""
        trials, acc = 0.0, 0.0
        for i, (d, a) in enumerate(zip(self.drafted, self.accepted, strict=True)):
            if i == 0:
                trials += d
            elif self.drafted[i - 1]:
                trials += self.accepted[i - 1] * d / self.drafted[i - 1]
            acc += a
        return min(acc / trials, 0.999) if trials else 0.0

    def reliable(self, min_rounds: float = 10) -> int:
        """Positions measured by enough rounds to stand on their own."""
        n = 0
        while n < len(self.drafted) and self.drafted[n] >= min_rounds:
            n += 1
        return n

    def expected_tokens(self, k: float, alpha_boost: float = 0.0) -> float:
        """E(K) = 1 + sum_{i<K} P_i, measured P_i where reliable, extrapolated beyond (`specmesh.loop.
        expected_tokens`; with `alpha_boost`, α + boost beyond); fractional K interpolates."""
        lo = math.floor(k)
        e_lo = self._expected_int(lo, alpha_boost)
        if k == lo:
            return e_lo
        return e_lo + (k - lo) * (self._expected_int(lo + 1, alpha_boost) - e_lo)

    def _expected_int(self, k: int, alpha_boost: float) -> float:
        p, n = self.cumulative, self.reliable()
        if not alpha_boost:  # the rule the draft service's K policy plans with
            return expected_tokens(p[:n], self.alpha, k)
        alpha = min(0.999, self.alpha + alpha_boost)
        e, last = 1.0, 1.0
        for i in range(k):
            if i < n:
                # A better draft (alpha_boost) raises each conditional acceptance by the same amount.
                cond = self.conditional[i]
                last = p[i] if not alpha_boost else last * min(0.999, cond + alpha_boost)
            else:
                last *= alpha
            e += last
        return e


def acceptance(phases: list[Phase], endpoints: list[Endpoint], summaries: list[PhaseSummary]) -> Acceptance:
    """Per-position counts of the speculative phases: the draft services' counters, else the responses."""
    drafted: dict[int, float] = {}
    accepted: dict[int, float] = {}
    for ph in phases:
        if not ph.speculative:
            continue
        for e in endpoints:
            if e.role != "draft":
                continue
            d = ph.delta(e.name)
            for pos, v in by_label(d, "specmesh_draft_spec_draft_tokens_per_pos_total", "position").items():
                drafted[int(pos)] = drafted.get(int(pos), 0.0) + v
            for pos, v in by_label(d, "specmesh_draft_spec_accepted_tokens_per_pos_total", "position").items():
                accepted[int(pos)] = accepted.get(int(pos), 0.0) + v
    if not drafted:  # no draft metrics: per-response rates, each weighted by its drafts
        for ph in phases:
            for r in ph.results if ph.speculative else []:
                for i, rate in enumerate(r.stats.get("acceptance_per_pos") or []):
                    w = float(r.stats.get("drafts", 0))
                    drafted[i] = drafted.get(i, 0.0) + w
                    accepted[i] = accepted.get(i, 0.0) + w * rate
    n = 0
    while drafted.get(n, 0.0) > 0:
        n += 1
    return Acceptance([drafted.get(i, 0.0) for i in range(n)], [accepted.get(i, 0.0) for i in range(n)])


# --- the cost model -----------------------------------------------------------------------------------------
@dataclass
class CostModel:
    t_draft: float  # seconds per drafted token, as a round sees it
    a: float  # t_fwd(T) = a + b·T, the verify forward over T positions
    b: float
    overhead: float  # per round besides drafting and the forward (network, queueing, sampling)
    fixed: float  # per request, outside its rounds (prefill, gateway, HTTP)
    tokens: float  # tokens per request
    baseline_rate: float  # target-only tokens/s of one stream (measured)
    acc: Acceptance

    def round_time(self, k: float) -> float:
        return k * self.t_draft + self.overhead + self.a + self.b * (k + 1)

    def rate(self, k: float, **change: float) -> float:
        """Tokens/s of one stream drafting K per round; `change` scales a part (draft=0.5: twice as fast) or
        adds acceptance (alpha=+0.05)."""
        t_draft = self.t_draft * change.get("draft", 1.0)
        a, b = self.a * change.get("forward", 1.0), self.b * change.get("forward", 1.0)
        overhead = self.overhead * change.get("overhead", 1.0)
        fixed = self.fixed * change.get("fixed", 1.0)
        e = self.acc.expected_tokens(k, change.get("alpha", 0.0))
        round_s = k * t_draft + overhead + a + b * (k + 1)
        return self.tokens / ((self.tokens / e) * round_s + fixed)

    def speedup(self, k: float, **change: float) -> float:
        return self.rate(k, **change) / self.baseline_rate if self.baseline_rate else 0.0

    def best_k(self, **change: float) -> int:
        return max(K_RANGE, key=lambda k: (round(self.rate(k, **change), 9), -k))

    def ceiling(self) -> float:
        """The most speculation could gain over target-only with this draft: max over K of E(K) / (1 + K·c)."""
        c = self.cost_ratio
        return max(self.acc.expected_tokens(k) / (1 + k * c) for k in K_RANGE)

    @property
    def cost_ratio(self) -> float:
        """Draft token time / one-position target forward (Leviathan et al.'s c)."""
        one = self.a + self.b
        return self.t_draft / one if one > 0 else 0.0


def cost_model(single: PhaseSummary, baseline: PhaseSummary | None, acc: Acceptance) -> CostModel | None:
    if not single.budget or not single.rounds or not single.requests:
        return None
    t_draft = (
        single.draft_seconds / single.draft_tokens
        if single.draft_tokens
        else (single.budget["drafting"] / single.mean_k if single.mean_k else 0.0)
    )
    f_s, t_s = single.verify_forward_per_step, single.verify_tokens_per_step
    a, b = f_s, 0.0
    if baseline is not None and baseline.verify_forward_per_step and t_s > baseline.verify_tokens_per_step:
        f_b, t_b = baseline.verify_forward_per_step, baseline.verify_tokens_per_step
        b = max(0.0, (f_s - f_b) / (t_s - t_b))
        a = max(0.0, f_s - b * t_s)
    elif t_s:
        a = f_s  # one point only: a flat forward (its cost independent of K)
    bud = single.budget
    overhead = bud["network"] + bud["verify queue"] + bud["sampling"]
    rounds_per_request = single.rounds / single.requests
    fixed = bud["other"] * rounds_per_request
    tokens = single.tokens / single.requests
    if baseline is not None and baseline.stream_rate:
        base = baseline.stream_rate
    else:  # not measured: one target forward per token plus the same overheads
        base = 1.0 / (a + b + overhead + fixed / max(tokens, 1.0))
    return CostModel(t_draft, a, b, overhead, fixed, tokens, base, acc)


# --- findings -----------------------------------------------------------------------------------------------
@dataclass
class Recommendation:
    title: str
    why: str
    command: str
    gain: float | None  # expected relative gain (0.08 = +8 %), None when it cannot be estimated
    kind: str  # "k", "draft", "verify", "batch", "acceptance", "deadline", "speculation", ...
    gain_note: str = ""

    @property
    def gain_text(self) -> str:
        if self.gain is None:
            return "gain not estimated"
        return f"{self.gain * 100:+.0f} %" + (f" {self.gain_note}" if self.gain_note else "")


@dataclass
class Findings:
    summaries: list[PhaseSummary]
    acceptance: Acceptance
    model: CostModel | None
    configured_k: int | None
    bottleneck: str  # "draft" | "verify" | "network" | "overhead" | "unknown"
    bottleneck_text: str
    sensitivity: dict[str, float]  # single-stream gain if a part were twice as fast
    recommendations: list[Recommendation]
    notes: list[str]
    record: dict
    cores: int | None


def _busiest(s: PhaseSummary, role: str) -> tuple[str, float]:
    items = [(n, v) for n, v in s.busy.items() if n.startswith(role)]
    return max(items, key=lambda x: x[1]) if items else ("", 0.0)


def _replicas(record: dict, role: str, summaries: list[PhaseSummary]) -> int:
    if record:
        return sum(1 for s in record.get("services", []) if s["role"] == role)
    return max((sum(1 for n in s.busy if n.startswith(role)) for s in summaries), default=0) or 1


def serve_command(record: dict, **changes) -> str:
    """The `specmesh serve` command of the profiled stack with `changes` applied (flag name -> value;
    `verify_arg="--flag=v"` adds a passed-through service flag)."""
    plan = record.get("plan") if record else None
    flag = lambda k, v: f"--{k.replace('_', '-')} {v}"
    if not plan:
        return "specmesh serve ... " + " ".join(
            f"--{k.replace('_', '-')}={v}" if k.endswith("_arg") else flag(k, v) for k, v in changes.items()
        )
    values: dict = {"model_path": plan["target"]}
    if plan["algorithm"] == "ngram":
        values["speculative_algorithm"] = "ngram"
    else:
        values["speculative_draft_model_path"] = plan["draft"]
    if plan.get("model_name"):
        values["served_model_name"] = plan["model_name"]
    for key, plan_key, default in (
        ("speculative_num_steps", "num_steps", None),
        ("verify_replicas", "verify_replicas", 1),
        ("draft_replicas", "draft_replicas", 1),
        ("device", "device", None),
        ("draft_device", "draft_device", None),
        ("dtype", "dtype", "auto"),
        ("kv_cache_dtype", "kv_cache_dtype", "auto"),
        ("port", "port", 8000),
        ("grpc_port", "grpc_port", 50070),
    ):
        if plan.get(plan_key) is not None and plan.get(plan_key) != default:
            values[key] = plan[plan_key]
    values.update({k: v for k, v in changes.items() if not k.endswith("_arg")})
    args = ["specmesh serve", *(flag(k, v) for k, v in values.items())]
    for role in ("verify", "draft", "gateway"):
        words = plan.get(f"{role}_args") or []
        if words:
            args.append(f"--{role}-arg={shlex.quote(shlex.join(words))}")
        if changes.get(f"{role}_arg"):
            args.append(f"--{role}-arg={changes[f'{role}_arg']}")
    return " ".join(args)


def analyze(phases: list[Phase], endpoints: list[Endpoint], record: dict, prompts: list[str] | None = None) -> Findings:
    """`prompts`: what the phases sent (cycled from the first), for the prefix cache's expected hit rate."""
    summaries = [summarize(p, endpoints) for p in phases]
    for s, share in zip(summaries, prompt_sharing(prompts or [], phases), strict=True):
        if s.kv is not None:
            s.kv.expected_hit_rate = share
    spec = [s for s in summaries if s.speculative and s.requests]
    baseline = next((s for s in summaries if not s.speculative and s.requests), None)
    acc = acceptance(phases, endpoints, summaries)
    single = min(spec, key=lambda s: s.concurrency) if spec else None
    model = cost_model(single, baseline, acc) if single else None
    plan = record.get("plan") or {}
    configured_k = plan.get("num_steps")
    if configured_k is None and plan:
        configured_k = 4  # the draft service's default
    if configured_k is None and acc.drafted:
        configured_k = len(acc.drafted)  # the longest block seen
    cores = record.get("cores") if record else None
    notes: list[str] = []
    recs: list[Recommendation] = []
    sensitivity: dict[str, float] = {}
    bottleneck, bottleneck_text = "unknown", "not measured (no speculative phase with metrics)"
    if single is not None and model is not None:
        k_now = single.mean_k or float(configured_k or 1)
        best = model.best_k()
        now = model.rate(k_now)
        at_best = model.rate(best)
        for part, change in (
            ("draft", {"draft": 0.5}),
            ("verify", {"forward": 0.5}),
            ("network", {"overhead": 0.5}),
            ("overhead", {"fixed": 0.5}),
        ):
            sensitivity[part] = model.rate(model.best_k(**change), **change) / at_best - 1
        bottleneck = max(sensitivity, key=lambda p: sensitivity[p])
        shares = {p: v / sum(single.budget.values()) for p, v in single.budget.items()} if single.budget else {}
        label = {
            "draft": "the draft service (drafting)",
            "verify": "the verify service (the target forward)",
            "network": "network, queueing and sampling between draft and verify",
            "overhead": "per-request overhead outside the rounds (prefill, gateway)",
        }
        share_of = {
            "draft": shares.get("drafting", 0.0),
            "verify": shares.get("verify forward", 0.0),
            "network": shares.get("network", 0.0) + shares.get("verify queue", 0.0) + shares.get("sampling", 0.0),
            "overhead": shares.get("other", 0.0),
        }
        bottleneck_text = (
            f"{label[bottleneck]}: {share_of[bottleneck] * 100:.0f} % of a round at {single.concurrency} stream(s); "
            f"making it twice as fast would give {sensitivity[bottleneck] * 100:+.0f} % tokens/s per stream"
        )
        # The draft's cost alone bounds the gain (Leviathan et al.): a round of K drafts commits E(K) tokens for
        # at least K draft tokens and one target forward, so speculation is at most E(K) / (1 + K·c) times as
        # fast as target-only, whatever the verify side costs. A draft that caps it low is the bottleneck.
        ceiling = model.ceiling()
        if ceiling < DRAFT_CEILING:
            bottleneck = "draft"
            bottleneck_text = (
                f"the draft service: a draft token costs {model.cost_ratio:.2f} of a one-position target forward, "
                f"so with the measured acceptance speculation can be at most {ceiling:.2f}x as fast as target-only "
                "decoding, whatever K and however fast the verify side"
            )
        # Blocks so late that the verifier gave up on them measure a draft too slow directly, whatever the model
        # makes of the rounds that did carry drafts.
        steps, late = sum(s.steps for s in spec), sum(s.deadline_steps for s in spec)
        if steps and late / steps >= 0.2:
            bottleneck = "draft"
            bottleneck_text = (
                f"the draft service: {late / steps * 100:.0f} % of verify steps went target-only because the draft "
                f"block came after the verify service's deadline (a draft token costs {model.cost_ratio:.2f} of a "
                "target forward)"
            )
        draft_bound = bottleneck == "draft"
        # Under load the saturated service decides throughput, whatever a single stream's round looks like.
        top = max(spec, key=lambda s: s.concurrency)
        if top.concurrency > single.concurrency:
            v_name, v_busy = _busiest(top, "verify")
            d_name, d_busy = _busiest(top, "draft")
            if max(v_busy, d_busy) >= BUSY:
                role, name, busy = ("draft", d_name, d_busy) if d_busy >= v_busy else ("verify", v_name, v_busy)
                if role != bottleneck:
                    bottleneck_text += (
                        f"; under load, the {role} service is the limit ({name} {busy * 100:.0f} % busy at "
                        f"{top.concurrency} streams)"
                    )
                    # A draft that bounds speculation by its own cost stays named: more verify capacity
                    # would not lift that bound.
                    if not draft_bound and sensitivity.get(role, 0) * 2 >= sensitivity[bottleneck]:
                        bottleneck = role
                else:
                    bottleneck_text += f"; under load {name} is {busy * 100:.0f} % busy at {top.concurrency} streams"
        recs += _k_advice(model, record, configured_k, k_now, best, now, at_best)
        recs += _draft_speed_advice(model, record, sensitivity, best, bottleneck)
        recs += _acceptance_advice(model, record, acc, best, at_best)
        speedup_now = model.speedup(k_now)
        if model.speedup(best) < 1.0:
            recs.append(
                Recommendation(
                    "speculation does not pay here: decode target-only",
                    f"the best K ({best}) is predicted at {model.speedup(best):.2f}x of target-only decoding "
                    f"(measured now {speedup_now:.2f}x)",
                    serve_command(record, speculative_num_steps=0) + "   (or per request: num_speculative_tokens 0)",
                    1.0 / max(speedup_now, 1e-6) - 1,
                    "speculation",
                )
            )
    recs += _contention_advice(spec)
    recs += _load_advice(spec, record, summaries, cores, model)
    recs += _deadline_advice(spec, record)
    recs += _kv_advice(summaries, record)
    recs += _cpu_step_advice(summaries, record)
    recs += _suffix_advice(spec, record)
    verify_seen = any(ph.after.get(e.name) for ph in phases for e in endpoints if e.role == "verify")
    if verify_seen and not any(s.kv for s in summaries):
        notes.append(
            "the verify service exports no KV block metrics (its runner keeps no block pool: --runner batched or "
            "hf), so the report has no KV section"
        )
    for s in summaries:
        if s.errors:
            notes.append(f"{s.name}: {s.errors} request(s) failed; their numbers are missing")
    if not any(e.role == "verify" for e in endpoints) or not any(e.role == "draft" for e in endpoints):
        notes.append(
            "the verify and draft services' /metrics were not found (no `specmesh serve` record for this port): "
            "the time budget, utilisation and most advice need --metrics-url verify=URL --metrics-url draft=URL"
        )
    if baseline is None:
        notes.append("no target-only baseline was measured: speedups use a modelled baseline")
    recs.sort(key=lambda r: -(r.gain if r.gain is not None else -1.0))
    return Findings(
        summaries, acc, model, configured_k, bottleneck, bottleneck_text, sensitivity, recs, notes, record, cores
    )


def _k_advice(model, record, configured_k, k_now, best, now, at_best) -> list[Recommendation]:
    gain = at_best / now - 1
    if configured_k is None or best == configured_k or gain < 0.02:
        return []
    lower = best < configured_k
    return [
        Recommendation(
            f"set --speculative-num-steps {best}" + (" (lower K)" if lower else " (higher K)"),
            f"blocks average {k_now:.1f} draft tokens (the ceiling is {configured_k}); with the measured acceptance "
            f"(α {model.acc.alpha:.2f}) and costs, {best} maximises tokens/s per stream: "
            f"{model.speedup(best):.2f}x of target-only instead of {model.speedup(k_now):.2f}x",
            serve_command(record, speculative_num_steps=best) + f"   (or per request: num_speculative_tokens {best})",
            gain,
            "k",
        )
    ]


def _draft_speed_advice(model, record, sensitivity, best, bottleneck) -> list[Recommendation]:
    gain = sensitivity.get("draft", 0.0)
    if bottleneck != "draft" and (model.cost_ratio < 0.25 or gain < 0.05):
        return []
    plan = (record or {}).get("plan") or {}
    device = plan.get("draft_device") or plan.get("device") or ""
    what = (
        "put the draft on the GPU (--draft-device cuda)"
        if not device.startswith("cuda") and _cuda_hint(record)
        else "use a smaller or faster draft model (fewer layers; the distiller can train one from the target)"
    )
    cmd = (
        serve_command(record, draft_device="cuda")
        if "GPU" in what
        else "python -m specmesh.training.distill --target "
        + (plan.get("target") or "TARGET")
        + " --corpus 'DATA/*.jsonl' --draft-layers 2 --out DRAFT-small --steps 2000"
    )
    return [
        Recommendation(
            f"the draft is the bottleneck: a draft token costs {model.cost_ratio:.2f} of a target forward — {what}",
            f"drafting takes {model.t_draft * 1e3:.1f} ms per token against {(model.a + model.b) * 1e3:.1f} ms for a "
            f"one-position target forward; a draft twice as fast would give {gain * 100:+.0f} % per stream "
            f"(best K would become {model.best_k(draft=0.5)})",
            cmd,
            gain,
            "draft",
            "if twice as fast",
        )
    ]


def _cuda_hint(record) -> bool:
    plan = (record or {}).get("plan") or {}
    return str(plan.get("device") or "").startswith("cuda")


def _acceptance_advice(model, record, acc: Acceptance, best: int, at_best: float) -> list[Recommendation]:
    p, n = acc.cumulative, acc.reliable()
    weak = next((i for i in range(min(n, best)) if p[i] < 0.4), None)
    if weak is None and acc.alpha >= 0.8:
        return []
    boosted = model.rate(model.best_k(alpha=0.05), alpha=0.05) / at_best - 1
    plan = (record or {}).get("plan") or {}
    target, draft = plan.get("target") or "TARGET", plan.get("draft") or "DRAFT"
    where = (
        f"acceptance at position {weak + 1} is {p[weak]:.2f}"
        if weak is not None
        else f"per-token acceptance α is {acc.alpha:.2f}"
    )
    return [
        Recommendation(
            f"{where}: distil the draft longer on your traffic",
            f"each +0.05 of per-token acceptance is worth {boosted * 100:+.0f} % per stream (model); the draft "
            "learns the target's own distribution from text like your requests",
            f"python -m specmesh.training.distill --target {target} --draft {draft} --corpus 'YOUR-DATA/*.jsonl' "
            f"--cache-dir .work/teacher-cache --steps 4000 --out {draft}-distilled",
            boosted,
            "acceptance",
            "per +0.05 α",
        )
    ]


def _load_advice(spec, record, summaries, cores, model) -> list[Recommendation]:
    recs: list[Recommendation] = []
    if not spec:
        return recs
    top = max(spec, key=lambda s: s.concurrency)
    cpu_used = sum(top.cpu.values())
    machine_full = bool(cores) and cpu_used >= 0.9 * cores
    for role, other in (("draft", "verify"), ("verify", "draft")):
        name, busy = _busiest(top, role)
        if busy < BUSY or _starved(top, name):  # starved: the machine's cores are the limit, not the replicas
            continue
        n = _replicas(record, role, summaries)
        _, other_busy = _busiest(top, other)
        # Twice the capacity at most, and only until the other service saturates in turn.
        gain = min((n + 1) / n, 1.0 / max(other_busy, 0.05)) - 1
        why = (
            f"{name} is {busy * 100:.0f} % busy at {top.concurrency} streams (the {other} service "
            f"{other_busy * 100:.0f} %): its streams queue for it"
        )
        note = ""
        if machine_full:
            why += (
                f"; this machine's {cores} cores are already {cpu_used:.1f} busy, so the new replica needs cores of "
                "its own (another machine, or a GPU)"
            )
            note = "with cores of its own"
        recs.append(
            Recommendation(
                f"the {role} service is saturated: add a {role} replica (--{role}-replicas {n + 1})",
                why,
                serve_command(record, **{f"{role}_replicas": n + 1}),
                gain,
                role,
                note,
            )
        )
    for s in spec:
        if s.concurrency < 2 or not s.verify_batch:
            continue
        _, v_busy = _busiest(s, "verify")
        if s.verify_batch < 0.6 * s.concurrency and v_busy < BUSY and model is not None:
            # A forward's fixed cost a is paid once per batch: merging the streams' blocks saves it.
            batches_per_round = s.concurrency / s.verify_batch
            saved = model.a * (batches_per_round - 1) / batches_per_round
            round_s = sum(s.budget.values()) or 1.0
            recs.append(
                Recommendation(
                    f"verify batches average {s.verify_batch:.1f} blocks at {s.concurrency} streams: raise "
                    "--batch-wait-ms",
                    f"the {s.concurrency} streams' blocks reach the verify service apart and are verified in "
                    f"{batches_per_round:.1f} forwards instead of one; waiting a little longer for them saves up to "
                    f"{saved * 1e3:.1f} ms of {round_s * 1e3:.1f} ms per round",
                    serve_command(record, verify_arg="--batch-wait-ms=10"),
                    saved / round_s,
                    "batch",
                    "at most",
                )
            )
            break
    return recs


def _starved(s: PhaseSummary, name: str) -> bool:
    """A model thread busy most of the time while its process gets little CPU waits for cores that something
    else holds: every time measured on such a machine is inflated, and so is every gain."""
    busy, cpu = s.busy.get(name, 0.0), s.cpu.get(name)
    return cpu is not None and busy >= 0.5 and cpu < 0.6 * busy


def _contention_advice(spec: list[PhaseSummary]) -> list[Recommendation]:
    for s in sorted(spec, key=lambda s: s.concurrency):
        for name, busy in s.busy.items():
            cpu = s.cpu.get(name, 0.0)
            if _starved(s, name):
                return [
                    Recommendation(
                        f"{name} is starved of CPU: give the stack the machine's cores",
                        f"its model thread was busy {busy * 100:.0f} % of the time at {s.concurrency} stream(s) "
                        f"while the process used {cpu:.2f} cores: other processes hold the cores (or --threads "
                        "exceeds them), so forwards wait for a core and every number here is inflated",
                        "top   (other work on the machine?); then specmesh serve ... --verify-threads N "
                        "--draft-threads M within the cores the stack may use, and profile again",
                        None,
                        "contention",
                    )
                ]
    return []


def _deadline_advice(spec, record) -> list[Recommendation]:
    steps = sum(s.steps for s in spec)
    late = sum(s.deadline_steps for s in spec)
    if not steps or late / steps < 0.02:
        return []
    return [
        Recommendation(
            f"{late / steps * 100:.0f} % of verify steps were target-only because a draft block was late: raise "
            "--draft-deadline-ms (or speed up the draft)",
            "a deadline step commits one token where the block would have committed several",
            serve_command(record, verify_arg="--draft-deadline-ms=500"),
            None,
            "deadline",
        )
    ]


SUFFIX_LOW_ACCEPTANCE = 0.3  # under this share of suffix draft tokens accepted, proposals are too bold


def suffix_share(s: PhaseSummary) -> float | None:
    """The suffix trees' share of the phase's accepted draft tokens (None: no suffix drafts)."""
    if "suffix" not in s.by_method:
        return None
    accepted = sum(a for _, a in s.by_method.values())
    return s.by_method["suffix"][1] / accepted if accepted else 0.0


def _suffix_advice(spec: list[PhaseSummary], record: dict) -> list[Recommendation]:
    """The suffix trees' settings, from what their proposals got accepted."""
    drafted = sum(s.by_method.get("suffix", (0.0, 0.0))[0] for s in spec)
    accepted = sum(s.by_method.get("suffix", (0.0, 0.0))[1] for s in spec)
    if drafted < 50:  # too few proposals to judge
        return []
    rate = accepted / drafted
    if rate < SUFFIX_LOW_ACCEPTANCE:
        return [
            Recommendation(
                "suffix proposals are mostly rejected: propose only likelier continuations",
                f"{rate * 100:.0f} % of the suffix trees' draft tokens were accepted; a higher "
                "--suffix-decoding-min-token-prob cuts proposals where the continuation gets unlikely, and a lower "
                "--suffix-decoding-max-spec-factor keeps short matches from proposing long blocks",
                serve_command(record, draft_arg="--suffix-decoding-min-token-prob=0.3"),
                None,
                "suffix",
            )
        ]
    if rate > 0.8:
        return [
            Recommendation(
                "suffix proposals are nearly always accepted: let them run longer",
                f"{rate * 100:.0f} % of the suffix trees' draft tokens were accepted; a larger "
                "--suffix-decoding-max-spec-factor (and --speculative-num-steps, the cap per round) lets a long "
                "match propose more of what follows it",
                serve_command(record, draft_arg="--suffix-decoding-max-spec-factor=2"),
                None,
                "suffix",
            )
        ]
    return []


def _cpu_step_advice(summaries: list[PhaseSummary], record: dict) -> list[Recommendation]:
    """From the verify forward's phases at the most loaded phase that ran it: attention worth a narrower KV,
    barriers that say the step's threads share their cores."""
    ran = [s for s in summaries if s.cpu_step_calls and s.cpu_step_shares]
    if not ran:
        return []
    s = max(ran, key=lambda s: (s.concurrency, s.speculative))
    shares, recs = s.cpu_step_shares, []
    ms = 1e3 * sum(s.cpu_step.values()) / s.cpu_step_calls
    where = f"at {s.concurrency} stream(s){'' if s.speculative else ' target-only'} (a forward {ms:.1f} ms)"
    attention = shares.get("attention", 0.0)
    if attention >= STEP_ATTENTION and _kv_halving(record):
        recs.append(
            Recommendation(
                f"attention is {attention * 100:.0f} % of the verify forward {where}: keep the KV in bfloat16",
                "a forward's attention reads every sequence's keys and values, and at this share its time is that "
                "read's (the products run at the CPU's GEMM rate); --kv-cache-dtype bfloat16 halves the bytes, "
                "each key and value rounded once when written (greedy outputs can differ from a float32 cache's "
                "at near-ties)",
                serve_command(record, kv_cache_dtype="bfloat16"),
                None,
                "verify",
            )
        )
    barrier = shares.get("barrier wait", 0.0)
    if barrier >= STEP_BARRIER:
        recs.append(
            Recommendation(
                f"the verify forward's threads wait on each other for {barrier * 100:.0f} % of it {where}: "
                "their cores are shared",
                "its threads split every product and meet at a barrier after each, so one that loses its core "
                "holds up the rest: the draft service drafting for other streams, the gateway or other processes "
                "run on the same cores (or --verify-threads exceeds them). That share of the forward is what cores "
                "of its own would give back; on a machine with no cores to spare it is the price of co-locating "
                "the services",
                "top   (what else runs there?); specmesh serve ... --verify-threads N --draft-threads M with N + M "
                "within the cores, or the draft replicas on other machines",
                None,
                "contention",
            )
        )
    return recs


def _kv_halving(record: dict) -> str:
    """The words that offer --kv-cache-dtype bfloat16 where the profiled stack could take it (a float32
    target's KV in float32, not on CUDA), else none."""
    plan = (record or {}).get("plan") or {}
    if str(plan.get("device") or "").startswith("cuda") or not str(plan.get("device") or "cpu").startswith("cpu"):
        return ""
    if plan.get("dtype", "auto") not in ("auto", "float32", "float"):
        return ""
    if plan.get("kv_cache_dtype", "auto") not in ("auto", "float32", "float"):
        return ""
    words, runner = list(plan.get("verify_args") or []), "auto"
    for i, word in enumerate(words):
        if word.startswith("--runner="):
            runner = word.split("=", 1)[1]
        elif word == "--runner" and i + 1 < len(words):
            runner = words[i + 1]
    if runner not in ("auto", "paged"):
        return ""  # only the paged runner keeps its KV in another dtype
    return (
        "; on a CPU, --verify-arg=--kv-cache-dtype=bfloat16 (specmesh serve --kv-cache-dtype bfloat16) keeps the "
        "float32 target's KV in bfloat16: twice the tokens in the same budget"
    )


def _kv_advice(summaries: list[PhaseSummary], record: dict) -> list[Recommendation]:
    recs: list[Recommendation] = []
    kv = [(s, s.kv) for s in summaries if s.kv is not None]
    if not kv:
        return recs
    budget = max(k.budget_bytes for _, k in kv)
    raise_budget = serve_command(record, verify_arg=f"--kv-cache-budget-mb={math.ceil(2 * budget / 2**20)}")
    halve = _kv_halving(record)
    preempted = [(s, k) for s, k in kv if k.preemptions > 0]
    if preempted:
        s, k = max(preempted, key=lambda sk: sk[1].preemptions)
        recs.append(
            Recommendation(
                f"{k.preemptions:.0f} session(s) preempted at {s.concurrency} stream(s): the KV budget is too small "
                "for the load — raise --kv-cache-budget-mb or lower --max-sessions",
                f"the verify service ran out of KV blocks ({k.usage_peak * 100:.0f} % of {k.num_blocks:.0f} blocks of "
                f"{k.block_size} tokens in use at the peak) and took running sessions' blocks back; each resumes by "
                f"recomputing its prompt and output so far, so its stream stalls and that prefill is paid twice{halve}",
                raise_budget if budget else serve_command(record, verify_arg="--max-sessions=N"),
                None,
                "kv",
            )
        )
    losing = [
        (s, k)
        for s, k in kv
        if k.hit_rate is not None
        and k.expected_hit_rate is not None
        and k.expected_hit_rate >= KV_SHARED
        and k.hit_rate < KV_SHORT * k.expected_hit_rate
    ]
    if losing:
        s, k = max(losing, key=lambda sk: sk[1].prefix_queries)
        hit, expected = k.hit_rate or 0.0, k.expected_hit_rate or 0.0
        where = (
            f"the prefix cache served {hit * 100:.0f} % of the prompt tokens looked up at {s.concurrency} "
            f"stream(s), where this workload's prompts repeat or share about {expected * 100:.0f} %"
        )
        if k.replicas > 1:
            recs.append(
                Recommendation(
                    f"{where}: route requests that share a prefix to one verify replica (session / prefix affinity)",
                    f"each of the {k.replicas} verify replicas keeps a prefix cache of its own, so a prefix computed "
                    "on one is computed again on the others. The gateway sends a request without a session_id to the "
                    "replica that has seen the longest part of its prompt (when that covers over 30 % of it, within "
                    "the load bound), and one with a session_id by the session's hash",
                    "clients: send one-shot requests that share a system prompt without a session_id (routed by "
                    "prefix), and one session_id per conversation (its turns stay on its replica)",
                    None,
                    "kv",
                )
            )
        elif k.evictions > 0:
            recs.append(
                Recommendation(
                    f"{where}: cached prefix blocks are evicted before they are reused — raise --kv-cache-budget-mb",
                    f"{k.evictions:.0f} cached blocks were taken for new KV during the phase: with no free block left, "
                    f"the pool gives up the least recently released prefixes first{halve}",
                    raise_budget,
                    None,
                    "kv",
                )
            )
        else:
            recs.append(
                Recommendation(
                    f"{where}: check the requests' tenants and cache_salt",
                    "blocks are shared only within one tenant (API key) and cache_salt, and with one verify replica "
                    "and no eviction nothing else keeps a prefix from being found",
                    "send requests that should share a prefix with one tenant's key and the same cache_salt (or none)",
                    None,
                    "kv",
                )
            )
    return recs
