"""`make run`'s program: the whole local stack with the demo models answers, then stops cleanly on Ctrl-C."""

import json
import signal
import subprocess
import sys
import threading
import urllib.request

from services import ROOT, free_port


def test_stack_answers_and_stops_on_ctrl_c():
    port, grpc_port = free_port(), free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specmesh.stack", "--port", str(port), "--grpc-port",
                             str(grpc_port)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 8 and answer["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0
        assert any("stack stopped" in line for line in lines)
    finally:
        if proc.poll() is None:
            proc.kill()
