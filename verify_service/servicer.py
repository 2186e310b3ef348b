"""specmesh.v1.VerifyService over gRPC: protobuf <-> domain objects, nothing else (see engine.py)."""

from __future__ import annotations

import asyncio
import contextlib

from specmesh import wire
from specmesh.errors import Unavailable
from specmesh.v1 import verify_pb2, verify_pb2_grpc
from verify_service.engine import END_OF_STREAM, BlockIn, VerifyEngine

HALF_CLOSE_GRACE_S = 0.05


def _cancelled() -> Unavailable:
    return Unavailable("the client cancelled the Verify stream")


class VerifyServicer(verify_pb2_grpc.VerifyServiceServicer):
    def __init__(self, engine: VerifyEngine):
        self.engine = engine

    def _params(self, pb):
        return wire.params_from_pb(pb, self.engine.vocab_size)

    async def OpenSession(self, request, context):
        opened = await self.engine.open(
            request.session_id, list(request.prompt_ids), self._params(request.params), scope=request.cache_scope
        )
        return verify_pb2.OpenSessionResponse(
            session_id=opened.session_id,
            epoch=opened.epoch,
            base_position=opened.base_position,
            cached_prompt_tokens=opened.cached_prompt_tokens,
            prefill_seconds=opened.prefill_seconds,
            target_only_runs=True,
            chained_blocks=True,
        )

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
                    chained = pb.chained_after if pb.HasField("chained_after") else None
                    inbox.put_nowait(
                        BlockIn(pb.session_id, pb.epoch, pb.base_position, block, pb.target_only_steps, chained)
                    )
                # A client's cancel ends the request iterator as quietly as a half-close, and the handler
                # is cancelled only a moment later: wait that moment, so a cancelled stream is not taken
                # for a finished one (whose session would be kept). Only early half-closes pay it.
                await asyncio.sleep(HALF_CLOSE_GRACE_S)
                inbox.put_nowait(_cancelled() if context.cancelled() else END_OF_STREAM)
            except Exception as e:  # noqa: BLE001 — the stream broke: end the session's loop
                # A client that cancelled or went away abandoned its turn: an error, so its session is
                # released (a half-close, the loop's normal end above, keeps it).
                inbox.put_nowait(_cancelled() if context.cancelled() else e)

        reader = asyncio.get_running_loop().create_task(pump())
        try:
            async with contextlib.aclosing(self.engine.session_stream(inbox)) as verdicts:
                async for verdict in verdicts:
                    yield wire.verdict_to_pb(verdict)
        finally:
            reader.cancel()

    async def Generate(self, request, context):
        events = self.engine.generate(
            request.session_id, list(request.prompt_ids), self._params(request.params), scope=request.cache_scope
        )
        async with contextlib.aclosing(events):
            async for event in events:
                yield wire.event_to_pb(event, verify_pb2.VerifyServiceGenerateResponse)

    async def ReleaseSession(self, request, context):
        return verify_pb2.ReleaseSessionResponse(released=self.engine.release(request.session_id))

    async def PromptLogprobs(self, request, context):
        logprobs = await self.engine.prompt_logprobs(list(request.prompt_ids), request.top_logprobs)
        return verify_pb2.PromptLogprobsResponse(logprobs=wire.logprobs_to_pb([lp for lp in logprobs if lp]))

    async def Info(self, request, context):
        return verify_pb2.VerifyServiceInfoResponse(**self.engine.info())
