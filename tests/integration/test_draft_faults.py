"""The draft service under verify-side faults: a stream the verify service ended on its own, a replica that
died, a client that went away. Each answers with the right status and leaves nothing held."""

import asyncio
import threading
import time

import grpc
import pytest

from draft_service.remote import RemoteVerifier
from specmesh.domain import DraftBlock
from specmesh.errors import Unavailable
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2, verify_pb2_grpc
from tests.support.models import noisy_copy, tiny_model
from tests.support.services import draft_stub, start_draft, start_verify

VOCAB = 96


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab=VOCAB, seed=5)


async def _remote(address: str, max_tokens: int) -> RemoteVerifier:
    stub = verify_pb2_grpc.VerifyServiceStub(grpc.aio.insecure_channel(address))
    remote = RemoteVerifier(stub, "", 10.0)
    await remote.start([1, 2, 3], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    return remote


def test_verdicts_sent_before_the_verify_service_ended_the_stream_still_answer(target):
    """A late draft: deadline steps finish the generation and the verify service closes the stream while
    the draft still has blocks to send. The writes fail, yet every verdict arrives, the last with its
    finish reason (it was an INTERNAL "Internal error from Core", a spurious failover, before)."""
    verify = start_verify(target, draft_deadline_ms=20)

    async def run():
        remote = await _remote(verify.address, 4)
        tokens = (await remote.submit(DraftBlock([]))).tokens
        await asyncio.sleep(1.0)  # three deadline steps finish it; the service ends the stream
        finish = None
        for _ in range(4):
            verdict = await remote.submit(DraftBlock([]))
            tokens += verdict.tokens
            if verdict.finish_reason:
                finish = verdict.finish_reason
                break
        await remote.aclose(True)
        return tokens, finish

    try:
        tokens, finish = verify.call(run())
        assert len(tokens) == 4 and finish == "length"
    finally:
        verify.stop()


def test_a_dead_replica_is_unavailable_not_internal(target):
    """The replica stops mid-session: the next block is UNAVAILABLE (an asyncio.InvalidStateError from
    writing to the finished call, answered as INTERNAL, before)."""
    verify = start_verify(target)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(30)

    try:
        remote = call(_remote(verify.address, 50))
        assert call(remote.submit(DraftBlock([]))).tokens
        verify.stop()
        time.sleep(0.5)

        async def after():
            try:
                await remote.submit(DraftBlock([]))
            except Exception as e:  # noqa: BLE001 - the test looks at what it was
                return e
            return None

        error = call(after())
        code = error.code() if isinstance(error, grpc.aio.AioRpcError) else getattr(error, "code", None)
        assert isinstance(error, grpc.aio.AioRpcError | Unavailable), repr(error)
        assert str(getattr(code, "name", code)) == "UNAVAILABLE", repr(error)
        call(remote.aclose(False))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_cancelled_and_failed_streams_leave_no_active_session(target):
    """Clients that go away at every point of a stream, then a verify replica that dies under the rest: the
    draft service's active count returns to 0 (it is what its SIGTERM drain waits for)."""
    verify = start_verify(target)
    draft = start_draft(noisy_copy(target, 0.03), verify.address)
    stub = draft_stub(draft)
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    def one(i: int, cancel_after: int | None) -> None:
        call = stub.Generate(
            draft_pb2.DraftServiceGenerateRequest(
                prompt_ids=[1, 2, 3 + i], session_id=f"s{i}" if i % 2 else "", params=params
            ),
            timeout=60,
        )
        try:
            for n, _ in enumerate(call):
                if cancel_after is not None and n >= cancel_after:
                    call.cancel()
                    return
        except grpc.RpcError:
            pass

    try:
        threads = [threading.Thread(target=one, args=(i, i % 5)) for i in range(20)]
        threads += [threading.Thread(target=one, args=(20 + i, None)) for i in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        verify.stop()  # the six uncancelled streams lose their replica mid-stream
        for t in threads:
            t.join(60)
        engine = draft.server.engine
        end = time.monotonic() + 10
        while engine.active and time.monotonic() < end:
            time.sleep(0.05)
        assert engine.active == 0
    finally:
        draft.stop()
        verify.stop()
