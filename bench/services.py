"""Services benchmark: speculative decoding through the draft and verify services on loopback.

    python -m bench.services [--prompts 6] [--max-tokens 64] [--concurrency 1 4 16] [--quick]

The verify service and two draft services run as separate processes (`python -m verify_service`,
`python -m draft_service`, one torch thread each); this process is the client and also runs the
in-process baselines (one torch thread). Greedy, the demo pair, held-out prompts (the first tokens of
held-out standard library files), after a warm-up. Measured:

1. single stream, tokens/s: (a) in-process target-only (SpeculativeEngine, K = 0), (b) in-process
   speculative K = 4, (c) DraftService.Generate K = 4 (adaptive K and pipelining, the defaults), (d) the
   same through a second draft service started with --no-adaptive --no-pipeline, (e) target-only through
   the verify service (VerifyService.Generate); ratios vs (a) and vs (e), and whether every output equals
   (a) token for token; the methods run interleaved (all five on prompt 1, then on prompt 2, ...) so
   load from elsewhere on the machine hits them alike; "median" is the median per-prompt tokens/s;
2. per-round overhead: a raw Verify stream client (OpenSession, then DraftBlock up / Verdict down) with an
   in-process ModelDrafter drafting K = 4 greedy blocks; per round the client-side round time (write ->
   verdict), the server's timings.batch_seconds (target forward + rejection sampling) and the overhead
   (round time - batch_seconds: gRPC, serialisation, scheduler hand-offs), p50 / p99 in ms;
3. aggregate tokens/s with N concurrent sessions (different prompts, a thread pool of sync stubs): the
   draft service (K = 4) vs target-only VerifyService.Generate, and the mean verify batch size from
   VerifyService.Info (batched_blocks / batches over the run);
4. draft time per token: DraftService.Info draft_seconds_per_token vs a plain HF one-token decode of the
   draft (DynamicCache) measured here.

Writes bench/results/services.json and bench/results/services.png.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import torch
import transformers
from tqdm import tqdm

from bench.inprocess import decode_ms, heldout_prompts
from bench.output import write_json
from bench.plots import concurrency_axis, label_bars, pyplot, save
from specmesh import wire
from specmesh.domain import DraftBlock, SpecStats
from specmesh.drafters import ModelDrafter
from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
K = 4
RPC_TIMEOUT = 300.0


# ---------------------------------------------------------------------------------------------------------
# service subprocesses


class Services:
    """The service processes of this run; `close()` (also at exit and on SIGTERM) shuts every one down."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen, Path]] = []

    def spawn(self, name: str, module: str, args: list[str]) -> tuple[subprocess.Popen, Path]:
        log = self.log_dir / f"{name}.log"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(log, "w") as f:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, "--port", "0", "--metrics-port", "0", "--threads", "1", *args],
                cwd=ROOT,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.procs.append((name, proc, log))
        return proc, log

    def wait_listening(self, name: str, timeout: float = 180.0) -> str:
        _, proc, log = next(p for p in self.procs if p[0] == name)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"listening on (\S+)", log.read_text())
            if m:
                return m.group(1)
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{name} did not start (exit code {proc.poll()}):\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        _, _, log = next(p for p in self.procs if p[0] == name)
        return "\n".join(log.read_text().splitlines()[-lines:]) if log.exists() else ""

    def check_alive(self) -> None:
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}:\n{self.tail(name)}")

    def close(self) -> None:
        # Drafts first (they hold streams to the verifier), then the verifier: SIGTERM, then SIGKILL.
        try:
            for _, proc, _ in reversed(self.procs):
                if proc.poll() is None:
                    proc.terminate()
            for _, proc, _ in reversed(self.procs):
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        except BaseException:  # interrupted while waiting (a second Ctrl-C): no more grace
            for _, proc, _ in self.procs:
                if proc.poll() is None:
                    proc.kill()
            raise
        self.procs.clear()


# ---------------------------------------------------------------------------------------------------------
# measurements


def draft_runner_default() -> str:
    """The draft service's default draft runner (its --draft-runner flag), as this checkout defines it."""
    from draft_service.engine import DraftConfig

    return str(getattr(DraftConfig(model_path="-"), "draft_runner", "hf"))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def greedy_pb(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def summary(tokens: int, seconds: float, **extra) -> dict:
    return {"tokens": tokens, "seconds": round(seconds, 4), "tokens_per_s": round(tokens / seconds, 2), **extra}


def spec_summary(stats: SpecStats) -> dict:
    """The speculation figures a result reports, by SpecStats' (vLLM's) definitions."""
    d = stats.as_dict()
    return {k: d[k] for k in ("rounds", "drafts", "drafted", "accepted", "acceptance_rate", "mean_accepted_length")}


def engine_once(engine, prompt, max_tokens, k) -> tuple[list[int], SpecStats | None]:
    r = engine.generate(prompt, greedy(max_tokens), k)
    return r.token_ids, r.stats


def generate_once(stub, prompt, max_tokens) -> tuple[list[int], object]:
    """All tokens and the finished chunk of one DraftService / VerifyService Generate call."""
    if isinstance(stub, draft_pb2_grpc.DraftServiceStub):
        req = draft_pb2.DraftServiceGenerateRequest(
            prompt_ids=prompt, params=greedy_pb(max_tokens), num_speculative_tokens=K
        )
    else:
        req = verify_pb2.VerifyServiceGenerateRequest(prompt_ids=prompt, params=greedy_pb(max_tokens))
    tokens, last = [], None
    for chunk in stub.Generate(req, timeout=RPC_TIMEOUT):
        tokens.extend(chunk.tokens.token_ids)
        if chunk.HasField("finished"):
            last = chunk.finished
    return tokens, last


def service_once(stub, prompt, max_tokens) -> tuple[list[int], SpecStats | None]:
    out, last = generate_once(stub, prompt, max_tokens)
    return out, wire.stats_from_pb(last.stats) if last.HasField("stats") else None


def run_interleaved(plan, prompts, check) -> tuple[dict, dict]:
    """Every method on prompt 1, then every method on prompt 2, ...: load from elsewhere on the machine
    then hits all methods alike instead of whichever ran while it lasted."""
    acc = {name: {"tokens": 0, "seconds": 0.0, "per_prompt_s": [], "spec": None} for name, _ in plan}
    outputs = {name: [] for name, _ in plan}
    for p in tqdm(prompts, desc="1. single stream", unit="prompt"):
        for name, fn in plan:
            t0 = time.perf_counter()
            out, stats = fn(p)
            dt = time.perf_counter() - t0
            a = acc[name]
            a["tokens"] += len(out)
            a["seconds"] += dt
            a["per_prompt_s"].append(round(dt, 4))
            if stats is not None and stats.drafted:
                a["spec"] = a["spec"] or SpecStats()
                a["spec"].merge(stats)
            outputs[name].append(out)
        check()
    methods = {}
    for name, a in acc.items():
        per_prompt = [len(o) / t for o, t in zip(outputs[name], a["per_prompt_s"], strict=True)]
        extra = spec_summary(a["spec"]) if a["spec"] is not None else {}
        methods[name] = summary(
            a["tokens"],
            a["seconds"],
            **extra,
            median_prompt_tokens_per_s=round(float(np.median(per_prompt)), 2),
            per_prompt_seconds=a["per_prompt_s"],
        )
    return methods, outputs


async def _raw_verify(address: str, batcher, prompts, max_tokens: int, k: int) -> tuple[list[dict], list]:
    """Drive the Verify stream by hand, drafting with `batcher` (a DraftBatcher running inline); one record
    per round."""
    rounds, outputs = [], []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        for prompt in prompts:
            drafter = ModelDrafter(batcher)
            await drafter.start(prompt, greedy(max_tokens))
            opened = await stub.OpenSession(
                verify_pb2.OpenSessionRequest(prompt_ids=prompt, params=greedy_pb(max_tokens)), timeout=RPC_TIMEOUT
            )
            call = stub.Verify()
            epoch, position, out = opened.epoch, opened.base_position, []
            while True:
                kk = min(k, max_tokens - len(out) - 1)
                proposal = await drafter.propose(kk) if kk > 0 else DraftBlock([])
                msg = verify_pb2.VerifyRequest(
                    session_id=opened.session_id, epoch=epoch, base_position=position, draft_ids=proposal.token_ids
                )
                t0 = time.perf_counter()
                await call.write(msg)
                while True:
                    v = await call.read()
                    if v is grpc.aio.EOF:
                        raise RuntimeError("the verify service ended the stream before the generation ended")
                    if not v.stale:
                        break
                t1 = time.perf_counter()
                rounds.append(
                    {
                        "round_s": t1 - t0,
                        "batch_s": v.timings.batch_seconds,
                        "queue_s": v.timings.queue_seconds,
                        "k": len(proposal.token_ids),
                        "drafted": v.num_drafted,
                        "accepted": v.num_accepted,
                        "deadline": v.deadline,
                    }
                )
                epoch, position = v.epoch + 1, position + len(v.token_ids)
                out.extend(v.token_ids)
                if v.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                    break
                drafter.commit(list(v.token_ids))
            await call.done_writing()
            await call.code()
            drafter.release()
            outputs.append(out)
    return rounds, outputs


def pct(values, qs=(50, 99)) -> dict:
    a = np.asarray(values) * 1e3
    return {**{f"p{q}": round(float(np.percentile(a, q)), 3) for q in qs}, "mean": round(float(a.mean()), 3)}


def run_concurrent(stubs, prompts, max_tokens) -> tuple[dict, list]:
    """All sessions at once, one sync stub (own channel) per session; wall clock over the lot."""
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        t0 = time.perf_counter()
        futures = [pool.submit(generate_once, s, p, max_tokens) for s, p in zip(stubs, prompts, strict=True)]
        results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
    outputs = [r[0] for r in results]
    extra = {}
    lasts = [r[1] for r in results]
    if all(last is not None and last.HasField("stats") for last in lasts):
        total = SpecStats()
        for last in lasts:
            total.merge(wire.stats_from_pb(last.stats))
        extra = spec_summary(total)
    return summary(sum(map(len, outputs)), wall, **extra), outputs


def verify_counters(stub) -> dict:
    info = stub.Info(verify_pb2.VerifyServiceInfoRequest(), timeout=30)
    return {
        f: getattr(info, f)
        for f in ("batches", "batched_blocks", "max_batch_size_seen", "deadline_steps", "stale_blocks")
    }


def batch_delta(before: dict, after: dict) -> dict:
    d = {f: after[f] - before[f] for f in ("batches", "batched_blocks", "deadline_steps", "stale_blocks")}
    d["mean_batch_size"] = round(d["batched_blocks"] / d["batches"], 3) if d["batches"] else None
    return d


# ---------------------------------------------------------------------------------------------------------
# report


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), gridspec_kw={"width_ratios": [1.5, 1, 1]})
    ss = results["single_stream"]["methods"]
    names = list(ss)
    ax = axes[0]
    colors = ["#888", "#4a7", "#37c", "#79d", "#c84"]
    bars = ax.bar(range(len(names)), [ss[n]["tokens_per_s"] for n in names], color=colors[: len(names)])
    ratio = "{m[speedup_vs_inprocess_target_only]:.2f}x / {m[speedup_vs_service_target_only]:.2f}x"
    label_bars(ax, bars, [ratio.format(m=ss[n]) for n in names], fontsize=8)
    ax.set_xticks(range(len(names)), [textwrap.fill(n, 15) for n in names], fontsize=7)
    ax.set_ylabel("tokens / s (greedy)")
    s = results["settings"]
    ax.set_title(
        f"single stream, {s['prompts']} prompts x {s['max_tokens']} tokens\n"
        f"(ratio vs in-process target-only / vs service target-only)",
        fontsize=9,
    )

    ax = axes[1]
    ro = results["round_overhead"]
    parts = ["round_ms", "batch_ms", "overhead_ms"]
    x = np.arange(len(parts))
    ax.bar(x - 0.2, [ro[p]["p50"] for p in parts], 0.4, label="p50", color="#4a7")
    ax.bar(x + 0.2, [ro[p]["p99"] for p in parts], 0.4, label="p99", color="#c84")
    ax.set_xticks(x, ["round (client)", "batch (server)", "overhead"])
    ax.set_ylabel("ms")
    ax.set_title(f"Verify stream, K={ro['k']}, {ro['rounds']} rounds", fontsize=9)
    ax.legend()

    ax = axes[2]
    levels = results["concurrency"]["levels"]
    n = [lv["sessions"] for lv in levels]
    ax.plot(n, [lv["draft_service"]["tokens_per_s"] for lv in levels], "o-", color="#37c", label=f"draft service K={K}")
    ax.plot(
        n,
        [lv["verify_generate"]["tokens_per_s"] for lv in levels],
        "s-",
        color="#c84",
        label="target-only (VerifyService.Generate)",
    )
    for lv in levels:
        for key in ("draft_service", "verify_generate"):
            ax.annotate(
                f"b={lv[key]['verify_batches']['mean_batch_size']:.2f}",
                (lv["sessions"], lv[key]["tokens_per_s"]),
                fontsize=7,
                xytext=(4, -10 if key == "verify_generate" else 4),
                textcoords="offset points",
            )
    concurrency_axis(ax, n, "concurrent sessions")
    ax.set_ylabel("aggregate tokens / s")
    ax.set_title(
        f"concurrency, {results['concurrency']['tokens_per_session']} tokens per session\n(b = mean verify batch size)",
        fontsize=9,
    )
    ax.legend(fontsize=8)
    save(fig, path)


def print_report(r: dict) -> None:
    ss = r["single_stream"]["methods"]
    width = max(map(len, ss))
    print(f"\n1. single stream ({r['settings']['prompts']} prompts x {r['settings']['max_tokens']} tokens)")
    print(f"{'method':<{width}}  tok/s  median  vs (a)  vs (e)  accept  mean_len  equal")
    for name, m in ss.items():
        print(
            f"{name:<{width}}  {m['tokens_per_s']:5.1f}  {m['median_prompt_tokens_per_s']:6.1f}  "
            f"{m['speedup_vs_inprocess_target_only']:5.2f}x  "
            f"{m['speedup_vs_service_target_only']:5.2f}x  {m.get('acceptance_rate') or '-':>6}  "
            f"{m.get('mean_accepted_length') or '-':>8}  {m['output_equals_target_only']}"
        )
    ro = r["round_overhead"]
    print(
        f"\n2. Verify stream rounds (K={ro['k']}, {ro['rounds']} rounds, output equal: "
        f"{ro['output_equals_target_only']}, deadline verdicts: {ro['deadline_verdicts']})"
    )
    for key in ("round_ms", "batch_ms", "queue_ms", "overhead_ms"):
        print(f"  {key:<12} p50 {ro[key]['p50']:7.2f}  p99 {ro[key]['p99']:7.2f}  mean {ro[key]['mean']:7.2f}")
    c = r["concurrency"]
    print(f"\n3. concurrency ({c['tokens_per_session']} tokens per session)")
    print("sessions  draft tok/s  batch  target-only tok/s  batch  ratio  equal")
    for lv in c["levels"]:
        d, v = lv["draft_service"], lv["verify_generate"]
        print(
            f"{lv['sessions']:>8}  {d['tokens_per_s']:11.1f}  {d['verify_batches']['mean_batch_size']:5.2f}  "
            f"{v['tokens_per_s']:17.1f}  {v['verify_batches']['mean_batch_size']:5.2f}  "
            f"{lv['speedup_vs_target_only']:4.2f}x  {lv['outputs_equal_target_only']}"
        )
    dt = r["draft_time"]
    print(
        f"\n4. draft ms/token: service (c) {dt['service_adaptive_pipelined_ms']:.3f}, service (d) "
        f"{dt['service_fixed_no_pipeline_ms']:.3f}, plain HF decode {dt['hf_decode_ms']:.3f} "
        f"(ratio (c)/HF {dt['ratio_service_vs_hf']:.2f}x); target HF decode {dt['target_hf_decode_ms']:.3f}"
    )
    print(f"\ntotal {r['total_seconds']:.0f} s")


# ---------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ROOT / "models/demo/target")
    ap.add_argument("--draft", type=Path, default=ROOT / "models/demo/draft")
    ap.add_argument("--prompts", type=int, default=6, help="prompts of parts 1 and 2")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per prompt in parts 1 and 2")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--concurrent-tokens", type=int, default=48, help="tokens per session in part 3")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of this process (the in-process runs)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 prompts x 16 tokens, concurrency 1 4")
    ap.add_argument("--out", type=Path, default=RESULTS / "services.json")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompts, args.max_tokens, args.concurrency, args.concurrent_tokens = 2, 16, [1, 4], 12

    t_start = time.perf_counter()
    load_start = os.getloadavg()
    torch.set_num_threads(args.threads)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup below on SIGTERM too
    log_dir = Path(tempfile.mkdtemp(prefix="specmesh-bench-services-"))
    services = Services(log_dir)
    atexit.register(services.close)
    try:
        # The services load their models while this process loads its own.
        services.spawn("verify", "verify_service", ["--model-path", str(args.target), "--grace-period-s", "2"])
        engine = SpeculativeEngine.from_paths(args.target, args.draft, device="cpu")
        vaddr = services.wait_listening("verify")
        common = [
            "--model-path",
            str(args.draft),
            "--verify-address",
            vaddr,
            "--speculative-num-steps",
            str(K),
            "--grace-period-s",
            "2",
        ]
        services.spawn("draft", "draft_service", common)
        services.spawn("draft_fixed", "draft_service", [*common, "--no-adaptive", "--no-pipeline"])
        n_prompts = max(args.prompts, max(args.concurrency))
        prompts = heldout_prompts(engine.tokenizer, n_prompts + 1, args.prompt_len)
        if len(prompts) < n_prompts + 1:
            raise RuntimeError(f"only {len(prompts)} held-out prompts of {args.prompt_len} tokens")
        warm, prompts = prompts[-1], prompts[:-1]
        p1 = prompts[: args.prompts]
        daddr, faddr = services.wait_listening("draft"), services.wait_listening("draft_fixed")
        vstub = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(vaddr))
        dstub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(daddr))
        fstub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(faddr))
        vinfo = vstub.Info(verify_pb2.VerifyServiceInfoRequest(), timeout=30)

        # warm-up: every path once (and the batched verify path: a few concurrent sessions)
        for _ in tqdm(range(1), desc="warm-up", unit="pass"):
            engine.generate(warm, greedy(16), 0)
            engine.generate(warm, greedy(16), K)
            for stub in (dstub, fstub, vstub):
                generate_once(stub, warm, 16)
            asyncio.run(_raw_verify(vaddr, engine.batcher, [warm], 16, K))
            run_concurrent([dstub] * 4, [warm] * 4, 8)
            run_concurrent([vstub] * 4, [warm] * 4, 8)

        # 1. single stream
        plan = [
            ("(a) in-process target-only", lambda p: engine_once(engine, p, args.max_tokens, 0)),
            (f"(b) in-process K={K}", lambda p: engine_once(engine, p, args.max_tokens, K)),
            (f"(c) services K={K} adaptive+pipeline", lambda p: service_once(dstub, p, args.max_tokens)),
            (f"(d) services K={K} fixed, no pipeline", lambda p: service_once(fstub, p, args.max_tokens)),
            ("(e) services target-only", lambda p: service_once(vstub, p, args.max_tokens)),
        ]
        dinfo_before = dstub.Info(draft_pb2.DraftServiceInfoRequest(), timeout=30)
        methods, outputs = run_interleaved(plan, p1, services.check_alive)
        dinfo = dstub.Info(draft_pb2.DraftServiceInfoRequest(), timeout=30)
        finfo = fstub.Info(draft_pb2.DraftServiceInfoRequest(), timeout=30)
        a_name, e_name = plan[0][0], plan[-1][0]
        reference = outputs[a_name]
        for name, m in methods.items():
            m["speedup_vs_inprocess_target_only"] = round(m["tokens_per_s"] / methods[a_name]["tokens_per_s"], 3)
            m["speedup_vs_service_target_only"] = round(m["tokens_per_s"] / methods[e_name]["tokens_per_s"], 3)
            m["output_equals_target_only"] = outputs[name] == reference
        c_name = plan[2][0]
        methods[c_name]["pipelined_blocks_used"] = dinfo.pipelined_blocks_used - dinfo_before.pipelined_blocks_used
        methods[c_name]["pipelined_blocks_discarded"] = (
            dinfo.pipelined_blocks_discarded - dinfo_before.pipelined_blocks_discarded
        )

        # 2. per-round overhead on the raw Verify stream
        with tqdm(total=1, desc="2. verify rounds", unit="run") as bar:
            before = verify_counters(vstub)
            rounds, raw_out = asyncio.run(_raw_verify(vaddr, engine.batcher, p1, args.max_tokens, K))
            after = verify_counters(vstub)
            bar.update()
        raw_stats = SpecStats()
        for r in rounds:
            raw_stats.record(r["drafted"], r["accepted"])
        round_overhead = {
            "k": K,
            "rounds": len(rounds),
            "tokens": sum(map(len, raw_out)),
            "round_ms": pct([r["round_s"] for r in rounds]),
            "batch_ms": pct([r["batch_s"] for r in rounds]),
            "queue_ms": pct([r["queue_s"] for r in rounds]),
            "overhead_ms": pct([r["round_s"] - r["batch_s"] for r in rounds]),
            "deadline_verdicts": sum(r["deadline"] for r in rounds),
            "verify_counters": batch_delta(before, after),
            **{k: v for k, v in spec_summary(raw_stats).items() if k in ("acceptance_rate", "mean_accepted_length")},
            "output_equals_target_only": raw_out == reference,
        }

        # 3. concurrency
        n_tok = args.concurrent_tokens
        ref3 = {}
        levels = []
        for n in tqdm(args.concurrency, desc="3. concurrency", unit="level"):
            ps = prompts[:n]
            for i, p in enumerate(ps):  # the in-process target-only output of each prompt
                if i not in ref3:
                    ref3[i] = (
                        reference[i][:n_tok]
                        if i < len(reference) and n_tok <= args.max_tokens
                        else engine.generate(p, greedy(n_tok), 0).token_ids
                    )
            level = {"sessions": n}
            outs = {}
            for key, addr, cls in (
                ("draft_service", daddr, draft_pb2_grpc.DraftServiceStub),
                ("verify_generate", vaddr, verify_pb2_grpc.VerifyServiceStub),
            ):
                channels = [grpc.insecure_channel(addr) for _ in ps]
                try:
                    stubs = [cls(ch) for ch in channels]
                    before = verify_counters(vstub)
                    level[key], outs[key] = run_concurrent(stubs, ps, n_tok)
                    level[key]["verify_batches"] = batch_delta(before, verify_counters(vstub))
                    level[key]["output_equals_target_only"] = outs[key] == [ref3[i] for i in range(n)]
                finally:
                    for ch in channels:
                        ch.close()
                services.check_alive()
            level["speedup_vs_target_only"] = round(
                level["draft_service"]["tokens_per_s"] / level["verify_generate"]["tokens_per_s"], 3
            )
            level["outputs_equal_target_only"] = (
                level["draft_service"]["output_equals_target_only"]
                and level["verify_generate"]["output_equals_target_only"]
            )
            levels.append(level)

        # 4. draft time per token
        hf_draft = float(np.median([decode_ms(engine.draft.model, context=args.prompt_len) for _ in range(3)]))
        hf_target = float(np.median([decode_ms(engine.target.model, context=args.prompt_len) for _ in range(3)]))
        c_ms, d_ms = dinfo.draft_seconds_per_token * 1e3, finfo.draft_seconds_per_token * 1e3
        draft_time = {
            "service_adaptive_pipelined_ms": round(c_ms, 3),
            "service_fixed_no_pipeline_ms": round(d_ms, 3),
            "hf_decode_ms": round(hf_draft, 3),
            "ratio_service_vs_hf": round(c_ms / hf_draft, 3),
            "ratio_service_fixed_vs_hf": round(d_ms / hf_draft, 3),
            "target_hf_decode_ms": round(hf_target, 3),
            "service_draft_runner": draft_runner_default(),
            "note": "service figures: DraftService.Info draft_seconds_per_token right after part 1 (warm-up and "
            "(c) / (d) runs, drafted-ahead tokens included); HF: one-token decode, DynamicCache, context "
            f"{args.prompt_len}, this process ({args.threads} torch thread(s)), median of 3 x 50 steps",
        }
        all_equal = (
            all(m["output_equals_target_only"] for m in methods.values())
            and round_overhead["output_equals_target_only"]
            and all(lv["outputs_equal_target_only"] for lv in levels)
        )
        results = {
            "bench": "services",
            "machine": {
                "processor": platform.processor() or platform.machine(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "grpcio": grpc.__version__,
                "device": "cpu",
                "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
            },
            "settings": {
                "target": str(args.target),
                "draft": str(args.draft),
                "k": K,
                "greedy": True,
                "prompts": len(p1),
                "prompt_len": args.prompt_len,
                "max_tokens": args.max_tokens,
                "concurrency": args.concurrency,
                "concurrent_tokens": n_tok,
                "quick": args.quick,
                "client_torch_threads": args.threads,
                "service_torch_threads": 1,
                "transport": "gRPC over loopback, each service its own process",
                "verify_service": {
                    f: getattr(vinfo, f) for f in ("max_batch_size", "max_sessions", "max_spec_len", "sampler_backend")
                },
                "draft_services": {
                    "(c)": {"adaptive": dinfo.adaptive, "pipelined": dinfo.pipelined},
                    "(d)": {"adaptive": finfo.adaptive, "pipelined": finfo.pipelined},
                    "draft_runner": draft_runner_default(),
                },
                "inprocess_draft_runner": type(engine.draft).__name__,
            },
            "all_outputs_equal_target_only": all_equal,
            "single_stream": {"methods": methods},
            "round_overhead": round_overhead,
            "concurrency": {"tokens_per_session": n_tok, "levels": levels},
            "draft_time": draft_time,
            "total_seconds": round(time.perf_counter() - t_start, 1),
        }
    except BaseException:
        for name, *_ in services.procs:
            print(f"--- {name} log tail ---\n{services.tail(name)}", file=sys.stderr)
        raise
    finally:
        services.close()
    write_json(args.out, results)
    plot(results, args.out.with_suffix(".png"))
    print_report(results)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return results


if __name__ == "__main__":
    main()
