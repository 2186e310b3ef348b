"""Real gRPC servers on loopback for tests: verify and draft services built around given models.

In-process servers (each on its own event-loop thread) keep the suite fast; the CLI tests start real
subprocesses as well.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from draft_service.engine import DraftConfig
from draft_service.server import build_server as build_draft
from specmesh.serving import BackgroundServer
from specmesh.stack import free_port
from specmesh.v1 import draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc
from tests.support.models import ROOT, demo_target, demo_tokenizer, noisy_copy
from verify_service.engine import VerifyConfig
from verify_service.server import build_server as build_verify


def start_verify(model, tokenizer=None, **kw) -> BackgroundServer:
    kw.setdefault("draft_deadline_ms", 5000)  # tests of the deadline set their own
    kw.setdefault("kv_cache_prefault", False)  # a resident 2 GiB pool per in-process service: tests of it set it
    config = VerifyConfig(model_path="(in-memory)", port=0, **kw)
    return BackgroundServer(lambda: build_verify(config, model, tokenizer))


# The draft service dials only the verify replicas it is allowed to: in tests, any on loopback (a test of
# several replicas names others than the draft's default).
LOOPBACK_VERIFY = "127.0.0.1:*"


def start_draft(model, verify_address: str, tokenizer=None, **kw) -> BackgroundServer:
    """`tokenizer`: the draft follows requests' grammars (structured output); without one it drafts unmasked."""
    kw.setdefault("verify_allow", LOOPBACK_VERIFY)
    kw.setdefault("kv_cache_prefault", False)
    # The tests' drafts are mostly noisy copies of their targets, as dear as the target, so the goodput guard
    # would rightly turn speculation off in them; the tests of the speculation machinery need it on. The
    # guard has its own tests (tests/integration/test_services.py).
    kw.setdefault("goodput_guard", False)
    # Likewise the tests of model drafting draft by the model alone; the hybrid has its own tests
    # (tests/integration/test_hybrid_drafting.py), and the stacks the e2e tests launch run it by default.
    kw.setdefault("enable_suffix_decoding", False)
    config = DraftConfig(
        model_path="(in-memory)" if model is not None else "", port=0, verify_address=verify_address, **kw
    )
    return BackgroundServer(lambda: build_draft(config, model, tokenizer=tokenizer))


def learnt(draft: BackgroundServer) -> None:
    """Wait until the draft service has added every finished output to its global suffix trees (a task of its
    own, after the answer)."""
    engine = draft.server.engine
    deadline = time.monotonic() + 10
    while engine._learning and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not engine._learning


def service_metrics(server: BackgroundServer) -> dict:
    """(name, labels) -> value of an in-process service's /metrics."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def random_prompts(n: int, vocab: int, seed: int = 0, longest: int = 15) -> list[list[int]]:
    """n prompts of 3 to `longest` token ids below vocab - 1, the same for the same arguments."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(0, vocab - 1, (int(torch.randint(3, longest + 1, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def verify_stub(server: BackgroundServer):
    return verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(server.address))


def draft_stub(server: BackgroundServer):
    return draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(server.address))


def generate(stub, prompt, params, **kw) -> tuple[list[int], list]:
    """All tokens and all response chunks of one DraftService / VerifyService Generate call (chunks[0] is
    the opened chunk, chunks[-1] the finished one)."""
    req_type = (
        draft_pb2.DraftServiceGenerateRequest
        if isinstance(stub, draft_pb2_grpc.DraftServiceStub)
        else verify_pb2.VerifyServiceGenerateRequest
    )
    chunks = list(stub.Generate(req_type(prompt_ids=prompt, params=params, **kw), timeout=120))
    return [t for c in chunks for t in c.tokens.token_ids], chunks


class GatewayServer:
    """The gateway (REST via uvicorn + gRPC front) on its own event-loop thread, on free loopback ports."""

    def __init__(
        self, verify: list[str], draft: list[str], tokenizer=None, api_keys=(), max_body_bytes=1 << 20, **config
    ):
        import asyncio
        import threading
        import time

        import uvicorn

        from gateway.config import GatewayConfig
        from gateway.core import Gateway
        from gateway.http import create_app
        from gateway.server import build_grpc_server
        from gateway.telemetry import GatewayMetrics

        config.setdefault("health_interval_s", 0.2)
        config.setdefault("model_name", "demo")
        self.config = GatewayConfig(verify=tuple(verify), draft=tuple(draft), **config)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="gateway")
        self.thread.start()

        async def build():
            self.metrics = GatewayMetrics()
            self.gateway = Gateway(self.config, tokenizer, self.metrics.stream)
            self.metrics.watch(self.gateway)
            await self.gateway.start()
            app = create_app(self.gateway, tuple(api_keys), max_body_bytes, self.metrics)
            self.http = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
            self.http_task = asyncio.ensure_future(self.http.serve())
            self.grpc = build_grpc_server(self.gateway, "127.0.0.1", 0, self.metrics)
            self.grpc_address = f"127.0.0.1:{await self.grpc.start()}"

        asyncio.run_coroutine_threadsafe(build(), self.loop).result(60)
        for _ in range(200):
            if self.http.started:
                break
            time.sleep(0.02)

    def openai(self, api_key: str = "unused", **kw):
        """The official openai client on this gateway's REST front, without retries (`kw`: its options)."""
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=api_key, max_retries=0, **kw)

    def call(self, coro):
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self):
        async def down():
            self.http.should_exit = True
            await self.http_task
            await self.grpc.stop(0)
            await self.gateway.close()

        self.call(down())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def save_tiny_checkpoints(base: Path, seed: int = 8) -> tuple[Path, Path]:
    """A tiny target and a noisy-copy draft on disk, with the demo tokenizer (so text and stop strings work)."""
    tok = demo_tokenizer()
    target = demo_target(tok, seed=seed)
    target.save_pretrained(base / "target")
    noisy_copy(target, 0.03).save_pretrained(base / "draft")
    for d in ("target", "draft"):
        tok.save_pretrained(base / d)
    return base / "target", base / "draft"


def spawn(module: str, args: list[str], env: dict) -> tuple[subprocess.Popen, str]:
    if module == "draft_service":
        # The goodput guard off, as in start_draft: these drafts are noisy copies of their targets.
        env = {"SPECMESH_DRAFT_VERIFY_ALLOW": LOOPBACK_VERIFY, "SPECMESH_DRAFT_GOODPUT_GUARD": "false", **env}
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--port", "0", "--metrics-port", "0", "--threads", "1", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (\S+)", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe drained
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError(f"{module} did not start:\n{''.join(lines)}")


@contextmanager
def speculative_gateway(target, tokenizer, draft_tokenizer=None) -> Iterator[GatewayServer]:
    """A verify service on `target`, a draft service on a close copy of it and a gateway in front, stopped
    in reverse order on exit. `draft_tokenizer`: the draft's own (structured output masks drafts with it)."""
    verify = start_verify(target, tokenizer)
    draft = start_draft(noisy_copy(target, 0.03), verify.address, tokenizer=draft_tokenizer)
    gw = GatewayServer([verify.address], [draft.address], tokenizer)
    try:
        yield gw
    finally:
        gw.stop()
        draft.stop()
        verify.stop()


def verify_replica_without(monkeypatch, *fields: str) -> None:
    """Make the in-process verify service answer OpenSession as a replica from before `fields` of
    OpenSessionResponse (the capabilities it advertises) were added: they are left unset."""
    import verify_service.servicer as servicer

    open_session = servicer.VerifyServicer.OpenSession

    async def old_open_session(self, request, context):
        resp = await open_session(self, request, context)
        for name in fields:
            resp.ClearField(name)
        return resp

    monkeypatch.setattr(servicer.VerifyServicer, "OpenSession", old_open_session)
