"""Build and run the draft service: engine + servicer + health + reflection + graceful shutdown."""

from __future__ import annotations

from specmesh.serving import GrpcServer
from specmesh.v1 import draft_pb2, draft_pb2_grpc
from draft_service.engine import DraftConfig, DraftEngine
from draft_service.servicer import DraftServicer

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


async def build_server(config: DraftConfig, engine: DraftEngine | None = None) -> GrpcServer:
    engine = engine or DraftEngine.from_config(config)

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(DraftServicer(engine), server)

    def drain():
        engine.shutting_down = True

    server = GrpcServer(config.host, config.port, [SERVICE_NAME], add, config.grace_period_s, engine.close,
                        on_drain=drain, active=lambda: engine.active)
    server.engine = engine
    return server
