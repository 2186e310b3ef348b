"""Hard bounds of the verify service under a flood: OpenSession calls that never stream, Verify streams
that go silent or are cancelled. Afterwards sessions and KV are back under the cap and budget, the process
grew by less than a fixed bound, and a normal request still works. Loopback only, bounded loops."""

import queue
import time

import grpc
import pytest

from specmesh.v1 import common_pb2, verify_pb2
from tests.support.models import tiny_model
from tests.support.services import generate, start_verify, verify_stub

VOCAB = 96
BPT = 512  # KV bytes per token of tiny_model("llama")
SLOT_LEN, CAP = 64, 8
BUDGET_MB = CAP * SLOT_LEN * BPT / 2**20
PARAMS = common_pb2.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
C = grpc.StatusCode


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc/self/status")


@pytest.fixture(scope="module", params=["batched", "hf"])
def server(request):
    target = tiny_model("llama", vocab=VOCAB, seed=5)
    extra = {"max_model_len": SLOT_LEN} if request.param == "batched" else {"max_cached_sessions": CAP}
    srv = start_verify(
        target,
        runner=request.param,
        max_sessions=4,
        kv_cache_budget_mb=BUDGET_MB,
        attach_timeout_s=0.5,
        stream_idle_timeout_s=0.6,
        draft_deadline_ms=100,
        **extra,
    )
    yield srv, verify_stub(srv)
    srv.stop()


def info(stub):
    return stub.Info(verify_pb2.VerifyServiceInfoRequest())


def within_bounds(stub) -> bool:
    i = info(stub)
    return i.sessions <= CAP and i.kv_cache_bytes <= BUDGET_MB * 2**20


def open_session(stub, sid: str, n: int):
    prompt = [(n * 7 + j) % VOCAB for j in range(4 + n % 8)]
    return stub.OpenSession(verify_pb2.OpenSessionRequest(session_id=sid, prompt_ids=prompt, params=PARAMS))


def stream(stub, first: verify_pb2.VerifyRequest):
    q: queue.Queue = queue.Queue()
    q.put(first)
    return stub.Verify(iter(q.get, None), timeout=30), q


def wait_until(cond, seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_flood_of_opens_and_abandoned_streams_stays_bounded(server):
    srv, stub = server
    tokens, _ = generate(stub, [1, 2, 3], PARAMS)  # warm every path before the baseline
    assert len(tokens) == 40
    before = rss_bytes()
    for n in range(300):  # opened, never streamed: named and ephemeral alike
        open_session(stub, f"flood-{n}" if n % 2 else "", n)
        if n % 50 == 0:
            assert within_bounds(stub)
    assert within_bounds(stub)
    # Streams that attach and then go silent: closed past the idle timeout, their sessions released.
    silent = []
    for n in range(3):
        opened = open_session(stub, f"silent-{n}", n)
        silent.append(
            stream(
                stub,
                verify_pb2.VerifyRequest(session_id=opened.session_id, epoch=0, base_position=opened.base_position),
            )
        )
    for responses, _ in silent:
        with pytest.raises(grpc.RpcError) as e:
            list(responses)
        assert e.value.code() == C.DEADLINE_EXCEEDED
    # Streams cancelled by their client mid-turn.
    for n in range(3):
        opened = open_session(stub, f"cancel-{n}", n)
        responses, _ = stream(
            stub, verify_pb2.VerifyRequest(session_id=opened.session_id, epoch=0, base_position=opened.base_position)
        )
        next(responses)
        responses.cancel()
    # Everything above is released: by the attach timeout, the idle timeout or the cancel.
    assert wait_until(lambda: info(stub).sessions == 0), info(stub)
    assert info(stub).kv_cache_bytes == 0 and info(stub).active_sessions == 0
    assert rss_bytes() - before < 64 * 2**20
    again, _ = generate(stub, [1, 2, 3], PARAMS)
    assert again == tokens


def test_a_stream_that_finishes_keeps_its_named_session(server):
    srv, stub = server
    opened = open_session(stub, "kept", 1)
    q: queue.Queue = queue.Queue()
    q.put(verify_pb2.VerifyRequest(session_id=opened.session_id, epoch=0, base_position=opened.base_position))
    q.put(None)  # half-close after one block: a normal end
    assert len(list(stub.Verify(iter(q.get, None), timeout=30))) == 1
    assert srv.server.engine.sessions.peek("kept") is not None
    assert open_session(stub, "kept", 1).cached_prompt_tokens > 0
