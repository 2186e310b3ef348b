"""A request message that does not parse is the caller's error on every RPC of the model services: INVALID_ARGUMENT
(grpc alone answers UNKNOWN, as for a server failure), and the server goes on serving."""

import grpc
import pytest

from specmesh.v1 import common_pb2
from tests.support.models import noisy_copy, tiny_model
from tests.support.services import draft_stub, generate, start_draft, start_verify

GARBAGE = b"\xff\xff\xff\xff\x0f\x01"  # a field number past the maximum: not a message of any type
RPCS = {
    "specmesh.v1.VerifyService": {
        "OpenSession": "unary",
        "ReleaseSession": "unary",
        "Info": "unary",
        "Generate": "stream",
        "Verify": "bidi",
    },
    "specmesh.v1.DraftService": {"Generate": "stream", "Info": "unary"},
}


@pytest.fixture(scope="module")
def servers():
    target = tiny_model("llama", vocab=96, seed=5)
    verify = start_verify(target)
    draft = start_draft(noisy_copy(target, 0.03), verify.address)
    yield {"specmesh.v1.VerifyService": verify, "specmesh.v1.DraftService": draft}
    draft.stop()
    verify.stop()


@pytest.mark.parametrize(("service", "method"), [(s, m) for s, ms in RPCS.items() for m in ms])
def test_an_undecodable_request_is_invalid_argument(servers, service, method):
    kind = RPCS[service][method]
    channel = grpc.insecure_channel(servers[service].address)
    name = f"/{service}/{method}"
    with pytest.raises(grpc.RpcError) as e:
        if kind == "unary":
            channel.unary_unary(name)(GARBAGE, timeout=10)
        elif kind == "stream":
            list(channel.unary_stream(name)(GARBAGE, timeout=10))
        else:
            list(channel.stream_stream(name)(iter([GARBAGE]), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert "does not parse" in e.value.details()
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(generate(draft_stub(servers["specmesh.v1.DraftService"]), [1, 2, 3], params)[0]) == 4
