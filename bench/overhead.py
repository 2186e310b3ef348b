"""What a speculation round costs outside the model forwards, through a real verify service.

    python -m bench.overhead [--k 4] [--prompts 8] [--max-tokens 64] [--verify-threads 2]

The draft side is put together here exactly as the draft service does it (one `DraftBatcher` whose
forwards run on one model thread, a `ModelDrafter` per session, a `RemoteVerifier` over a grpc.aio
bidirectional stream, the shared `speculative_generate` loop) so that every round can be taken apart; the
verifier is `python -m verify_service` as a subprocess. One stream, greedy, fixed K, no drafting ahead.

Per round (times from `RoundRecord` and the verdict's `BatchLoad`):
- draft forwards: the batcher's forward + sampling time of the tokens drafted in the round;
- verify batch: the verifier's batched forward + rejection sampling + commit (as it reports it);
- overhead = round wall time - draft forwards - verify batch: the event-loop and thread hand-offs,
  protobuf encoding, the gRPC hop both ways, the verifier's queueing and scheduling;
  split into draft side (drafting wall - draft forwards), verify queue (as the verifier reports it) and
  the hop (the rest).

Writes bench/results/overhead.json (p50/p90/p99 in ms of each part).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import AsyncGenerator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from bench.load import git_info
from bench.services import RESULTS, ROOT, Services
from draft_service.remote import RemoteVerifier
from specmesh.domain import DraftBlock, Verdict
from specmesh.drafters.batcher import DraftBatcher
from specmesh.drafters.model import ModelDrafter
from specmesh.loop import FixedK, RoundRecord, speculative_generate
from specmesh.models import load_model
from specmesh.runtime.batched import BatchedRunner
from specmesh.sampling import SamplingParams, StopChecker
from specmesh.v1 import verify_pb2_grpc


class Recorder:
    """Wraps a verifier and a batcher's forward callback so that each round can be split into its parts."""

    def __init__(self, inner: RemoteVerifier):
        self.inner = inner
        self.forwards: list[tuple[float, float]] = []  # (end instant, seconds) of each draft forward
        self.verdicts: list[Verdict] = []
        self.rounds: list[RoundRecord] = []

    async def start(self, prompt_ids, params) -> None:
        await self.inner.start(prompt_ids, params)

    async def submit(self, proposal: DraftBlock) -> Verdict:
        verdict = await self.inner.submit(proposal)
        self.verdicts.append(verdict)
        return verdict

    async def target_only(self, steps: int) -> AsyncGenerator[Verdict, None]:
        async with contextlib.aclosing(self.inner.target_only(steps)) as verdicts:
            async for verdict in verdicts:
                self.verdicts.append(verdict)
                yield verdict

    def on_batch(self, _sessions: int, seconds: float) -> None:
        self.forwards.append((time.perf_counter(), seconds))

    def parts(self) -> list[dict]:
        out = []
        for r, v in zip(self.rounds, self.verdicts, strict=True):
            draft_fwd = sum(s for end, s in self.forwards if r.t_start < end <= r.t_sent)
            wall = r.t_verdict - r.t_start
            wait = r.t_verdict - r.t_sent
            out.append(
                {
                    "k": r.k,
                    "committed": r.num_committed,
                    "wall": wall,
                    "draft_forwards": draft_fwd,
                    "verify_batch": v.load.batch_seconds,
                    "overhead": wall - draft_fwd - v.load.batch_seconds,
                    "draft_side": (r.t_sent - r.t_start) - draft_fwd,
                    "verify_queue": v.load.queue_seconds,
                    "hop": wait - v.load.batch_seconds - v.load.queue_seconds,
                }
            )
        return out


def pct_ms(values: list[float]) -> dict:
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else values * 99
    return {"p50": round(1e3 * q[49], 3), "p90": round(1e3 * q[89], 3), "p99": round(1e3 * q[98], 3)}


async def run(args, address: str, prompts: list[list[int]]) -> list[dict]:
    model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft-model")
    model = model_thread.submit(load_model, args.draft, "cpu").result()[0]
    runner = model_thread.submit(lambda: BatchedRunner(model, num_slots=4, max_seq_len=512)).result()

    async def on_model(fn, *a):
        return await asyncio.get_running_loop().run_in_executor(model_thread, fn, *a)

    parts: list[dict] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = verify_pb2_grpc.VerifyServiceStub(channel)
        for i, prompt in enumerate(prompts):
            remote = RemoteVerifier(stub, f"overhead-{i}", 60.0)
            rec = Recorder(remote)
            batcher = DraftBatcher(runner, 16, on_model, rec.on_batch)
            drafter = ModelDrafter(batcher)
            params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
            await speculative_generate(  # the model work enters inference mode on the model thread
                rec,
                drafter,
                prompt,
                params,
                FixedK(args.k),
                StopChecker(params, frozenset()),
                on_round=rec.rounds.append,
            )
            await remote.aclose(True)
            drafter.release()
            await batcher.close()
            if i >= args.warmup:
                parts.extend(rec.parts())
    model_thread.shutdown()
    return parts


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=str(ROOT / "models" / "demo" / "target"))
    ap.add_argument("--draft", default=str(ROOT / "models" / "demo" / "draft"))
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=1, help="first generations not counted")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--verify-threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "overhead.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # the draft service's one torch thread

    from transformers import AutoTokenizer

    from bench.inprocess import heldout_prompts  # the benchmarks' held-out prompts

    prompts = heldout_prompts(AutoTokenizer.from_pretrained(args.target), args.prompts + args.warmup, 64)
    with tempfile.TemporaryDirectory() as logs:
        services = Services(Path(logs))
        try:
            services.spawn(
                "verify",
                "verify_service",
                ["--model-path", args.target, "--threads", str(args.verify_threads), "--max-sessions", "8"],
            )
            address = services.wait_listening("verify")
            parts = asyncio.run(run(args, address, prompts))
        finally:
            services.close()
    keys = ["wall", "draft_forwards", "verify_batch", "overhead", "draft_side", "verify_queue", "hop"]
    result = {
        "bench": "overhead",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git": git_info(),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "rounds": len(parts),
        "tokens_per_round": round(sum(p["committed"] for p in parts) / max(1, len(parts)), 3),
        "ms": {k: pct_ms([p[k] for p in parts]) for k in keys},
        "definition": "overhead = round wall - draft forwards (+ sampling) - verify batch (forward + sampling)",
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    for k in keys:
        print(f"{k:>15}: " + "  ".join(f"{q} {v:7.3f} ms" for q, v in result["ms"][k].items()))
    return result


if __name__ == "__main__":
    main()
