"""The `Verifier` of distributed generation: a verify replica's session, over one bidirectional stream.

The speculation loop runs on the event loop that owns the gRPC channel, so a block goes on the wire as soon
as it is drafted, with no thread hand-off, and the loop keeps drafting ahead while it is verified. Stale
verdicts (the answer to a block that crossed a deadline verdict) are skipped; a deadline verdict answers
the block in flight with num_drafted = 0.

A reader task takes every verdict off the stream as it arrives. The verify service may end the stream on
its own: a late draft's deadline steps can finish the generation, and the service then closes the stream
while this side is still writing its next block. gRPC fails that write (an `asyncio.InvalidStateError`, or
an INTERNAL "Internal error from Core" that replaces the stream's real status), and a plain `read()` would
then lose the verdicts already sent. So a failed write is not an error by itself: the verdicts read so far
answer the rounds, and only a stream that ended without the verdict a round needs is, as UNAVAILABLE (or
the stream's own error status), so the caller fails over instead of reporting an internal error.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from specmesh import wire
from specmesh.domain import DraftBlock, Verdict
from specmesh.errors import Unavailable
from specmesh.futures import within
from specmesh.sampling import SamplingParams
from specmesh.v1 import verify_pb2, verify_pb2_grpc

_ENDED = object()  # the reader's last item after a stream that ended with an OK status


@dataclass(eq=False)
class RemoteVerifier:
    stub: verify_pb2_grpc.VerifyServiceStub
    session_id: str  # the replica's name for the session once it is open
    timeout: float
    on_open: Callable[[verify_pb2.OpenSessionResponse], None] | None = None
    metadata: tuple = ()
    cache_scope: str = ""  # the prefix-cache scope the session is opened in ("": the shared one)
    call: Any = field(default=None, init=False)  # the Verify stream, from start()
    epoch: int = field(default=0, init=False)
    position: int = field(default=0, init=False)
    runs: bool = field(default=False, init=False)  # the replica takes runs of target-only steps
    chains: bool = field(default=False, init=False)  # the replica takes chained blocks (`submit`'s `then`)
    # verdicts in arrival order, then _ENDED or the stream's error
    _inbox: asyncio.Queue = field(default_factory=asyncio.Queue, init=False)
    _reader: asyncio.Task | None = field(default=None, init=False)
    _ended: BaseException | object | None = field(default=None, init=False)  # the stream's last item, once read

    async def start(self, prompt_ids: list[int], params: SamplingParams) -> None:
        resp = await self.stub.OpenSession(
            verify_pb2.OpenSessionRequest(
                session_id=self.session_id,
                prompt_ids=prompt_ids,
                params=wire.params_to_pb(params),
                cache_scope=self.cache_scope,
            ),
            timeout=self.timeout,
            metadata=self.metadata,
        )
        self.session_id, self.epoch, self.position = resp.session_id, resp.epoch, resp.base_position
        self.runs = resp.target_only_runs
        self.chains = resp.chained_blocks
        self.call = self.stub.Verify(metadata=self.metadata)
        self._reader = asyncio.get_running_loop().create_task(self._read_all())
        if self.on_open is not None:
            self.on_open(resp)

    async def _read_all(self) -> None:
        try:
            while True:
                pb = await self.call.read()
                if pb is grpc.aio.EOF:
                    self._inbox.put_nowait(_ENDED)
                    return
                self._inbox.put_nowait(pb)
        except grpc.aio.AioRpcError as e:
            self._inbox.put_nowait(e)
        except (asyncio.InvalidStateError, asyncio.CancelledError):  # the call was cancelled here
            self._inbox.put_nowait(Unavailable("the session stream was cancelled"))

    async def submit(
        self, proposal: DraftBlock, then: tuple[DraftBlock, int] | None = None, sent: bool = False
    ) -> Verdict:
        """Send `proposal` (unless `sent`: it went out chained to the block before) and return its verdict.
        `then`: a chained block and the token it assumes this verdict ends with, sent right behind it, at the
        epoch and position this verdict leaves if it takes the whole proposal (VerifyRequest.chained_after);
        where the guess fails the service answers it stale, which the next round's read skips."""
        msgs = [] if sent else [wire.block_to_pb(proposal, self.session_id, self.epoch, self.position)]
        if then is not None:
            block, after = then
            base = self.position + proposal.k + 1
            msgs.append(wire.block_to_pb(block, self.session_id, self.epoch + 1, base, chained_after=after))
        return await self._verdict(msgs)

    async def target_only(self, steps: int) -> AsyncGenerator[Verdict, None]:
        """One message asks for the whole run, and the replica streams a verdict per step as it takes it; a
        replica that does not take runs (an older version, during a rolling upgrade) gets an empty block per
        step."""
        run = steps if self.runs else 0
        for i in range(steps):
            ask = not (self.runs and i)  # a run is asked once; a block per step is sent at each
            msg = wire.block_to_pb(DraftBlock([]), self.session_id, self.epoch, self.position, run) if ask else None
            verdict = await self._verdict([msg] if msg is not None else [])
            yield verdict
            if verdict.finish_reason is not None:
                return

    async def _verdict(self, msgs: list[verify_pb2.VerifyRequest]) -> Verdict:
        """Send `msgs` in order and return the next verdict, both within the timeout."""
        try:
            return await within(self._round(msgs), self.timeout)
        except TimeoutError:
            raise Unavailable(f"the verify service did not answer a block within {self.timeout} s") from None

    async def _round(self, msgs: list[verify_pb2.VerifyRequest]) -> Verdict:
        assert self.call is not None  # start() comes first
        for msg in msgs:
            if self._ended is not None:
                break
            # A failed write means the stream has ended: what it sent before it did is in the inbox.
            with contextlib.suppress(asyncio.InvalidStateError, grpc.aio.AioRpcError):
                await self.call.write(msg)
        return await self._next_verdict()

    async def _next_verdict(self) -> Verdict:
        while True:
            if self._ended is not None and self._inbox.empty():
                raise self._end_error()
            item = await self._inbox.get()
            if item is _ENDED or isinstance(item, BaseException):
                self._ended = item
                continue
            if not item.stale:
                break
        verdict = wire.verdict_from_pb(item)
        self.epoch = verdict.epoch + 1
        self.position += len(verdict.tokens)
        return verdict

    def _end_error(self) -> BaseException:
        """Why a round got no verdict: the stream's own error, unless that is gRPC's stand-in for a write the
        server had already ended the stream for (its real status is lost then)."""
        e = self._ended
        if isinstance(e, grpc.aio.AioRpcError) and e.code() != grpc.StatusCode.INTERNAL:
            return e
        if isinstance(e, Unavailable):
            return e
        return Unavailable("the verify service closed the session stream before the generation ended")

    async def aclose(self, finished: bool) -> None:
        """End the stream: half-close and let the server end it after a finished generation; cancel it
        (the server drops the work) otherwise."""
        try:
            if self.call is None or self.call.done():
                return
            if finished:
                try:
                    await self.call.done_writing()
                    await within(self.call.wait_for_connection(), 1.0)
                    await within(self.call.code(), 5.0)
                    return
                except (TimeoutError, grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    pass
            self.call.cancel()
        finally:
            if self._reader is not None and not self._reader.done():
                self._reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._reader
