"""The processes of a chaos run: verify replicas, a draft service and a gateway, each on a fixed loopback
port (so a restarted process comes back at the address the others know), its output in a log file."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Service:
    """One `python -m <module>` process on a fixed port; `start()` again after a kill restarts it there."""

    def __init__(self, name: str, module: str, args: list[str], log_dir: Path, ready: str = "listening on"):
        self.name, self.module, self.args, self.ready = name, module, args, ready
        self.port = free_port()
        self.log = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def launch(self) -> None:
        self.starts += 1
        out = self.log.open("a")
        out.write(f"--- start {self.starts} ---\n")
        out.flush()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, "--host", "127.0.0.1", "--port", str(self.port), *self.args],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def wait_ready(self, timeout: float = 300) -> float:
        """Seconds until the process printed its ready line (since now)."""
        t0 = time.monotonic()
        marker = f"--- start {self.starts} ---"
        while time.monotonic() - t0 < timeout:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log}")
            text = self.log.read_text(errors="replace")
            if self.ready in text[text.rfind(marker) :]:
                return time.monotonic() - t0
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; see {self.log}")

    def start(self, timeout: float = 300) -> float:
        self.launch()
        return self.wait_ready(timeout)

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def kill(self) -> None:
        self.signal(signal.SIGCONT)  # a stopped process must be able to die
        self.signal(signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(10)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss_mb(self) -> float | None:
        if not self.alive():
            return None
        assert self.proc is not None
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self, grace: float = 20) -> float | None:
        """SIGTERM and wait: the seconds it took to exit (None if it had to be killed)."""
        if not self.alive():
            return None
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
            return time.monotonic() - t0
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            return None


class Cluster:
    """`verify` replicas (one optionally reached through a fault proxy), one draft service, one gateway."""

    def __init__(self, target: Path, draft: Path, log_dir: Path, verify: int = 2, proxy=None, gateway_args=()):
        log_dir.mkdir(parents=True, exist_ok=True)
        common = ["--metrics-port", "-1", "--threads", "1", "--grace-period-s", "10", "--log-level", "WARNING"]
        self.verify = [
            Service(f"verify-{i}", "verify_service", ["--model-path", str(target), *common], log_dir)
            for i in range(verify)
        ]
        self.proxy = proxy  # a FaultProxy class: the first verify replica is dialled through one
        self.faults = None
        # every verify replica (and the proxy in front of one) is on loopback
        allow = ["--verify-allow", "127.0.0.1:*"]
        self.draft = Service(
            "draft", "draft_service", ["--model-path", str(draft), "--no-pipeline", *allow, *common], log_dir
        )
        self.grpc_port = free_port()
        self.gateway_args = list(gateway_args)
        self.target = target
        self.log_dir = log_dir
        self.gateway: Service | None = None

    def verify_addresses(self) -> list[str]:
        addrs = [v.address for v in self.verify]
        if self.faults is not None:
            addrs[0] = self.faults.address
        return addrs

    def start(self) -> None:
        for s in (*self.verify, self.draft):
            s.launch()
        for s in (*self.verify, self.draft):
            s.wait_ready()
        if self.proxy is not None:
            self.faults = self.proxy(self.verify[0].address)
            self.faults.start()
        self.gateway = Service(
            "gateway",
            "gateway",
            [
                "--grpc-port",
                str(self.grpc_port),
                "--verify",
                ",".join(self.verify_addresses()),
                "--draft",
                self.draft.address,
                "--tokenizer-path",
                str(self.target),
                "--model-name",
                "demo",
                "--health-interval-s",
                "0.5",
                "--max-concurrency",
                "48",
                "--max-queue",
                "512",
                "--log-level",
                "WARNING",
                *self.gateway_args,
            ],
            self.log_dir,
            ready="REST listening on",
        )
        self.gateway.start()

    @property
    def services(self) -> list[Service]:
        return [*self.verify, self.draft, *([self.gateway] if self.gateway else [])]

    def close(self) -> None:
        for s in reversed(self.services):
            if s.alive():
                s.kill()
        if self.faults is not None:
            self.faults.stop()
