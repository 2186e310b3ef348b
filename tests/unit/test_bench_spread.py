"""bench.spread: a level's ratios over repeated bench.load runs, against the same level of A/A runs."""

from __future__ import annotations

import json
import math

import pytest

from bench.spread import main


def _run(path, levels):
    path.write_text(
        json.dumps({"levels": [{"sampling": s, "concurrency": c, "spec_vs_target_only": r} for s, c, r in levels]})
    )


def test_each_level_gets_both_groups_spread_and_their_difference(tmp_path):
    for i, r in enumerate([0.90, 1.00, 1.10]):
        _run(tmp_path / f"ab-{i}.json", [("T=0.7", 1, r), ("greedy", 4, 2.0 + i)])
    for i, r in enumerate([0.97, 1.01]):
        _run(tmp_path / f"aa-{i}.json", [("T=0.7", 1, r)])
    out = tmp_path / "spread.json"
    r = main(["--runs", str(tmp_path / "ab-*.json"), "--control", str(tmp_path / "aa-*.json"), "--out", str(out)])
    assert json.loads(out.read_text()) == r and out.with_suffix(".png").stat().st_size > 0
    t07 = next(lv for lv in r["levels"] if lv["sampling"] == "T=0.7")
    assert t07["ab"]["ratios"] == [0.90, 1.00, 1.10] and t07["ab"]["mean"] == pytest.approx(1.0)
    assert t07["ab"]["sd"] == pytest.approx(0.1) and t07["ab"]["se"] == pytest.approx(0.1 / math.sqrt(3), abs=1e-4)
    assert t07["ab"]["below_threshold"] == 1 and t07["aa"]["below_threshold"] == 1  # 0.90 and 0.97 < 0.98
    assert t07["ab_minus_aa"]["mean_difference"] == pytest.approx(1.0 - 0.99)
    se = math.sqrt((0.1 / math.sqrt(3)) ** 2 + (math.sqrt(0.0008) / math.sqrt(2)) ** 2)
    assert t07["ab_minus_aa"]["se"] == pytest.approx(se, abs=1e-4)
    greedy = next(lv for lv in r["levels"] if lv["sampling"] == "greedy")
    assert "aa" not in greedy and "ab_minus_aa" not in greedy and greedy["ab"]["mean"] == pytest.approx(3.0)


def test_no_matching_runs_is_a_usage_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["--runs", str(tmp_path / "none-*.json"), "--out", str(tmp_path / "x.json")])
    assert e.value.code == 2
