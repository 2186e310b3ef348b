"""Build and run the verify service: engine + servicer + health + reflection + graceful shutdown."""

from __future__ import annotations

from specmesh.serving import GrpcServer
from specmesh.v1 import verify_pb2, verify_pb2_grpc
from verify_service.engine import VerifyConfig, VerifyEngine
from verify_service.servicer import VerifyServicer

SERVICE_NAME = verify_pb2.DESCRIPTOR.services_by_name["VerifyService"].full_name


async def build_server(config: VerifyConfig, engine: VerifyEngine | None = None) -> GrpcServer:
    """A started engine behind an unstarted server (call `await server.start()`)."""
    engine = engine or VerifyEngine.from_config(config)
    await engine.start()

    async def on_shutdown():
        await engine.close()

    def add(server):
        verify_pb2_grpc.add_VerifyServiceServicer_to_server(VerifyServicer(engine), server)

    def drain():
        engine.shutting_down = True

    server = GrpcServer(config.host, config.port, [SERVICE_NAME], add, config.grace_period_s, on_shutdown,
                        on_drain=drain, active=lambda: engine.sessions.attached)
    server.engine = engine
    return server
