"""`specmesh serve` as a user runs it: a subprocess on free ports that starts three services, answers, and
stops cleanly; set-up mistakes end with one line and a non-zero exit, before any process starts."""

import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specmesh.stack import free_ports, stack_file
from tests.support.services import ROOT, free_port

DEMO = ROOT / "models" / "demo"
SPECMESH = Path(sys.executable).parent / "specmesh"  # the console script pyproject.toml declares


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for a reaper that is not its parent counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and not all(gone(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if not gone(p)]


class Serve:
    """`specmesh serve ...` running, its output collected; `up()` waits for the banner."""

    def __init__(self, *args: str, command=(str(SPECMESH),)):
        self.port, self.grpc_port = free_ports(2)
        self.proc = subprocess.Popen(
            [*command, "serve", "--port", str(self.port), "--grpc-port", str(self.grpc_port), *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if "Ctrl-C stops the stack" in line:
                self.ready.set()

    def up(self, timeout: float = 400) -> dict:
        assert self.ready.wait(timeout), "".join(self.lines[-40:])
        return json.loads(stack_file(self.port).read_text())

    def kill(self):
        """Stop it as a user would (SIGTERM, so that it removes its record), killing it only if it hangs."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        stack_file(self.port).unlink(missing_ok=True)


def completion(port: int, prompt: str = "import os\n", max_tokens: int = 8) -> dict:
    body = json.dumps({"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_serve_answers_and_stops_on_sigterm():
    serve = Serve(
        "--model-path",
        str(DEMO / "target"),
        "--speculative-draft-model-path",
        str(DEMO / "draft"),
        "--served-model-name",
        "demo",
        "--speculative-num-steps",
        "3",
    )
    try:
        record = serve.up()
        pids = [s["pid"] for s in record["services"]]
        assert [s["role"] for s in record["services"]] == ["verify", "draft", "gateway"]
        assert len(set(pids)) == 3 and not any(gone(p) for p in pids)
        with urllib.request.urlopen(f"http://127.0.0.1:{serve.port}/health", timeout=10) as r:
            assert r.status == 200
        answer = completion(serve.port)
        assert answer["usage"]["completion_tokens"] == 8 and answer["specmesh"]["drafts"] > 0
        assert max(len(answer["specmesh"]["acceptance_per_pos"]), 1) <= 3  # --speculative-num-steps reached K
        for s in record["services"]:  # every service's metrics address answers, as printed
            with urllib.request.urlopen(s["metrics_url"], timeout=10) as r:
                assert b"specmesh_requests_total" in r.read() or s["role"] != "gateway"
        banner = "".join(serve.lines)
        assert f"REST at http://127.0.0.1:{serve.port}/v1" in banner and "metrics http://" in banner
        # The verify service's KV: the budget in blocks, and every session the model's whole context.
        assert re.search(r"KV: \d+ blocks of 16 tokens = \d+ tokens; max_model_len 2048", banner), banner
        serve.proc.send_signal(signal.SIGTERM)
        assert serve.proc.wait(90) == 0, "".join(serve.lines[-30:])
        assert wait_gone(pids, 10) == []
        assert not stack_file(serve.port).exists()
        assert "stack stopped" in "".join(serve.lines)
    finally:
        serve.kill()


def test_sigkilled_launcher_leaves_no_orphans():
    """The launcher killed outright (no chance to clean up): its children still go, asked by the kernel."""
    serve = Serve(
        "--model-path",
        str(DEMO / "target"),
        "--speculative-algorithm",
        "NGRAM",  # SGLang's spelling; no draft model to load
        "--served-model-name",
        "demo",
        "--no-first-request",
        command=(sys.executable, "-m", "specmesh"),
    )
    try:
        record = serve.up()
        pids = [s["pid"] for s in record["services"]]
        os.kill(serve.proc.pid, signal.SIGKILL)
        serve.proc.wait(10)
        assert wait_gone(pids, 60) == [], f"orphans left: {pids}"
    finally:
        serve.kill()


def run_serve(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(SPECMESH), "serve", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 2, out.stdout + out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    assert "stack stopped" not in out.stdout  # refused before any process started
    return lines[0]


def test_bad_model_path_is_one_line(tmp_path):
    line = one_line_error(
        run_serve("--model-path", str(tmp_path / "nope"), "--speculative-draft-model-path", str(DEMO / "draft"))
    )
    assert line == f"specmesh serve: error: --model-path {tmp_path / 'nope'}: no such directory"
    line = one_line_error(run_serve("--model-path", str(DEMO / "target"), "--draft-model", str(tmp_path)))
    assert "--speculative-draft-model-path" in line and "no config.json" in line


def test_incompatible_vocabularies_are_refused(tmp_path):
    other = tmp_path / "draft"
    shutil.copytree(DEMO / "draft", other, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((other / "config.json").read_text())
    config["vocab_size"] = 9000
    (other / "config.json").write_text(json.dumps(config))
    line = one_line_error(run_serve("--model-path", str(DEMO / "target"), "--draft-model", str(other)))
    assert "vocabulary (9000 entries" in line and "8192" in line
    # Same size, other ids: the tokenizers are compared too.
    config["vocab_size"] = 8192
    (other / "config.json").write_text(json.dumps(config))
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[300:302]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    line = one_line_error(run_serve("--model-path", str(DEMO / "target"), "--draft-model", str(other)))
    assert "tokenizers of the target" in line and "2 tokens" in line


def test_port_in_use_is_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["--model-path", str(DEMO / "target"), "--draft-model", str(DEMO / "draft")]
        line = one_line_error(run_serve(*args, "--port", str(port), "--grpc-port", str(free_port())))
        assert line == f"specmesh serve: error: --port {port}: 127.0.0.1:{port} is already in use"
        line = one_line_error(run_serve(*args, "--port", str(free_port()), "--grpc-port", str(port)))
        assert f"--grpc-port {port}" in line


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "2"], "--tp-size 2: specmesh runs each model on one device"),
        (["--api-key", "sk-secret"], "--api-key on the command line is visible"),
        (["--speculative-algorithm", "NEXTN"], "NEXTN"),
        (["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "5"], "contradicts"),
        (["--mem-fraction-static", "0.8", "--device", "cpu"], "on the CPU set the KV budget"),
    ],
)
def test_unsupported_sglang_flags_are_refused_with_the_reason(args, message):
    out = run_serve("--model-path", str(DEMO / "target"), "--draft-model", str(DEMO / "draft"), *args)
    assert message in one_line_error(out)
    assert "sk-secret" not in out.stderr


def test_serve_passes_tls_on_to_every_service(tmp_path):
    """`specmesh serve --tls-*`: each service gets the TLS flags under its own names (mTLS and the service key
    between them, HTTPS on the gateway's REST front), and the launcher's own checks go over it."""
    ca = trustme.CA()
    ca.cert_pem.write_to_path(tmp_path / "ca.pem")
    issued = ca.issue_cert("localhost", "127.0.0.1")
    (tmp_path / "cert.pem").write_bytes(b"".join(p.bytes() for p in issued.cert_chain_pems))
    issued.private_key_pem.write_to_path(tmp_path / "cert.key")
    (tmp_path / "service-key").write_text("svc-" + "k" * 24 + "\n")
    cert, key, ca_file = (str(tmp_path / n) for n in ("cert.pem", "cert.key", "ca.pem"))
    serve = Serve(
        "--model-path", str(DEMO / "target"), "--speculative-algorithm", "ngram", "--served-model-name", "demo",
        "--tls-cert", cert, "--tls-key", key, "--tls-ca", ca_file, "--tls-client-auth",
        "--service-key-file", str(tmp_path / "service-key"),
    )  # fmt: skip
    try:
        record = serve.up()
        assert record["url"] == f"https://127.0.0.1:{serve.port}" and "first answer" in "".join(serve.lines)
        for s in record["services"]:
            argv = Path(f"/proc/{s['pid']}/cmdline").read_text().split("\0")
            assert {"--tls-cert", "--tls-key", "--tls-ca", "--service-key-file"} <= set(argv), argv
            assert ("--upstream-tls-cert" in argv) == (s["role"] == "gateway")
            assert ("--tls-client-auth" in argv) == (s["role"] != "gateway")
        context = ssl.create_default_context(cafile=ca_file)
        with urllib.request.urlopen(f"{record['url']}/health", timeout=10, context=context) as r:
            assert r.status == 200
        with pytest.raises(OSError):  # no plain HTTP on the REST port
            urllib.request.urlopen(f"http://127.0.0.1:{serve.port}/health", timeout=10)
        verify = next(s["address"] for s in record["services"] if s["role"] == "verify")
        with pytest.raises(grpc.RpcError):  # nor plaintext gRPC on the internal hops
            stub = health_pb2_grpc.HealthStub(grpc.insecure_channel(verify))
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
    finally:
        serve.kill()
