"""python -m gateway --verify HOST:PORT[,...] --draft HOST:PORT[,...] --tokenizer-path DIR: the front door.

REST (OpenAI-compatible) on --port, gRPC (specmesh.v1.GatewayService, health, reflection) on --grpc-port.
Every flag can also be set by an environment variable SPECMESH_GATEWAY_<FLAG>. API keys come from
--api-key-file or SPECMESH_GATEWAY_API_KEY, never from the command line.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

import uvicorn

from gateway.core import Gateway, GatewayConfig
from gateway.http import create_app
from gateway.openai.tools import TOOL_CALL_PARSERS
from gateway.server import build_grpc_server
from gateway.telemetry import GatewayMetrics
from specmesh.config import EnvArgumentParser
from specmesh.rejection.limits import MAX_SPEC_LEN
from specmesh.security import KeyRing, Security, TLSConfig, add_tls_flags, keys_from
from specmesh.telemetry import serve_metrics, setup_logging, setup_tracing

log = logging.getLogger("specmesh.gateway")


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
    _security_flags(ap)
    ap.flag(
        "--speculative-num-steps",
        type=int,
        default=0,
        help="draft tokens per block of requests that leave num_speculative_tokens unset (0 = the draft's default)",
    )
    ap.flag(
        "--speculative-disable-by-batch-size",
        type=int,
        default=d.speculative_disable_by_batch_size,
        help="requests that leave num_speculative_tokens unset decode target-only while more than this many "
        "generations per healthy verify replica are in flight (0 = always speculate)",
    )
    ap.flag(
        "--goodput-probe-every",
        type=int,
        default=d.goodput_probe_every,
        help="requests that leave num_speculative_tokens unset decode target-only, straight on the verify "
        "replica, while the draft replica reports that speculation measures slower than target-only (its "
        "goodput guard); every N-th of them still goes through the draft replica to keep it measuring (0 = off)",
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
    ap.flag(
        "--stall-timeout-s",
        type=float,
        default=d.stall_timeout_s,
        help="longest a stream may go without a token before it continues without its draft or moves to "
        "another verify replica (0 = streams are not watched)",
    )
    ap.flag(
        "--stall-gap-multiple",
        type=float,
        default=d.stall_gap_multiple,
        help="a stream has stalled after this many times its mean gap between tokens (at most --stall-timeout-s)",
    )
    ap.flag(
        "--tool-call-parser",
        default=d.tool_call_parser,
        choices=list(TOOL_CALL_PARSERS),
        help="how chat finds tool calls in a reply with tool_choice auto (hermes: <tool_call>{json}</tool_call>)",
    )
    ap.flag("--log-level", default="INFO", help="logging level")
    ap.flag("--log-format", default="text", choices=["text", "json"], help="json: one object per line with trace ids")
    a = ap.parse_args(argv)
    name = a.model_name or (Path(a.tokenizer_path).name if a.tokenizer_path else "specmesh")
    config = GatewayConfig(
        verify=_list(a.verify),
        draft=_list(a.draft),
        model_name=name,
        speculative_num_steps=a.speculative_num_steps,
        speculative_disable_by_batch_size=a.speculative_disable_by_batch_size,
        goodput_probe_every=a.goodput_probe_every,
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
        stall_timeout_s=a.stall_timeout_s,
        stall_gap_multiple=a.stall_gap_multiple,
        tool_call_parser=a.tool_call_parser,
    )
    if not config.verify:
        ap.error("--verify needs at least one host:port")
    if not 0 <= config.speculative_num_steps <= MAX_SPEC_LEN:
        ap.error(f"--speculative-num-steps must be in [0, {MAX_SPEC_LEN}]")
    if config.speculative_disable_by_batch_size < 0:
        ap.error("--speculative-disable-by-batch-size must be >= 0")
    if config.goodput_probe_every < 0 or config.goodput_probe_every == 1:
        ap.error("--goodput-probe-every must be 0 (off) or >= 2 (1 would send every request as a probe)")
    try:
        flags = vars(a)
        a.api_keys = keys_from(a.api_key_file, a.api_key, "--api-key-file")
        a.front = Security(TLSConfig.from_flags(flags), KeyRing(a.api_keys), open_health=a.open_health)
        service_keys = keys_from(a.service_key_file, a.service_key, "--service-key-file")
        tls = TLSConfig.from_flags(flags, "upstream_tls", "--upstream-tls")
        a.upstream = Security(tls, key=service_keys[0] if service_keys else "")
    except ValueError as e:
        ap.error(str(e))
    return config, a


def _security_flags(ap: EnvArgumentParser) -> None:
    """Who may call the gateway and how it dials the replicas (specmesh.security)."""
    ap.flag(
        "--api-key-file", default="", help="file of API keys, one a line; when any, requests need Authorization: Bearer"
    )
    ap.secret_flag("--api-key", file_flag="--api-key-file", help="API keys, comma-separated")
    ap.flag("--open-health", type=bool, default=True, help="/health, /health/live and gRPC health need no key (probes)")
    ap.flag(
        "--open-metrics",
        type=bool,
        default=False,
        help="/metrics on the REST port needs no key (it lists the replicas' addresses); see --metrics-port",
    )
    ap.flag(
        "--metrics-port",
        type=int,
        default=-1,
        help="serve /metrics on this port of its own, plain HTTP without a key, and not on the REST port "
        "(-1 = on the REST port; 0 = any free port)",
    )
    add_tls_flags(ap, "--tls", "served on the REST and gRPC ports (HTTPS, TLS)", "verifies client certificates")
    ap.flag("--tls-client-auth", type=bool, default=False, help="both fronts require a client certificate (mTLS)")
    add_tls_flags(
        ap,
        "--upstream-tls",
        "presented to the draft and verify replicas (mTLS)",
        "verifies the draft and verify replicas; TLS to them is on when this or --upstream-tls-cert is set",
    )
    ap.flag(
        "--upstream-tls-server-name",
        default="",
        help="name the replicas' certificates must carry (default: the host dialed; set it for replicas found by "
        "DNS, such as pod IPs behind a headless Service)",
    )
    ap.flag(
        "--service-key-file",
        default="",
        help="file whose first line is the service key presented to the draft and verify replicas",
    )
    ap.secret_flag("--service-key", file_flag="--service-key-file", help="service key presented to the replicas")


def load_tokenizer(path: str):
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


async def serve(config: GatewayConfig, args) -> None:
    metrics = GatewayMetrics()
    gateway = Gateway(config, load_tokenizer(args.tokenizer_path), metrics.stream)
    metrics.watch(gateway)
    gateway.verify_pool.security = gateway.draft_pool.security = args.upstream  # before the first channel
    await gateway.start()
    front: Security = args.front
    if not front.keys:
        log.warning("no API key (--api-key-file): anyone who reaches %s can generate", args.host)
    app = create_app(
        gateway,
        args.api_keys,
        args.max_body_bytes,
        metrics,
        open_health=args.open_health,
        open_metrics=args.open_metrics,
        metrics_route=args.metrics_port < 0,
    )
    tls = front.tls.uvicorn_options() if front.tls is not None else {}
    server = uvicorn.Server(
        uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=10, **tls)
    )
    metrics_server = None
    if args.metrics_port >= 0:
        metrics_server = serve_metrics(metrics.registry, args.host, args.metrics_port)
        print(f"gateway metrics on http://{args.host}:{metrics_server.server_port}/metrics", flush=True)
    grpc_server = None
    if args.grpc_port >= 0:
        grpc_server = build_grpc_server(gateway, args.host, args.grpc_port, metrics, security=front)
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
    if metrics_server is not None:
        metrics_server.shutdown()
    await gateway.close()


def main(argv=None) -> None:
    config, args = parse_args(argv)
    setup_logging(args.log_level, args.log_format, "gateway")
    setup_tracing("gateway")
    asyncio.run(serve(config, args))


if __name__ == "__main__":
    main()
