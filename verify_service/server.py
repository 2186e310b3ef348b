"""Build and run the verify service: engine + servicer + health + reflection + metrics + graceful shutdown."""

from __future__ import annotations

import logging

from specmesh.serving import GrpcServer, ServiceTelemetry
from specmesh.telemetry import serve_metrics
from specmesh.v1 import verify_pb2, verify_pb2_grpc
from verify_service.engine import VerifyConfig, VerifyEngine
from verify_service.servicer import VerifyServicer
from verify_service.telemetry import VerifyMetrics

SERVICE_NAME = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name
log = logging.getLogger("specmesh.verify")


async def build_server(config: VerifyConfig, engine: VerifyEngine | None = None) -> GrpcServer:
    """A started engine behind an unstarted server (call `await server.start()`)."""
    engine = engine or VerifyEngine.from_config(config)
    await engine.start()
    metrics = VerifyMetrics(engine)
    metrics_server = None
    if config.metrics_port >= 0:
        metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port)
        log.info("metrics on http://%s:%d/metrics", config.host, metrics_server.server_port)

    async def on_shutdown():
        await engine.close()
        if metrics_server is not None:
            metrics_server.shutdown()

    def add(server):
        servicer = VerifyServicer(engine)
        servicer.telemetry = ServiceTelemetry("verify", metrics.rpc)
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, server)

    def drain():
        engine.shutting_down = True

    server = GrpcServer(config.host, config.port, [SERVICE_NAME], add, config.grace_period_s, on_shutdown,
                        on_drain=drain, active=lambda: engine.sessions.attached)
    server.engine = engine
    server.metrics = metrics
    server.metrics_port = metrics_server.server_port if metrics_server is not None else None
    return server
