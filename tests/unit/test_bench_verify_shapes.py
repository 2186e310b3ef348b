"""bench.verify_shapes: both passes replay the same forwards, every stream commits exactly its tokens, and a
backend setting runs in its own process end to end, with a profiled child (a tiny model built from its config
alone)."""

from __future__ import annotations

import json

import pytest

from bench import verify_shapes
from tests.support.models import tiny_model


@pytest.mark.parametrize("k", [0, 3])
def test_schedule_commits_every_token_of_every_stream(k):
    rounds = verify_shapes.schedule(streams=5, k=k, tokens=20, seed=1)
    committed = [0] * 5
    for rnd in rounds:
        assert len({s for s, _ in rnd}) == len(rnd)  # a stream at most once per forward
        for s, n in rnd:
            assert 1 <= n <= k + 1
            committed[s] += n
    assert committed == [20] * 5
    assert rounds == verify_shapes.schedule(streams=5, k=k, tokens=20, seed=1)  # the same shapes again
    if k == 0:
        assert len(rounds) == 20


def test_a_backend_run_end_to_end_with_its_profile(tmp_path):
    tiny_model("llama", vocab=97, seed=0).config.save_pretrained(tmp_path / "model")
    out = tmp_path / "shapes.json"
    argv = ["--target", str(tmp_path / "model"), "--random-weights", "--device", "cpu", "--streams", "1,3"]
    argv += ["--tokens", "6", "--prompt-len", "5", "--k", "2", "--backends", "math", "--profile", "math"]
    verify_shapes.main([*argv, "--out", str(out)])
    results = json.loads(out.read_text())
    profile = results["profile"]  # the profiled child's operator table: the most streams, first pass
    assert profile["backend"] == "math" and profile["streams"] == 3 and len(profile["ms"]) > 0
    assert "aten::mm" in profile["table"] or "aten::addmm" in profile["table"] or "aten::linear" in profile["table"]
    assert "Self CPU time total" in profile["table"]
    rows = results["rows"]
    assert {(r["streams"], r["mode"], r["pass"]) for r in rows} == {
        (s, m, p) for s in (1, 3) for m in ("speculative", "target-only") for p in (1, 2)
    }
    for r in rows:
        twin = next(x for x in rows if (x["streams"], x["mode"], x["pass"]) == (r["streams"], r["mode"], 3 - r["pass"]))
        assert r["forwards"] == twin["forwards"] == len(r["ms"]) > 0
        if r["mode"] == "target-only":
            assert r["forwards"] == 6
    assert out.with_suffix(".png").stat().st_size > 0


def test_an_unknown_backend_is_refused():
    with pytest.raises(SystemExit):
        verify_shapes.parse_args(["--backends", "default,flash2"])


def test_the_paged_runner_end_to_end_and_graphs_only_on_cuda(tmp_path):
    tiny_model("llama", vocab=97, seed=0).config.save_pretrained(tmp_path / "model")
    out = tmp_path / "shapes.json"
    argv = ["--target", str(tmp_path / "model"), "--random-weights", "--device", "cpu", "--streams", "2"]
    argv += ["--tokens", "5", "--prompt-len", "5", "--k", "2", "--backends", "default", "--runner", "paged"]
    verify_shapes.main([*argv, "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["runner"], r["graphs"], r["mode"]) for r in rows} == {
        ("paged", False, "speculative"),
        ("paged", False, "target-only"),
    }
    with pytest.raises(SystemExit):
        verify_shapes.parse_args([*argv, "--cuda-graphs", "on"])
