"""The launcher behind `specmesh serve` and `make run`: verify, draft and gateway as separate processes.

    specmesh serve --model-path T --speculative-draft-model-path D [--port 8000 ...]   (specmesh.cli parses)
    python -m specmesh.stack [--port 8000] [--smoke]                                    (the demo pair)

Each service runs as its own process, as in production where they are separate deployments. Before
anything starts, the set-up is checked (model directories, target and draft vocabularies, the REST and
gRPC ports), so a mistake ends with one line and a non-zero exit. Then the verify replicas start, the
draft replicas (each pointed at a verify replica), the gateway; the launcher waits until the gateway
reports every replica healthy, sends one request to show the stack answering and prints the endpoints.

Each service's command line is composed from settings under its own config's field names (`verify_argv`,
...), rendered by `specmesh.config.to_argv`, then the flags `--<role>-arg` passes through. The stack's TLS
(`StackSecurity`) reaches every service under the names it takes it by: mTLS and the service key between
the services, HTTPS on the gateway's REST port, and the launcher's own requests go over it.

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
import http.client
import json
import os
import re
import signal
import socket
import ssl
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
from typing import NoReturn

from specmesh.config import GatewayListen, option, to_argv
from specmesh.placement import cores, pipeline_pays, service_threads, speculation_batch_limit
from specmesh.security import TLSConfig

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
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct loopback ports free right now: each socket stays bound until all are, since one port asked
    for twice in a row can come back twice (a stack once got --port and --grpc-port the same)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


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
@dataclass(frozen=True)
class StackSecurity:
    """TLS and the service key on every hop of the stack: `specmesh serve`'s flags, named as each service names
    its own. Each service gets them as docker-compose.tls.yml sets them: the draft and verify services serve
    TLS with the certificate and present it when they dial (mTLS with --tls-client-auth), the gateway serves
    its REST and gRPC fronts with it and dials the replicas with it (--upstream-tls-*)."""

    tls_cert: str = option(
        "",
        "PEM certificate (chain) of every service: served on each gRPC port and on the gateway's REST port "
        "(HTTPS), and presented as the client certificate on every hop between them",
    )
    tls_key: str = option("", "PEM private key of --tls-cert")
    tls_ca: str = option("", "PEM CA bundle that verifies the services (and, with --tls-client-auth, their callers)")
    tls_client_auth: bool = option(
        False, "the draft and verify services require a client certificate signed by --tls-ca (mTLS)"
    )
    tls_server_name: str = option(
        "",
        "name the services' certificates must carry (default: the address dialed, 127.0.0.1)",
    )
    service_key_file: str = option(
        "",
        "file of shared service keys, one a line: the draft and verify services demand one, the gateway and the "
        "draft present the first (or set SPECMESH_<SERVICE>_SERVICE_KEY for each)",
    )

    def check(self) -> None:
        """ValueError naming the flag when the TLS files do not make a set-up the services would take."""
        if self.tls_ca and not self.tls_cert:
            raise ValueError("--tls-ca without --tls-cert: the services would serve plaintext")
        TLSConfig(self.tls_cert, self.tls_key, self.tls_ca, self.tls_client_auth, self.tls_server_name)


@dataclass
class StackPlan:
    """Everything the launcher starts, decided before any process runs (specmesh.cli builds it)."""

    target: str
    draft: str | None  # None: the n-gram drafter (no draft model)
    algorithm: str = "standalone"  # "standalone" | "ngram" | "suffix"
    num_steps: int | None = None  # the draft's K (None: the draft service's default)
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50070
    verify_replicas: int = 1
    draft_replicas: int = 1
    device: str | None = None
    draft_device: str | None = None
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # the verify replicas' (the draft's KV keeps its model's dtype)
    cuda_graph_max_bs: int | None = None  # None: the services' default
    disable_cuda_graph: bool = False
    model_name: str = ""
    api_keys: str = ""  # comma-separated; given to the gateway in its environment, never on a command line
    # Each service's flags beyond what the launcher decides itself, after those (so they win).
    verify_args: list[str] = field(default_factory=list)
    draft_args: list[str] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)
    verify_threads: int = 0
    draft_threads: int = 0
    first_request: bool = True
    smoke: bool = False
    startup_timeout_s: float = 600.0
    security: StackSecurity = field(default_factory=StackSecurity)

    def public(self) -> dict:
        """The plan as recorded in the stack file and shown to the profiler (no keys)."""
        d = asdict(self)
        d["api_keys"] = bool(self.api_keys)
        return d

    @property
    def scheme(self) -> str:
        return "https" if self.security.tls_cert else "http"


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
    if plan.algorithm in ("ngram", "suffix"):  # they draft without a model
        if plan.draft:
            raise LaunchError(f"--speculative-algorithm {plan.algorithm} drafts without a model: give no draft model")
    else:
        if not plan.draft:
            raise LaunchError(
                "a draft is needed: --speculative-draft-model-path DIR, or --speculative-algorithm ngram or suffix"
            )
        draft_config = check_model_dir("--speculative-draft-model-path", plan.draft)
        check_vocabularies(plan.target, target_config, plan.draft, draft_config)
    if plan.verify_replicas < 1 or plan.draft_replicas < 1:
        raise LaunchError("--verify-replicas and --draft-replicas must be at least 1")
    try:
        plan.security.check()
    except ValueError as e:
        raise LaunchError(str(e)) from None
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


class Client:
    """The launcher's own requests to its gateway: over TLS with the stack's CA and certificate when it has
    them (the gateway may ask for a client certificate), with an API key when the stack has keys."""

    def __init__(self, plan: StackPlan):
        sec = plan.security
        self.headers = {"authorization": f"Bearer {plan.api_keys.split(',')[0]}"} if plan.api_keys else {}
        handlers = []
        if sec.tls_cert:
            context = ssl.create_default_context(cafile=sec.tls_ca or None)
            context.load_cert_chain(sec.tls_cert, sec.tls_key)
            # The launcher dials its gateway by address on loopback, where a certificate made for the services'
            # name (--tls-server-name) does not match; the chain is still verified against the CA.
            context.check_hostname = not sec.tls_server_name
            handlers.append(urllib.request.HTTPSHandler(context=context))
        self.opener = urllib.request.build_opener(*handlers)

    def get(self, url: str, timeout: float) -> bytes:
        with self.opener.open(urllib.request.Request(url, headers=self.headers), timeout=timeout) as r:
            return r.read()

    def post(self, url: str, body: dict, timeout: float) -> dict:
        headers = {"content-type": "application/json", **self.headers}
        with self.opener.open(urllib.request.Request(url, json.dumps(body).encode(), headers), timeout=timeout) as r:
            return json.loads(r.read())


def replicas_healthy(base: str, expected: int, timeout: float, group: ProcessGroup, client: Client) -> None:
    """Wait until the gateway counts every verify and draft replica healthy (its own health checks)."""
    end = time.monotonic() + timeout
    healthy = 0
    while time.monotonic() < end:
        dead = group.exited()
        if dead is not None:
            raise LaunchError(f"{dead.name} exited with code {dead.proc.returncode}: {dead.failure()}")
        try:
            text = client.get(base + "/metrics", timeout=2).decode()
            healthy = len(re.findall(r"^specmesh_gateway_replica_healthy\{[^}]*\} 1\.0$", text, re.M))
            if healthy >= expected:
                return
        except (OSError, http.client.HTTPException):  # not up yet, or another server answers there: its exit
            pass  # (the port taken) is what the next pass reports
        time.sleep(0.3)
    raise LaunchError(f"only {healthy} of {expected} replicas became healthy within {timeout:.0f} s")


def first_request(base: str, model: str, client: Client, tries: int = 3) -> dict:
    """One completion. A 503 is retried: on a busy machine the very first round (one-off warm-up costs) can
    be slow enough for the gateway to take a replica out for a moment. Seeded, so that it takes a fixed K and
    feeds none of the draft service's adaptive state: its rounds pay those one-off costs, and measured by the
    goodput guard they could hold the first users' requests to target-only steps."""
    body = {"model": model, "prompt": "def fibonacci(n):\n", "max_tokens": 48, "temperature": 0, "seed": 0}
    for attempt in range(tries):
        try:
            return client.post(base + "/v1/completions", body, timeout=300)
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == tries - 1:
                raise
            time.sleep(2.0 * (attempt + 1))
    raise AssertionError("unreachable")


# --- each service's command line --------------------------------------------------------------------------
# The model services are the gateway's backends: loopback only, whatever --host opens the gateway to, on any
# free ports (printed), so that stacks can share a machine.
BACKEND = {"host": "127.0.0.1", "port": 0, "metrics_port": 0}
SPECULATION_LIMIT = "--speculative-disable-by-batch-size"


def verify_argv(plan: StackPlan) -> list[str]:
    """A verify replica's flags: what the launcher decides, then the stack's security, then --verify-arg's."""
    settings = {
        "model_path": plan.target,
        **BACKEND,
        "device": plan.device,
        "dtype": plan.dtype,
        "kv_cache_dtype": None if plan.kv_cache_dtype == "auto" else plan.kv_cache_dtype,
        **_graphs(plan),
        **_threads(plan)[0],
    }
    return to_argv(settings) + security_argv(plan.security, "verify") + plan.verify_args


def draft_argv(plan: StackPlan, verify: str, verifies: list[str]) -> list[str]:
    """Draft replica's flags, pointed at `verify` and allowed to dial every one of `verifies` (the gateway
    names the verify replica of each session)."""
    settings = {
        "model_path": plan.draft,
        "speculative_algorithm": plan.algorithm,
        "speculative_num_steps": plan.num_steps,
        "verify_address": verify,
        "verify_allow": tuple(verifies),
        **BACKEND,
        "device": (plan.draft_device or plan.device) if plan.draft else None,
        "dtype": plan.dtype if plan.draft else None,
        **(_graphs(plan) if plan.draft else {}),
        **_threads(plan)[1],
        "speculative_disable_by_batch_size": None if _has(plan.draft_args, SPECULATION_LIMIT) else _limit(plan),
    }
    return to_argv(settings) + security_argv(plan.security, "draft") + plan.draft_args


def _graphs(plan: StackPlan) -> dict:
    """A model service's CUDA graph flags (what the launcher was not given stays the service's default)."""
    return {"cuda_graph_max_bs": plan.cuda_graph_max_bs, "disable_cuda_graph": plan.disable_cuda_graph or None}


def gateway_argv(plan: StackPlan, verifies: list[str], drafts: list[str]) -> list[str]:
    """The gateway's flags: where it listens, its replicas, the target's tokenizer and name."""
    settings = {
        **asdict(GatewayListen(plan.host, plan.port, plan.grpc_port)),
        "verify": tuple(verifies),
        "draft": tuple(drafts),
        "tokenizer_path": plan.target,
        "model_name": model_name(plan),
        "speculative_disable_by_batch_size": None if _has(plan.gateway_args, SPECULATION_LIMIT) else _limit(plan),
    }
    return to_argv(settings) + security_argv(plan.security, "gateway") + plan.gateway_args


def security_argv(security: StackSecurity, role: str) -> list[str]:
    """A service's TLS and service-key flags, from the stack's: the gateway serves its fronts with the
    certificate and dials the replicas with it (--upstream-tls-*); the model services serve it and present it
    when they dial (the draft)."""
    files: dict[str, str | bool] = {
        "tls_cert": security.tls_cert,
        "tls_key": security.tls_key,
        "tls_ca": security.tls_ca,
    }
    if role == "gateway":
        upstream = {f"upstream_{k}": v for k, v in files.items()}
        settings = {**files, **upstream, "upstream_tls_server_name": security.tls_server_name}
    else:
        settings = {**files, "tls_client_auth": security.tls_client_auth}
        settings["tls_server_name"] = security.tls_server_name if role == "draft" else ""  # verify dials nothing
    settings["service_key_file"] = security.service_key_file
    return to_argv({k: v for k, v in settings.items() if v})


def model_name(plan: StackPlan) -> str:
    return plan.model_name or Path(plan.target).name


def _threads(plan: StackPlan) -> tuple[dict, dict]:
    """Torch threads per process (specmesh.placement), shared out among replicas on the CPU; the draft's are
    left to it, and so is pipelining, when --draft-arg gives its threads."""
    n_verify = plan.verify_threads or max(1, service_threads("verify") // plan.verify_replicas)
    n_draft = plan.draft_threads or max(1, service_threads("draft") // plan.draft_replicas)
    on_cpu = not _cuda_available(plan.device)
    busy = n_verify * plan.verify_replicas if on_cpu else 0
    draft = {"threads": n_draft, "pipeline": pipeline_pays(busy, n_draft * plan.draft_replicas)}
    return {"threads": n_verify}, {} if _has(plan.draft_args, "--threads") else draft


def _limit(plan: StackPlan) -> int:
    """--speculative-disable-by-batch-size of the gateway and (per round) the draft: as given to the gateway,
    else by the verify service's device."""
    given = _flag_value(plan.gateway_args, SPECULATION_LIMIT)
    return int(given) if given is not None else speculation_batch_limit(_cuda_available(plan.device))


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


# --- the stack --------------------------------------------------------------------------------------------
def launch(plan: StackPlan, group: ProcessGroup, client: Client) -> dict:
    """Start every process and wait until the stack answers; returns the stack's record (stack_file)."""
    spawn = lambda role, i, argv, **kw: group.spawn(f"{role}-{i}", role, f"{role}_service", argv, **kw)
    verifies = [spawn("verify", i, verify_argv(plan)) for i in range(plan.verify_replicas)]
    group.wait_ready(verifies, plan.startup_timeout_s)
    addresses = [v.address for v in verifies]
    drafts = [
        spawn("draft", i, draft_argv(plan, addresses[i % len(addresses)], addresses))
        for i in range(plan.draft_replicas)
    ]
    group.wait_ready(drafts, plan.startup_timeout_s)
    gateway_env = {"SPECMESH_GATEWAY_API_KEY": plan.api_keys} if plan.api_keys else {}
    argv = gateway_argv(plan, addresses, [d.address for d in drafts])
    gateway = group.spawn("gateway", "gateway", "gateway", argv, env=gateway_env, pattern=r"REST listening on (\S+)")
    group.wait_ready([gateway], plan.startup_timeout_s)
    local = "127.0.0.1" if plan.host in ("0.0.0.0", "::") else plan.host
    base = f"{plan.scheme}://{local}:{plan.port}"
    replicas_healthy(base, plan.verify_replicas + plan.draft_replicas, plan.startup_timeout_s, group, client)
    return {
        "url": base,
        "grpc": f"{local}:{plan.grpc_port}" if plan.grpc_port >= 0 else None,
        "model": model_name(plan),
        "launcher_pid": os.getpid(),
        "cores": cores(),
        "services": [_service_record(s, base) for s in group.services],
        "plan": plan.public(),
    }


def _service_record(s: Service, base: str) -> dict:
    metrics = f"http://{BACKEND['host']}:{s.metrics_port}/metrics" if s.metrics_port else None
    return {
        "name": s.name,
        "role": s.role,
        "address": s.address,
        "pid": s.proc.pid,
        "metrics_url": f"{base}/metrics" if s.role == "gateway" else metrics,
        # The verify service's KV layout, as it logged it at start ("KV: N blocks of 16 tokens = T tokens;
        # max_model_len L"), for the banner.
        "kv": next((m.group(0) for line in s.lines if (m := re.search(r"KV: .*max_model_len \d+", line))), None),
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
        if s.get("kv"):
            out.append(f"  {'':<10} {s['kv']}")
    out.append(f"metrics: {', '.join(s['name'] + ' ' + str(s['metrics_url']) for s in record['services'])}")
    out.append(
        f"try:\n  curl -s {_curl_tls(record)}{base}/v1/completions -H 'content-type: application/json' -d "
        f'\'{{"model": "{record["model"]}", "prompt": "import os\\n", "max_tokens": 32, "temperature": 0}}\''
    )
    out.append(f"profile it: specmesh profile --url {base}  (the stack is recorded in {stack_file(_port(base))})")
    out.append("=" * 78 + "\nCtrl-C stops the stack.")
    return "\n".join(out)


def _curl_tls(record: dict) -> str:
    """curl's flags for the stack's TLS: its CA, and its certificate (the gateway may ask for one)."""
    sec = record["plan"]["security"]
    return f"--cacert {sec['tls_ca']} --cert {sec['tls_cert']} --key {sec['tls_key']} " if sec["tls_ca"] else ""


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
    try:
        client = Client(plan)
        record = launch(plan, group, client)
        answer = first_request(record["url"], record["model"], client) if plan.first_request else None
        record_path = stack_file(plan.port)
        record_path.write_text(json.dumps(record, indent=2))
        print(banner(record, answer), flush=True)
        return 0 if plan.smoke else _watch(group)
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


def _watch(group: ProcessGroup) -> int:
    """Serve until a service dies (1); Ctrl-C / SIGTERM end it sooner (_Stop)."""
    while (dead := group.exited()) is None:
        time.sleep(0.5)
    print(
        f"specmesh serve: error: {dead.name} exited with code {dead.proc.returncode}: {dead.failure()}; "
        "stopping the stack",
        file=sys.stderr,
        flush=True,
    )
    return 1


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


def main(argv: list[str] | None = None) -> NoReturn:
    """`python -m specmesh.stack`: `specmesh serve` on the demo pair (model "demo") unless told otherwise, run
    as the `specmesh` command in this process's place: the launcher stays below the command line that
    drives it, and imports none of it."""
    argv = list(sys.argv[1:] if argv is None else argv)
    demo = []
    if not any(a.startswith(("--model-path", "--model", "--target")) for a in argv):
        demo += ["--model-path", str(DEMO / "target")]
    if not any(a.startswith(("--speculative-draft", "--draft", "--speculative-algorithm")) for a in argv):
        demo += ["--speculative-draft-model-path", str(DEMO / "draft")]
    if not any(a.startswith("--served-model-name") for a in argv):
        demo += ["--served-model-name", "demo"]
    os.execv(sys.executable, [sys.executable, "-m", "specmesh", "serve", *demo, *argv])


if __name__ == "__main__":
    main()
