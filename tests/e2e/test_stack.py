"""`make run`'s program: the whole local stack with the demo models answers, then stops cleanly on Ctrl-C."""

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request

from specmesh.stack import free_ports
from tests.support.services import ROOT


def readme_block(lang: str, must_contain: str) -> str:
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```" + lang + r"\n(.*?)```", text, re.S)
    return next(b for b in blocks if must_contain in b)


def check_readme_examples(port: int) -> None:
    """The README's curl and openai examples work as pasted (only the port differs)."""
    curl = readme_block("", "curl -s").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    out = subprocess.run(["bash", "-c", curl], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["object"] == "text_completion"
    code = readme_block("python", "from openai import OpenAI").replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "completion_tokens=" in out.stdout and "mean_accepted_length" in out.stdout


def check_readme_grpc_example(grpc_port: int) -> None:
    code = readme_block("python", "GatewayServiceStub").replace("127.0.0.1:50070", f"127.0.0.1:{grpc_port}")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "accepted of" in out.stdout and "completion_tokens" in out.stdout


def test_stack_answers_and_stops_on_ctrl_c():
    port, grpc_port = free_ports(2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "specmesh.stack", "--port", str(port), "--grpc-port", str(grpc_port)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines, up = [], threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C stops the stack" in line:
                up.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert up.wait(240), "".join(lines[-30:])
        body = json.dumps({"model": "demo", "prompt": "import os\n", "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions", body, {"content-type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length"
        check_readme_examples(port)
        check_readme_grpc_example(grpc_port)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert any("stack stopped" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
