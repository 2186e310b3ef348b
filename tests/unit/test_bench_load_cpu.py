"""bench.load's CPU accounting: CPU seconds of each stack process per 1,000 completion tokens, from /proc."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.load import SPLIT, cpu_per_1k_tokens, parse_args, pin_threads, process_cpu_seconds

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def test_a_busy_process_is_charged_and_an_idle_one_is_not():
    busy = subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 0.6: pass"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.6)"])
    procs = [("busy", busy), ("idle", idle)]
    try:
        before = process_cpu_seconds(procs)
        time.sleep(0.5)
        after = process_cpu_seconds(procs)
    finally:
        busy.wait(5), idle.wait(5)
    assert before is not None and after is not None
    assert after["busy"] - before["busy"] > 0.2
    assert after["idle"] - before["idle"] < 0.1
    per_1k = cpu_per_1k_tokens([(before, after)], 500)
    assert per_1k is not None and per_1k["busy"] == pytest.approx(2 * (after["busy"] - before["busy"]), abs=1e-3)


def test_passes_pool_and_a_missing_reading_is_null():
    a = ({"verify": 1.0}, {"verify": 3.0})
    b = ({"verify": 5.0}, {"verify": 6.0})
    assert cpu_per_1k_tokens([a, b], 2000) == {"verify": 1.5}
    assert cpu_per_1k_tokens([a, (None, {"verify": 1.0})], 1010) is None
    assert cpu_per_1k_tokens([], 100) is None
    assert cpu_per_1k_tokens([({"v": 0.0}, {"v": 1.0})], 0) is None


def test_split_placement_pins_every_thread_of_a_process():
    """--placement split: a process's threads already running (torch's pools) move to its role's core too."""
    import os

    script = (
        "import threading, time\n"
        "for _ in range(3): threading.Thread(target=time.sleep, args=(5,)).start()\n"
        "time.sleep(5)"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        time.sleep(0.5)
        pin_threads(proc.pid, SPLIT["draft"])
        tasks = list(Path(f"/proc/{proc.pid}/task").iterdir())
        assert len(tasks) >= 4
        assert all(os.sched_getaffinity(int(t.name)) == {1} for t in tasks)
    finally:
        proc.kill()
        proc.wait()
    assert SPLIT["verify"] == SPLIT["gateway"] == {0} and not SPLIT["draft"] & SPLIT["verify"]
    assert parse_args(["--placement", "split"]).placement == "split"
