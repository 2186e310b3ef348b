"""The gateway's gRPC front (specmesh.v1.GatewayService, health, reflection), wired in one place for the
CLI and the tests alike."""

from __future__ import annotations

from gateway.core import Gateway
from gateway.grpc_api import GatewayServicer
from gateway.telemetry import GatewayMetrics
from specmesh.security import Security
from specmesh.serving import GrpcServer, ServiceTelemetry
from specmesh.v1 import gateway_pb2, gateway_pb2_grpc

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name


def build_grpc_server(
    gateway: Gateway,
    host: str,
    port: int,
    metrics: GatewayMetrics | None = None,
    grace_seconds: float = 10.0,
    security: Security | None = None,
) -> GrpcServer:
    """The gRPC front of `gateway`, unstarted (port 0 = any free port). Its drain waits for every generation
    in flight, REST ones included: they share the gateway's slots and replicas. `security`: its TLS and the
    API keys its calls need (the same as the REST front's)."""
    servicer = GatewayServicer(gateway)
    return GrpcServer(
        host,
        port,
        [SERVICE_NAME],
        lambda s: gateway_pb2_grpc.add_GatewayServiceServicer_to_server(servicer, s),
        grace_seconds=grace_seconds,
        active=lambda: gateway.inflight,
        telemetry=ServiceTelemetry("gateway", metrics.rpc if metrics is not None else None),
        engine=gateway,
        metrics=metrics,
        security=security,
    )
