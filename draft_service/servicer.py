"""specmesh.v1.DraftService over gRPC: protobuf <-> domain objects, nothing else (see engine.py)."""

from __future__ import annotations

from specmesh import wire
from specmesh.loop import GenerationResult
from specmesh.serving import stream_errors, unary_errors
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc
from draft_service.engine import DraftEngine, Opened


class DraftServicer(draft_pb2_grpc.DraftServiceServicer):
    def __init__(self, engine: DraftEngine):
        self.engine = engine

    @stream_errors
    async def Generate(self, request, context):
        params = wire.params_from_pb(request.params, self.engine.vocab_size or None)
        async for item in self.engine.generate(request.session_id, list(request.prompt_ids), params,
                                               request.verify_address, request.num_speculative_tokens):
            if isinstance(item, Opened):
                yield common_pb2.GenerateResponse(session_id=item.session_id, prompt_tokens=item.prompt_tokens,
                                                  cached_prompt_tokens=item.cached_prompt_tokens)
            elif isinstance(item, GenerationResult):
                yield common_pb2.GenerateResponse(finish_reason=wire.FINISH_TO_PB[item.finish_reason],
                                                  stats=wire.stats_to_pb(item.stats))
            else:
                yield common_pb2.GenerateResponse(token_ids=item)

    @unary_errors
    async def Info(self, request, context):
        return draft_pb2.DraftServiceInfoResponse(**self.engine.info())
