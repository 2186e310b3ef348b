"""Sessions and their cached prefixes are the caller's own: scoped to its API key and its cache_salt.

The oracle this closes: a second caller naming someone's session_id learnt from `cached_tokens` how much
of a guessed prompt matched the cached one (7 against 5 cached tokens for a right against a wrong
password), and could overwrite or block that conversation.
"""

import grpc
import openai
import pytest

from gateway.server import build_grpc_server
from specmesh.security import KeyRing, Security
from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.models import noisy_copy
from tests.support.services import GatewayServer, start_draft, start_verify

SECRET = "the admin password is hunter2, and the backup code is 7734"
WRONG = "the admin password is letmein, and the backup code is 0000"


@pytest.fixture(scope="module")
def stack(target, tokenizer):
    verify = start_verify(target, tokenizer)
    draft = start_draft(noisy_copy(target, 0.03), verify.address)
    gw = GatewayServer([verify.address], [draft.address], tokenizer, api_keys=("sk-a", "sk-b", "sk-c"))
    yield gw, verify
    gw.stop()
    draft.stop()
    verify.stop()


def cached(c, prompt, session, **extra):
    r = c.completions.create(
        model="demo", prompt=prompt, max_tokens=2, temperature=0, extra_body={"session_id": session, **extra}
    )
    return r.usage.prompt_tokens_details.cached_tokens


def test_another_tenant_neither_sees_nor_touches_a_session(stack):
    gw, verify = stack
    a, b, c = gw.openai("sk-a"), gw.openai("sk-b"), gw.openai("sk-c")
    assert cached(a, SECRET, "conv") == 0
    mine = cached(a, SECRET, "conv")
    assert mine > 0  # the owner reuses its cached prompt: the cache is there to be probed
    # Other tenants, naming the same session: nothing cached, whether the guess is right or wrong
    assert cached(b, SECRET, "conv") == 0
    assert cached(c, WRONG, "conv") == 0
    assert cached(c, WRONG, "conv") > 0  # its own session under that name, which it does reuse
    # ... and the owner's session was neither overwritten nor dropped
    assert cached(a, SECRET, "conv") == mine
    # The client's id never reaches the replicas as it is
    assert verify.server.engine.sessions.peek("conv") is None


def test_another_tenant_cannot_block_a_streaming_session(stack):
    gw, _ = stack
    a, b = gw.openai("sk-a"), gw.openai("sk-b")
    stream = a.completions.create(
        model="demo",
        prompt="def f():",
        max_tokens=300,
        temperature=0,
        stream=True,
        extra_body={"session_id": "busy", "ignore_eos": True},
    )
    try:
        next(iter(stream))  # the owner's stream holds its session
        # Naming the same session is no conflict (it was a 409 once the owner's stream held it for 5 s)
        r = b.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={"session_id": "busy"})
        assert r.choices[0].finish_reason == "length"
    finally:
        stream.close()


def test_a_cache_salt_opts_out_of_sharing(stack):
    gw, _ = stack
    a = gw.openai("sk-a")
    prompt = "import os\nimport sys\n\ndef main(argv):\n"
    assert cached(a, prompt, "salted", cache_salt="s1") == 0
    assert cached(a, prompt, "salted", cache_salt="s1") > 0  # same salt: shared
    assert cached(a, prompt, "salted", cache_salt="s2") == 0  # another salt: not
    assert cached(a, prompt, "salted") == 0  # none: not either
    # The gRPC front salts sessions alike
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(gw.grpc_address))
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=2)

    def grpc_cached(salt):
        request = gateway_pb2.GatewayServiceGenerateRequest(
            prompt=prompt, params=params, session_id="grpc-salted", cache_salt=salt
        )
        return stub.Generate(request).usage.cached_prompt_tokens

    assert grpc_cached("s1") == 0 and grpc_cached("s1") > 0 and grpc_cached("s2") == 0
    with pytest.raises(openai.BadRequestError) as e:
        a.completions.create(model="demo", prompt="x", max_tokens=2, extra_body={"cache_salt": ""})
    assert e.value.body["param"] == "cache_salt"


def test_cached_prompt_blocks_are_shared_only_within_a_tenant_and_salt(stack):
    """The verify service shares a prompt's full KV blocks with any later request whose prompt starts the same,
    sessions or none: within one tenant and cache_salt only, or a hit would tell a caller whether someone
    else had sent a guessed prefix."""
    gw, _ = stack
    a, b = gw.openai("sk-a"), gw.openai("sk-b")
    prompt = [100 + (i * 37) % 1000 for i in range(200)]  # 12 full blocks of 16 tokens, and then some

    def cached(c, **extra):
        r = c.completions.create(model="demo", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra)
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached(a) == 0
    assert cached(a) > 0  # no session named: the hit is the block cache's
    assert cached(b) == 0  # the same prompt, another key
    assert cached(a, cache_salt="s1") == 0  # the same key, another salt
    # Target-only requests go to the verify service with no draft service between: scoped alike
    assert cached(a, num_speculative_tokens=0) > 0
    assert cached(b, cache_salt="s2", num_speculative_tokens=0) == 0


def test_the_grpc_front_scopes_sessions_by_key_too(stack):
    gw, _ = stack

    async def start():
        server = build_grpc_server(gw.gateway, "127.0.0.1", 0, security=Security(keys=KeyRing(["sk-a", "sk-b"])))
        return server, await server.start()

    server, port = gw.call(start())
    try:
        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
        params = common_pb2.SamplingParams(temperature=0.0, max_tokens=2)

        def grpc_cached(key):
            # not SECRET itself: sk-a's blocks of it, cached by the REST test, would serve a new session too
            prompt = "over gRPC: " + SECRET
            request = gateway_pb2.GatewayServiceGenerateRequest(prompt=prompt, params=params, session_id="grpc-conv")
            r = stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),))
            return r.usage.cached_prompt_tokens

        assert grpc_cached("sk-a") == 0 and grpc_cached("sk-a") > 0
        assert grpc_cached("sk-b") == 0  # the same session id, another key: another session
    finally:
        gw.call(server.stop(0))
