"""python -m gateway --verify HOST:PORT[,...] --draft HOST:PORT[,...] --tokenizer-path DIR: the front door.

REST (OpenAI-compatible) on --port, gRPC (specmesh.v1.GatewayService, health, reflection) on --grpc-port.
Every flag can also be set by an environment variable SPECMESH_GATEWAY_<FLAG>. API keys come from
--api-key-file or SPECMESH_GATEWAY_API_KEY, never from the command line.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field, replace
from pathlib import Path

import uvicorn

from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.http import create_app
from gateway.server import build_grpc_server
from gateway.telemetry import GatewayMetrics
from specmesh.config import (
    EnvArgumentParser,
    GatewayListen,
    Logging,
    add_config_flags,
    flag_fields,
    option,
    parse_config,
)
from specmesh.rejection.limits import MAX_SPEC_LEN
from specmesh.security import KeyRing, Security, TLSConfig, add_tls_flags, keys_from
from specmesh.telemetry import serve_metrics, setup_logging, setup_tracing

log = logging.getLogger("specmesh.gateway")


@dataclass(frozen=True)
class GatewayProcess(Logging, GatewayListen):
    """How the gateway process runs, beyond GatewayConfig: where it listens, what it loads, its metrics and
    logging; and, from the security flags, who may call it and how it dials the replicas."""

    tokenizer_path: str = option("", "directory with the target's tokenizer (text in and out)")
    max_body_bytes: int = option(1 << 20, "largest request body accepted")
    open_health: bool = option(True, "/health, /health/live and gRPC health need no key (probes)")
    open_metrics: bool = option(
        False, "/metrics on the REST port needs no key (it lists the replicas' addresses); see --metrics-port"
    )
    metrics_port: int = option(
        -1,
        "serve /metrics on this port of its own, plain HTTP without a key, and not on the REST port "
        "(-1 = on the REST port; 0 = any free port)",
    )
    api_keys: tuple[str, ...] = ()
    front: Security = field(default_factory=Security)  # the REST and gRPC fronts'
    upstream: Security = field(default_factory=Security)  # what it presents to the replicas


def parse_args(argv=None) -> tuple[GatewayConfig, GatewayProcess]:
    """GatewayConfig and GatewayProcess from their flags (declared by their fields) and the security flags."""
    ap = EnvArgumentParser(prog="python -m gateway", description=__doc__, env_prefix="SPECMESH_GATEWAY_")
    add_config_flags(ap, GatewayConfig)
    with ap.process_flags():
        add_config_flags(ap, GatewayProcess)
        _security_flags(ap)
    config, flags = parse_config(ap, GatewayConfig, argv)
    tokenizer = flags["tokenizer_path"]
    config = replace(config, model_name=config.model_name or (Path(tokenizer).name if tokenizer else "specmesh"))
    try:
        _check(config)
        process = {f.name: flags[f.name] for f in flag_fields(GatewayProcess)}
        return config, GatewayProcess(**process, **_security(flags))
    except ValueError as e:
        ap.error(str(e))


def _check(config: GatewayConfig) -> None:
    """What the gateway's flags must hold beyond each one's type (code that builds a GatewayConfig itself may
    leave the replica lists empty)."""
    if not config.verify:
        raise ValueError("--verify needs at least one host:port")
    if not 0 <= config.speculative_num_steps <= MAX_SPEC_LEN:
        raise ValueError(f"--speculative-num-steps must be in [0, {MAX_SPEC_LEN}]")
    if config.speculative_disable_by_batch_size < 0:
        raise ValueError("--speculative-disable-by-batch-size must be >= 0")
    if config.goodput_probe_every < 0 or config.goodput_probe_every == 1:
        raise ValueError("--goodput-probe-every must be 0 (off) or >= 2 (1 would send every request as a probe)")


def _security(flags: dict) -> dict:
    """GatewayProcess's keys and Security objects from the security flags (ValueError: a file is unreadable,
    a TLS setting incomplete)."""
    api_keys = keys_from(flags["api_key_file"], flags["api_key"], "--api-key-file")
    front = Security(TLSConfig.from_flags(flags), KeyRing(api_keys), open_health=flags["open_health"])
    service_keys = keys_from(flags["service_key_file"], flags["service_key"], "--service-key-file")
    tls = TLSConfig.from_flags(flags, "upstream_tls", "--upstream-tls")
    return dict(api_keys=api_keys, front=front, upstream=Security(tls, key=service_keys[0] if service_keys else ""))


def _security_flags(ap: EnvArgumentParser) -> None:
    """Who may call the gateway and how it dials the replicas (specmesh.security)."""
    ap.flag(
        "--api-key-file", default="", help="file of API keys, one a line; when any, requests need Authorization: Bearer"
    )
    ap.secret_flag("--api-key", file_flag="--api-key-file", help="API keys, comma-separated")
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


async def serve(config: GatewayConfig, args: GatewayProcess) -> None:
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

    # Ours stop both fronts (the REST server here, the others once it has returned). uvicorn (>= 0.29, which
    # replaced install_signal_handlers with capture_signals) takes SIGTERM and SIGINT only while serve() runs,
    # setting should_exit as ours do, then puts ours back and raises the signals it caught again.
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
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
