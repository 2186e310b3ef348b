"""Malformed input for the soak suite: raw HTTP requests at the gateway's REST front, and random bytes,
HTTP/2 frames and protobuf payloads at every gRPC server. Counted by status: a 5xx, an INTERNAL or UNKNOWN
status, or a process that died is a finding; 4xx and INVALID_ARGUMENT-like statuses are the right answers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import struct

import grpc

PATHS = ["/v1/completions", "/v1/chat/completions"]


def _bodies(rng: random.Random) -> tuple[str, str, bytes, str]:
    """(method, path, body, content-type) of one malformed request."""
    good = {"model": "demo", "prompt": "def f():\n", "max_tokens": 4}
    kind = rng.randrange(16)
    path = rng.choice(PATHS)
    ct = "application/json"
    if kind == 0:  # not JSON
        body = bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
    elif kind == 1:  # truncated JSON
        s = json.dumps(good)
        body = s[: rng.randint(0, len(s) - 1)].encode()
    elif kind == 2:  # deep nesting
        d = rng.randint(1_000, 100_000)
        body = b"[" * d + b"]" * d
    elif kind == 3:  # huge integers
        digits = "9" * rng.randint(20, 5000)  # written out: json.dumps refuses ints past 4300 digits
        body = ('{"model": "demo", "prompt": "x", "max_tokens": ' + digits + "}").encode()
    elif kind == 4:  # wrong types
        key = rng.choice(["prompt", "max_tokens", "temperature", "top_p", "stop", "seed", "messages", "n"])
        body = json.dumps({**good, key: rng.choice([None, [], {}, "x", -1, 1e309 if False else 1e308, True])}).encode()
    elif kind == 5:  # token ids out of range
        body = json.dumps({**good, "prompt": [rng.choice([-1, 2**31, 2**40, 10**9])]}).encode()
    elif kind == 6:  # lone surrogates in prompt / stop / chat
        body = (
            '{"model": "demo", "prompt": "a\\ud800b", "max_tokens": 2, "stop": ["\\udfff"]}'
            if rng.random() < 0.5
            else '{"model": "demo", "messages": [{"role": "user", "content": "\\ud83d"}]}'
        ).encode()
        path = rng.choice(PATHS)
    elif kind == 7:  # invalid UTF-8
        body = b'{"model": "demo", "prompt": "\xff\xfe\xfd"}'
    elif kind == 8:  # wrong content type
        body, ct = json.dumps(good).encode(), rng.choice(["text/plain", "application/x-www-form-urlencoded", ""])
    elif kind == 9:  # out-of-range values
        key, val = rng.choice(
            [("temperature", -1), ("top_p", 0), ("top_p", 2), ("max_tokens", 0), ("n", 5), ("logprobs", 99)]
        )
        body = json.dumps({**good, key: val}).encode()
    elif kind == 10:  # chat without messages / bad roles
        body = json.dumps(
            {"model": "demo", "messages": rng.choice([[], [{"role": "x"}], [{"content": 1}], "hi"])}
        ).encode()
        path = "/v1/chat/completions"
    elif kind == 11:  # unknown model
        body = json.dumps({**good, "model": "x" * rng.randint(1, 5000)}).encode()
    elif kind == 12:  # a long stop list
        body = json.dumps({**good, "stop": ["s"] * rng.randint(17, 2000)}).encode()
    elif kind == 13:  # unknown routes and methods
        return rng.choice(["GET", "PUT", "DELETE", "PATCH"]), rng.choice([*PATHS, "/v1/x", "/..%2f"]), b"{}", ct
    elif kind == 14:  # random JSON values
        body = json.dumps(rng.choice([0, "s", None, [1, 2], {"a": {"b": []}}, 1.5])).encode()
    else:  # prompt too long by characters
        body = json.dumps({**good, "prompt": "x" * rng.randint(100_000, 400_000)}).encode()
    return "POST", path, body, ct


def fuzz_rest(address: str, count: int, seed: int = 0) -> dict:
    """`count` malformed requests, over a few keep-alive connections (a bad request must not break the
    connection it came on): statuses counted, 5xx and dropped connections listed."""
    import http.client

    host, _, port = address.rpartition(":")
    rng = random.Random(seed)
    statuses: dict[str, int] = {}
    reconnects = 0
    samples_5xx: list[str] = []
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    for _ in range(count):
        method, path, body, ct = _bodies(rng)
        headers = {"content-type": ct} if ct else {}
        try:
            conn.request(method, path, body=body, headers=headers)
            resp = conn.getresponse()
            resp.read()
            code = str(resp.status)
            if resp.status >= 500 and len(samples_5xx) < 5:
                samples_5xx.append(f"{resp.status} {method} {path} {body[:80]!r}")
        except (OSError, http.client.HTTPException):
            code = "connection_error"
            reconnects += 1
            conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=30)
        statuses[code] = statuses.get(code, 0) + 1
    conn.close()
    return dict(
        requests=count,
        statuses=dict(sorted(statuses.items())),
        **{"5xx": sum(v for k, v in statuses.items() if k.startswith("5"))},
        connection_errors=reconnects,
        samples_5xx=samples_5xx,
    )


PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


def _frame(rng: random.Random) -> bytes:
    payload = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes([rng.randrange(10), rng.randrange(256)])
        + struct.pack(">I", rng.randrange(1 << 31))
        + payload
    )


def _raw(address: str, data: bytes) -> None:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2) as s:
            s.sendall(data)
            s.settimeout(0.2)
            with contextlib.suppress(OSError):
                s.recv(4096)
    except OSError:
        pass


METHODS = {
    "verify": ["OpenSession", "Verify", "Generate", "ReleaseSession", "Info"],
    "draft": ["Generate", "Info"],
    "gateway": ["Generate", "GenerateStream"],
}


async def fuzz_grpc(address: str, count: int, seed: int = 0) -> dict:
    """Random bytes and random HTTP/2 frames on raw connections (half each of count / 2), then count / 2
    gRPC calls carrying random bytes as the request message to every method: statuses counted."""
    rng = random.Random(seed)
    raw = count // 2
    for i in range(raw):
        data = (
            bytes(rng.randrange(256) for _ in range(rng.randint(1, 512)))
            if i % 2
            else PREFACE + b"".join(_frame(rng) for _ in range(rng.randint(1, 8)))
        )
        await asyncio.to_thread(_raw, address, data)
    codes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as ch:
        calls = []
        for service, methods in (
            ("specmesh.v1.VerifyService", METHODS["verify"]),
            ("specmesh.v1.DraftService", METHODS["draft"]),
            ("specmesh.v1.GatewayService", METHODS["gateway"]),
        ):
            calls += [(service, m) for m in methods]
        for _ in range(count - raw):
            service, method = rng.choice(calls)
            payload = bytes(rng.randrange(256) for _ in range(rng.randint(0, 256)))
            stream = method in ("Verify", "GenerateStream") or (method == "Generate" and "Gateway" not in service)
            name = f"/{service}/{method}"
            try:
                if method == "Verify":
                    call = ch.stream_stream(name)(iter([payload]), timeout=2)
                    async for _ in call:
                        pass
                elif stream:
                    async for _ in ch.unary_stream(name)(payload, timeout=2):
                        pass
                else:
                    await ch.unary_unary(name)(payload, timeout=2)
                code = "OK"
            except grpc.aio.AioRpcError as e:
                code = e.code().name
                if code == "INTERNAL" and e.details() == CLIENT_CORE_RACE:
                    code = "INTERNAL (client core)"
            codes[code] = codes.get(code, 0) + 1
    return dict(
        raw_connections=raw,
        calls=count - raw,
        statuses=dict(sorted(codes.items())),
        internal_or_unknown=codes.get("INTERNAL", 0) + codes.get("UNKNOWN", 0),
    )


# What grpc's client core reports, not any server, for a bidi stream to a method the server does not
# implement: the server answers UNIMPLEMENTED at once and the client's own write races it. Measured against
# the gateway's port (no VerifyService there): 15-20 % of Verify calls, whatever the payload, empty included.
# Counted apart so that internal_or_unknown stays a count of what the servers sent.
CLIENT_CORE_RACE = "Internal error from Core"
