"""The launcher behind `specmesh serve` and `make run`: verify, draft and gateway as separate processes.

    specmesh serve --model-path T --speculative-draft-model-path D [--port 8000 ...]   (specmesh.cli parses)
    python -m specmesh.stack [--port 8000] [--smoke]                                    (the demo pair)

Each service runs as its own process, as in production where they are separate deployments. Before
anything starts, the set-up is checked (model directories, target and draft vocabularies, the REST and
gRPC ports), so a mistake ends with one line and a non-zero exit. Then the verify replicas start, the
draft replicas (each pointed at a verify replica), the gateway; the launcher waits until the gateway
reports every replica healthy, sends one request to show the stack answering and prints the endpoints.

Stopping: Ctrl-C or SIGTERM stops the gateway first, then the drafts, then the verify replicas (each
drains gracefully), and whatever is left of their process group is killed. The children share one process
group of their own and each asks the kernel (PR_SET_PDEATHSIG) for SIGTERM should the launcher die, so
not even a SIGKILLed launcher leaves orphans behind.

While it serves, the launcher records the stack (endpoints, metrics addresses, process ids, the set-up) in
`stack_file(port)`, where `specmesh profile` finds the services' metrics.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specmesh.placement import cores, pipeline_pays, service_threads, speculation_batch_limit

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo"
PR_SET_PDEATHSIG = 1


class LaunchError(Exception):
    """A set-up the stack cannot run with: its message is the one line the user sees."""


class _Stop(BaseException):
    """Raised in the main thread by SIGINT / SIGTERM: unwinds whatever the launcher was waiting for."""


def free_port() -> int:
    """A loopback port free right now, for a process that must be told its port rather than take port 0 (the
    gateway prints the port it was given, not the one it bound)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on host:port now. SO_REUSEADDR as uvicorn and gRPC set it, so a port
    left in TIME_WAIT by a stack just stopped counts as free, as it is for them."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def stack_file(port: int) -> Path:
    """Where a running `specmesh serve` with REST on `port` records itself (read by `specmesh profile`)."""
    return Path(tempfile.gettempdir()) / f"specmesh-serve-{port}.json"


# --- the set-up -------------------------------------------------------------------------------------------
@dataclass
class StackPlan:
    """Everything the launcher starts, decided before any process runs (specmesh.cli builds it)."""

    target: str
    draft: str | None  # None: the n-gram drafter (no draft model)
    algorithm: str = "standalone"  # "standalone" | "ngram"
    num_steps: int | None = None  # the draft's K (None: the draft service's default)
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50070
    verify_replicas: int = 1
    draft_replicas: int = 1
    device: str | None = None
    draft_device: str | None = None
    model_name: str = ""
    api_keys: str = ""  # comma-separated; given to the gateway in its environment, never on a command line
    verify_args: list[str] = field(default_factory=list)
    draft_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    verify_threads: int = 0
    draft_threads: int = 0
    first_request: bool = True
    smoke: bool = False
    startup_timeout_s: float = 600.0

    def public(self) -> dict:
        """The plan as recorded in the stack file and shown to the profiler (no keys)."""
        d = asdict(self)
        d["api_keys"] = bool(self.api_keys)
        return d


def check_model_dir(flag: str, path: str) -> dict:
    """A local HF checkpoint's config.json, or a LaunchError naming the flag and what is wrong."""
    p = Path(path)
    if not p.exists():
        raise LaunchError(f"{flag} {path}: no such directory")
    if not p.is_dir():
        raise LaunchError(f"{flag} {path}: not a directory (a local Hugging Face checkpoint directory is expected)")
    config = p / "config.json"
    if not config.is_file():
        raise LaunchError(f"{flag} {path}: no config.json there (not a Hugging Face checkpoint directory)")
    try:
        return json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise LaunchError(f"{flag} {path}: config.json is unreadable ({e})") from None


def _config_vocab(config: dict) -> int | None:
    size = config.get("vocab_size")
    if size is None and isinstance(config.get("text_config"), dict):
        size = config["text_config"].get("vocab_size")
    return int(size) if size is not None else None


def _tokenizer_vocab(path: str) -> dict[str, int] | None:
    """The checkpoint's token -> id map (tokenizer.json when there is one: fast, no model code), or None."""
    file = Path(path) / "tokenizer.json"
    try:
        if file.is_file():
            from tokenizers import Tokenizer

            return Tokenizer.from_file(str(file)).get_vocab(with_added_tokens=True)
        if not any((Path(path) / n).exists() for n in ("tokenizer_config.json", "tokenizer.model", "vocab.json")):
            return None
        from transformers import AutoTokenizer

        return dict(AutoTokenizer.from_pretrained(path).get_vocab())
    except Exception as e:  # noqa: BLE001 - any loader failure is a set-up error shown in one line
        raise LaunchError(f"the tokenizer in {path} does not load: {type(e).__name__}: {e}") from None


def check_vocabularies(target: str, target_config: dict, draft: str, draft_config: dict) -> None:
    """Target and draft must number tokens alike: the draft service refuses a verify replica whose vocabulary
    size differs from its own, and the same size with other ids would only show as near-zero acceptance."""
    tv, dv = _config_vocab(target_config), _config_vocab(draft_config)
    if tv is not None and dv is not None and tv != dv:
        raise LaunchError(
            f"the draft's vocabulary ({dv} entries, {draft}) differs from the target's ({tv}, {target}): "
            "speculative decoding needs a draft with the target's tokenizer"
        )
    t_tok, d_tok = _tokenizer_vocab(target), _tokenizer_vocab(draft)
    if t_tok is not None and d_tok is not None and t_tok != d_tok:
        differ = sum(1 for tok, i in t_tok.items() if d_tok.get(tok) != i) + len(set(d_tok) - set(t_tok))
        raise LaunchError(
            f"the tokenizers of the target ({target}) and the draft ({draft}) differ ({differ} tokens with other "
            "ids or missing): speculative decoding needs a draft with the target's tokenizer"
        )


def preflight(plan: StackPlan) -> None:
    """Every check that needs no process: paths, vocabularies, ports."""
    target_config = check_model_dir("--model-path", plan.target)
    if plan.algorithm == "ngram":
        if plan.draft:
            raise LaunchError("--speculative-algorithm ngram drafts from the prompt: give no draft model")
    else:
        if not plan.draft:
            raise LaunchError("a draft is needed: --speculative-draft-model-path DIR, or --speculative-algorithm ngram")
        draft_config = check_model_dir("--speculative-draft-model-path", plan.draft)
        check_vocabularies(plan.target, target_config, plan.draft, draft_config)
    if plan.verify_replicas < 1 or plan.draft_replicas < 1:
        raise LaunchError("--verify-replicas and --draft-replicas must be at least 1")
    ports = [("--port", plan.port)] + ([("--grpc-port", plan.grpc_port)] if plan.grpc_port >= 0 else [])
    if plan.grpc_port == plan.port:
        raise LaunchError(f"--port and --grpc-port are both {plan.port}")
    for flag, port in ports:
        if not 0 < port < 65536:
            raise LaunchError(f"{flag} {port}: not a port number")
        if port_in_use(plan.host, port):
            raise LaunchError(f"{flag} {port}: {plan.host}:{port} is already in use")


# --- processes --------------------------------------------------------------------------------------------
def _die_with_parent(parent: int):
    """A preexec_fn: SIGTERM this child when the launcher dies, however it dies (even SIGKILL). Resolved in the
    parent, so the child only makes the one system call between fork and exec."""
    libc_name = ctypes.util.find_library("c")
    prctl = ctypes.CDLL(libc_name, use_errno=True).prctl if libc_name and sys.platform == "linux" else None

    def preexec() -> None:
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher died before the request took effect
            os._exit(1)

    return preexec


@dataclass
class Service:
    name: str  # "verify-0", "draft-1", "gateway"
    role: str  # "verify" | "draft" | "gateway"
    proc: subprocess.Popen
    address: str = ""
    metrics_port: str | None = None
    lines: deque = field(default_factory=lambda: deque(maxlen=40))
    ready: threading.Event = field(default_factory=threading.Event)

    def failure(self) -> str:
        """The last line that says what went wrong (a traceback's last line is the exception)."""
        for line in reversed(self.lines):
            text = line.strip()
            if text and not text.startswith(("File ", "^", "~")):
                return text
        return "(no output)"


class ProcessGroup:
    """The stack's children: one process group of their own, each dying with the launcher."""

    def __init__(self, echo: bool = True, isolate: bool = True):
        """`isolate`: the children get their own process group and die with the launcher (a stack); without it
        they are plain children of the caller (the benchmarks, which manage their processes themselves)."""
        self.services: list[Service] = []
        self.pgid: int | None = None
        self.echo = echo
        self.isolate = isolate
        self._preexec = _die_with_parent(os.getpid()) if isolate else None

    def spawn(
        self, name: str, role: str, module: str, args: Sequence[str], env: dict | None = None, pattern: str = ""
    ) -> Service:
        proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            process_group=(self.pgid or 0) if self.isolate else None,
            preexec_fn=self._preexec,
        )
        if self.pgid is None and self.isolate:
            self.pgid = proc.pid
        service = Service(name, role, proc)
        self.services.append(service)
        threading.Thread(target=self._pump, args=(service, pattern or r"listening on (\S+)"), daemon=True).start()
        return service

    def _pump(self, service: Service, pattern: str) -> None:
        stdout = service.proc.stdout
        assert stdout is not None  # stdout=PIPE
        try:
            for line in stdout:
                service.lines.append(line)
                if self.echo:
                    print(f"[{service.name}] {line}", end="", flush=True)
                m = re.search(pattern, line)
                if m and not service.ready.is_set():
                    service.address = m.group(1)
                    metrics = re.search(r"metrics port (\d+)", line)
                    service.metrics_port = metrics.group(1) if metrics else None
                    service.ready.set()
        except (OSError, ValueError):  # the pipe closed under us at shutdown
            pass

    def wait_ready(self, services: list[Service], timeout: float) -> None:
        end = time.monotonic() + timeout
        for s in services:
            while not s.ready.wait(0.2):
                if s.proc.poll() is not None:
                    time.sleep(0.3)  # let the pump read the process's last words
                    raise LaunchError(f"{s.name} exited with code {s.proc.returncode} during start-up: {s.failure()}")
                if time.monotonic() > end:
                    raise LaunchError(f"{s.name} did not start within {timeout:.0f} s: {s.failure()}")

    def exited(self) -> Service | None:
        return next((s for s in self.services if s.proc.poll() is not None), None)

    def stop(self, grace_s: float = 30.0) -> None:
        """Gateway first, then drafts, then verify replicas, each drained by SIGTERM; then the group is killed
        (anything a child left behind, and whatever did not drain in time)."""
        for role in ("gateway", "draft", "verify"):
            group = [s for s in self.services if s.role == role and s.proc.poll() is None]
            for s in group:
                s.proc.send_signal(signal.SIGTERM)
            end = time.monotonic() + grace_s
            for s in group:
                try:
                    s.proc.wait(max(0.1, end - time.monotonic()))
                except subprocess.TimeoutExpired:
                    s.proc.kill()
                    s.proc.wait()
        if self.pgid is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):  # nothing left
                os.killpg(self.pgid, signal.SIGKILL)


# --- health and the first answer --------------------------------------------------------------------------
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


def replicas_healthy(base: str, expected: int, timeout: float, group: ProcessGroup) -> None:
    """Wait until the gateway counts every verify and draft replica healthy (its own health checks)."""
    end = time.monotonic() + timeout
    healthy = 0
    while time.monotonic() < end:
        dead = group.exited()
        if dead is not None:
            raise LaunchError(f"{dead.name} exited with code {dead.proc.returncode}: {dead.failure()}")
        try:
            with urllib.request.urlopen(base + "/metrics", timeout=2) as r:
                text = r.read().decode()
            healthy = len(re.findall(r"^specmesh_gateway_replica_healthy\{[^}]*\} 1\.0$", text, re.M))
            if healthy >= expected:
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise LaunchError(f"only {healthy} of {expected} replicas became healthy within {timeout:.0f} s")


def first_request(base: str, model: str, headers: dict, tries: int = 3) -> dict:
    """One completion. A 503 is retried: on a busy machine the very first round (one-off warm-up costs) can
    be slow enough for the gateway to take a replica out for a moment."""
    body = json.dumps({"model": model, "prompt": "def fibonacci(n):\n", "max_tokens": 48, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json", **headers})
    for attempt in range(tries):
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == tries - 1:
                raise
            time.sleep(2.0 * (attempt + 1))
    raise AssertionError("unreachable")


# --- the stack --------------------------------------------------------------------------------------------
def _thread_flags(plan: StackPlan) -> tuple[list[str], list[str]]:
    """Torch threads per process (specmesh.placement), shared out among replicas on the CPU."""
    n_verify = plan.verify_threads or max(1, service_threads("verify") // plan.verify_replicas)
    n_draft = plan.draft_threads or max(1, service_threads("draft") // plan.draft_replicas)
    on_cpu = not _cuda_available(plan.device)
    busy = n_verify * plan.verify_replicas if on_cpu else 0
    pipeline = pipeline_pays(busy, n_draft * plan.draft_replicas)
    return ["--threads", str(n_verify)], ["--threads", str(n_draft), "--pipeline" if pipeline else "--no-pipeline"]


def _speculation_limit(plan: StackPlan) -> list[str]:
    """The gateway's --speculative-disable-by-batch-size for the verify service's device, unless given."""
    if _has(plan.gateway_args, "--speculative-disable-by-batch-size"):
        return []
    return ["--speculative-disable-by-batch-size", str(speculation_batch_limit(_cuda_available(plan.device)))]


def _draft_speculation_limit(plan: StackPlan) -> list[str]:
    """The draft's per-round side of the same limit: the gateway's value, as given or by device."""
    if _has(plan.draft_args, "--speculative-disable-by-batch-size"):
        return []
    given = _flag_value(plan.gateway_args, "--speculative-disable-by-batch-size")
    value = given if given is not None else str(speculation_batch_limit(_cuda_available(plan.device)))
    return ["--speculative-disable-by-batch-size", value]


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def _cuda_available(device: str | None) -> bool:
    if device is not None:
        return device.startswith("cuda")
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _has(args: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def launch(plan: StackPlan, group: ProcessGroup) -> dict:
    """Start every process and wait until the stack answers; returns the stack's record (stack_file)."""
    # The model services are the gateway's backends: loopback only, whatever --host opens the gateway to, on
    # any free ports (printed), so that stacks can share a machine.
    common = ["--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"]
    verify_threads, draft_threads = _thread_flags(plan)
    device = ["--device", plan.device] if plan.device else []
    draft_device = plan.draft_device or plan.device
    verifies = [
        group.spawn(
            f"verify-{i}",
            "verify",
            "verify_service",
            ["--model-path", plan.target, *common, *device, *verify_threads, *plan.verify_args],
        )
        for i in range(plan.verify_replicas)
    ]
    group.wait_ready(verifies, plan.startup_timeout_s)
    draft_model = ["--model-path", plan.draft] if plan.draft else []
    k = ["--speculative-num-steps", str(plan.num_steps)] if plan.num_steps is not None else []
    threads = [] if _has(plan.draft_args, "--threads") else draft_threads
    drafts = [
        group.spawn(
            f"draft-{i}",
            "draft",
            "draft_service",
            [
                *draft_model,
                "--speculative-algorithm",
                plan.algorithm,
                *k,
                "--verify-address",
                verifies[i % len(verifies)].address,
                # the gateway names the replica of each session: the draft may dial every one of them
                "--verify-allow",
                ",".join(v.address for v in verifies),
                *common,
                *(["--device", draft_device] if draft_device and plan.draft else []),
                *threads,
                *_draft_speculation_limit(plan),
                *plan.draft_args,
            ],
        )
        for i in range(plan.draft_replicas)
    ]
    group.wait_ready(drafts, plan.startup_timeout_s)
    name = plan.model_name or Path(plan.target).name
    gateway_env = {"SPECMESH_GATEWAY_API_KEY": plan.api_keys} if plan.api_keys else {}
    gateway = group.spawn(
        "gateway",
        "gateway",
        "gateway",
        [
            "--host",
            plan.host,
            "--port",
            str(plan.port),
            "--grpc-port",
            str(plan.grpc_port),
            "--verify",
            ",".join(v.address for v in verifies),
            "--draft",
            ",".join(d.address for d in drafts),
            "--tokenizer-path",
            plan.target,
            "--model-name",
            name,
            *_speculation_limit(plan),
            *plan.gateway_args,
        ],
        env=gateway_env,
        pattern=r"REST listening on (\S+)",
    )
    group.wait_ready([gateway], plan.startup_timeout_s)
    local = "127.0.0.1" if plan.host in ("0.0.0.0", "::") else plan.host
    base = f"http://{local}:{plan.port}"
    replicas_healthy(base, plan.verify_replicas + plan.draft_replicas, plan.startup_timeout_s, group)
    metrics_host = common[1]
    return {
        "url": base,
        "grpc": f"{local}:{plan.grpc_port}" if plan.grpc_port >= 0 else None,
        "model": name,
        "launcher_pid": os.getpid(),
        "cores": cores(),
        "services": [
            {
                "name": s.name,
                "role": s.role,
                "address": s.address,
                "pid": s.proc.pid,
                "metrics_url": f"{base}/metrics"
                if s.role == "gateway"
                else (f"http://{metrics_host}:{s.metrics_port}/metrics" if s.metrics_port else None),
            }
            for s in group.services
        ],
        "plan": plan.public(),
    }


def banner(record: dict, answer: dict | None) -> str:
    base, out = record["url"], ["", "=" * 78]
    grpc = f", gRPC gateway at {record['grpc']}" if record["grpc"] else ""
    out.append(f'specmesh is up: OpenAI-compatible REST at {base}/v1 (model "{record["model"]}"){grpc}')
    if answer is not None:
        spec = answer["specmesh"]
        out.append(
            f"first answer ({answer['usage']['completion_tokens']} tokens, mean accepted length "
            f"{spec['mean_accepted_length']}):\ndef fibonacci(n):\n{answer['choices'][0]['text']}"
        )
    out.append("services:")
    for s in record["services"]:
        where = f"gRPC {s['address']}" if s["role"] != "gateway" else f"REST {base}"
        out.append(f"  {s['name']:<10} {where:<28} metrics {s['metrics_url']}  (pid {s['pid']})")
    out.append(f"metrics: {', '.join(s['name'] + ' ' + str(s['metrics_url']) for s in record['services'])}")
    out.append(
        "try:\n  curl -s " + base + "/v1/completions -H 'content-type: application/json' -d "
        f'\'{{"model": "{record["model"]}", "prompt": "import os\\n", "max_tokens": 32, "temperature": 0}}\''
    )
    out.append(f"profile it: specmesh profile --url {base}  (the stack is recorded in {stack_file(_port(base))})")
    out.append("=" * 78 + "\nCtrl-C stops the stack.")
    return "\n".join(out)


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def serve(plan: StackPlan) -> int:
    """Run the stack until Ctrl-C / SIGTERM (0) or a service's death (1); a bad set-up is one line (2)."""
    try:
        preflight(plan)
    except LaunchError as e:
        print(f"specmesh serve: error: {e}", file=sys.stderr, flush=True)
        return 2

    def stop(signum, _frame):
        raise _Stop(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    group = ProcessGroup()
    record_path: Path | None = None
    code = 0
    try:
        record = launch(plan, group)
        headers = {"authorization": f"Bearer {plan.api_keys.split(',')[0]}"} if plan.api_keys else {}
        answer = first_request(record["url"], record["model"], headers) if plan.first_request else None
        record_path = stack_file(plan.port)
        record_path.write_text(json.dumps(record, indent=2))
        print(banner(record, answer), flush=True)
        if plan.smoke:
            return 0
        while True:
            dead = group.exited()
            if dead is not None:
                print(
                    f"specmesh serve: error: {dead.name} exited with code {dead.proc.returncode}: {dead.failure()}; "
                    "stopping the stack",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                return code
            time.sleep(0.5)
    except _Stop:
        return 0
    except LaunchError as e:
        print(f"specmesh serve: error: {e}", file=sys.stderr, flush=True)
        return 1
    except OSError as e:  # the first request failed
        print(f"specmesh serve: error: the stack did not answer its first request: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        for sig in previous:  # a second Ctrl-C must not interrupt the orderly stop
            signal.signal(sig, signal.SIG_IGN)
        group.stop()
        if record_path is not None:
            record_path.unlink(missing_ok=True)
        print("stack stopped", flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def start(
    name: str,
    module: str,
    args: list[str],
    pattern: str = r"listening on (\S+)",
    timeout: float = 180,
    ports: dict | None = None,
) -> tuple[subprocess.Popen, str]:
    """One service process for the benchmarks (which manage its life): started, echoed with its name, and
    returned with its address once it listens."""
    group = ProcessGroup(isolate=False)
    service = group.spawn(name, name.split("-")[0], module, args, pattern=pattern)
    try:
        group.wait_ready([service], timeout)
    except LaunchError as e:
        service.proc.kill()
        raise RuntimeError(str(e)) from None
    if ports is not None and service.metrics_port:
        ports[name] = service.metrics_port
    return service.proc, service.address


def main(argv: list[str] | None = None) -> int:
    """`python -m specmesh.stack`: `specmesh serve` on the demo pair (model "demo") unless told otherwise."""
    from specmesh.cli import main as cli_main

    argv = list(sys.argv[1:] if argv is None else argv)
    demo = []
    if not any(a.startswith(("--model-path", "--model", "--target")) for a in argv):
        demo += ["--model-path", str(DEMO / "target")]
    if not any(a.startswith(("--speculative-draft", "--draft", "--speculative-algorithm")) for a in argv):
        demo += ["--speculative-draft-model-path", str(DEMO / "draft")]
    if not any(a.startswith("--served-model-name") for a in argv):
        demo += ["--served-model-name", "demo"]
    return cli_main(["serve", *demo, *argv])


if __name__ == "__main__":
    sys.exit(main())
