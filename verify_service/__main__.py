"""python -m verify_service --model-path DIR [--port N ...]: the target model behind a batching scheduler.

Every flag can also be set by an environment variable SPECMESH_VERIFY_<FLAG> (e.g. SPECMESH_VERIFY_PORT).
"""

from __future__ import annotations

import asyncio
import logging

import torch

from specmesh.config import EnvArgumentParser
from specmesh.telemetry import setup_logging, setup_tracing
from verify_service.engine import VerifyConfig
from verify_service.rejection import MAX_SPEC_LEN
from verify_service.server import build_server


def parse_args(argv=None) -> tuple[VerifyConfig, dict]:
    ap = EnvArgumentParser(prog="python -m verify_service", description=__doc__, env_prefix="SPECMESH_VERIFY_")
    d = VerifyConfig()
    ap.flag("--model-path", required=True, help="local HF checkpoint directory of the target model")
    ap.flag("--host", default=d.host, help="address to listen on (0.0.0.0 for all interfaces)")
    ap.flag("--port", type=int, default=d.port, help="gRPC port (0 = any free port, printed at start)")
    ap.flag("--device", default=None, help="torch device; default cuda when available, else cpu")
    ap.flag("--max-batch-size", type=int, default=d.max_batch_size,
            help="most draft blocks (sessions) verified in one batched target forward")
    ap.flag("--max-sessions", type=int, default=d.max_sessions,
            help="concurrent session streams and generate calls; more get RESOURCE_EXHAUSTED")
    ap.flag("--kv-cache-budget-mb", type=float, default=d.kv_cache_budget_mb,
            help="KV cache memory for all sessions; idle sessions are evicted LRU to stay under it")
    ap.flag("--session-ttl-s", type=float, default=d.session_ttl_s, help="idle sessions are evicted after this")
    ap.flag("--draft-deadline-ms", type=float, default=d.draft_deadline_ms,
            help="past this wait for a draft block, take a target-only step instead (0 = never)")
    ap.flag("--batch-wait-ms", type=float, default=d.batch_wait_ms,
            help="a batch waits up to this long for the other active sessions' blocks (0 = start at once)")
    ap.flag("--max-spec-len", type=int, default=d.max_spec_len,
            help=f"most draft tokens one block may carry (<= {MAX_SPEC_LEN})")
    ap.flag("--sampler-backend", default=d.sampler_backend, choices=["auto", "torch", "triton"],
            help="rejection sampler: triton on CUDA, torch on CPU when auto")
    ap.flag("--seed", type=int, default=None, help="seed of the shared random stream (unseeded requests)")
    ap.flag("--grace-period-s", type=float, default=d.grace_period_s,
            help="on SIGTERM, in-flight sessions get this long to finish")
    ap.flag("--metrics-port", type=int, default=9464, help="Prometheus /metrics HTTP port (-1 = off, 0 = any)")
    ap.flag("--threads", type=int, default=0, help="torch CPU threads (0 = torch's default)")
    ap.flag("--log-level", default="INFO", help="logging level")
    ap.flag("--log-format", default="text", choices=["text", "json"], help="json: one object per line with trace ids")
    args = vars(ap.parse_args(argv))
    extra = {k: args.pop(k) for k in ("threads", "log_level", "log_format")}
    try:
        return VerifyConfig(**args), extra
    except ValueError as e:
        ap.error(str(e))


async def amain(config: VerifyConfig) -> None:
    server = await build_server(config)
    port = await server.start()
    logging.getLogger("specmesh.verify").info("verify service on %s:%d (model %s)", config.host, port,
                                              config.model_path)
    print(f"verify_service listening on {config.host}:{port} (metrics port {server.metrics_port})", flush=True)
    await server.serve_forever()


def main(argv=None) -> None:
    config, extra = parse_args(argv)
    setup_logging(extra["log_level"], extra["log_format"], "verify")
    setup_tracing("verify")
    if extra["threads"]:
        torch.set_num_threads(extra["threads"])
    asyncio.run(amain(config))


if __name__ == "__main__":
    main()
