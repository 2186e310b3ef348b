"""Build and run the draft service: engine + servicer + health + reflection + metrics + graceful shutdown."""

from __future__ import annotations

from draft_service.engine import DraftConfig, DraftEngine
from draft_service.servicer import DraftServicer
from draft_service.telemetry import DraftMetrics
from specmesh.security import Security
from specmesh.serving import GrpcServer, engine_server
from specmesh.telemetry import FnCollector
from specmesh.v1 import draft_pb2, draft_pb2_grpc

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftService"].full_name


async def build_server(config: DraftConfig, model=None, security: Security | None = None, tokenizer=None) -> GrpcServer:
    """The service around `model` (an nn.Module; None = load what the config names), unstarted. `security`:
    its port's TLS and keys, and the TLS and key it dials verify replicas with. `tokenizer` (with `model`)
    lets drafts follow a request's grammar."""
    metrics = DraftMetrics()
    if model is not None:
        engine = DraftEngine(config, model, metrics.stream, metrics.on_batch, tokenizer=tokenizer)
    else:
        engine = DraftEngine.from_config(config, metrics.stream, metrics.on_batch)
    metrics.watch(engine)
    if engine.online is not None:
        metrics.registry.register(FnCollector(engine.online.families))
    engine.security = security

    def add(server):
        draft_pb2_grpc.add_DraftServiceServicer_to_server(DraftServicer(engine), server)

    return engine_server(
        config, "draft", SERVICE_NAME, add, engine, metrics, active=lambda: engine.active, security=security
    )
