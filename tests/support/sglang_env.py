"""A side virtualenv holding the real `sglang` package, whose frontend language the tests run against the
gateway (the project's own environment never installs sglang).

SGLang's wheel is installed without its dependencies (its server needs CUDA libraries); the frontend only
needs `import sglang` to work, and that imports a few small libraries (installed here, pinned) and torch,
numpy and transformers, which the side env takes from the project's environment through a .pth line (a second
torch would cost minutes and gigabytes for nothing). The env is keyed by the pinned versions, built once
under a lock (the first build needs PyPI) and reused; `python -m tests.support.sglang_env` builds it ahead.
"""

from __future__ import annotations

import fcntl
import hashlib
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SGLANG_VERSION = "0.5.23"
# What `import sglang` (its frontend) needs that the project's environment does not have.
FRONTEND_DEPS = (
    "aiohttp==3.14.5",
    "ipython==9.18.1",
    "msgspec==0.23.0",
    "orjson==3.13.0",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "pyzmq==27.3.0",
    "requests==2.34.2",
)
_KEY = hashlib.sha256(" ".join((SGLANG_VERSION, *FRONTEND_DEPS)).encode()).hexdigest()[:10]
ENV_DIR = ROOT / ".work" / f"sglang-venv-{SGLANG_VERSION}-{_KEY}"


class SideEnvError(RuntimeError):
    pass


def _run(cmd: list, what: str, timeout: float) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise SideEnvError(f"{what} took more than {timeout:.0f} s") from None
    if r.returncode != 0:
        raise SideEnvError(f"{what} failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}")


def python() -> Path:
    """The side env's interpreter, building the env first if needed; SideEnvError says why it could not."""
    py = ENV_DIR / "bin" / "python"
    stamp = ENV_DIR / ".complete"
    if stamp.exists():
        return py
    ENV_DIR.parent.mkdir(parents=True, exist_ok=True)
    with open(ENV_DIR.parent / f".{ENV_DIR.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent test runs build it once
        if stamp.exists():
            return py
        shutil.rmtree(ENV_DIR, ignore_errors=True)
        _run([sys.executable, "-m", "venv", str(ENV_DIR)], "creating the side virtualenv", 300)
        pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        _run([*pip, "--no-deps", f"sglang=={SGLANG_VERSION}"], f"pip install --no-deps sglang=={SGLANG_VERSION}", 900)
        _run([*pip, *FRONTEND_DEPS], "pip install of the sglang frontend's libraries", 900)
        site = subprocess.run(
            [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        # Appended to sys.path after the side env's own packages: those win where both have one.
        Path(site, "zz_specmesh_project.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
        _run([str(py), "-c", "import sglang; sglang.RuntimeEndpoint"], "import sglang in the side virtualenv", 300)
        stamp.write_text(f"sglang=={SGLANG_VERSION} {' '.join(FRONTEND_DEPS)}\n")
    return py


if __name__ == "__main__":
    print(python())
