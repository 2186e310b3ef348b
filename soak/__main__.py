"""The chaos and soak suite (`python -m soak`, `make soak`): real processes on loopback, faults injected
while streams run, and every figure in one JSON report (default soak/results/report.json).

Scenarios, in order, on one cluster (two verify replicas, the first dialled through a fault proxy, one
draft service, one gateway; the demo models):
- verify_sigkill: SIGKILL a verify replica under 100 greedy streams; completed / 100, and tokens lost or
  repeated against target-only greedy output; then verify_restart: the replica comes back on its port and
  serves again.
- draft_sigkill, draft_sigstop: the draft killed (then restarted) or hung under 32 streams: % complete,
  longest gap between tokens any client saw, outputs against target-only greedy; the hung draft's return to
  rotation.
- verify_sigstop: a verify replica hung under 32 streams.
- link_delay, link_blackhole, link_reset: the first verify replica's traffic (the draft's Verify streams and
  the gateway's calls) delayed, black-holed or reset by the proxy under 32 streams.
- gateway_sigkill: the gateway killed mid-stream, restarted on its ports, serving again.
- fuzz: malformed REST requests and random gRPC frames / payloads at every service: crashes and 5xx.
- soak: 32 concurrent clients for --duration-s, multi-turn sessions, greedy and sampled mixed: errors, RSS
  of every process after warm-up against the end, sessions still held at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import platform
import random
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from soak.cluster import ROOT, Cluster
from soak.fuzz import fuzz_grpc, fuzz_rest
from specmesh.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verify_pb2,
    verify_pb2_grpc,
)
from tests.support.faultproxy import FaultProxy

log = logging.getLogger("soak")
DEMO = ROOT / "models" / "demo"


@dataclass
class Result:
    ids: list[int] = field(default_factory=list)
    finish: str = ""
    error: str = ""
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (when the gap ended, its length)
    failovers: int = 0
    target_only: bool = False
    drafted: int = 0


async def stream(
    stub, prompt_ids, max_tokens, temperature=0.0, session_id="", k=None, seed=None, timeout=240.0, on_delta=None
) -> Result:
    params = common_pb2.SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)
    if temperature > 0:
        params.top_p = 0.95
    if seed is not None:
        params.seed = seed
    req = gateway_pb2.GatewayServiceGenerateStreamRequest(prompt_ids=prompt_ids, params=params, session_id=session_id)
    if k is not None:
        req.num_speculative_tokens = k
    r = Result()
    last = None
    try:
        async for chunk in stub.GenerateStream(req, timeout=timeout):
            now = time.monotonic()
            if last is not None:
                r.gaps.append((now, now - last))
            last = now
            if chunk.WhichOneof("chunk") == "delta":
                r.ids += chunk.delta.token_ids
                if on_delta is not None:
                    on_delta()
            else:
                f = chunk.finished
                r.ids += f.token_ids
                r.finish = common_pb2.FinishReason.Name(f.finish_reason)
                r.failovers, r.target_only, r.drafted = f.failovers, f.target_only, f.stats.drafted
    except grpc.aio.AioRpcError as e:
        r.error = f"{e.code().name}: {e.details()}"
    return r


def lost_or_repeated(want: list[int], got: list[int]) -> int:
    """Tokens that differ from the reference: everything past the longest common prefix, on either side."""
    n = 0
    while n < min(len(want), len(got)) and want[n] == got[n]:
        n += 1
    return max(len(want), len(got)) - n


def prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    """Prompts cut from the project's own Python sources (code, as the demo models were trained on)."""
    rng = random.Random(seed)
    lines = [ln for p in sorted((ROOT / "specmesh").glob("*.py")) for ln in p.read_text().splitlines() if ln.strip()]
    out = []
    for _ in range(count):
        i = rng.randrange(len(lines) - 4)
        out.append(tokenizer("\n".join(lines[i : i + rng.randint(1, 4)]) + "\n", add_special_tokens=False)["input_ids"])
    return out


class Suite:
    def __init__(self, args, cluster: Cluster, tokenizer):
        self.args, self.cluster, self.tokenizer = args, cluster, tokenizer
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{cluster.grpc_port}")
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)
        self.references: dict[tuple, list[int]] = {}

    async def reopen(self) -> None:
        await self.channel.close()
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.cluster.grpc_port}")
        self.stub = gateway_pb2_grpc.GatewayServiceStub(self.channel)

    async def reference(self, batch: list[list[int]], max_tokens: int) -> list[list[int]]:
        """Target-only greedy output (num_speculative_tokens 0: the verify replica decodes alone)."""
        todo = [p for p in batch if (tuple(p), max_tokens) not in self.references]
        sem = asyncio.Semaphore(16)

        async def one(p):
            async with sem:
                r = await stream(self.stub, p, max_tokens, k=0)
                if r.error:
                    raise RuntimeError(f"reference generation failed: {r.error}")
                self.references[(tuple(p), max_tokens)] = r.ids

        await asyncio.gather(*(one(p) for p in todo))
        return [self.references[(tuple(p), max_tokens)] for p in batch]

    async def health(self) -> dict:
        return await asyncio.to_thread(_get_json, f"http://127.0.0.1:{self.cluster.gateway.port}/health")

    async def wait_health(self, key: str, want: int, timeout: float = 60) -> float | None:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                if (await self.health()).get(key, 0) >= want:
                    return round(time.monotonic() - t0, 2)
            except OSError:
                pass
            await asyncio.sleep(0.2)
        return None

    async def under_fault(self, n: int, max_tokens: int, fault, heal=None, hold_s: float = 0.0) -> dict:
        """n greedy streams; once every stream has its first tokens, `fault()`; `heal()` after `hold_s`.
        Figures: complete, equal to target-only greedy, tokens lost or repeated, longest gap."""
        batch = prompts(self.tokenizer, n, seed=n * 7 + max_tokens)
        want = await self.reference(batch, max_tokens)
        started = [0]
        seen: set[int] = set()

        def delta(i):
            if i not in seen:
                seen.add(i)
                started[0] += 1

        tasks = [
            asyncio.ensure_future(stream(self.stub, p, max_tokens, on_delta=lambda i=i: delta(i)))
            for i, p in enumerate(batch)
        ]
        t_end = time.monotonic() + 120
        while started[0] < n and time.monotonic() < t_end and not all(t.done() for t in tasks):
            await asyncio.sleep(0.02)
        t_fault = time.monotonic()
        await asyncio.to_thread(fault)
        if heal is not None:
            await asyncio.sleep(hold_s)
            await asyncio.to_thread(heal)
        results = await asyncio.gather(*tasks)
        complete = [r for r in results if not r.error and r.finish]
        return dict(
            streams=n,
            max_tokens=max_tokens,
            streams_started_before_fault=started[0],
            completed=len(complete),
            completed_pct=round(100 * len(complete) / n, 1),
            equal_to_target_only=sum(r.ids == w for r, w in zip(results, want, strict=True)),
            tokens_lost_or_repeated=sum(
                lost_or_repeated(w, r.ids) for r, w in zip(results, want, strict=True) if not r.error
            ),
            # the longest wait for a token that spans the fault or follows it, and, for scale, before it
            longest_gap_s=round(max((g for r in results for t, g in r.gaps if t >= t_fault), default=0.0), 3),
            longest_gap_before_fault_s=round(
                max((g for r in results for t, g in r.gaps if t < t_fault), default=0.0), 3
            ),
            failovers=sum(r.failovers for r in results),
            errors=sorted({r.error for r in results if r.error})[:5],
            fault_held_s=hold_s,
            wall_s=round(time.monotonic() - t_fault, 2),
        )

    # scenarios ---------------------------------------------------------------------------------------------
    async def verify_sigkill(self) -> dict:
        victim = self.cluster.verify[1]
        out = await self.under_fault(100, 48, victim.kill)
        t0 = time.monotonic()
        victim.launch()
        await asyncio.to_thread(victim.wait_ready)
        back = await self.wait_health("verify_healthy", 2, 60)
        after = await self.under_fault(8, 32, lambda: None)
        out["restart"] = dict(
            ready_s=round(time.monotonic() - t0, 2),
            back_in_pool_s=back,
            then_streams_completed=after["completed"],
            then_equal_to_target_only=after["equal_to_target_only"],
        )
        return out

    async def draft_sigkill(self) -> dict:
        draft = self.cluster.draft
        out = await self.under_fault(32, 96, draft.kill)
        draft.launch()
        await asyncio.to_thread(draft.wait_ready)
        out["back_in_pool_s"] = await self.wait_health("draft_healthy", 1, 60)
        return out

    async def draft_sigstop(self) -> dict:
        draft = self.cluster.draft
        out = await self.under_fault(
            32, 160, lambda: draft.signal(signal.SIGSTOP), lambda: draft.signal(signal.SIGCONT), hold_s=8.0
        )
        out["back_in_pool_s"] = await self.wait_health("draft_healthy", 1, 60)
        r = await stream(self.stub, prompts(self.tokenizer, 1, 5)[0], 24)
        out["then_speculating"] = bool(r.drafted) and not r.target_only
        return out

    async def verify_sigstop(self) -> dict:
        v = self.cluster.verify[1]
        out = await self.under_fault(
            32, 160, lambda: v.signal(signal.SIGSTOP), lambda: v.signal(signal.SIGCONT), hold_s=8.0
        )
        out["back_in_pool_s"] = await self.wait_health("verify_healthy", 2, 60)
        return out

    async def link(self, mode: str) -> dict:
        proxy = self.cluster.faults
        assert proxy is not None
        faults = {
            "delay": (lambda: proxy.delay(0.05), 6.0),
            "blackhole": (proxy.blackhole, 8.0),
            "reset": (proxy.reset, 3.0),
        }
        fault, hold = faults[mode]
        out = await self.under_fault(32, 160, fault, proxy.heal, hold_s=hold)
        out["back_in_pool_s"] = await self.wait_health("verify_healthy", 2, 60)
        return out

    async def gateway_sigkill(self) -> dict:
        gw = self.cluster.gateway
        assert gw is not None
        batch = prompts(self.tokenizer, 8, seed=99)
        tasks = [asyncio.ensure_future(stream(self.stub, p, 400)) for p in batch]
        await asyncio.sleep(1.0)
        gw.kill()
        results = await asyncio.gather(*tasks)
        t0 = time.monotonic()
        gw.launch()
        await asyncio.to_thread(gw.wait_ready)
        await self.reopen()
        verify_back = await self.wait_health("verify_healthy", 2, 60)
        draft_back = await self.wait_health("draft_healthy", 1, 60)
        after = await self.under_fault(8, 32, lambda: None)
        return dict(
            streams_cut=sum(bool(r.error) for r in results),
            cut_with_an_error_status=all(
                r.error.startswith(("UNAVAILABLE", "CANCELLED", "INTERNAL")) for r in results if r.error
            ),
            restart_to_serving_s=round(time.monotonic() - t0, 2),
            pools_healthy_s=[verify_back, draft_back],
            then_streams_completed=after["completed"],
            then_equal_to_target_only=after["equal_to_target_only"],
        )

    async def fuzz(self) -> dict:
        gw = self.cluster.gateway
        assert gw is not None
        rest = await asyncio.to_thread(fuzz_rest, f"127.0.0.1:{gw.port}", self.args.fuzz_requests)
        frames = {}
        for s in self.cluster.services:
            address = s.address if s is not gw else f"127.0.0.1:{self.cluster.grpc_port}"
            frames[s.name] = await fuzz_grpc(address, self.args.fuzz_frames)
        crashed = [s.name for s in self.cluster.services if not s.alive()]
        after = await self.under_fault(4, 16, lambda: None)
        return dict(
            rest=rest,
            grpc=frames,
            processes_crashed=crashed,
            then_streams_completed=after["completed"],
        )

    async def soak(self) -> dict:
        duration = self.args.duration_s
        warmup = min(max(30.0, duration * 0.25), duration / 2)
        t0 = time.monotonic()
        stats = dict(requests=0, turns=0, errors=0, greedy=0, sampled=0, tokens=0)
        errors: list[str] = []
        rss: dict[str, dict] = {s.name: {} for s in self.cluster.services}
        source = prompts(self.tokenizer, 256, seed=1234)

        async def worker(w: int):
            rng = random.Random(w)
            n = 0
            while time.monotonic() - t0 < duration:
                n += 1
                session = f"soak-{w}-{n}"
                greedy = rng.random() < 0.5
                context = list(rng.choice(source))
                for _turn in range(rng.randint(1, 4)):
                    if time.monotonic() - t0 >= duration:
                        break
                    r = await stream(
                        self.stub,
                        context,
                        rng.randint(16, 96),
                        temperature=0.0 if greedy else 0.7,
                        session_id=session,
                        seed=rng.randrange(1 << 30) if not greedy and rng.random() < 0.3 else None,
                    )
                    stats["requests"] += 1
                    stats["turns"] += 1
                    stats["greedy" if greedy else "sampled"] += 1
                    stats["tokens"] += len(r.ids)
                    if r.error or not r.finish:
                        stats["errors"] += 1
                        errors.append(r.error or "no finish reason")
                        break
                    context = (context + r.ids + rng.choice(source))[-900:]

        async def sample_rss():
            warm_taken = False
            while time.monotonic() - t0 < duration:
                await asyncio.sleep(1.0)
                if not warm_taken and time.monotonic() - t0 >= warmup:
                    for s in self.cluster.services:
                        rss[s.name]["after_warmup_mb"] = s.rss_mb()
                    warm_taken = True

        await asyncio.gather(sample_rss(), *(worker(w) for w in range(self.args.soak_streams)))
        for s in self.cluster.services:
            rss[s.name]["end_mb"] = s.rss_mb()
            a, b = rss[s.name].get("after_warmup_mb"), rss[s.name]["end_mb"]
            rss[s.name]["growth_pct"] = round(100 * (b - a) / a, 2) if a and b else None
        await asyncio.sleep(3.0)  # streams that just ended release what they hold
        held = await self.held()
        return dict(
            duration_s=duration,
            warmup_s=warmup,
            concurrent_clients=self.args.soak_streams,
            **stats,
            error_samples=sorted(set(errors))[:5],
            rss=rss,
            held_at_end=held,
        )

    async def held(self) -> dict:
        out: dict = {}
        for v in self.cluster.verify:
            async with grpc.aio.insecure_channel(v.address) as ch:
                info = await verify_pb2_grpc.VerifyServiceStub(ch).Info(
                    verify_pb2.VerifyServiceInfoRequest(), timeout=10
                )
            out[v.name] = dict(active_sessions=info.active_sessions, cached_sessions=info.sessions)
        async with grpc.aio.insecure_channel(self.cluster.draft.address) as ch:
            info = await draft_pb2_grpc.DraftServiceStub(ch).Info(draft_pb2.DraftServiceInfoRequest(), timeout=10)
        out["draft"] = dict(active_sessions=info.active_sessions)
        gw = self.cluster.gateway
        assert gw is not None
        page = await asyncio.to_thread(_get_text, f"http://127.0.0.1:{gw.port}/metrics")
        out["gateway"] = {
            ln.split()[0]: float(ln.split()[1])
            for ln in page.splitlines()
            if ln.startswith("specmesh_gateway_") and ("inflight" in ln or "waiting" in ln or "running" in ln)
        }
        return out


def _get_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _get_json(url: str) -> dict:
    import urllib.error

    try:
        return json.loads(_get_text(url))
    except urllib.error.HTTPError as e:  # 503 while no verify replica is healthy still has the body
        return json.loads(e.read().decode())


SCENARIOS = (
    "verify_sigkill",
    "draft_sigkill",
    "draft_sigstop",
    "verify_sigstop",
    "link_delay",
    "link_blackhole",
    "link_reset",
    "gateway_sigkill",
    "fuzz",
    "soak",
)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration-s", type=float, default=600.0, help="length of the soak scenario")
    ap.add_argument("--soak-streams", type=int, default=32, help="concurrent clients of the soak")
    ap.add_argument(
        "--scenarios", default=",".join(SCENARIOS), help="comma-separated, in this order: " + ", ".join(SCENARIOS)
    )
    ap.add_argument("--fuzz-requests", type=int, default=10_000, help="malformed REST requests")
    ap.add_argument("--fuzz-frames", type=int, default=500, help="random gRPC frames and payloads per service")
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--out", default=str(ROOT / "soak" / "results" / "report.json"))
    ap.add_argument("--log-dir", default=str(ROOT / ".work" / "soak"), help="each process's output")
    return ap.parse_args(argv)


async def run(args) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.target)
    cluster = Cluster(Path(args.target), Path(args.draft), Path(args.log_dir), verify=2, proxy=FaultProxy)
    report: dict = dict(
        started=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        machine=dict(cpus=__import__("os").cpu_count(), python=platform.python_version()),
        git=_git(),
        args=vars(args),
        scenarios={},
    )
    t0 = time.monotonic()
    try:
        await asyncio.to_thread(cluster.start)
        suite = Suite(args, cluster, tokenizer)
        await suite.wait_health("draft_healthy", 1, 60)
        await suite.wait_health("verify_healthy", 2, 60)
        for name in [s for s in args.scenarios.split(",") if s]:
            log.info("scenario %s", name)
            t = time.monotonic()
            try:
                if name.startswith("link_"):
                    result = await suite.link(name.removeprefix("link_"))
                else:
                    result = await getattr(suite, name)()
            except Exception as e:
                log.exception("scenario %s failed", name)
                result = dict(failed=f"{type(e).__name__}: {e}")
            result["scenario_wall_s"] = round(time.monotonic() - t, 1)
            report["scenarios"][name] = result
            log.info("%s: %s", name, json.dumps(result)[:400])
            _write(args.out, report)
        report["sigterm_exit_s"] = {s.name: s.stop() for s in reversed(cluster.services)}
    finally:
        cluster.close()
    report["wall_s"] = round(time.monotonic() - t0, 1)
    report["summary"] = summary(report["scenarios"])
    _write(args.out, report)
    return report


def summary(s: dict) -> dict:
    """The figures the suite is judged by, in one place."""
    out: dict = {}
    if "verify_sigkill" in s and "completed" in s["verify_sigkill"]:
        v = s["verify_sigkill"]
        out["verify_sigkill_100_streams"] = (
            f"{v['completed']}/{v['streams']} complete, {v['tokens_lost_or_repeated']} tokens lost or repeated"
        )
    for name in ("draft_sigkill", "draft_sigstop"):
        if name in s and "completed_pct" in s[name]:
            r = s[name]
            out[name] = (
                f"{r['completed_pct']} % complete, longest gap {r['longest_gap_s']} s, "
                f"{r['equal_to_target_only']}/{r['streams']} equal to target-only greedy"
            )
    if "soak" in s and "rss" in s["soak"]:
        so = s["soak"]
        out["soak"] = dict(
            errors=so["errors"],
            requests=so["requests"],
            max_rss_growth_pct=max(
                (r["growth_pct"] for r in so["rss"].values() if r.get("growth_pct") is not None), default=None
            ),
            held_at_end=so["held_at_end"],
        )
    if "fuzz" in s and "rest" in s["fuzz"]:
        f = s["fuzz"]
        out["fuzz"] = dict(
            rest_requests=f["rest"]["requests"],
            rest_5xx=f["rest"]["5xx"],
            grpc_internal_or_unknown=sum(g["internal_or_unknown"] for g in f["grpc"].values()),
            crashed=f["processes_crashed"],
        )
    return out


def _write(path: str, report: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(report, indent=2) + "\n")


def _git() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    return dict(commit=git("rev-parse", "HEAD"), dirty=bool(git("status", "--porcelain")))


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # SIGTERM unwinds like Ctrl-C, so the cluster's processes are stopped rather than orphaned
    signal.signal(signal.SIGTERM, _interrupt)
    args = parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps(report["summary"], indent=2))
    return report


if __name__ == "__main__":
    main()
