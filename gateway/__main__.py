"""python -m gateway --verify HOST:PORT[,...] --draft HOST:PORT[,...] --tokenizer-path DIR: the front door.

REST (OpenAI-compatible) on --port, gRPC (specmesh.v1.GatewayService, health, reflection) on --grpc-port.
Every flag can also be set by an environment variable SPECMESH_GATEWAY_<FLAG>.
"""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import uvicorn

from gateway.core import Gateway, GatewayConfig
from gateway.http import create_app
from gateway.server import build_grpc_server
from gateway.telemetry import GatewayMetrics
from specmesh.config import EnvArgumentParser
from specmesh.rejection.limits import MAX_SPEC_LEN
from specmesh.telemetry import setup_logging, setup_tracing


def _list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def parse_args(argv=None):
    ap = EnvArgumentParser(prog="python -m gateway", description=__doc__, env_prefix="SPECMESH_GATEWAY_")
    d = GatewayConfig()
    ap.flag("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    ap.flag("--port", type=int, default=8000, help="REST port (OpenAI-compatible API, /health, /metrics)")
    ap.flag("--grpc-port", type=int, default=50070, help="gRPC port (specmesh.v1.GatewayService); -1 = off")
    ap.flag(
        "--verify",
        default="",
        required=True,
        help="verify replicas, comma-separated host:port; a host that resolves to several addresses "
        "(a headless Service) gives one replica per address, re-resolved every health round",
    )
    ap.flag("--draft", default="", help="draft replicas, comma-separated host:port (none = target-only)")
    ap.flag("--tokenizer-path", default="", help="directory with the target's tokenizer (text in and out)")
    ap.flag("--model-name", default="", help="the model id clients send (default: the tokenizer directory's name)")
    ap.flag("--api-key", default="", help="comma-separated API keys; when set, requests need Authorization: Bearer")
    ap.flag(
        "--speculative-num-steps",
        type=int,
        default=0,
        help="draft tokens per block of requests that leave num_speculative_tokens unset (0 = the draft's default)",
    )
    ap.flag("--max-prompt-tokens", type=int, default=d.max_prompt_tokens, help="longest prompt accepted")
    ap.flag("--max-tokens-limit", type=int, default=d.max_tokens_limit, help="largest max_tokens accepted")
    ap.flag("--max-body-bytes", type=int, default=1 << 20, help="largest request body accepted")
    ap.flag("--max-concurrency", type=int, default=d.max_concurrency, help="generations running at once")
    ap.flag("--max-queue", type=int, default=d.max_queue, help="generations waiting for a slot; more get 429")
    ap.flag("--request-timeout-s", type=float, default=d.request_timeout_s, help="deadline of each generation")
    ap.flag("--max-failovers", type=int, default=d.max_failovers, help="replica failovers per generation")
    ap.flag("--health-interval-s", type=float, default=d.health_interval_s, help="replica health check period")
    ap.flag("--fail-threshold", type=int, default=d.fail_threshold, help="failed checks that take a replica out")
    ap.flag("--success-threshold", type=int, default=d.success_threshold, help="good checks that bring it back")
    ap.flag("--load-factor", type=float, default=d.load_factor, help="bounded-load hashing: max load / mean load")
    ap.flag("--log-level", default="INFO", help="logging level")
    ap.flag("--log-format", default="text", choices=["text", "json"], help="json: one object per line with trace ids")
    a = ap.parse_args(argv)
    name = a.model_name or (Path(a.tokenizer_path).name if a.tokenizer_path else "specmesh")
    config = GatewayConfig(
        verify=_list(a.verify),
        draft=_list(a.draft),
        model_name=name,
        speculative_num_steps=a.speculative_num_steps,
        max_prompt_tokens=a.max_prompt_tokens,
        max_tokens_limit=a.max_tokens_limit,
        request_timeout_s=a.request_timeout_s,
        max_concurrency=a.max_concurrency,
        max_queue=a.max_queue,
        max_failovers=a.max_failovers,
        health_interval_s=a.health_interval_s,
        fail_threshold=a.fail_threshold,
        success_threshold=a.success_threshold,
        load_factor=a.load_factor,
    )
    if not config.verify:
        ap.error("--verify needs at least one host:port")
    if not 0 <= config.speculative_num_steps <= MAX_SPEC_LEN:
        ap.error(f"--speculative-num-steps must be in [0, {MAX_SPEC_LEN}]")
    return config, a


def load_tokenizer(path: str):
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def serve(config: GatewayConfig, args) -> None:
    metrics = GatewayMetrics()
    gateway = Gateway(config, load_tokenizer(args.tokenizer_path), metrics.stream)
    metrics.watch(gateway)
    await gateway.start()
    app = create_app(gateway, _list(args.api_key), args.max_body_bytes, metrics)
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10)
    )
    grpc_server = None
    if args.grpc_port >= 0:
        grpc_server = build_grpc_server(gateway, args.host, args.grpc_port, metrics)
        port = await grpc_server.start()
        print(f"gateway gRPC listening on {args.host}:{port}", flush=True)
    loop = asyncio.get_running_loop()

    def stop():
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    server.install_signal_handlers = lambda: None  # ours stop both fronts
    print(f"gateway REST listening on {args.host}:{args.port} (model {config.model_name!r})", flush=True)
    await server.serve()
    if grpc_server is not None:
        await grpc_server.stop()
    await gateway.close()


def main(argv=None) -> None:
    config, args = parse_args(argv)
    setup_logging(args.log_level, args.log_format, "gateway")
    setup_tracing("gateway")
    asyncio.run(serve(config, args))


if __name__ == "__main__":
    main()
