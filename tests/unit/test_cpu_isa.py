"""The CPU kernels built for a lesser x86 CPU than this one (`SPECMESH_CPU_MARCH`), run here through their own
tests: the kernels have a path per vector width (AVX-512's 16 floats and 64-column panels, AVX2's 8 and 16-column
panels, plain C's [in, out] rows), and a host runs only its own natively. Every AVX-512 CPU runs AVX2's code and
every x86-64 CPU the baseline's, so the suite on any x86 host meets every path it can execute. (The AVX2 path
once failed a test for as long as every host had AVX-512.)"""

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from specmesh.runtime import cpu_kernels

ROOT = Path(__file__).resolve().parents[2]

# what a CPU must have to run a build for each target (Linux's /proc/cpuinfo names), and, where this CPU's own
# build already is that target's vector path, nothing new to test
TARGETS = {
    "x86-64-v3": {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"},
    "x86-64-v2": {"sse4_2", "ssse3", "popcnt"},
}


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 targets only")
@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler here: the kernels cannot be built")
@pytest.mark.parametrize("target", list(TARGETS))
def test_the_kernels_built_for_a_lesser_cpu_pass_their_tests_here(target, tmp_path):
    flags = set(cpu_kernels._cpu_flags().split())
    missing = TARGETS[target] - flags
    if missing:
        pytest.skip(f"this CPU cannot run a build for {target} (no {', '.join(sorted(missing))})")
    if target == "x86-64-v3" and "avx512f" not in flags:
        pytest.skip("this CPU's own build is AVX2's path: the suite ran it already")
    env = {**os.environ, "SPECMESH_CPU_MARCH": target, "SPECMESH_CACHE_DIR": str(tmp_path)}
    tests = ["tests/unit/test_decode_step.py", "tests/unit/test_cpu_kernels.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-p", "no:xdist", *tests]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout
    # built for that target, not this CPU: the library's cache holds one build, named by its flags' hash
    assert len(list(tmp_path.glob("cpu_kernels-*.so"))) == 1
