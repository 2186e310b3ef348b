"""The gateway over real services: the official openai client, the gRPC front, sessions, errors, limits."""

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.models import noisy_copy
from tests.support.rest import greedy_stream, http, stream_with_usage
from tests.support.services import GatewayServer, start_draft, start_verify


@pytest.fixture(scope="module")
def stack(target, tokenizer):
    verifies = [start_verify(target, tokenizer) for _ in range(2)]
    draft = start_draft(noisy_copy(target, 0.03), verifies[0].address)
    gw = GatewayServer([v.address for v in verifies], [draft.address], tokenizer)
    yield gw, verifies, draft
    gw.stop()
    draft.stop()
    for v in verifies:
        v.stop()


@pytest.fixture
def client(stack):
    return stack[0].openai()


def test_completions(client, tokenizer, greedy):
    prompt = "def parse(text):\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    want = greedy(ids, 24)
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=24, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == want.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want.token_ids) == 24
    spec = r.model_extra["specmesh"]
    assert spec["drafted"] > 0 and 0 <= spec["acceptance_rate"] <= 1 and spec["mean_accepted_length"] >= 1
    # token ids as the prompt
    r2 = client.completions.create(model="demo", prompt=ids, max_tokens=24, temperature=0)
    assert r2.choices[0].text == want.text


def test_completions_stream_with_usage(client, tokenizer, greedy):
    prompt = "import os\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    want = greedy(ids, 30)
    chunks = list(greedy_stream(client, prompt, 30))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_plain_and_streaming(stack, client, greedy):
    gw = stack[0]
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A loop, please."}]
    ids = gw.gateway.chat_prompt(messages)
    want_text = greedy(ids, 20).text
    r = client.chat.completions.create(model="demo", messages=messages, max_tokens=20, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want_text
    chunks = list(
        client.chat.completions.create(model="demo", messages=messages, max_tokens=20, temperature=0, stream=True)
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want_text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_ends_text_before_it(client, tokenizer, greedy):
    prompt = "class A:\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    full = greedy(ids, 40).text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.find(stop)]
    chunks = list(
        client.completions.create(model="demo", prompt=prompt, max_tokens=40, temperature=0, stop=stop, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == full[: full.find(stop)]


def test_models_and_health(stack, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"] and models.data[0].object == "model"
    h = http("GET", stack[0].base_url + "/health").json()
    assert h["status"] == "ok" and h["verify_healthy"] == 2 and h["draft_healthy"] == 1
    assert http("GET", stack[0].base_url + "/health/live").json() == {"status": "ok"}


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(max_tokens=-1), "max_tokens"),
        (dict(max_tokens=10**9), None),
        (dict(temperature="hot"), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(n=17), "n"),
        (dict(stop=[1, 2]), "stop"),
        (dict(logprobs=21), "logprobs"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(extra_body={"num_speculative_tokens": 33}), "num_speculative_tokens"),
        (dict(extra_body={"num_speculative_tokens": -1}), "num_speculative_tokens"),
        (dict(extra_body={"num_speculative_tokens": "4"}), "num_speculative_tokens"),
    ],
)
def test_bad_requests_are_openai_400s(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="demo", prompt="x = 1", **kwargs)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error" and err["message"]
    if param:
        assert err["param"] == param


def test_raw_bad_input(stack):
    base = stack[0].base_url
    r = http("POST", base + "/v1/completions", b"{not json")
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http("POST", base + "/v1/chat/completions", json_body={"model": "demo"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = http("POST", base + "/v1/chat/completions", json_body={"model": "demo", "messages": [{"role": "pirate"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]
    r = http("POST", base + "/v1/completions", json_body={"model": "demo", "prompt": "x" * (2 << 20)})
    assert r.status_code == 413
    r = http("POST", base + "/v1/completions", json_body={"model": "demo", "prompt": [1, 10**6]})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    r = http("GET", base + "/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    assert http("GET", base + "/health").status_code == 200  # still serving


def test_unknown_nulls_and_unused_parameters_are_accepted(stack):
    base = stack[0].base_url
    # unknown fields are ignored, null takes the default, a false or empty unsupported one asks for nothing,
    # stream_options is read only when streaming, and max_completion_tokens wins over max_tokens (unread)
    r = http(
        "POST",
        base + "/v1/chat/completions",
        json_body={
            "model": "demo",
            "messages": [{"role": "developer", "content": [{"type": "text", "text": "Hi"}]}],
            "user": "u-1",
            "temperature": None,
            "logprobs": False,
            "tools": [],
            "stream_options": "unread",
            "max_completion_tokens": 2,
            "max_tokens": -1,
        },
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    r = http(
        "POST",
        base + "/v1/completions",
        json_body={"model": "demo", "prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options.include_usage"
    r = http("POST", base + "/v1/completions", json_body={"model": "demo", "prompt": "x", "top_k": True})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"
    r = http("POST", base + "/v1/completions", json_body={"model": "demo", "prompt": "x", "num_speculative_tokens": 33})
    assert r.status_code == 400 and r.json()["error"]["param"] == "num_speculative_tokens"
    r = http("DELETE", base + "/v1/models")
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-9", prompt="x", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"


def test_api_keys_and_overload(stack, tokenizer):
    _, verifies, draft = stack
    gw = GatewayServer(
        [verifies[0].address], [draft.address], tokenizer, api_keys=("sk-good",), max_concurrency=1, max_queue=0
    )
    try:
        bad = gw.openai("sk-bad")
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = gw.openai("sk-good")
        stream = good.completions.create(
            model="demo", prompt="def f():", max_tokens=400, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        next(iter(stream))  # one generation holds the only slot
        with pytest.raises(openai.RateLimitError):
            good.completions.create(model="demo", prompt="x", max_tokens=2)
        stream.close()  # a client disconnect releases the slot and cancels the work downstream
        import time

        for _ in range(100):
            if gw.gateway.inflight == 0:
                break
            time.sleep(0.05)
        assert gw.gateway.inflight == 0
        assert good.completions.create(model="demo", prompt="x", max_tokens=2).choices[0].finish_reason
    finally:
        gw.stop()


def test_grpc_front_unary_and_streaming(stack, tokenizer, greedy):
    gw = stack[0]
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gw.grpc_address))
    prompt = "for i in range(10):\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    want = greedy(ids, 16)
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=16)
    r = stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt=prompt, params=params))
    assert r.text == want.text and list(r.token_ids) == want.token_ids
    assert r.finish_reason == common_pb2.FINISH_REASON_LENGTH and r.usage.completion_tokens == 16
    chunks = list(stub.GenerateStream(gateway_pb2.GatewayServiceGenerateStreamRequest(prompt_ids=ids, params=params)))
    assert all(c.HasField("delta") for c in chunks[:-1]) and chunks[-1].HasField("finished")
    assert "".join(c.delta.text + c.finished.text for c in chunks) == want.text
    assert chunks[-1].finished.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].finished.usage.completion_tokens == 16
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(params=params))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt="x", params=common_pb2.SamplingParams(top_p=3)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_num_speculative_tokens_zero_is_target_only_unset_speculates(stack, client, tokenizer, greedy):
    gw = stack[0]
    prompt = "while True:\n"
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    want_text = greedy(ids, 20).text
    r = client.completions.create(
        model="demo", prompt=prompt, max_tokens=20, temperature=0, extra_body={"num_speculative_tokens": 0}
    )
    spec = r.model_extra["specmesh"]
    assert r.choices[0].text == want_text and spec["drafted"] == 0 and spec["rounds"] == 0 and spec["target_only"]
    messages = [{"role": "user", "content": "A loop, please."}]
    want_chat = greedy(gw.gateway.chat_prompt(messages), 12).text
    chunks = list(
        stream_with_usage(
            client.chat.completions.create,
            model="demo",
            messages=messages,
            max_tokens=12,
            temperature=0,
            extra_body={"num_speculative_tokens": 0},
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].model_extra["specmesh"]["drafted"] == 0 and chunks[-1].model_extra["specmesh"]["target_only"]
    # absent or null: the draft service's default K; 1..32: at most that many draft tokens per block
    for extra in ({}, {"num_speculative_tokens": None}, {"num_speculative_tokens": 1}):
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=20, temperature=0, extra_body=extra)
        spec = r.model_extra["specmesh"]
        assert r.choices[0].text == want_text and spec["drafted"] > 0 and not spec["target_only"], extra
    assert len(spec["acceptance_per_pos"]) == 1  # K max 1


def test_speculation_turns_off_past_the_batch_size(stack, tokenizer, greedy):
    """--speculative-disable-by-batch-size 1 over two verify replicas: a request admitted while more than
    two generations are in flight decodes target-only (same tokens), one that sets K still speculates, and
    the first of a burst always speculates."""
    _, verifies, draft = stack
    gw = GatewayServer([v.address for v in verifies], [draft.address], tokenizer, speculative_disable_by_batch_size=1)
    try:
        prompt = "for item in items:\n"
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        want_text = greedy(ids, 32).text
        client = gw.openai()

        def one(extra):
            r = client.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0, extra_body=extra)
            return r.choices[0].text, r.model_extra["specmesh"]["target_only"]

        with ThreadPoolExecutor(8) as pool:
            burst = list(pool.map(one, [{}] * 7 + [{"num_speculative_tokens": 2}]))
        assert all(text == want_text for text, _ in burst)
        modes = [target_only for _, target_only in burst]
        assert any(modes[:7]) and not all(modes[:7]) and not modes[7], modes
        decisions = gw.gateway.draft_pool.decisions
        assert decisions.get("target_only_under_load") == sum(modes)
        assert one({}) == (want_text, False)  # alone again: speculating
    finally:
        gw.stop()


def test_a_hybrid_draft_replica_takes_requests_past_the_batch_size_and_a_full_one_hands_them_over(
    target, tokenizer, greedy
):
    """Past --speculative-disable-by-batch-size a draft replica that chooses its draft per round (suffix trees,
    its Info says so) still gets the requests; when it is full (RESOURCE_EXHAUSTED) a request that left K and
    the seed unset decodes target-only on the verify replica instead of failing, with the same tokens."""
    verify = start_verify(target, tokenizer)
    draft = start_draft(noisy_copy(target, 0.03), verify.address, enable_suffix_decoding=True, max_sessions=2)
    gw = GatewayServer([verify.address], [draft.address], tokenizer, speculative_disable_by_batch_size=1)
    try:
        prompt = "for item in items:\n"
        want_text = greedy(tokenizer(prompt, add_special_tokens=False)["input_ids"], 32).text
        client = gw.openai()
        # All eight sent at once: started one by one as the pool's threads came up, the first requests of this
        # tiny pair could finish before the third arrived, and the replica was never full.
        start = threading.Barrier(8)

        def one(_):
            start.wait(timeout=60)
            r = client.completions.create(model="demo", prompt=prompt, max_tokens=32, temperature=0)
            return r.choices[0].text, r.model_extra["specmesh"]["target_only"]

        with ThreadPoolExecutor(8) as pool:
            burst = list(pool.map(one, range(8)))
        assert all(text == want_text for text, _ in burst)
        decisions = gw.gateway.draft_pool.decisions
        assert not decisions.get("target_only_under_load")  # the hybrid replica was asked, past the limit too
        assert decisions.get("target_only_draft_full", 0) >= 1  # 8 at once into 2 draft sessions
        assert sum(not target_only for _, target_only in burst) >= 2
        assert gw.gateway.draft_pool.replicas[draft.address].suffix_decoding is True
    finally:
        gw.stop()
        draft.stop()
        verify.stop()


def test_grpc_front_num_speculative_tokens(stack, tokenizer, greedy):
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(stack[0].grpc_address))
    ids = tokenizer("if x:\n", add_special_tokens=False)["input_ids"]
    want = greedy(ids, 16)
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=16)
    r = stub.Generate(
        gateway_pb2.GatewayServiceGenerateRequest(prompt_ids=ids, params=params, num_speculative_tokens=0)
    )
    assert list(r.token_ids) == want.token_ids and r.text == want.text
    assert r.target_only and r.stats.drafted == 0
    r = stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt_ids=ids, params=params))
    assert list(r.token_ids) == want.token_ids and not r.target_only and r.stats.drafted > 0
    request = gateway_pb2.GatewayServiceGenerateStreamRequest(prompt_ids=ids, params=params, num_speculative_tokens=0)
    last = list(stub.GenerateStream(request))[-1].finished
    assert last.target_only and last.stats.drafted == 0 and last.usage.completion_tokens == 16
    too_many = dict(prompt_ids=ids, params=params, num_speculative_tokens=33)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(**too_many))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_speculative_tokens" in e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        list(stub.GenerateStream(gateway_pb2.GatewayServiceGenerateStreamRequest(**too_many)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_speculative_tokens" in e.value.details()


def test_an_error_mid_stream_is_an_event_with_its_code(target, tokenizer):
    verify = start_verify(target, tokenizer)
    gw = GatewayServer([verify.address], [], tokenizer)
    try:
        client = gw.openai()
        stream = client.completions.create(
            model="demo", prompt="x", max_tokens=1000, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)
        verify.stop()  # the only verify replica goes away mid-stream: nowhere to fail over to
        with pytest.raises(openai.APIError) as e:
            for _ in chunks:
                pass
        assert e.value.body["code"] == "service_unavailable" and e.value.body["type"] == "service_unavailable_error"
    finally:
        gw.stop()
        verify.stop()


def test_session_sticks_to_its_replica_and_reuses_kv(stack, client, greedy):
    gw = stack[0]
    messages = [{"role": "user", "content": "Write a function."}]
    first = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=12, temperature=0, extra_body={"session_id": "conv-7"}
    )
    replica = first.model_extra["specmesh"]["verify_replica"]
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "Now test it."},
    ]
    second = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=12, temperature=0, extra_headers={"X-Session-Id": "conv-7"}
    )
    assert second.model_extra["specmesh"]["verify_replica"] == replica
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the earlier turn's KV was reused
    want_text = greedy(gw.gateway.chat_prompt(messages), 12).text
    assert second.choices[0].message.content == want_text


class _Context:
    """What the handlers read of grpc.aio's ServicerContext."""

    def invocation_metadata(self):
        return ()

    def cancelled(self):
        return False


def _close_after_first(loop, method: str, behavior, request, probe):
    """On a service's loop: a streaming handler, wrapped as its server wraps it, gives its first message and
    is then closed, as grpc closes it when the client goes away. Returns what `probe()` reads as the close
    returns, before the loop runs anything else: the handler's cleanup must not wait for garbage
    collection (the inner generators' finalizers run later, or, when a reference cycle holds them, much
    later)."""
    from specmesh.serving import ServiceInterceptor, ServiceTelemetry

    class Details:
        def __init__(self):
            self.method = f"/specmesh.v1.{method}"

    async def run():
        async def continuation(_):
            return grpc.unary_stream_rpc_method_handler(behavior)

        handler = await ServiceInterceptor(ServiceTelemetry("test")).intercept_service(continuation, Details())
        stream = handler.unary_stream(request, _Context())
        first = await anext(stream)
        await stream.aclose()
        return first, probe()

    return asyncio.run_coroutine_threadsafe(run(), loop).result(60)


def test_a_closed_handler_stops_its_work_before_the_close_returns(stack, tokenizer):
    from draft_service.servicer import DraftServicer
    from gateway.core import GenRequest, Outcome
    from specmesh import wire
    from specmesh.v1 import draft_pb2, verify_pb2
    from verify_service.servicer import VerifyServicer

    gw, verifies, draft = stack
    prompt = tokenizer("def f():", add_special_tokens=False)["input_ids"]
    sampling = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    params = wire.params_to_pb(sampling)
    verify = verifies[0].server.engine
    first, attached = _close_after_first(
        verifies[0].loop,
        "VerifyService/Generate",
        VerifyServicer(verify).Generate,
        verify_pb2.VerifyServiceGenerateRequest(prompt_ids=prompt, params=params),
        lambda: verify.sessions.attached,
    )
    assert first.HasField("opened") and attached == 0  # its session detached and its KV freed

    engine = draft.server.engine
    slots = engine.batcher.runner.free_slots
    first, (active, free) = _close_after_first(
        draft.loop,
        "DraftService/Generate",
        DraftServicer(engine).Generate,
        draft_pb2.DraftServiceGenerateRequest(
            prompt_ids=prompt, params=params, verify_address=verifies[0].address, num_speculative_tokens=4
        ),
        lambda: (engine.active, engine.batcher.runner.free_slots),
    )
    assert first.HasField("opened")
    assert active == 0 and free == slots  # the speculation loop stopped and its draft cache was given back

    async def gateway_side():
        chunks = gw.gateway.generate(GenRequest(prompt, sampling), Outcome(prompt_tokens=len(prompt)))
        await anext(chunks)
        await chunks.aclose()
        pools = (gw.gateway.verify_pool, gw.gateway.draft_pool)
        return gw.gateway.inflight, [r.inflight for pool in pools for r in pool.replicas.values()]

    inflight, replicas = asyncio.run_coroutine_threadsafe(gateway_side(), gw.loop).result(60)
    assert inflight == 0 and replicas == [0, 0, 0]  # the replicas' load and the call downstream: released


def test_client_disconnect_cancels_a_non_streaming_generation(stack):
    import socket
    import time

    gw, verifies, _ = stack
    emitted = lambda: sum(v.server.engine.scheduler.stats.tokens for v in verifies)
    body = json.dumps(
        {"model": "demo", "prompt": "def f():", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    ).encode()
    before = emitted()
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    for _ in range(200):
        if gw.gateway.inflight:
            break
        time.sleep(0.01)
    assert gw.gateway.inflight == 1
    sock.close()  # the client goes away before the answer
    for _ in range(300):
        if gw.gateway.inflight == 0 and all(v.server.engine.sessions.attached == 0 for v in verifies):
            break
        time.sleep(0.01)
    assert gw.gateway.inflight == 0 and all(v.server.engine.sessions.attached == 0 for v in verifies)
    time.sleep(0.3)
    assert emitted() - before < 1000  # the generation was stopped downstream, not run to the end
