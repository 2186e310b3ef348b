"""Bad input on every RPC gets the right status code, and the servers keep serving (batches unharmed)."""

import queue
import threading
import time

import grpc
import pytest

from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, verify_pb2
from tests.support.models import noisy_copy, tiny_model
from tests.support.services import draft_stub, generate, start_draft, start_verify, verify_stub
from verify_service.engine import VerifyEngine

VOCAB = 96
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
C = grpc.StatusCode


@pytest.fixture(scope="module")
def target():
    return tiny_model("llama", vocab=VOCAB, seed=5)


@pytest.fixture(scope="module")
def servers(target):
    verify = start_verify(target, max_spec_len=8)
    draft = start_draft(noisy_copy(target, 0.03), verify.address)
    yield verify, draft
    draft.stop()
    verify.stop()


class Stream:
    """A raw Verify stream: send blocks, read verdicts one by one."""

    def __init__(self, stub):
        self.q: queue.Queue = queue.Queue()
        self.responses = stub.Verify(iter(self.q.get, None), timeout=30)

    def send(self, **fields):
        self.q.put(verify_pb2.VerifyRequest(**fields))

    def read(self):
        return next(self.responses)

    def close(self):
        self.q.put(None)


def open_session(stub, prompt, session_id="", params=GREEDY):
    return stub.OpenSession(verify_pb2.OpenSessionRequest(session_id=session_id, prompt_ids=prompt, params=params))


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    assert e.value.details()  # every error says what was wrong
    return e.value.code()


BAD_OPEN = [
    ([], GREEDY, "at least one token"),
    ([1, VOCAB], GREEDY, "out of range"),
    ([1, -3], GREEDY, "out of range"),
    ([1, 2], common_pb2.SamplingParams(temperature=-1.0), "temperature"),
    ([1, 2], common_pb2.SamplingParams(top_p=1.5), "top_p"),
    ([1, 2], common_pb2.SamplingParams(max_tokens=5000), "context length"),
    ([1, 2], common_pb2.SamplingParams(stop=["x"]), "tokenizer"),
    ([1, 2], common_pb2.SamplingParams(stop_token_ids=[VOCAB + 1]), "stop_token_ids"),
]


@pytest.mark.parametrize("prompt,params,message", BAD_OPEN)
def test_bad_session_and_generate_requests(servers, prompt, params, message):
    verify, draft = servers
    vs = verify_stub(verify)
    for call in (
        lambda: open_session(vs, prompt, params=params),
        lambda: generate(vs, prompt, params),
        lambda: generate(draft_stub(draft), prompt, params),
    ):
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == C.INVALID_ARGUMENT and message in e.value.details(), e.value.details()


def test_bad_blocks_on_the_verify_stream(servers):
    verify, _ = servers
    vs = verify_stub(verify)

    def first_block_error(**fields):
        s = Stream(vs)
        s.send(**fields)
        return code_of(s.read)

    assert first_block_error(session_id="nope", epoch=0, base_position=3) == C.NOT_FOUND
    assert first_block_error(epoch=0) == C.INVALID_ARGUMENT  # the first block must name the session
    cases = [
        (dict(epoch=5), C.FAILED_PRECONDITION),  # an epoch from the future
        (dict(base_position=1), C.FAILED_PRECONDITION),
        (dict(draft_ids=list(range(9))), C.INVALID_ARGUMENT),  # > --max-spec-len 8
        (dict(draft_ids=[1, VOCAB + 7]), C.INVALID_ARGUMENT),
        (dict(draft_ids=[1, 2], q_ids=[1, 2, 3], q_probs=[1.0, 0.0, 0.0], q_width=2), C.INVALID_ARGUMENT),
        (dict(draft_ids=[1], q_ids=[1, 2], q_probs=[0.7, 0.7], q_width=2), C.INVALID_ARGUMENT),  # sum != 1
        (dict(draft_ids=[1], q_ids=[1, 2], q_probs=[float("nan"), 1.0], q_width=2), C.INVALID_ARGUMENT),
        (dict(draft_ids=[3], q_ids=[1, 2], q_probs=[0.5, 0.5], q_width=2), C.INVALID_ARGUMENT),  # x outside q
    ]
    for fields, code in cases:
        opened = open_session(vs, [1, 2, 3])
        block = dict(session_id=opened.session_id, epoch=opened.epoch, base_position=opened.base_position)
        block.update(fields)
        assert first_block_error(**block) == code, fields


def test_stale_and_repeated_blocks_are_harmless(servers, target):
    verify, _ = servers
    vs = verify_stub(verify)
    opened = open_session(vs, [4, 5, 6], session_id="stale-test")
    s = Stream(vs)
    s.send(session_id="stale-test", epoch=0, base_position=3, draft_ids=[])
    v0 = s.read()
    assert v0.epoch == 0 and len(v0.token_ids) == 1 and not v0.stale
    s.send(epoch=0, base_position=3, draft_ids=[7, 8])  # the same epoch again: stale, nothing changes
    assert s.read().stale
    s.send(epoch=1, base_position=4, draft_ids=[])
    v1 = s.read()
    assert v1.epoch == 1 and not v1.stale
    reference = (
        SpeculativeEngine.from_models(target)
        .generate([4, 5, 6], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), 0)
        .token_ids
    )
    assert list(v0.token_ids) + list(v1.token_ids) == reference
    # a second stream on a session that is in use
    s2 = Stream(vs)
    s2.send(session_id="stale-test", epoch=2, base_position=5)
    assert code_of(s2.read) == C.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as e:
        vs.ReleaseSession(verify_pb2.ReleaseSessionRequest(session_id="stale-test"))
    assert e.value.code() == C.FAILED_PRECONDITION
    s.close()
    assert opened.session_id == "stale-test"


@pytest.fixture
def deadline_verify(target):
    """A fresh verify service (its counters start at 0) whose draft deadline is 50 ms, and its stub."""
    verify = start_verify(target, draft_deadline_ms=50)
    yield verify_stub(verify)
    verify.stop()


def test_a_late_draft_gets_a_deadline_step(deadline_verify, target):
    vs = deadline_verify
    opened = open_session(vs, [9, 8, 7])
    s = Stream(vs)
    s.send(session_id=opened.session_id, epoch=0, base_position=3, draft_ids=[])
    first = s.read()
    late = s.read()  # nothing sent: the verifier steps on its own
    assert late.deadline and late.epoch == 1 and late.num_drafted == 0 and len(late.token_ids) == 1
    s.send(epoch=1, base_position=4, draft_ids=[1, 2])  # crossed the deadline verdict on the wire
    stale = s.read()
    while stale.deadline:  # the machine may be slow enough for more deadline steps
        stale = s.read()
    assert stale.stale
    info = vs.Info(verify_pb2.VerifyServiceInfoRequest())
    assert info.deadline_steps >= 1 and info.stale_blocks >= 1
    reference = (
        SpeculativeEngine.from_models(target)
        .generate([9, 8, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), 0)
        .token_ids
    )
    assert list(first.token_ids) + list(late.token_ids) == reference
    s.close()


def test_a_silent_client_gets_no_more_deadline_steps(deadline_verify):
    # A hung draft (SIGSTOPped, black-holed) must not keep its sessions stepping: their verdicts go unread
    # while they take batch rows from live sessions. Past QUIET_DEADLINES deadlines the session waits.
    vs = deadline_verify
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    opened = open_session(vs, [9, 8, 7], params=params)
    s = Stream(vs)
    s.send(session_id=opened.session_id, epoch=0, base_position=3, draft_ids=[])
    got = [s.read()]
    time.sleep(1.5)  # silent: a few deadline steps, then none
    steps = vs.Info(verify_pb2.VerifyServiceInfoRequest()).deadline_steps
    assert 1 <= steps <= VerifyEngine.QUIET_DEADLINES + 1
    time.sleep(0.5)
    assert vs.Info(verify_pb2.VerifyServiceInfoRequest()).deadline_steps == steps
    got += [s.read() for _ in range(steps)]
    assert all(v.deadline for v in got[1:])
    position = 3 + sum(len(v.token_ids) for v in got)
    s.send(epoch=got[-1].epoch + 1, base_position=position, draft_ids=[])  # heard again: served as before
    after = s.read()
    assert not after.stale and len(after.token_ids) == 1
    s.close()


def test_a_new_turn_takes_over_a_session_whose_stream_went_silent(deadline_verify, target):
    # The gateway's target-only continuation of a stream stalled on a hung draft names the stalled stream's
    # (ephemeral) session: it continues that cache instead of waiting for the stream or prefilling again.
    vs = deadline_verify
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = [9, 8, 7, 6, 5, 4]
    opened = open_session(vs, prompt, params=params)
    assert opened.session_id.startswith("eph-")
    s = Stream(vs)
    s.send(session_id=opened.session_id, epoch=0, base_position=len(prompt), draft_ids=[])
    committed = list(s.read().token_ids)
    time.sleep(0.6)  # silent past the quiet bound; its deadline steps are never read
    rest = params.max_tokens - len(committed)
    tokens, chunks = generate(
        vs,
        prompt + committed,
        common_pb2.SamplingParams(temperature=0.0, max_tokens=rest, ignore_eos=True),
        session_id=opened.session_id,
    )
    assert chunks[0].opened.session_id == opened.session_id
    assert chunks[0].opened.cached_prompt_tokens == len(prompt + committed) - 1  # all but the token to feed
    with pytest.raises(grpc.RpcError) as e:
        while True:
            s.read()
    assert e.value.code() == C.ABORTED and "taken over" in e.value.details()
    reference = (
        SpeculativeEngine.from_models(target)
        .generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), 0)
        .token_ids
    )
    assert committed + tokens == reference
    info = vs.Info(verify_pb2.VerifyServiceInfoRequest())
    assert info.sessions == 0  # still ephemeral: released when the turn that took it over ended


def test_bad_draft_requests(servers):
    _, draft = servers
    ds = draft_stub(draft)
    assert code_of(lambda: generate(ds, [1, 2], GREEDY, num_speculative_tokens=99)) == C.INVALID_ARGUMENT
    assert code_of(lambda: generate(ds, [1, 2], GREEDY, verify_address="127.0.0.1:1")) == C.UNAVAILABLE


def test_overload_is_resource_exhausted(target):
    verify = start_verify(target, max_sessions=1)
    draft = start_draft(noisy_copy(target, 0.03), verify.address, max_sessions=1)
    try:
        vs = verify_stub(verify)
        opened = open_session(vs, [1, 2, 3])
        s = Stream(vs)
        s.send(session_id=opened.session_id, epoch=0, base_position=3)
        s.read()  # the session is now attached: the one slot is taken
        assert code_of(lambda: generate(vs, [1, 2], GREEDY)) == C.RESOURCE_EXHAUSTED
        assert code_of(lambda: generate(draft_stub(draft), [1, 2], GREEDY)) == C.RESOURCE_EXHAUSTED
        s.close()
        s.responses.cancel()
    finally:
        draft.stop()
        verify.stop()


def test_bad_requests_do_not_disturb_a_running_batch(servers, target):
    verify, draft = servers
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = [[1, 2, 3], [7, 7, 8, 9], [20, 21]]
    results = {}
    threads = [
        threading.Thread(target=lambda p=p: results.__setitem__(tuple(p), generate(draft_stub(draft), p, params)[0]))
        for p in prompts
    ]
    for t in threads:
        t.start()
    vs = verify_stub(verify)
    for _ in range(10):
        for prompt, bad, _msg in BAD_OPEN[:3]:
            code_of(lambda: open_session(vs, prompt, params=bad))
        s = Stream(vs)
        s.send(session_id="nope")
        code_of(s.read)
    for t in threads:
        t.join(120)
    engine = SpeculativeEngine.from_models(target)
    for p in prompts:
        want = engine.generate(p, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), 0).token_ids
        assert results[tuple(p)] == want


def test_kv_budget_evicts_idle_sessions_lru_and_ttl(target):
    # 512 bytes of KV per token for this model: a 12 KiB budget holds 24 tokens, in caches that grow by the
    # token (the HF runner: the block and slot pools refuse a budget below one whole sequence at start)
    verify = start_verify(target, runner="hf", kv_cache_budget_mb=12 / 1024, session_ttl_s=0.5)
    try:
        vs = verify_stub(verify)
        open_session(vs, list(range(1, 13)), session_id="a")
        open_session(vs, list(range(1, 13)), session_id="b")  # 22 cached tokens: both fit
        open_session(vs, list(range(20, 32)), session_id="c")  # evicts "a", the least recently used
        info = vs.Info(verify_pb2.VerifyServiceInfoRequest())
        assert info.evicted_sessions == 1 and info.sessions == 2 and info.kv_cache_bytes <= 12 * 1024
        s = Stream(vs)
        s.send(session_id="a", epoch=0, base_position=12)
        assert code_of(s.read) == C.NOT_FOUND
        held = Stream(vs)  # "b" attached: it cannot be evicted, so room for a long prompt runs out
        held.send(session_id="b", epoch=0, base_position=12)
        held.read()
        assert code_of(lambda: open_session(vs, list(range(1, 20)), session_id="d")) == C.RESOURCE_EXHAUSTED
        held.close()
        held.responses.cancel()
        import time

        time.sleep(2.0)  # past the TTL: the reaper drops idle sessions
        info = vs.Info(verify_pb2.VerifyServiceInfoRequest())
        assert info.sessions == 0 and info.kv_cache_bytes == 0
    finally:
        verify.stop()
