"""Real gRPC servers on loopback for tests: verify and draft services built around given models.

In-process servers (each on its own event-loop thread) keep the suite fast; the CLI tests start real
subprocesses as well.
"""

from __future__ import annotations

import grpc

from draft_service.engine import DraftConfig, DraftEngine
from draft_service.server import build_server as build_draft
from specmesh.serving import BackgroundServer
from specmesh.v1 import draft_pb2, draft_pb2_grpc, verify_pb2_grpc
from verify_service.engine import VerifyConfig, VerifyEngine
from verify_service.server import build_server as build_verify


def start_verify(model, tokenizer=None, **kw) -> BackgroundServer:
    kw.setdefault("draft_deadline_ms", 5000)  # tests of the deadline set their own
    config = VerifyConfig(model_path="(in-memory)", port=0, **kw)
    return BackgroundServer(lambda: build_verify(config, VerifyEngine(config, model, tokenizer)))


def start_draft(model, verify_address: str, **kw) -> BackgroundServer:
    config = DraftConfig(model_path="(in-memory)" if model is not None else "", port=0,
                         verify_address=verify_address, **kw)
    return BackgroundServer(lambda: build_draft(config, DraftEngine(config, model)))


def verify_stub(server: BackgroundServer):
    return verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(server.address))


def draft_stub(server: BackgroundServer):
    return draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(server.address))


def generate(stub, prompt, params, **kw) -> tuple[list[int], list]:
    """All tokens and all response chunks of one DraftService / VerifyService Generate call."""
    req_type = draft_pb2.DraftGenerateRequest if isinstance(stub, draft_pb2_grpc.DraftServiceStub) else None
    if req_type is None:
        from specmesh.v1 import verify_pb2

        req_type = verify_pb2.VerifyGenerateRequest
    chunks = list(stub.Generate(req_type(prompt_ids=prompt, params=params, **kw), timeout=120))
    return [t for c in chunks for t in c.token_ids], chunks
