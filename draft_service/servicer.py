"""specmesh.v1.DraftService over gRPC: protobuf <-> domain objects, nothing else (see engine.py)."""

from __future__ import annotations

import contextlib

from draft_service.engine import DraftEngine
from specmesh import wire
from specmesh.v1 import draft_pb2, draft_pb2_grpc


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine: DraftEngine):
        self.engine = engine

    async def Generate(self, request, context):
        params = wire.params_from_pb(request.params, self.engine.vocab_size or None)
        events = self.engine.generate(
            request.session_id,
            list(request.prompt_ids),
            params,
            request.verify_address,
            wire.spec_len_from_pb(request),
            goodput_probe=request.goodput_probe,
            cache_scope=request.cache_scope,
            hand_off=request.hand_off,
        )
        async with contextlib.aclosing(events):
            async for event in events:
                yield wire.event_to_pb(event, draft_pb2.DraftServiceGenerateResponse)

    async def Info(self, request, context):
        return draft_pb2.DraftServiceInfoResponse(**self.engine.info())
