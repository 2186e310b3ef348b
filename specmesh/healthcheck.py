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
"""

from __future__ import annotations

import argparse
import sys

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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m specmesh.healthcheck", description="Exit 0 iff grpc.health.v1 Check at HOST:PORT says SERVING."
    )
    p.add_argument("address", help="HOST:PORT of the gRPC server")
    p.add_argument("--service", default="", help="service name to check ('' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="RPC deadline in seconds")
    args = p.parse_args(argv)
    ok, text = check(args.address, args.service, args.timeout)
    print(text, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
