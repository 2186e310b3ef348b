"""`specmesh profile` against real `specmesh serve` stacks of the demo pair: its advice follows the set-up.

Two stacks that differ in one thing each: a fixed K = 12 (far past what the demo draft's acceptance pays for)
must get "lower K" advice; a draft slowed by the draft service's test knob (--debug-draft-slowdown: 20 times
slower, however loaded the machine is) must be named the bottleneck. The HTML report is opened in a real
headless Chromium, which must load every plot.
"""

import json
import shutil
import subprocess
import sys

import pytest

from tests.e2e.test_serve import DEMO, Serve
from tests.support.services import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Speculating at every load (on a CPU the stack would turn it off past one stream, and the gateway would send
# requests past a slow draft once its goodput guard says speculation loses): the advice under test is about K
# and the draft, which the concurrency-4 phase must see speculating. The draft model drafts every round (the
# per-round choice would rightly go around a slow draft with suffix proposals). One verify thread: beside the
# suite's other worker on two cores, a two-thread OpenMP team waits at each of its barriers for a thread the
# scheduler has descheduled, and the forward went from ~2.5 to ~40 ms, so slow that any K's drafts cost nothing
# beside it and lowering K gained under the profiler's 2 % (a machine whose last-level cache holds the target).
DEMO_STACK = [
    "--model-path", str(DEMO / "target"), "--speculative-draft-model-path", str(DEMO / "draft"),
    "--speculative-disable-by-batch-size", "0", "--gateway-arg=--goodput-probe-every=0",
    "--draft-arg=--no-enable-suffix-decoding", "--verify-threads", "1",
]  # fmt: skip


def profile(port: int, out, duration: float = 10) -> dict:
    """`specmesh profile` on the stack at `port` (its metrics found through the stack's record)."""
    run = subprocess.run(
        [sys.executable, "-m", "specmesh", "profile", "--url", f"http://127.0.0.1:{port}", "--duration", str(duration)]
        + ["--concurrency", "1,4", "--max-tokens", "48", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads((out / "report.json").read_text())
    report["stdout"], report["out"] = run.stdout, out
    report["md"] = (out / "report.md").read_text()
    return report


@pytest.fixture(scope="module")
def k12_report(tmp_path_factory):
    # A fixed K: adaptive K would itself stay near the best K below the ceiling of 12 (the profiler then rightly
    # sees little to gain from lowering the ceiling).
    serve = Serve(
        *DEMO_STACK, "--served-model-name", "demo", "--speculative-num-steps", "12", "--draft-arg=--no-adaptive"
    )
    try:
        serve.up()
        # 20 s phases: on a loaded machine (the suite's other worker beside the stack on two cores) the verify
        # forward's share of a round rises to ~60 % and the gain of lowering K falls from ~20 % to ~8-10 %, where
        # a 10 s phase's noise once left it under the profiler's 2 % threshold.
        yield profile(serve.port, tmp_path_factory.mktemp("k12"), duration=20)
    finally:
        serve.kill()


@pytest.fixture(scope="module")
def slow_draft_report(tmp_path_factory):
    # A fixed K here too: adaptive K rightly stops drafting with a draft this slow, and then only its rare
    # probes would measure the draft's cost (a 10 s phase may hold none).
    serve = Serve(
        *DEMO_STACK,
        "--served-model-name",
        "demo",
        "--draft-arg=--debug-draft-slowdown=20",
        "--draft-arg=--no-adaptive",
    )
    try:
        serve.up()
        yield profile(serve.port, tmp_path_factory.mktemp("slow"))
    finally:
        serve.kill()


def test_k12_gets_lower_k_advice(k12_report):
    report = k12_report
    assert report["configured_k"] == 12
    k_advice = [r for r in report["recommendations"] if r["kind"] == "k"]
    assert k_advice, report["recommendations"]
    best = report["best_k"]
    assert best < 12 and f"--speculative-num-steps {best}" in k_advice[0]["command"]
    assert k_advice[0]["gain"] > 0.02
    # The report's sections are all there, each measured.
    for section in ("Bottleneck", "Recommendations", "A round's time budget", "Acceptance per position"):
        assert f"## {section}" in report["md"]
    spec = [p for p in report["phases"] if p["speculative"]]
    assert [p["concurrency"] for p in spec] == [1, 4]
    assert all(p["target_only_requests"] == 0 for p in spec)  # the stack speculated every request (see DEMO_STACK)
    assert all(p["budget_seconds"]["verify forward"] > 0 and p["budget_seconds"]["drafting"] > 0 for p in spec)
    assert 0 < report["alpha"] < 1 and 0 < report["cost_ratio"] < 1
    # The verify forward split by the fused step's own clock (the demo target runs it on this CPU).
    assert "## The verify forward on the CPU, by phase" in report["md"]
    assert all(p["cpu_step_calls"] > 0 and p["cpu_step_seconds"]["products"] > 0 for p in report["phases"])


def test_slow_draft_is_named_the_bottleneck(slow_draft_report, k12_report):
    report = slow_draft_report
    assert report["bottleneck"] == "draft", report["stdout"]
    assert "Bottleneck: draft" in report["md"]
    assert "draft" in [r["kind"] for r in report["recommendations"]], report["stdout"]
    # The same demo pair, only the set-up differs: the measured draft cost and the advice follow it.
    k12 = k12_report
    assert report["cost_ratio"] > 3 * k12["cost_ratio"]
    # ... and so does what a faster draft would give. (Whether the demo draft at K = 12 is itself the
    # bottleneck depends on the machine: with one verify thread its token costs 0.24-0.33 of a target forward,
    # which caps speculation near 1.5x, and the profiler may rightly say so.)
    assert report["sensitivity"]["draft"] > k12["sensitivity"]["draft"]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium)")
def test_html_report_renders_with_its_plots_in_chromium(k12_report, tmp_path):
    report = k12_report
    out = report["out"]
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--allow-file-access-from-files"]
    url = (out / "report.html").as_uri()
    dom = subprocess.run(
        [*flags, "--virtual-time-budget=5000", "--dump-dom", url], capture_output=True, text=True, timeout=120
    ).stdout
    n = len(report["plots"])
    assert n >= 5
    assert f'data-plots="{n}/{n}"' in dom, dom[:500]  # every <img> loaded with a non-zero natural width
    shot = tmp_path / "screenshot.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1000,2400", url], capture_output=True, timeout=120)
    from PIL import Image

    image = Image.open(shot).convert("L")
    assert image.size == (1000, 2400)
    colors = image.getcolors(maxcolors=1 << 16) or []
    assert len(colors) > 50  # text and plots, not a blank page
