"""Build and run the verify service: engine + servicer + health + reflection + metrics + graceful shutdown."""

from __future__ import annotations

from specmesh.security import Security
from specmesh.serving import GrpcServer, ServiceTelemetry
from specmesh.v1 import verify_pb2, verify_pb2_grpc
from verify_service.engine import VerifyConfig, VerifyEngine
from verify_service.servicer import VerifyServicer
from verify_service.telemetry import VerifyMetrics

SERVICE_NAME = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name


async def build_server(
    config: VerifyConfig, model=None, tokenizer=None, security: Security | None = None
) -> GrpcServer:
    """A started engine around `model` (None = load what the config names) behind an unstarted server
    (call `await server.start()`). `security`: its port's TLS and the keys callers need."""
    metrics = VerifyMetrics()
    if model is not None:
        engine = VerifyEngine(config, model, tokenizer, on_batch=metrics.on_batch)
    else:
        engine = VerifyEngine.from_config(config, on_batch=metrics.on_batch)
    metrics.watch(engine)
    await engine.start()

    def add(server):
        servicer = VerifyServicer(engine)
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, server)

    def drain():
        engine.shutting_down = True

    return GrpcServer(
        config.host,
        config.port,
        [SERVICE_NAME],
        add,
        config.grace_period_s,
        engine.close,
        on_drain=drain,
        active=lambda: engine.sessions.attached,
        metrics_registry=metrics.registry,
        metrics_port=config.metrics_port,
        telemetry=ServiceTelemetry("verify", metrics.rpc),
        engine=engine,
        metrics=metrics,
        security=security,
    )
