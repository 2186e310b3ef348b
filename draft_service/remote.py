"""The `Verifier` of distributed generation: a verify replica's session, over one bidirectional stream.

The speculation loop runs on the event loop that owns the gRPC channel, so a block goes on the wire as soon
as it is drafted, with no thread hand-off, and the loop keeps drafting ahead while it is verified. Stale
verdicts (the answer to a block that crossed a deadline verdict) are skipped; a deadline verdict answers
the block in flight with num_drafted = 0.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from specmesh import wire
from specmesh.domain import DraftBlock, Verdict
from specmesh.errors import Unavailable
from specmesh.sampling import SamplingParams
from specmesh.v1 import verify_pb2, verify_pb2_grpc


@dataclass(eq=False)
class RemoteVerifier:
    stub: verify_pb2_grpc.VerifyServiceStub
    session_id: str  # the replica's name for the session once it is open
    timeout: float
    on_open: Callable[[verify_pb2.OpenSessionResponse], None] | None = None
    metadata: tuple = ()
    call: Any = field(default=None, init=False)  # the Verify stream, from start()
    epoch: int = field(default=0, init=False)
    position: int = field(default=0, init=False)

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        resp = await self.stub.OpenSession(
            verify_pb2.OpenSessionRequest(
                session_id=self.session_id, prompt_ids=prompt_ids, params=wire.params_to_pb(params)
            ),
            timeout=self.timeout,
            metadata=self.metadata,
        )
        self.session_id, self.epoch, self.position = resp.session_id, resp.epoch, resp.base_position
        self.call = self.stub.Verify(metadata=self.metadata)
        if self.on_open is not None:
            self.on_open(resp)

    async def submit(self, proposal: DraftBlock) -> Verdict:
        msg = wire.block_to_pb(proposal, self.session_id, self.epoch, self.position)
        try:
            return await asyncio.wait_for(self._round(msg), self.timeout)
        except TimeoutError:
            raise Unavailable(f"the verify service did not answer a block within {self.timeout} s") from None

    async def _round(self, msg: verify_pb2.VerifyRequest) -> Verdict:
        assert self.call is not None  # start() comes first
        await self.call.write(msg)
        while True:
            pb = await self.call.read()
            if pb is grpc.aio.EOF:
                raise Unavailable("the verify service closed the session stream before the generation ended")
            if not pb.stale:
                break
        verdict = wire.verdict_from_pb(pb)
        self.epoch = verdict.epoch + 1
        self.position += len(verdict.tokens)
        return verdict

    async def aclose(self, finished: bool) -> None:
        """End the stream: half-close and let the server end it after a finished generation; cancel it
        (the server drops the work) otherwise."""
        if self.call is None or self.call.done():
            return
        if finished:
            try:
                await self.call.done_writing()
                await asyncio.wait_for(self.call.wait_for_connection(), 1.0)
                await asyncio.wait_for(self.call.code(), 5.0)
                return
            except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
        self.call.cancel()
