"""specmesh.v1.VerifyService over gRPC: protobuf <-> domain objects, nothing else (see engine.py)."""

from __future__ import annotations

import asyncio

from specmesh import wire
from specmesh.serving import stream_errors, unary_errors
from specmesh.v1 import common_pb2, verify_pb2, verify_pb2_grpc
from verify_service.engine import END_OF_STREAM, BlockIn, VerifyEngine


class VerifyServicer(verify_pb2_grpc.VerifyServiceServicer):
    def __init__(self, engine: VerifyEngine):
        self.engine = engine

    def _params(self, pb):
        return wire.params_from_pb(pb, self.engine.vocab_size)

    @unary_errors
    async def OpenSession(self, request, context):
        opened = await self.engine.open(request.session_id, list(request.prompt_ids), self._params(request.params))
        s = opened.session
        return verify_pb2.OpenSessionResponse(session_id=s.session_id, epoch=s.epoch, base_position=s.position,
                                              cached_prompt_tokens=opened.cached_prompt_tokens,
                                              prefill_seconds=opened.prefill_seconds)

    @stream_errors
    async def Verify(self, request_iterator, context):
        inbox: asyncio.Queue = asyncio.Queue()

        async def pump():
            try:
                async for pb in request_iterator:
                    try:
                        block = wire.block_from_pb(pb)
                    except ValueError as e:
                        inbox.put_nowait(e)
                        return
                    inbox.put_nowait(BlockIn(pb.session_id, pb.epoch, pb.base_position, block))
                inbox.put_nowait(END_OF_STREAM)
            except Exception as e:  # noqa: BLE001 — the stream broke: end the session's loop
                inbox.put_nowait(END_OF_STREAM if context.cancelled() else e)

        reader = asyncio.get_running_loop().create_task(pump())
        try:
            async for verdict in self.engine.session_stream(inbox):
                yield wire.verdict_to_pb(verdict)
        finally:
            reader.cancel()

    @stream_errors
    async def Generate(self, request, context):
        first = True
        async for item in self.engine.generate(request.session_id, list(request.prompt_ids),
                                               self._params(request.params)):
            if first:
                first = False
                yield common_pb2.GenerateResponse(session_id=item.session.session_id,
                                                  prompt_tokens=item.session.prompt_len,
                                                  cached_prompt_tokens=item.cached_prompt_tokens)
                continue
            yield common_pb2.GenerateResponse(token_ids=item.tokens,
                                              finish_reason=wire.FINISH_TO_PB[item.finish_reason])

    @unary_errors
    async def ReleaseSession(self, request, context):
        return verify_pb2.ReleaseSessionResponse(released=self.engine.release(request.session_id))

    @unary_errors
    async def Info(self, request, context):
        return verify_pb2.VerifyServiceInfoResponse(**self.engine.info())
