"""Failover with real processes: SIGKILL the verify replica serving a stream, then the draft service; the
client's stream completes with nothing lost, nothing repeated, and the greedy output unchanged."""

import signal
import time

import pytest

from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from tests.support.rest import greedy_stream
from tests.support.services import GatewayServer, save_tiny_checkpoints, spawn


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    target, draft = save_tiny_checkpoints(tmp_path_factory.mktemp("failover"), seed=13)
    procs = {}
    try:
        for name in ("verify-a", "verify-b"):
            procs[name] = spawn("verify_service", ["--model-path", str(target)], {})
        procs["draft"] = spawn("draft_service", ["--model-path", str(draft)], {})
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(target)
        gw = GatewayServer(
            [procs["verify-a"][1], procs["verify-b"][1]], [procs["draft"][1]], tok, health_interval_s=0.2
        )
        yield gw, procs, SpeculativeEngine.from_paths(target, device="cpu")
        gw.stop()
    finally:
        for p, _ in procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(10)


def stream_and_kill(client, prompt, max_tokens, kill, session_id=None):
    chunks, killed = [], False
    session = {"session_id": session_id} if session_id else {}
    for c in greedy_stream(client, prompt, max_tokens, ignore_eos=True, **session):
        chunks.append(c)
        if len(chunks) == 4 and not killed:
            kill()
            killed = True
    assert killed
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    return text, chunks[-1]


def test_verify_then_draft_die_mid_stream(cluster):
    gw, procs, engine = cluster
    client = gw.openai()
    prompt = "def handler(event, context):\n"
    ids = engine.tokenizer(prompt, add_special_tokens=False)["input_ids"]
    n = 400
    want = engine.generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), 0).text

    def kill_serving_verify():
        busy = [r.address for r in gw.gateway.verify_pool.replicas.values() if r.inflight > 0]
        assert len(busy) == 1
        name = next(k for k, (_, addr) in procs.items() if addr == busy[0])
        procs[name][0].send_signal(signal.SIGKILL)
        procs["killed"] = procs.pop(name)

    text, last = stream_and_kill(client, prompt, n, kill_serving_verify)
    assert text == want  # no gap, no repeat, the greedy output unchanged
    assert last.usage.completion_tokens == n
    assert last.model_extra["specmesh"]["failovers"] >= 1
    dead = procs["killed"][1]
    assert not gw.gateway.verify_pool.replicas[dead].healthy

    def kill_draft():
        procs["draft"][0].send_signal(signal.SIGKILL)

    # with a session: the retry finds the verify session still held by the dead draft's stream, and waits
    text, last = stream_and_kill(client, prompt, n, kill_draft, session_id="conversation-1")
    assert text == want
    assert last.model_extra["specmesh"]["target_only"]  # no draft replica left: target-only decoding
    # and new requests keep being served, target-only, by the surviving verify replica
    for _ in range(50):
        if not gw.gateway.draft_pool.healthy:
            break
        time.sleep(0.1)
    r = client.completions.create(
        model="demo", prompt=prompt, max_tokens=20, temperature=0, extra_body={"session_id": "conversation-1"}
    )
    assert r.choices[0].text == engine.generate(ids, SamplingParams(temperature=0, max_tokens=20), 0).text
    assert r.model_extra["specmesh"]["target_only"] and r.model_extra["specmesh"]["drafted"] == 0
    assert r.usage.prompt_tokens_details.cached_tokens > 0  # the session's KV survived on its replica
