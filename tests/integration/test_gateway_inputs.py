"""Whatever a client sends, the gateway answers in OpenAI's shape (REST) or with INVALID_ARGUMENT (gRPC):
never a 5xx or INTERNAL, never an exception's text or a large echo of the input, and a REST connection stays
usable for the next request. Bodies over the limit are refused as they arrive.

The fuzz test sends SPECMESH_FUZZ_REQUESTS malformed requests (1,000 by default; the soak suite sets more).
"""

import http.client
import json
import os
import random
import socket
import time

import grpc
import pytest

from gateway.openai.body import DRAIN_BYTES
from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.models import demo_target
from tests.support.services import GatewayServer, start_verify

MAX_BODY = 256 << 10
FUZZ_REQUESTS = int(os.environ.get("SPECMESH_FUZZ_REQUESTS", "1000"))


@pytest.fixture(scope="module")
def gw(tokenizer):
    # Target-only (no draft replica) and small caps: a request the fuzzer makes valid by chance is quick.
    # The replica never leaves the pool (a 503 here would be a loaded machine's missed health checks, not
    # the input's doing).
    verify = start_verify(demo_target(tokenizer, seed=5), tokenizer)
    gw = GatewayServer(
        [verify.address],
        [],
        tokenizer,
        max_body_bytes=MAX_BODY,
        max_prompt_tokens=64,
        max_tokens_limit=4,
        fail_threshold=1_000_000,
    )
    yield gw
    gw.stop()
    verify.stop()


def post(conn: http.client.HTTPConnection, path: str, body: bytes, content_type="application/json"):
    conn.request("POST", path, body=body, headers={"content-type": content_type})
    r = conn.getresponse()
    return r, r.read()


def assert_openai_error(r, data: bytes, status: int, param: str | None = "?") -> dict:
    assert r.status == status, (r.status, data[:300])
    error = json.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert len(error["message"]) < 400, error["message"]  # no large echo of the input
    assert "Traceback" not in error["message"] and "Error:" not in error["message"]
    if param != "?":
        assert error["param"] == param, error
    return error


GOOD = json.dumps({"model": "demo", "prompt": "x = 1", "max_tokens": 1}).encode()

# (name, raw body, route, expected param): each was a 500 with a plain-text body once, and broke the
# next request on the same connection.
BAD_BODIES = [
    ("nested 100k deep", b'{"model": "demo", "prompt": "x", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("nested 1k deep", b'{"model": "demo", "prompt": "x", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}", None),
    ("5,000-digit integer", b'{"model": "demo", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}", None),
    ("4,000-digit integer", b'{"model": "demo", "prompt": "x", "max_tokens": ' + b"9" * 4000 + b"}", "max_tokens"),
    ("4,000-digit token id", b'{"model": "demo", "prompt": [1, ' + b"9" * 4000 + b"]}", "prompt"),
    ("token id beyond int32", json.dumps({"model": "demo", "prompt": [1, 2**31]}).encode(), "prompt"),
    ("negative token id", json.dumps({"model": "demo", "prompt": [1, -1]}).encode(), "prompt"),
    ("token id beyond the vocabulary", json.dumps({"model": "demo", "prompt": [1, 8192]}).encode(), "prompt"),
    ("lone surrogate in the prompt", b'{"model": "demo", "prompt": "abc\\ud800"}', "prompt"),
    (
        "lone surrogate in chat",
        b'{"model": "demo", "messages": [{"role": "user", "content": "hi \\udfff"}]}',
        "messages[0].content",
    ),
    ("lone surrogate in stop", b'{"model": "demo", "prompt": "x", "stop": ["a", "\\ud83d"]}', "stop[1]"),
    ("lone surrogate in the model", b'{"model": "\\ud800", "prompt": "x"}', "model"),
    ("NaN", b'{"model": "demo", "prompt": "x", "temperature": NaN}', None),
    ("1e999", b'{"model": "demo", "prompt": "x", "temperature": 1e999}', None),
    ("a model that is a list", json.dumps({"model": ["demo"] * 10_000, "prompt": "x"}).encode(), "model"),
    ("huge top_k", json.dumps({"model": "demo", "prompt": "x", "top_k": 10**300}).encode(), "top_k"),
    ("a long seed", json.dumps({"model": "demo", "prompt": "x", "seed": -(10**300)}).encode(), "seed"),
    ("not UTF-8", b'{"model": "demo", "prompt": "\xff\xfe"}', None),
    (
        "a session_id of 300 characters",
        json.dumps({"model": "demo", "prompt": "x", "session_id": "s" * 300}).encode(),
        "session_id",
    ),
    (
        "a cache_salt that is a number",
        json.dumps({"model": "demo", "prompt": "x", "cache_salt": 7}).encode(),
        "cache_salt",
    ),
]


@pytest.mark.parametrize("name,body,param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_input_is_an_openai_400_and_the_connection_stays_usable(gw, name, body, param):
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    route = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r, data = post(conn, route, body)
    assert_openai_error(r, data, 400, param)
    assert not r.will_close
    sock = conn.sock
    r, data = post(conn, "/v1/completions", GOOD)  # the next request, on the same connection
    assert r.status == 200 and json.loads(data)["choices"][0]["finish_reason"] == "length"
    assert conn.sock is sock
    conn.close()


def test_large_inputs_are_not_echoed(gw):
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    for body, status in [
        ({"model": "m" * 50_000, "prompt": "x"}, 404),
        ({"model": "demo", "prompt": "x", "temperature": "hot" * 10_000}, 400),
        ({"model": "demo", "prompt": "x", "stop": ["s"] * 10_000}, 400),
        ({"model": "demo", "messages": [{"role": "r" * 50_000, "content": "x"}]}, 400),
    ]:
        route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r, data = post(conn, route, json.dumps(body).encode())
        assert_openai_error(r, data, status)
    conn.request("GET", "/v1/" + "p" * 20_000)
    r = conn.getresponse()
    assert_openai_error(r, r.read(), 404)
    conn.request("POST", "/v1/completions", GOOD, {"content-type": "application/json", "x-session-id": "s" * 300})
    r = conn.getresponse()
    assert_openai_error(r, r.read(), 400, "session_id")


def test_an_oversized_body_is_refused_as_it_arrives(gw):
    # Declared too large: a 413 at once, before the client has sent any of the body
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 67108864\r\n\r\n" + b"{" * 1000
        )
        head = s.recv(65536)
        assert head.startswith(b"HTTP/1.1 413") and b"body_too_large" in head + s.recv(65536)
    # Chunked, with no length said: the 413 comes once the body is past what is read to answer it cleanly,
    # though the body goes on
    with socket.create_connection(("127.0.0.1", gw.port), timeout=5) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        chunk = b"x" * 65536
        for _ in range((MAX_BODY + DRAIN_BYTES) // len(chunk) + 2):
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        t0 = time.monotonic()
        assert s.recv(65536).startswith(b"HTTP/1.1 413")
        assert time.monotonic() - t0 < 2
    # Somewhat past the limit, whole: a 413 the client reads (after sending it all), on a connection it keeps
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    r, data = post(conn, "/v1/completions", json.dumps({"model": "demo", "prompt": "x" * (2 * MAX_BODY)}).encode())
    assert_openai_error(r, data, 413)
    assert post(conn, "/v1/completions", GOOD)[0].status == 200


def _random_json(rng: random.Random, depth: int = 0):
    kind = rng.randrange(12 if depth < 3 else 8)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, -1, 2**31, -(2**31) - 1, 2**63, 10**30, 8191, 8192, rng.randrange(-100, 100)])
    if kind == 3:
        return rng.choice([0.0, -0.5, 0.5, 1.5, 3.0, 1e308, -1e-308])
    if kind == 4:
        return rng.choice(["", "demo", "x", "user", "assistant", "text", "\ud800", "\x00", "é" * 50, "a" * 3000])
    if kind == 5:
        return "".join(chr(rng.randrange(0x20, 0x3000)) for _ in range(rng.randrange(20)))
    if kind in (6, 7):
        return rng.randrange(-5, 50)
    if kind in (8, 9):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]
    keys = ["role", "content", "type", "text", "include_usage", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "seed", "n", "stop", "stream", "stream_options", "logprobs", "logit_bias", "presence_penalty",
    "ignore_eos", "session_id", "cache_salt", "num_speculative_tokens", "echo", "user", "tools",
]  # fmt: skip


def _malformed(rng: random.Random) -> tuple[str, str, bytes, str]:
    """(method, path, body, content type) of one malformed request."""
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/v1/completions", "/v1/models", "/v1/x"])
    ctype = rng.choice(["application/json"] * 6 + ["text/plain", "application/x-www-form-urlencoded", ""])
    method = "POST" if rng.random() < 0.95 else rng.choice(["GET", "PUT", "DELETE"])
    r = rng.random()
    if r < 0.1:
        return method, path, bytes(rng.randrange(256) for _ in range(rng.randrange(64))), ctype
    if path == "/v1/chat/completions":
        body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    else:
        body = {"model": "demo", "prompt": "x = 1", "max_tokens": 1}
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(FIELDS)
        if rng.random() < 0.15:
            body.pop(field, None)
        else:
            body[field] = _random_json(rng)
    data = json.dumps(body).encode()  # lone surrogates are written as JSON escapes (\ud800), as clients do
    if r < 0.2:
        data = data[: rng.randrange(len(data))]  # truncated
    elif r < 0.25:
        data = json.dumps(_random_json(rng)).encode()  # any JSON at all
    return method, path, data, ctype


def test_fuzz_malformed_rest_requests_never_get_a_5xx(gw):
    rng = random.Random(1234)
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=30)
    statuses: dict[int, int] = {}
    for i in range(FUZZ_REQUESTS):
        method, path, body, ctype = _malformed(rng)
        conn.request(method, path, body=body, headers={"content-type": ctype} if ctype else {})
        r = conn.getresponse()
        data = r.read()
        statuses[r.status] = statuses.get(r.status, 0) + 1
        assert r.status < 500, (i, method, path, body[:300], data[:300])
        if r.status >= 400:
            assert_openai_error(r, data, r.status)
        elif b'"stream": true' not in body:
            json.loads(data)
    assert statuses.get(400, 0) > FUZZ_REQUESTS // 3, statuses  # many were refused, as they should be
    r, data = post(conn, "/v1/completions", GOOD)
    assert r.status == 200  # alive, and the connection with it


def _raw_call(address: str, method: str, payload: bytes, timeout: float = 30):
    """A GatewayService call with `payload` as the serialized request, whatever it holds."""
    channel = grpc.insecure_channel(address)
    call = (channel.unary_unary if method == "Generate" else channel.unary_stream)(
        f"/specmesh.v1.GatewayService/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    try:
        result = call(payload, timeout=timeout)
        return grpc.StatusCode.OK if method == "Generate" else (list(result) and grpc.StatusCode.OK)
    except grpc.RpcError as e:
        return e.code()
    finally:
        channel.close()


def test_grpc_bad_input_is_invalid_argument(gw):
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gw.grpc_address))
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=1)
    Req = gateway_pb2.GatewayServiceGenerateRequest
    # A prompt string that is not UTF-8 (field 2, bytes ff fe): it does not parse; grpc said INTERNAL
    for method in ("Generate", "GenerateStream"):
        assert _raw_call(gw.grpc_address, method, b"\x12\x02\xff\xfe") == grpc.StatusCode.INVALID_ARGUMENT
    bad = [
        Req(prompt_ids=[1, -1], params=params),
        Req(prompt_ids=[1, 8192], params=params),
        Req(prompt_ids=[1] * 65, params=params),
        Req(prompt="x" * (gw.gateway.max_prompt_chars + 1), params=params),
        Req(prompt="x", params=params, session_id="s" * 257),
        Req(prompt="x", params=params, cache_salt="s" * 257),
        Req(prompt="x", params=common_pb2.SamplingParams(temperature=-1.0)),
        Req(prompt="x", params=common_pb2.SamplingParams(top_p=float("nan"))),
        Req(prompt="x", params=common_pb2.SamplingParams(max_tokens=5)),
        Req(prompt="x", params=common_pb2.SamplingParams(max_tokens=1, stop=[""])),
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(request, timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, e.value.details())
        assert len(e.value.details()) < 400
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(Req(model="m" * 100_000, prompt="x", params=params), timeout=30)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND and len(e.value.details()) < 400
    # Past the configured caps, gRPC itself refuses the message before it is parsed
    too_big = Req(prompt="x" * (5 * gw.gateway.max_prompt_chars + (1 << 20)), params=params)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(too_big, timeout=30)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Random frames: whatever parses or not, never INTERNAL or UNKNOWN
    rng = random.Random(7)
    for _ in range(200):
        payload = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 48)))
        code = _raw_call(gw.grpc_address, rng.choice(["Generate", "GenerateStream"]), payload)
        assert code not in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN), payload
    assert stub.Generate(Req(prompt="x = 1", params=params), timeout=30).usage.completion_tokens == 1
