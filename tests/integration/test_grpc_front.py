"""The gateway's gRPC front through the typed client (specmesh_client): chat messages through the chat
template, the session id in every response, errors; health List and reflection v1 / v1alpha on a real
server."""

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2
from specmesh_client import SpecmeshClient

MESSAGES = [{"role": "developer", "content": "You write Python."}, {"role": "user", "content": "A loop, please."}]


@pytest.fixture(scope="module")
def client(demo_stack):
    with SpecmeshClient(demo_stack.grpc_address, model="demo") as c:
        yield c


def test_chat_messages_use_the_chat_template_like_rest(demo_stack, client, greedy):
    # "developer" is taken as "system", as the REST chat route does
    ids = demo_stack.gateway.chat_prompt([{"role": "system", "content": "You write Python."}, MESSAGES[1]])
    want = greedy(ids, 16)
    r = client.generate(messages=MESSAGES, max_tokens=16, temperature=0, session_id="chat-1")
    assert r.text == want.text and list(r.token_ids) == list(want.token_ids)
    assert r.finish_reason == "length" and r.session_id == "chat-1"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 16
    assert r.stats.drafted > 0 and 0 <= r.stats.acceptance_rate <= 1

    chunks = list(client.generate_stream(messages=MESSAGES, max_tokens=16, temperature=0, session_id="chat-1"))
    assert "".join(c.text for c in chunks) == want.text
    assert [c.finished for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert all(c.session_id == "chat-1" for c in chunks) and chunks[-1].finish_reason == "length"
    # the second turn of the session reuses its KV cache
    assert chunks[-1].usage.cached_prompt_tokens > 0


def test_session_id_is_empty_without_a_session(client):
    r = client.generate("import os\n", max_tokens=4, temperature=0)
    assert r.session_id == "" and len(r.token_ids) == 4
    last = list(client.generate_stream(prompt_ids=r.token_ids, max_tokens=4, temperature=0))[-1]
    assert last.session_id == "" and last.finish_reason == "length"


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(prompt="x", messages=[{"role": "user", "content": "x"}]), "exactly one"),
        (dict(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (dict(messages=[{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}]), "messages[1].role"),
    ],
)
def test_bad_chat_requests_are_invalid_argument(demo_stack, kwargs, words):
    raw = SpecmeshClient(demo_stack.grpc_address)
    if "prompt" in kwargs:  # the typed client refuses this itself; the raw request reaches the gateway
        from specmesh.v1 import gateway_pb2, gateway_pb2_grpc

        stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(demo_stack.grpc_address))
        request = gateway_pb2.GatewayServiceGenerateRequest(prompt="x")
        request.messages.add(role="user", content="x")
        with pytest.raises(grpc.RpcError) as e:
            stub.Generate(request, timeout=30)
        with pytest.raises(ValueError):
            raw.generate(**kwargs)
    else:
        with pytest.raises(grpc.RpcError) as e:
            raw.generate(**kwargs, max_tokens=2)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()


def test_health_list(demo_stack):
    stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(demo_stack.grpc_address))
    statuses = stub.List(health_pb2.HealthListRequest(), timeout=10).statuses
    serving = health_pb2.HealthCheckResponse.SERVING
    assert statuses[""].status == serving and statuses["specmesh.v1.GatewayService"].status == serving


def _reflect(channel, version: str, **request) -> reflection_pb2.ServerReflectionResponse:
    """One ServerReflectionInfo exchange on `grpc.reflection.<version>.ServerReflection`, raw bytes on the
    wire (v1 and v1alpha share every field number), so each version's own method path is what is tested."""
    call = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    (reply,) = list(call(iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=10))
    return reply


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_v1_and_v1alpha(demo_stack, version):
    channel = grpc.insecure_channel(demo_stack.grpc_address)
    names = {s.name for s in _reflect(channel, version, list_services="").list_services_response.service}
    assert {
        "specmesh.v1.GatewayService",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    for symbol, file_name in (
        ("specmesh.v1.GatewayService", "specmesh/v1/gateway.proto"),
        ("grpc.reflection.v1.ServerReflection", "grpc/reflection/v1/reflection.proto"),
    ):
        reply = _reflect(channel, version, file_containing_symbol=symbol)
        blobs = reply.file_descriptor_response.file_descriptor_proto
        files = [descriptor_pb2.FileDescriptorProto.FromString(b) for b in blobs]
        assert file_name in {f.name for f in files}, (symbol, reply)
    v1 = next(f for f in files if f.name == "grpc/reflection/v1/reflection.proto")
    method = v1.service[0].method[0]
    assert v1.package == "grpc.reflection.v1" and method.input_type == ".grpc.reflection.v1.ServerReflectionRequest"
