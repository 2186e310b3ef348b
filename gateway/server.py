"""The gateway's gRPC front (specmesh.v1.GatewayService, health, reflection), wired in one place for the
CLI and the tests alike.

Requests are parsed by a deserializer that never raises: grpc would answer a request that does not parse
(a string that is not UTF-8) with INTERNAL; the servicer answers it INVALID_ARGUMENT. The largest message
received follows the gateway's own caps (the longest prompt, in text or ids), so an oversized request is
refused by gRPC before it is even parsed.
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

from gateway.core import Gateway
from gateway.grpc_api import GatewayServicer
from gateway.telemetry import GatewayMetrics
from specmesh.security import Security
from specmesh.serving import GrpcServer, ServiceTelemetry
from specmesh.v1 import gateway_pb2

SERVICE_NAME = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"].full_name
# Room in a request beyond its prompt: sampling parameters, stop strings, ids, the model's name.
REQUEST_OVERHEAD_BYTES = 256 << 10
MAX_SEND_BYTES = 16 << 20


def max_request_bytes(gateway: Gateway) -> int:
    """The largest request the gRPC front takes: the longest prompt text (4 UTF-8 bytes a character at
    most) or the most prompt ids (5 bytes each as varints), plus the rest of the message."""
    return max(4 * gateway.max_prompt_chars, 5 * gateway.config.max_prompt_tokens) + REQUEST_OVERHEAD_BYTES


def _parse(message_type):
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except DecodeError:
            return None  # the servicer refuses it with INVALID_ARGUMENT

    return parse


def _add_servicer(servicer: GatewayServicer, server: grpc.aio.Server) -> None:
    """gateway_pb2_grpc.add_GatewayServiceServicer_to_server, with `_parse` as the deserializer."""
    handlers = {
        "Generate": grpc.unary_unary_rpc_method_handler(
            servicer.Generate,
            request_deserializer=_parse(gateway_pb2.GatewayServiceGenerateRequest),
            response_serializer=gateway_pb2.GatewayServiceGenerateResponse.SerializeToString,
        ),
        "GenerateStream": grpc.unary_stream_rpc_method_handler(
            servicer.GenerateStream,
            request_deserializer=_parse(gateway_pb2.GatewayServiceGenerateStreamRequest),
            response_serializer=gateway_pb2.GatewayServiceGenerateStreamResponse.SerializeToString,
        ),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))


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
    servicer = GatewayServicer(gateway, keyed_tenants=bool(security is not None and security.keys))
    return GrpcServer(
        host,
        port,
        [SERVICE_NAME],
        lambda s: _add_servicer(servicer, s),
        grace_seconds=grace_seconds,
        options=[
            ("grpc.max_receive_message_length", max_request_bytes(gateway)),
            ("grpc.max_send_message_length", MAX_SEND_BYTES),
        ],
        active=lambda: gateway.inflight,
        telemetry=ServiceTelemetry("gateway", metrics.rpc if metrics is not None else None),
        engine=gateway,
        metrics=metrics,
        security=security,
    )
