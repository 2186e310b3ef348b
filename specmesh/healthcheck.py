"""`python -m specmesh.healthcheck HOST:PORT [--service NAME] [--timeout S]`: a grpc.health.v1 probe.

Exits 0 iff the server answers `Check(service=NAME)` with SERVING before the timeout, 1 otherwise
(NOT_SERVING, unknown service, nothing listening, deadline exceeded, any RPC error). One line goes to
stdout (status) or stderr (failure) so `docker inspect` shows why a container is unhealthy.

Made for container healthchecks where no `grpc_health_probe` binary is installed, e.g. in
docker-compose.yml:

    healthcheck:
      test: ["CMD", "python", "-m", "specmesh.healthcheck", "127.0.0.1:50061"]

(`ENTRYPOINT ["python", "-m"]` images: healthchecks are not passed through the entrypoint, so the
full command is spelled out.) Service "" is the server as a whole; every specmesh gRPC service also
registers its own full name (e.g. `specmesh.v1.VerifyService`). Kubernetes uses its native gRPC
probes instead; they call the same Check RPC.

TLS: `--tls-ca` (and `--tls-cert` / `--tls-key` for a server that requires client certificates,
`--tls-server-name` when the certificate does not name 127.0.0.1). With `--auto` the probe takes them from
the service's own environment (SPECMESH_<SERVICE>_TLS_*), so one HEALTHCHECK serves plaintext and mTLS
deployments alike; that is also how Kubernetes probes a service with TLS on (its gRPC probes speak no TLS).

`python -m specmesh.healthcheck --auto` is the image's HEALTHCHECK: one image runs any of the three
services, so it reads the command of PID 1 (`python -m verify_service ...`) and probes that service on
127.0.0.1 at its port (`--port` on that command line, else SPECMESH_<SERVICE>_PORT, else the default):
gRPC health of the service's own name for verify and draft, `GET /health` (ready) for the gateway.
"""

from __future__ import annotations

import argparse
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.security import TLSConfig


def _channel(address: str, tls: TLSConfig | None) -> grpc.Channel:
    if tls is not None and tls.dials:
        return grpc.secure_channel(address, tls.channel_credentials(), options=tls.channel_options())
    return grpc.insecure_channel(address)


def check(address: str, service: str = "", timeout: float = 3.0, tls: TLSConfig | None = None) -> tuple[bool, str]:
    """(serving, description) of one Check RPC against `address` (host:port); over TLS with `tls` (its
    certificate presented to a server that asks for one)."""
    try:
        with _channel(address, tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        code = e.code() if hasattr(e, "code") else None
        details = e.details() if hasattr(e, "details") else str(e)
        return False, f"{address} service {service!r}: {getattr(code, 'name', code)}: {details}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} service {service!r}: {status}"


# module -> (environment prefix, default port, what to probe): the services' own defaults (a test checks
# them against each service's --help), kept here because the core never imports a service.
SERVICES = {
    "verify_service": ("SPECMESH_VERIFY_", 50061, "specmesh.v1.VerifyService"),
    "draft_service": ("SPECMESH_DRAFT_", 50062, "specmesh.v1.DraftService"),
    "gateway": ("SPECMESH_GATEWAY_", 8000, "http"),
}


def auto_target(cmdline: list[str], env: dict[str, str]) -> tuple[str, int, str]:
    """(module, port, probe) of the service that `cmdline` (PID 1's argv) runs; ValueError if none."""
    module = next((cmdline[i + 1] for i, a in enumerate(cmdline[:-1]) if a == "-m"), None)
    if module not in SERVICES:
        raise ValueError(f"no specmesh service in the command {' '.join(cmdline)!r}")
    prefix, port, probe = SERVICES[module]
    port = int(env.get(prefix + "PORT", port))
    for i, arg in enumerate(cmdline):
        if arg == "--port" and i + 1 < len(cmdline):
            port = int(cmdline[i + 1])
        elif arg.startswith("--port="):
            port = int(arg.split("=", 1)[1])
    return module, port, probe


def check_http(url: str, timeout: float, context: ssl.SSLContext | None = None) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as reply:
            return True, f"{url}: {reply.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: {e.code}"
    except OSError as e:  # refused, timed out, unreachable
        return False, f"{url}: {e}"


def tls_from_env(prefix: str, env: dict[str, str]) -> TLSConfig | None:
    """The TLS a service runs with, from its environment (`<prefix>TLS_CERT`, `_KEY`, `_CA`, `_SERVER_NAME`):
    the probe, in the same container, dials it as one of its peers would."""
    args = {f"tls_{k}": env.get(f"{prefix}TLS_{k.upper()}", "") for k in ("cert", "key", "ca", "server_name")}
    return TLSConfig.from_flags(args, flags=prefix + "TLS")


def _https_context(tls: TLSConfig) -> ssl.SSLContext:
    # The probe runs next to the server, on loopback: it only has to get through the handshake (with the
    # service's own certificate where clients must present one), not to authenticate the server.
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    if tls.cert:
        ctx.load_cert_chain(tls.cert, tls.key)
    return ctx


def check_auto(timeout: float, proc: Path = Path("/proc/1/cmdline")) -> tuple[bool, str]:
    try:
        module, port, probe = auto_target(proc.read_bytes().decode().split("\0"), dict(os.environ))
        tls = tls_from_env(SERVICES[module][0], dict(os.environ))
    except (OSError, ValueError) as e:
        return False, f"--auto: {e}"
    if probe == "http":
        if tls is not None and tls.serves:
            return check_http(f"https://127.0.0.1:{port}/health", timeout, _https_context(tls))
        return check_http(f"http://127.0.0.1:{port}/health", timeout)
    return check(f"127.0.0.1:{port}", probe, timeout, tls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specmesh.healthcheck", description="Exit 0 iff grpc.health.v1 Check at HOST:PORT says SERVING."
    )
    p.add_argument("address", nargs="?", help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="RPC deadline in seconds")
    p.add_argument("--auto", action="store_true", help="probe the service PID 1 runs (a container's healthcheck)")
    p.add_argument("--tls-ca", default="", help="TLS: PEM CA bundle that verifies the server")
    p.add_argument("--tls-cert", default="", help="TLS: PEM client certificate (a server that requires one)")
    p.add_argument("--tls-key", default="", help="TLS: PEM private key of --tls-cert")
    p.add_argument("--tls-server-name", default="", help="TLS: the name the server's certificate carries")
    args = p.parse_args(argv)
    try:
        tls = TLSConfig.from_flags(vars(args))
    except ValueError as e:
        p.error(str(e))
    if args.auto == bool(args.address):
        p.error("give either HOST:PORT or --auto")
    ok, text = check_auto(args.timeout) if args.auto else check(args.address, args.service, args.timeout, tls)
    print(text, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
