"""llama.cpp's own server as a peer for the load benchmark (`python -m bench.load --llamacpp`).

    python -m bench.llamacpp [--build] [--convert DIR ...]   # build llama-server / convert checkpoints ahead

Nothing here runs in the tests: it builds C++ (about 6 minutes on 2 cores, once) and starts processes.

- `ensure_server()`: llama.cpp's source as vendored by the `llama-cpp-python` sdist (PyPI is reachable where
  GitHub may not be), `llama-server` built from it once with cmake (Release, CPU, native ISA, no curl, no
  web UI, static), reused afterwards;
- `convert(model_dir)`: an HF checkpoint to a GGUF f32 file with the sdist's `convert_hf_to_gguf.py`, cached by
  the checkpoint's content hash. Our tokenizer is GPT-2's byte-level BPE (GPT-2's pre-tokenizer regex, no
  normalizer, no prefix space) on our own vocabulary; the converter identifies pre-tokenizers by hashing the
  token ids of a test string, so it knows no hash of ours and refuses. It is told, at run time, that ours is
  llama.cpp's `gpt-2` (the vendored files stay as shipped);
- `LlamaServer`: `llama-server` on loopback as a context manager, healthy on entry, stopped on exit.

The cache lives outside git: `$SPECMESH_LLAMACPP_DIR`, else `~/.cache/specmesh/llama.cpp`.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
import urllib.request
from collections import deque
from pathlib import Path
from typing import IO

# The sdist whose vendored llama.cpp is built: pinned, so a figure names the llama.cpp it was measured on.
# SPECMESH_LLAMACPP_VERSION picks another.
SDIST = "llama-cpp-python"
DEFAULT_VERSION = "0.3.36"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_CURL=OFF",  # deprecated (a no-op) in recent llama.cpp, still honoured by older ones
    "-DLLAMA_OPENSSL=OFF",  # loopback HTTP only: no TLS, no libssl needed
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
# The pre-tokenizer llama.cpp applies to a checkpoint whose tokenizer hash it does not know, if the tokenizer is
# byte-level BPE with GPT-2's split regex (what ours is): token ids then match the HF tokenizer's exactly.
GPT2_PRE = "gpt-2"


def cache_dir() -> Path:
    return Path(os.environ.get("SPECMESH_LLAMACPP_DIR") or Path.home() / ".cache" / "specmesh" / "llama.cpp")


def version() -> str:
    return os.environ.get("SPECMESH_LLAMACPP_VERSION") or DEFAULT_VERSION


def log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on `path` (two benchmarks starting together build and convert once)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def source_dir() -> Path:
    """llama.cpp's source tree from the pinned sdist, downloaded and unpacked once."""
    root = cache_dir()
    src = root / f"src-{version()}"
    tree = src / f"llama_cpp_python-{version()}" / "vendor" / "llama.cpp"
    with locked(root / ".source.lock"):
        if not (tree / "CMakeLists.txt").exists():
            unpack(src)
    return tree


def unpack(src: Path) -> None:
    root = cache_dir()
    dl = root / "sdist"
    dl.mkdir(parents=True, exist_ok=True)
    archive = dl / f"llama_cpp_python-{version()}.tar.gz"
    if not archive.exists():
        log(f"downloading the {SDIST}=={version()} sdist (about 75 MB) into {dl}")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
             "--progress-bar", "on", "-d", str(dl), f"{SDIST}=={version()}"],
            check=True,
        )  # fmt: skip
    if not archive.exists():
        raise RuntimeError(f"pip download left no {archive.name} in {dl}")
    log(f"unpacking {archive.name}")
    tmp = src.with_name(src.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    shutil.rmtree(src, ignore_errors=True)
    tmp.rename(src)


def server_binary() -> Path:
    return cache_dir() / f"build-{version()}" / "bin" / "llama-server"


def ensure_server() -> Path:
    """The path of a built `llama-server`; builds it first (minutes) unless a build with the same flags exists."""
    binary = server_binary()
    stamp = binary.parent.parent / "specmesh-build.json"
    want = {"version": version(), "flags": list(CMAKE_FLAGS)}
    with locked(cache_dir() / ".build.lock"):
        if binary.exists() and stamp.exists() and json.loads(stamp.read_text()) == want:
            return binary
        tree = source_dir()
        build = binary.parent.parent
        build_log = build.with_name(build.name + ".log")
        log(f"building llama-server from {tree} (about 6 minutes on 2 cores; output in {build_log})")
        jobs = str(os.cpu_count() or 2)
        with open(build_log, "w") as out:
            run_logged(["cmake", "-S", str(tree), "-B", str(build), *CMAKE_FLAGS], out)
            run_logged(["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs], out)
        if not binary.exists():
            raise RuntimeError(f"the build finished without {binary}; see {build_log}")
        stamp.write_text(json.dumps(want) + "\n")
        log(f"built {binary}")
        return binary


def run_logged(cmd: list[str], out) -> None:
    """`cmd` with its output to `out`, its progress lines ("[ 42%] ...") echoed to stderr as they come."""
    tail: deque[str] = deque(maxlen=40)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    last = -1.0
    for line in proc.stdout:
        out.write(line)
        tail.append(line)
        now = time.monotonic()
        if line.startswith("[") and "%]" in line[:8] and now - last > 5:
            log(line.rstrip()[:140])
            last = now
    if proc.wait():
        raise RuntimeError(f"{' '.join(cmd[:3])} ... failed ({proc.returncode}):\n{''.join(tail)}")


# ---------------------------------------------------------------------------------------------------------
# conversion


def checkpoint_hash(model_dir: Path) -> str:
    """sha256 over the names and bytes of the files the converter reads (weights, config, tokenizer)."""
    h = hashlib.sha256()
    for f in sorted(model_dir.iterdir()):
        if f.is_file() and (f.suffix in (".json", ".safetensors", ".bin", ".model", ".txt")):
            if f.name in ("rehearsal.safetensors",) or f.name.endswith("report.json") or f.name == "eval.json":
                continue  # not part of the model
            h.update(f.name.encode() + b"\0")
            with open(f, "rb") as fh:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    h.update(block)
    return h.hexdigest()


# Runs in the converter's own process: imports the vendored converter as shipped and wraps its pre-tokenizer
# lookup, so that a tokenizer with GPT-2's byte-level scheme converts as `gpt-2` and anything else still fails.
_WRAPPER = textwrap.dedent(
    """
    import importlib.util, json, sys
    from pathlib import Path

    script, model_dir, pre = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    sys.path.insert(0, str(Path(script).parent))
    sys.path.insert(1, str(Path(script).parent / "gguf-py"))
    from conversion import base

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    pt = tok.get("pre_tokenizer") or {}
    byte_level = (
        tok.get("model", {}).get("type") == "BPE"
        and not tok.get("normalizer")
        and pt.get("type") == "ByteLevel"
        and pt.get("use_regex", True)
        and not pt.get("add_prefix_space", False)
    )
    original = base.TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer):
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not byte_level:
                raise
            print(f"pre-tokenizer: GPT-2's byte-level scheme, converted as {pre!r}", file=sys.stderr)
            return pre

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre

    # The Llama converter tries a SentencePiece vocabulary first and imports sentencepiece before it looks for
    # tokenizer.model; without that file the answer is FileNotFoundError (then the BPE path) either way, so a
    # checkpoint like ours converts without sentencepiece installed.
    create_sp = base.TextModel._create_vocab_sentencepiece

    def create_vocab_sentencepiece(self):
        if not (self.dir_model / "tokenizer.model").is_file():
            raise FileNotFoundError(f"File not found: {self.dir_model / 'tokenizer.model'}")
        return create_sp(self)

    base.TextModel._create_vocab_sentencepiece = create_vocab_sentencepiece
    spec = importlib.util.spec_from_file_location("convert_hf_to_gguf", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.argv = [script, *sys.argv[4:]]
    module.main()
    """
)


def convert(model_dir: Path, out_gguf: Path | None = None) -> Path:
    """`model_dir` (an HF checkpoint) as a GGUF f32 file; converted once per checkpoint content."""
    model_dir = Path(model_dir).resolve()
    digest = checkpoint_hash(model_dir)[:16]
    if out_gguf is None:
        out_gguf = cache_dir() / "gguf" / f"{model_dir.parent.name}-{model_dir.name}-{digest}-f32.gguf"
    out_gguf = Path(out_gguf)
    with locked(cache_dir() / ".convert.lock"):
        if out_gguf.exists():
            return out_gguf
        script = source_dir() / "convert_hf_to_gguf.py"
        out_gguf.parent.mkdir(parents=True, exist_ok=True)
        tmp = out_gguf.with_name(out_gguf.name + ".tmp")
        log(f"converting {model_dir} to {out_gguf.name}")
        proc = subprocess.run(
            [sys.executable, "-c", _WRAPPER, str(script), str(model_dir), GPT2_PRE,
             str(model_dir), "--outtype", "f32", "--outfile", str(tmp)],
            capture_output=True, text=True,
        )  # fmt: skip
        if proc.returncode or not tmp.exists():
            raise RuntimeError(f"converting {model_dir} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
        for line in proc.stderr.splitlines():
            if line.startswith("pre-tokenizer:"):
                log(line)
        tmp.rename(out_gguf)
        return out_gguf


# ---------------------------------------------------------------------------------------------------------
# the server


KEEP_LOGS = 64


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """`llama-server` on 127.0.0.1 with `target` (GGUF), `parallel` slots of `ctx_per_slot` tokens each, CPU
    only, and with `draft` and `draft_n` its draft-model speculation (`draft-simple`, at most `draft_n` tokens
    a round). The KV caches hold `kv_type` (f32 by default, as our services' fp32 caches; llama.cpp's default
    is f16). A context manager: healthy (`/health` 200) on entry, stopped on exit, at interpreter exit and on
    SIGTERM / Ctrl-C of this process."""

    def __init__(
        self,
        target: Path,
        parallel: int,
        ctx_per_slot: int,
        draft: Path | None = None,
        draft_n: int | None = None,
        threads: int | None = None,
        binary: Path | None = None,
        extra: list[str] | None = None,
        kv_type: str = "f32",
        startup_timeout_s: float = 180,
    ):
        if (draft is None) != (draft_n is None):
            raise ValueError("draft and draft_n go together")
        self.binary = binary or server_binary()
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # one KV cache of parallel x ctx_per_slot cells, rounded up to a multiple of 256
        ctx = -(-parallel * ctx_per_slot // 256) * 256
        threads = threads or os.cpu_count() or 2
        self.cmd = [
            str(self.binary), "-m", str(target), "--host", "127.0.0.1", "--port", str(self.port),
            "-np", str(parallel), "-c", str(ctx), "-t", str(threads), "-tb", str(threads), "-ngl", "0",
            "--no-webui", "-ctk", kv_type, "-ctv", kv_type,
        ]  # fmt: skip
        if draft is not None:
            self.cmd += ["-md", str(draft), "-ngld", "0", "-td", str(threads), "-tbd", str(threads),
                         "-ctkd", kv_type, "-ctvd", kv_type,
                         "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_n)]  # fmt: skip
        self.cmd += list(extra or [])
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log: IO[str] | None = None
        self.log_path = cache_dir() / "logs" / f"llama-server-{self.port}.log"

    def __enter__(self) -> LlamaServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        # every server writes its own log; the newest ones are enough to look into a failure
        logs = sorted(self.log_path.parent.glob("llama-server-*.log"), key=lambda f: f.stat().st_mtime)
        for old in logs[:-KEEP_LOGS]:
            old.unlink(missing_ok=True)
        self._log = open(self.log_path, "w")
        self._log.write(" ".join(self.cmd) + "\n")
        self._log.flush()
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        import atexit

        atexit.register(self.close)
        end = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                self.close()
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}):\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (OSError, ValueError):
                pass
            time.sleep(0.25)
        self.close()
        raise RuntimeError(f"llama-server not healthy after {self.startup_timeout_s:.0f} s:\n{self.log_tail()}")

    def __exit__(self, *exc) -> None:
        self.close()

    def log_tail(self, n: int = 30) -> str:
        try:
            return "".join(self.log_path.read_text().splitlines(keepends=True)[-n:])
        except OSError:
            return ""

    def close(self) -> None:
        p, self.proc = self.proc, None
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.llamacpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--build", action="store_true", help="build llama-server (if not built yet) and print its path")
    ap.add_argument("--convert", type=Path, nargs="*", default=[], help="HF checkpoints to convert to GGUF f32")
    args = ap.parse_args(argv)
    if args.build or not args.convert:
        print(ensure_server())
    for d in args.convert:
        print(convert(d))


if __name__ == "__main__":
    main()
