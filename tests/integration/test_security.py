"""Authentication and TLS on every hop, against real services on loopback with certificates made here.

- The gateway, launched as users launch it (`python -m gateway`), with its API key in a file, mTLS on both
  fronts and mTLS plus a service key towards the draft and verify services: the key is not on its
  command line; REST and gRPC refuse a client without a certificate, one signed by another CA, and one
  without the key; health stays open; metrics are on their own port.
- The internal services refuse calls without the service key (generate, release a session, read the model
  path) and clients without a certificate; the draft -> verify hop refuses a draft without a certificate,
  with one from another CA, or without the key.
- The draft service dials only the verify replicas it was configured with or allowed.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draft_service.engine import DraftConfig
from draft_service.server import build_server as build_draft
from gateway.config import GatewayConfig
from gateway.core import Gateway
from gateway.http import create_app
from gateway.telemetry import GatewayMetrics
from specmesh.config import EnvArgumentParser
from specmesh.security import AllowList, KeyRing, Security, TLSConfig, keys_from
from specmesh.serving import BackgroundServer
from specmesh.stack import free_port, free_ports
from specmesh.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    verify_pb2,
    verify_pb2_grpc,
)
from tests.support.models import DEMO_TOKENIZER, ROOT, demo_target, noisy_copy
from verify_service.engine import VerifyConfig
from verify_service.server import build_server as build_verify

API_KEY = "sk-" + secrets.token_hex(12)
SERVICE_KEY = "svc-" + secrets.token_hex(12)
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=6)
C = grpc.StatusCode


@dataclass(frozen=True)
class PKI:
    """PEM files: `ca` signs `server` (localhost, 127.0.0.1) and `client`; `rogue_ca` signs `rogue`."""

    dir: Path

    def __getattr__(self, name: str) -> str:
        return str(self.dir / name)

    def read(self, name: str) -> bytes:
        return (self.dir / name).read_bytes()

    def tls(self, cert: str = "server", ca: str = "ca", client_auth: bool = False) -> TLSConfig:
        return TLSConfig(
            str(self.dir / f"{cert}.pem") if cert else "",
            str(self.dir / f"{cert}.key") if cert else "",
            str(self.dir / f"{ca}.pem") if ca else "",
            client_auth,
        )


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    d = tmp_path_factory.mktemp("pki")
    ca, rogue_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(d / "ca.pem")
    rogue_ca.cert_pem.write_to_path(d / "rogue_ca.pem")
    for authority, name, hosts in (
        (ca, "server", ("localhost", "127.0.0.1")),
        (ca, "client", ("specmesh-client",)),
        (rogue_ca, "rogue", ("localhost", "127.0.0.1")),
    ):
        cert = authority.issue_cert(*hosts)
        (d / f"{name}.pem").write_bytes(b"".join(p.bytes() for p in cert.cert_chain_pems))
        cert.private_key_pem.write_to_path(d / f"{name}.key")
    return PKI(d)


@pytest.fixture(scope="module")
def target(tokenizer):
    return demo_target(tokenizer, seed=41)


def _service_security(pki: PKI) -> Security:
    """An internal service's: mTLS with the shared certificate, the service key demanded and presented."""
    return Security(pki.tls(client_auth=True), KeyRing([SERVICE_KEY]), SERVICE_KEY)


def _start_verify(model, tokenizer, security: Security | None) -> BackgroundServer:
    config = VerifyConfig(model_path="(in-memory)", port=0, draft_deadline_ms=5000, kv_cache_prefault=False)
    return BackgroundServer(lambda: build_verify(config, model, tokenizer, security=security))


def _start_draft(model, verify_address: str, server: Security | None, client: Security | None = None, **kw):
    """A draft service whose port has `server` security and whose channels to verify `client` (default the
    same, as the CLI does)."""
    algorithm = {} if model is not None else {"speculative_algorithm": "ngram"}
    config = DraftConfig(
        model_path="(in-memory)" if model is not None else "",
        port=0,
        verify_address=verify_address,
        kv_cache_prefault=False,
        goodput_guard=False,  # its draft is a noisy copy of the target, as dear: the guard would turn it off
        **algorithm,
        **kw,
    )

    async def build():
        built = await build_draft(config, model, security=server)
        if client is not None:
            built.engine.security = client
        return built

    return BackgroundServer(build)


@pytest.fixture(scope="module")
def backend(pki, target, tokenizer):
    """verify and draft with mTLS and the service key on both, the draft dialing verify with them."""
    verify = _start_verify(target, tokenizer, _service_security(pki))
    draft = _start_draft(noisy_copy(target, 0.03), verify.address, _service_security(pki))
    yield verify, draft
    draft.stop()
    verify.stop()


def _channel(address: str, pki: PKI, cert: str | None = "client", ca: str = "ca") -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=pki.read(f"{ca}.pem"),
        private_key=pki.read(f"{cert}.key") if cert else None,
        certificate_chain=pki.read(f"{cert}.pem") if cert else None,
    )
    return grpc.secure_channel(address, creds)


def _code(call) -> grpc.StatusCode:
    try:
        result = call()
        if not hasattr(result, "ListFields"):  # a server stream: read it to its status
            list(result)
    except grpc.RpcError as e:
        return e.code()
    return C.OK


def _health(channel: grpc.Channel) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def _auth(key: str) -> tuple:
    return (("authorization", f"Bearer {key}"),)


# ---------------------------------------------------------------------------------------------------
# keys


def test_keys_come_from_a_file_or_the_environment_and_are_compared_whole(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# rotated weekly\nsk-new\n\n  sk-old  \n")
    keys = keys_from(str(f), "sk-env, sk-new", "--api-key-file")
    assert keys == ("sk-new", "sk-old", "sk-env")
    ring = KeyRing(keys)
    assert ring.accepts("sk-old") and ring.accepts_authorization("Bearer sk-env")
    assert ring.accepts_authorization(b"Bearer  sk-new ")
    # exactly "Bearer <key>": the gateway's tenancy reads the key the same way (bearer_token)
    for wrong in ("sk-ol", "sk-old2", "", "Bearer", "Basic sk-old", "sk-old sk-new", "bearer sk-new", "Bearer sk-ol"):
        assert not ring.accepts_authorization(wrong), wrong
    assert not ring.accepts(None) and not KeyRing().accepts("")
    assert "sk-" not in repr(ring)
    with pytest.raises(ValueError, match=r"--api-key-file .*cannot read"):
        keys_from(str(tmp_path / "missing"), flag="--api-key-file")
    (tmp_path / "empty").write_text("# nothing yet\n")
    with pytest.raises(ValueError, match=r"--service-key-file .*holds no key"):
        keys_from(str(tmp_path / "empty"), flag="--service-key-file")


def test_keys_are_refused_on_the_command_line(monkeypatch, capsys):
    from draft_service.__main__ import parse_args as draft_args
    from gateway.__main__ import parse_args as gateway_args
    from verify_service.__main__ import parse_args as verify_args

    for parse, argv, file_flag, env in (
        (gateway_args, ["--verify", "127.0.0.1:1", "--api-key", API_KEY], "--api-key-file", "SPECMESH_GATEWAY_API_KEY"),
        (gateway_args, ["--verify", "127.0.0.1:1", f"--service-key={SERVICE_KEY}"], "--service-key-file", None),
        (draft_args, ["--speculative-algorithm", "ngram", "--service-key", SERVICE_KEY], "--service-key-file", None),
        (verify_args, ["--model-path", "m", "--service-key", SERVICE_KEY], "--service-key-file", None),
    ):
        with pytest.raises(SystemExit) as exit_:
            parse(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "refused on the command line" in err and file_flag in err, err
        assert env is None or env in err
    # The environment is the other way in, and --help never shows what it holds.
    monkeypatch.setenv("SPECMESH_GATEWAY_API_KEY", f"{API_KEY},sk-second")
    _, args = gateway_args(["--verify", "127.0.0.1:1"])
    assert args.api_keys == (API_KEY, "sk-second") and args.front.keys.accepts(API_KEY)
    ap = EnvArgumentParser(prog="x", env_prefix="SPECMESH_GATEWAY_")
    ap.secret_flag("--api-key", file_flag="--api-key-file", help="keys")
    assert API_KEY not in ap.format_help() and ap.parse_args([]).api_key == f"{API_KEY},sk-second"


def test_tls_flags_are_checked_with_clear_errors(pki, tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        TLSConfig(cert=pki.server + ".pem")
    with pytest.raises(ValueError, match="--tls-client-auth needs --tls-ca"):
        TLSConfig(pki.server + ".pem", pki.server + ".key", client_auth=True)
    with pytest.raises(ValueError, match=r"--upstream-tls-ca .*cannot read"):
        TLSConfig(ca=str(tmp_path / "nope.pem"), flags="--upstream-tls")
    from verify_service.__main__ import main as verify_main

    with pytest.raises(SystemExit, match="verify_service: --tls-cert and --tls-key go together"):
        verify_main(["--model-path", "m", "--tls-cert", str(tmp_path / "nope.pem")])  # before loading anything


# ---------------------------------------------------------------------------------------------------
# REST policy: which routes need the key (the app alone, called in-process)


def _asgi_get(app, path: str, key: str | None = None, *more_keys: str) -> tuple[int, bytes]:
    headers = [(b"authorization", f"Bearer {k}".encode()) for k in (key, *more_keys) if k]
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": headers,
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_rest_routes_need_the_key_but_those_left_open():
    gateway = Gateway(GatewayConfig(verify=("127.0.0.1:1",), model_name="demo"))

    def app(**kw):
        return create_app(gateway, (API_KEY,), metrics=GatewayMetrics(), **kw)

    default = app()
    for path in ("/metrics", "/openapi.json", "/v1/models", "/no/such/route"):
        status, body = _asgi_get(default, path)
        assert status == 401, (path, status)
        error = json.loads(body)["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "authentication_error", body
        assert _asgi_get(default, path, "sk-wrong")[0] == 401
    assert _asgi_get(default, "/metrics", API_KEY)[0] == 200
    assert _asgi_get(default, "/metrics", API_KEY, "sk-someone-else")[0] == 401  # two keys: refused
    assert _asgi_get(default, "/v1/models", API_KEY)[0] == 200
    assert _asgi_get(default, "/health")[0] == 200 and _asgi_get(default, "/health/live")[0] == 200

    assert _asgi_get(app(open_metrics=True), "/metrics")[0] == 200
    closed = app(open_health=False)
    assert _asgi_get(closed, "/health")[0] == 401 and _asgi_get(closed, "/health/live", API_KEY)[0] == 200
    assert _asgi_get(app(metrics_route=False), "/metrics", API_KEY)[0] == 404  # served on a port of its own
    open_app = create_app(gateway, (), metrics=GatewayMetrics())  # no keys: as before, nothing to present
    assert _asgi_get(open_app, "/metrics")[0] == 200 and _asgi_get(open_app, "/v1/models")[0] == 200


# ---------------------------------------------------------------------------------------------------
# internal services: the service key and mTLS


def test_verify_and_draft_need_the_service_key(backend, pki):
    verify, draft = backend
    vch, dch = _channel(verify.address, pki), _channel(draft.address, pki)
    vstub, dstub = verify_pb2_grpc.VerifyServiceStub(vch), draft_pb2_grpc.DraftServiceStub(dch)
    attacks = {
        "verify Info (the model path)": lambda md: vstub.Info(verify_pb2.VerifyServiceInfoRequest(), metadata=md),
        "verify ReleaseSession": lambda md: vstub.ReleaseSession(
            verify_pb2.ReleaseSessionRequest(session_id="someone-else"), metadata=md
        ),
        "verify OpenSession": lambda md: vstub.OpenSession(
            verify_pb2.OpenSessionRequest(session_id="s", prompt_ids=[1, 2, 3], params=GREEDY), metadata=md
        ),
        "verify Generate": lambda md: vstub.Generate(
            verify_pb2.VerifyServiceGenerateRequest(prompt_ids=[1, 2, 3], params=GREEDY), metadata=md
        ),
        "draft Generate": lambda md: dstub.Generate(
            draft_pb2.DraftServiceGenerateRequest(prompt_ids=[1, 2, 3], params=GREEDY), metadata=md
        ),
        "draft Info": lambda md: dstub.Info(draft_pb2.DraftServiceInfoRequest(), metadata=md),
    }
    for name, call in attacks.items():
        assert _code(lambda call=call: call(())) == C.UNAUTHENTICATED, name
        assert _code(lambda call=call: call(_auth("svc-wrong"))) == C.UNAUTHENTICATED, name
    assert _health(vch) == "SERVING" and _health(dch) == "SERVING"  # probes need no key
    info = vstub.Info(verify_pb2.VerifyServiceInfoRequest(), metadata=_auth(SERVICE_KEY), timeout=30)
    assert info.vocab_size > 0
    # The draft reaches verify over mTLS with the key: a whole speculative generation.
    chunks = list(
        dstub.Generate(
            draft_pb2.DraftServiceGenerateRequest(prompt_ids=[5, 6, 7], params=GREEDY),
            metadata=_auth(SERVICE_KEY),
            timeout=120,
        )
    )
    assert sum(len(c.tokens.token_ids) for c in chunks) == GREEDY.max_tokens and chunks[-1].HasField("finished")


def test_internal_ports_refuse_clients_without_the_right_certificate(backend, pki):
    verify, draft = backend
    for address in (verify.address, draft.address):
        for cert, ca in ((None, "ca"), ("rogue", "ca"), ("client", "rogue_ca")):
            ch = _channel(address, pki, cert, ca)
            assert _code(lambda ch=ch: _health(ch)) == C.UNAVAILABLE, (address, cert, ca)
            ch.close()
        plain = grpc.insecure_channel(address)
        assert _code(lambda plain=plain: _health(plain)) == C.UNAVAILABLE
        plain.close()


def test_healthcheck_probes_a_service_with_mtls(backend, pki, tmp_path):
    from specmesh import healthcheck

    verify, _ = backend
    assert healthcheck.check(verify.address, "specmesh.v1.VerifyService", 10, pki.tls(cert="client"))[0]
    assert not healthcheck.check(verify.address, "", 10, pki.tls(cert=""))[0]  # no certificate
    assert not healthcheck.check(verify.address, "", 10)[0]  # plaintext
    env = {"SPECMESH_VERIFY_TLS_CERT": pki.server + ".pem", "SPECMESH_VERIFY_TLS_KEY": pki.server + ".key"}
    env["SPECMESH_VERIFY_TLS_CA"] = pki.ca + ".pem"
    tls = healthcheck.tls_from_env("SPECMESH_VERIFY_", env)  # what --auto probes a container's service with
    assert tls is not None and healthcheck.check(verify.address, "", 10, tls)[0]


def test_draft_to_verify_hop_needs_certificate_and_key(backend, pki):
    verify, _ = backend
    cases = {
        "no client certificate": (Security(pki.tls(cert="")), C.UNAVAILABLE),
        "a certificate of another CA": (Security(pki.tls(cert="rogue")), C.UNAVAILABLE),
        "a server of another CA": (Security(pki.tls(ca="rogue_ca"), key=SERVICE_KEY), C.UNAVAILABLE),
        "no service key": (Security(pki.tls()), C.UNAUTHENTICATED),
        "certificate and key": (Security(pki.tls(), key=SERVICE_KEY), C.OK),
    }
    for name, (client, expect) in cases.items():
        draft = _start_draft(None, verify.address, None, client)  # an n-gram draft, open and plaintext itself
        try:
            stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(draft.address))
            request = draft_pb2.DraftServiceGenerateRequest(prompt_ids=[5, 6, 5, 6, 5], params=GREEDY)
            assert _code(lambda stub=stub, request=request: stub.Generate(request, timeout=60)) == expect, name
        finally:
            draft.stop()


# ---------------------------------------------------------------------------------------------------
# the draft dials only what it may


def test_draft_dials_only_configured_or_allowed_verify_replicas(target, tokenizer):
    verify = _start_verify(target, tokenizer, None)
    strict = _start_draft(None, verify.address, None)
    lenient = _start_draft(None, verify.address, None, verify_allow="127.0.0.1:*")
    nothing_there = f"127.0.0.1:{free_port()}"
    port = verify.address.rsplit(":", 1)[1]
    try:
        s_stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(strict.address))
        l_stub = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(lenient.address))

        def gen(stub, address):
            req = draft_pb2.DraftServiceGenerateRequest(prompt_ids=[5, 6, 5], params=GREEDY, verify_address=address)
            return lambda: stub.Generate(req, timeout=60)

        for address in (nothing_there, f"localhost:{port}", "unix:/tmp/specmesh.sock", "dns:///example.com:443"):
            with pytest.raises(grpc.RpcError) as err:
                list(gen(s_stub, address)())
            assert err.value.code() == C.PERMISSION_DENIED, address
            assert "--verify-allow" in err.value.details() and "may dial" in err.value.details()
        assert _code(gen(s_stub, verify.address)) == C.OK  # the replica it was configured with
        assert _code(gen(s_stub, "")) == C.OK  # the default, that replica
        assert _code(gen(l_stub, nothing_there)) == C.UNAVAILABLE  # allowed: dialed, nobody answers
        assert _code(gen(l_stub, "dns:///example.com:443")) == C.PERMISSION_DENIED
    finally:
        lenient.stop()
        strict.stop()
        verify.stop()
    with pytest.raises(ValueError, match="--verify-allow"):
        DraftConfig(speculative_algorithm="ngram", verify_allow="10.0.0.0/40:50061")


def test_allow_list_entries():
    allow = AllowList.parse("10.0.0.0/8:50061,*.verify.svc:50061,[fd00::/8]:*,localhost:7000", ["verify:50061"])

    def permits(address: str) -> bool:
        return asyncio.run(allow.permits(address))

    assert permits("10.1.2.3:50061") and not permits("10.1.2.3:50062") and not permits("11.0.0.1:50061")
    assert permits("a.verify.svc:50061") and not permits("a.verify.svc.attacker.example:50061")
    assert permits("[fd00::5]:9") and not permits("[fe80::1]:9")
    assert permits("verify:50061") and permits("localhost:7000") and permits("127.0.0.1:7000")  # DNS names
    assert not permits("127.0.0.1:7001") and not permits("10.1.2.3:*") and not permits("10.1.2.3")
    for bad in ("verify", "verify:0", "verify:x", "::1:5", "a b:1", "10.0.0.0/33:1"):
        with pytest.raises(ValueError, match="--verify-allow"):
            AllowList.parse(bad)


# ---------------------------------------------------------------------------------------------------
# the gateway as users launch it


@pytest.fixture(scope="module")
def gateway_cli(pki, backend, tmp_path_factory):
    """`python -m gateway`: API key in a file, mTLS on both fronts, metrics on their own port, mTLS and the
    service key towards the replicas."""
    verify, draft = backend
    d = tmp_path_factory.mktemp("keys")
    (d / "api-keys").write_text(f"{API_KEY}\n")
    (d / "service-key").write_text(f"{SERVICE_KEY}\n")
    for f in d.iterdir():
        f.chmod(0o600)
    ports = dict(zip(("rest", "grpc", "metrics"), free_ports(3), strict=True))
    tls = ["--tls-cert", pki.server + ".pem", "--tls-key", pki.server + ".key", "--tls-ca", pki.ca + ".pem"]
    upstream = [f"--upstream-{flag[2:]}" if flag.startswith("--") else flag for flag in tls]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway",
            "--port",
            str(ports["rest"]),
            "--grpc-port",
            str(ports["grpc"]),
            "--metrics-port",
            str(ports["metrics"]),
            "--verify",
            verify.address,
            "--draft",
            draft.address,
            "--tokenizer-path",
            str(DEMO_TOKENIZER),
            "--model-name",
            "demo",
            "--health-interval-s",
            "0.2",
            "--api-key-file",
            str(d / "api-keys"),
            "--service-key-file",
            str(d / "service-key"),
            *tls,
            "--tls-client-auth",
            *upstream,
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SPECMESH_")},
    )
    base = f"https://127.0.0.1:{ports['rest']}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if _https(base + "/health", _context(pki))[0] == 200:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not become healthy:\n{proc.stdout.read() if proc.stdout else ''}")
            time.sleep(0.2)
        yield proc, base, f"127.0.0.1:{ports['grpc']}", ports["metrics"]
    finally:
        proc.kill()  # its graceful drain is tested elsewhere
        proc.wait(20)


def _context(pki: PKI, cert: str | None = "client", ca: str = "ca") -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=pki.dir / f"{ca}.pem")
    if cert:
        ctx.load_cert_chain(pki.dir / f"{cert}.pem", pki.dir / f"{cert}.key")
    return ctx


def _https(url: str, ctx: ssl.SSLContext | None, key: str | None = None, body: dict | None = None):
    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method="POST" if data else "GET")
    try:
        with urllib.request.urlopen(req, timeout=60, context=ctx) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_gateway_key_is_not_on_its_command_line(gateway_cli):
    proc = gateway_cli[0]
    cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
    assert b"--api-key-file" in cmdline
    assert API_KEY.encode() not in cmdline and SERVICE_KEY.encode() not in cmdline


def test_gateway_rest_needs_a_client_certificate_and_the_key(gateway_cli, pki):
    _, base, _, metrics_port = gateway_cli
    completion = {"model": "demo", "prompt": "def f(x):", "max_tokens": 6, "temperature": 0}
    for cert, ca in ((None, "ca"), ("rogue", "ca"), ("client", "rogue_ca")):
        with pytest.raises((ssl.SSLError, ConnectionError, urllib.error.URLError)):
            _https(base + "/v1/completions", _context(pki, cert, ca), API_KEY, completion)
    ctx = _context(pki)
    for key in (None, "sk-wrong"):
        status, body = _https(base + "/v1/completions", ctx, key, completion)
        assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body
        assert _https(base + "/openapi.json", ctx, key)[0] == 401
        assert _https(base + "/metrics", ctx, key)[0] == 401
    assert _https(base + "/health", ctx)[0] == 200 and _https(base + "/health/live", ctx)[0] == 200
    status, body = _https(base + "/v1/completions", ctx, API_KEY, completion)
    assert status == 200, body
    answer = json.loads(body)
    assert answer["usage"]["completion_tokens"] == 6 and answer["choices"][0]["text"]
    assert answer["specmesh"]["target_only"] is False  # through the draft: the mTLS hops with the service key
    assert _https(base + "/metrics", ctx, API_KEY)[0] == 404  # not on the REST port: on its own
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
        assert r.status == 200 and b"specmesh" in r.read()


def test_gateway_grpc_needs_a_client_certificate_and_the_key(gateway_cli, pki):
    address = gateway_cli[2]
    request = gateway_pb2.GatewayServiceGenerateRequest(prompt_ids=[5, 6, 7], params=GREEDY)
    stream_request = gateway_pb2.GatewayServiceGenerateStreamRequest(prompt_ids=[5, 6, 7], params=GREEDY)
    for cert, ca in ((None, "ca"), ("rogue", "ca"), ("client", "rogue_ca")):
        ch = _channel(address, pki, cert, ca)
        stub = gateway_pb2_grpc.GatewayServiceStub(ch)
        assert _code(lambda stub=stub: stub.Generate(request, metadata=_auth(API_KEY), timeout=30)) == C.UNAVAILABLE
        ch.close()
    ch = _channel(address, pki)
    stub = gateway_pb2_grpc.GatewayServiceStub(ch)
    twice = (*_auth(API_KEY), *_auth("sk-someone-else"))  # which would a later reader of the metadata take?
    for md in ((), _auth("sk-wrong"), (("authorization", API_KEY),), twice):
        assert _code(lambda md=md: stub.Generate(request, metadata=md, timeout=30)) == C.UNAUTHENTICATED
        assert _code(lambda md=md: stub.GenerateStream(stream_request, metadata=md, timeout=30)) == C.UNAUTHENTICATED
    assert _health(ch) == "SERVING"
    reply = stub.Generate(request, metadata=_auth(API_KEY), timeout=120)
    assert len(reply.token_ids) == GREEDY.max_tokens and not reply.target_only
    chunks = list(stub.GenerateStream(stream_request, metadata=_auth(API_KEY), timeout=120))
    assert chunks[-1].HasField("finished")
    ch.close()
