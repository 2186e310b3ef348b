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

`python -m specmesh.healthcheck --auto` is the image's HEALTHCHECK: one image runs any of the three
services, so it reads the command of PID 1 (`python -m verify_service ...`) and probes that service on
127.0.0.1 at its port (`--port` on that command line, else SPECMESH_<SERVICE>_PORT, else the default):
gRPC health of the service's own name for verify and draft, `GET /health` (ready) for the gateway.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout: float = 3.0) -> tuple[bool, str]:
    """(serving, description) of one Check RPC against `address` (host:port)."""
    try:
        with grpc.insecure_channel(address) as channel:
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


def check_http(url: str, timeout: float) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as reply:
            return True, f"{url}: {reply.status}"
    except urllib.error.HTTPError as e:
        return False, f"{url}: {e.code}"
    except OSError as e:  # refused, timed out, unreachable
        return False, f"{url}: {e}"


def check_auto(timeout: float, proc: Path = Path("/proc/1/cmdline")) -> tuple[bool, str]:
    try:
        _, port, probe = auto_target(proc.read_bytes().decode().split("\0"), dict(os.environ))
    except (OSError, ValueError) as e:
        return False, f"--auto: {e}"
    if probe == "http":
        return check_http(f"http://127.0.0.1:{port}/health", timeout)
    return check(f"127.0.0.1:{port}", probe, timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specmesh.healthcheck", description="Exit 0 iff grpc.health.v1 Check at HOST:PORT says SERVING."
    )
    p.add_argument("address", nargs="?", help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="RPC deadline in seconds")
    p.add_argument("--auto", action="store_true", help="probe the service PID 1 runs (a container's healthcheck)")
    args = p.parse_args(argv)
    if args.auto == bool(args.address):
        p.error("give either HOST:PORT or --auto")
    ok, text = check_auto(args.timeout) if args.auto else check(args.address, args.service, args.timeout)
    print(text, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
