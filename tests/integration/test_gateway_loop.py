"""The gateway's event loop never does heavy work: the largest prompts it takes, over REST and gRPC, are
tokenized on worker threads, so every other stream keeps its pace and /health/live keeps answering.

A prompt's size is capped before it is tokenized (characters, bytes of the request, gRPC's message size);
within the caps, the worst case is a text at the character cap, whose tokenization costs 0.2-0.5 s on the
machines this has run on (it was done on the loop, and froze every stream and the liveness probe for as long).
"""

import asyncio
import http.client
import json
import subprocess
import sys
import threading
import time

import grpc
import pytest
import torch

from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.models import ROOT, demo_target, noisy_copy
from tests.support.services import GatewayServer, start_draft, start_verify

LIMIT_S = 0.100
STREAMS = 2


@pytest.fixture(scope="module")
def stack(tokenizer):
    # The services run in this process, next to the gateway's tokenizer threads: with torch on both cores a
    # tokenizing thread stalls every OpenMP barrier of the forwards, and the streams' gaps measure that CPU
    # contention (a deployment runs the gateway apart), not the event loop this test is about.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target = demo_target(tokenizer, seed=3)
    verify = start_verify(target, tokenizer)
    draft = start_draft(noisy_copy(target, 0.03), verify.address)
    # The default prompt cap (4,096 tokens: 266,240 characters of the demo tokenizer's, whose longest token
    # is 65 characters) and a body cap that fits it
    gw = GatewayServer([verify.address], [draft.address], tokenizer, max_prompt_tokens=4096, max_body_bytes=2 << 20)
    yield gw, tokenizer
    gw.stop()
    draft.stop()
    verify.stop()
    torch.set_num_threads(threads)


async def loop_lag(lags: list[float], done: threading.Event) -> None:
    """How late the gateway's own event loop wakes from 5 ms sleeps: its stalls, seen from inside."""
    while not done.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.005)
        lags.append(time.perf_counter() - t0 - 0.005)


def attempt(gw) -> tuple[float, float, float]:
    """One measurement: (worst stream gap, worst /health/live latency, worst event-loop lag), seconds."""
    # The largest text the character cap admits, of varied words (so tokenizing it is real work): it is
    # tokenized, then refused for its token count.
    words = " ".join(f"w{i % 9973}x{(i * 7) % 101}" for i in range(gw.gateway.max_prompt_chars // 8))
    big = words[: gw.gateway.max_prompt_chars]
    # The streams and the liveness probe run in a client process of their own (tests.support.stream_probe)
    client = subprocess.Popen(
        [sys.executable, "-m", "tests.support.stream_probe", str(gw.port), str(STREAMS)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    done, lags = threading.Event(), []
    lag = asyncio.run_coroutine_threadsafe(loop_lag(lags, done), gw.loop)
    try:
        assert client.stdout.readline().strip() == "ready"
        time.sleep(0.3)  # the streams' pace before
        big_calls = []
        t0 = time.perf_counter()
        conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=60)
        body = json.dumps({"model": "demo", "prompt": big})
        conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
        r = conn.getresponse()
        error = json.loads(r.read())["error"]
        big_calls.append(time.perf_counter() - t0)
        conn.close()
        assert r.status == 400 and "tokens" in error["message"]  # tokenized, then too many tokens
        t0 = time.perf_counter()
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gw.grpc_address))
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=4)
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt=big, params=params), timeout=60)
        big_calls.append(time.perf_counter() - t0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        time.sleep(0.3)  # and after
    finally:
        out, _ = client.communicate(timeout=60)  # closes its stdin: it reports and exits
        done.set()
        lag.result(10)
    figures = json.loads(out)
    gaps, latencies = figures["gaps"], figures["latencies"]
    worst_gap = max(max(g) for g in gaps)
    print(
        f"\n{len(big)}-character prompts took {[round(c, 2) for c in big_calls]} s each; "
        f"worst gap between events of {STREAMS} streams {worst_gap * 1000:.0f} ms "
        f"({sum(map(len, gaps))} gaps), worst /health/live {max(latencies) * 1000:.0f} ms ({len(latencies)} probes), "
        f"worst lag of the gateway's event loop {max(lags) * 1000:.0f} ms"
    )
    # The prompts were real work, so the test could have failed: on the loop, either would stall it past the
    # bound by half again (0.19 s on the fastest machine it has run on, 0.4-0.5 s on slower ones).
    assert min(big_calls) > 1.5 * LIMIT_S
    assert all(len(g) > 10 for g in gaps) and len(latencies) > 10
    return worst_gap, max(latencies), max(lags)


def test_a_maximum_size_prompt_stalls_no_stream_and_no_probe(stack):
    gw, _ = stack
    # The streams' gaps and the probe's latency carry the 2 shared cores' contention (the tokenizer takes one
    # of them for half a second), and the loop's own lag any pause of this whole process (the services and
    # the test suite's garbage live in it too: a fresh-clone CI run once saw a single 364 ms lag while the
    # streams' worst gap was 53 ms and the probe's 27 ms). So a measurement past the bound gets a second
    # one, which must hold. Tokenizing on the loop fails both: it stalls the loop for the whole 0.4-0.5 s.
    gap, latency, lag = attempt(gw)
    if gap >= LIMIT_S or latency >= LIMIT_S or lag >= LIMIT_S:
        gap, latency, lag = attempt(gw)
    assert lag < LIMIT_S
    assert gap < LIMIT_S
    assert latency < LIMIT_S
