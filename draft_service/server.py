"""Build and run the draft service: engine + servicer + health + reflection + metrics + graceful shutdown."""

from __future__ import annotations

import logging

from draft_service.engine import DraftConfig, DraftEngine
from draft_service.servicer import DraftServicer
from draft_service.telemetry import DraftMetrics
from specmesh.serving import GrpcServer, ServiceTelemetry
from specmesh.telemetry import serve_metrics
from specmesh.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name
log = logging.getLogger("specmesh.draft")


async def build_server(config: DraftConfig, engine: DraftEngine | None = None) -> GrpcServer:
    engine = engine or DraftEngine.from_config(config)
    metrics = DraftMetrics(engine)
    metrics_server = None
    if config.metrics_port >= 0:
        metrics_server = serve_metrics(metrics.registry, config.host, config.metrics_port)
        log.info("metrics on http://%s:%d/metrics", config.host, metrics_server.server_port)

    async def on_shutdown():
        await engine.close()
        if metrics_server is not None:
            metrics_server.shutdown()

    def add(server):
        servicer = DraftServicer(engine)
        servicer.telemetry = ServiceTelemetry("draft", metrics.rpc)
        draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)

    def drain():
        engine.shutting_down = True

    server = GrpcServer(config.host, config.port, [SERVICE_NAME], add, config.grace_period_s, on_shutdown,
                        on_drain=drain, active=lambda: engine.active)
    server.engine = engine
    server.metrics = metrics
    server.metrics_port = metrics_server.server_port if metrics_server is not None else None
    return server
