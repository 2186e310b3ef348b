"""The local stack on loopback: verify + draft + gateway with the demo models (`make run`).

    python -m specmesh.stack [--port 8000] [--verify-replicas 1] [--smoke]

Starts each service as its own process (as in production, where they are separate deployments), waits
until the gateway reports healthy, sends one request to show the stack answering, and serves until
Ctrl-C / SIGTERM, which stops every process gracefully. `--smoke` exits after that first answer (CI).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from specmesh.placement import add_thread_flags, pipeline_pays, service_threads

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo"


def free_port() -> int:
    """A loopback port free right now, for a process that must be told its port rather than take port 0 (the
    gateway prints the port it was given, not the one it bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    name: str,
    module: str,
    args: list[str],
    pattern: str = r"listening on (\S+)",
    timeout: float = 180,
    ports: dict | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start `python -m module args`, echo its output prefixed with its name, return it and its address."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    found: dict = {}
    ready = threading.Event()

    stdout = proc.stdout
    assert stdout is not None  # stdout=PIPE

    def pump():
        for line in stdout:
            print(f"[{name}] {line}", end="", flush=True)
            m = re.search(pattern, line)
            if m and not ready.is_set():
                found["address"] = m.group(1)
                metrics = re.search(r"metrics port (\d+)", line)
                found["metrics"] = metrics.group(1) if metrics else None
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(timeout) or "address" not in found:
        proc.kill()
        raise RuntimeError(f"{name} did not start (exit code {proc.poll()})")
    if ports is not None and found.get("metrics"):
        ports[name] = found["metrics"]
    return proc, found["address"]


def wait_healthy(url: str, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not become healthy")


def demo_request(base: str, model: str) -> dict:
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):\n", "max_tokens": 48, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1", help="REST address of the gateway")
    ap.add_argument("--port", type=int, default=8000, help="REST port of the gateway")
    ap.add_argument("--grpc-port", type=int, default=50070, help="gRPC port of the gateway (-1 = off)")
    ap.add_argument("--target", default=str(DEMO / "target"), help="target checkpoint (verify service)")
    ap.add_argument("--draft", default=str(DEMO / "draft"), help="draft checkpoint (draft service)")
    ap.add_argument("--verify-replicas", type=int, default=1, help="verify service processes")
    add_thread_flags(ap)
    ap.add_argument("--smoke", action="store_true", help="exit after the first answer")
    args = ap.parse_args(argv)

    procs: list[subprocess.Popen] = []
    stopping = threading.Event()

    def shutdown(*_):
        stopping.set()

    signal.signal(signal.SIGINT, shutdown)
    signal.signal(signal.SIGTERM, shutdown)
    # Any free ports (printed), so several stacks and services can share a machine.
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    n_verify, n_draft = service_threads("verify", args.verify_threads), service_threads("draft", args.draft_threads)
    verify_threads = ["--threads", str(n_verify)]
    draft_threads = ["--threads", str(n_draft), "--pipeline" if pipeline_pays(n_verify, n_draft) else "--no-pipeline"]
    metrics: dict[str, str] = {}
    try:
        verify = []
        for i in range(args.verify_replicas):
            p, addr = start(
                f"verify-{i}", "verify_service", ["--model-path", args.target, *common, *verify_threads], ports=metrics
            )
            procs.append(p)
            verify.append(addr)
        p, draft = start(
            "draft",
            "draft_service",
            # the gateway names the replica of each session: the draft may dial every one of them
            ["--model-path", args.draft, "--verify-address", verify[0], "--verify-allow", ",".join(verify)]
            + [*common, *draft_threads],
            ports=metrics,
        )
        procs.append(p)
        p, _ = start(
            "gateway",
            "gateway",
            [
                "--host",
                args.host,
                "--port",
                str(args.port),
                "--grpc-port",
                str(args.grpc_port),
                "--verify",
                ",".join(verify),
                "--draft",
                draft,
                "--tokenizer-path",
                args.target,
                "--model-name",
                "demo",
            ],
            pattern=r"REST listening on (\S+)",
        )
        procs.append(p)
        base = f"http://{args.host}:{args.port}"
        wait_healthy(base + "/health")
        answer = demo_request(base, "demo")
        text = answer["choices"][0]["text"]
        spec = answer["specmesh"]
        print("\n" + "=" * 78)
        print(
            f'specmesh is up: OpenAI-compatible REST at {base}/v1 (model "demo"), gRPC gateway at '
            f"{args.host}:{args.grpc_port}"
        )
        print(
            f"first answer ({answer['usage']['completion_tokens']} tokens, mean accepted length "
            f"{spec['mean_accepted_length']}):\ndef fibonacci(n):\n{text}"
        )
        print(
            "metrics: "
            + ", ".join([f"{n} http://127.0.0.1:{p}/metrics" for n, p in metrics.items()] + [f"gateway {base}/metrics"])
        )
        print(
            "try:\n  curl -s " + base + "/v1/completions -H 'content-type: application/json' -d "
            '\'{"model": "demo", "prompt": "import os\\n", "max_tokens": 32, "temperature": 0}\''
        )
        print("=" * 78 + "\nCtrl-C stops the stack.", flush=True)
        if args.smoke:
            return 0
        while not stopping.is_set():
            if any(p.poll() is not None for p in procs):
                print("a service exited; stopping the stack", file=sys.stderr)
                return 1
            stopping.wait(0.5)
        return 0
    finally:
        for p in reversed(procs):  # gateway first, then draft, then verify
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
        print("stack stopped", flush=True)


if __name__ == "__main__":
    sys.exit(main())
