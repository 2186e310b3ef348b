"""The verify engine in process, without gRPC, for the tests of its rules on a tiny model."""

import asyncio

from specmesh.sampling import SamplingParams
from verify_service.engine import VerifyConfig, VerifyEngine

BPT = 512  # KV bytes per token of tiny_model: 2 layers x 2 KV heads x 16 dims x (K, V) x fp32
BLOCK = 16  # the verify service's default block size
MiB = 2**20


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def make_engine(model, blocks: int | None = None, **kw) -> VerifyEngine:
    """A verify engine on `model` (`blocks`: a KV budget of that many blocks of tiny_model; `kw`: VerifyConfig)."""
    kw.setdefault("batch_wait_ms", 0)
    kw.setdefault("kv_cache_prefault", False)
    if blocks is not None:
        kw["kv_cache_budget_mb"] = blocks * BLOCK * BPT / MiB
    return VerifyEngine(VerifyConfig(model_path="(in-memory)", **kw), model)


def run(engine: VerifyEngine, body, timeout: float = 120):
    """`await body(engine)` between the engine's start and close; a stalled batch fails it past `timeout`."""

    async def main():
        await engine.start()
        try:
            async with asyncio.timeout(timeout):
                return await body(engine)
        finally:
            await engine.close()

    return asyncio.run(main())
