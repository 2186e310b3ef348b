"""vLLM's per-request speculative-decoding metrics from a generation's SpecStats: the histograms by draft
length and the per-step arrays as rounds are recorded (kept per generation, never in totals), across merges
and the wire, and `gateway.core.speculative_decoding` holding the invariants AIPerf's vLLM adapter checks;
`specmesh serve --per-request-spec-decode-metrics` reaching the gateway."""

import random

import pytest

from gateway.config import SPEC_DECODE_METRICS_LEVELS
from gateway.core import speculative_decoding
from specmesh import cli, wire
from specmesh.domain import SpecStats
from specmesh.rejection.limits import MAX_SPEC_LEN
from specmesh.v1 import common_pb2


def rounds(stats: SpecStats, pairs) -> SpecStats:
    for k, accepted in pairs:
        stats.record(k, accepted)
    return stats


def aiperf_invariants(m: dict) -> None:
    """What AIPerf 0.13's vLLM adapter and its acceptance record refuse a payload for breaking."""
    hist = m["acceptance_histogram"]
    assert isinstance(hist, list) and all(type(c) is int for c in hist)
    assert len(hist) == m["num_spec_tokens"] + 1
    assert sum(hist) == m["num_spec_steps"]
    assert sum(j * c for j, c in enumerate(hist)) == m["num_accepted_draft_tokens"] <= m["num_draft_tokens"]
    if m.get("per_step_accepted") is not None:
        assert len(m["per_step_accepted"]) == len(m["per_step_drafted"]) == m["num_spec_steps"]
        assert sum(m["per_step_accepted"]) == m["num_accepted_draft_tokens"]
        assert sum(m["per_step_drafted"]) == m["num_draft_tokens"]
        assert all(a <= d for a, d in zip(m["per_step_accepted"], m["per_step_drafted"], strict=True))


def test_rounds_fill_the_histograms_and_the_steps_of_a_generation():
    s = rounds(SpecStats.per_generation(4), [(4, 2), (4, 4), (0, 0), (3, 0), (4, 2)])
    assert s.accepted_by_draft_length == {4: [0, 0, 2, 0, 1], 3: [1, 0, 0, 0]}
    assert s.acceptance_histogram() == [1, 0, 2, 0, 1]
    assert (s.step_drafted, s.step_accepted) == ([4, 4, 3, 4], [2, 4, 0, 2])  # the K = 0 step is no spec step
    m = speculative_decoding(s, detailed=True)
    assert m == {
        "num_spec_tokens": 4,
        "num_spec_steps": 4,
        "num_draft_tokens": 15,
        "num_accepted_draft_tokens": 8,
        "mean_acceptance_length": 3.0,
        "draft_acceptance_rate": 8 / 15,
        "acceptance_histogram": [1, 0, 2, 0, 1],
        "acceptance_histogram_by_draft_length": {3: [1, 0, 0, 0], 4: [0, 0, 2, 0, 1]},
        "per_step_accepted": [2, 4, 0, 2],
        "per_step_drafted": [4, 4, 3, 4],
    }
    assert "per_step_accepted" not in speculative_decoding(s, detailed=False)
    aiperf_invariants(m)


def test_totals_keep_no_steps_and_stay_bounded():
    totals = SpecStats()  # a service's totals over every generation
    for _ in range(1000):
        rounds(totals, [(4, 1), (2, 2)])
        totals.merge(rounds(SpecStats.per_generation(4), [(4, 3)]))
    assert totals.step_drafted is None and totals.step_accepted is None
    assert totals.accepted_by_draft_length == {4: [0, 1000, 0, 1000, 0], 2: [0, 0, 1000]}
    assert totals.num_spec_tokens == 4


def test_merging_adds_histograms_and_steps():
    a = rounds(SpecStats.per_generation(2), [(2, 1), (1, 1)])
    b = rounds(SpecStats.per_generation(5), [(5, 5)])
    a.merge(b)
    assert a.num_spec_tokens == 5 and a.acceptance_histogram() == [0, 2, 0, 0, 0, 1]
    assert (a.step_drafted, a.step_accepted) == ([2, 1, 5], [1, 1, 5])
    a.merge(rounds(SpecStats(), [(2, 0)]))  # a peer that kept no steps: they no longer add up
    m = speculative_decoding(a, detailed=True)
    assert m["per_step_accepted"] is None and m["per_step_drafted"] is None
    assert m["num_spec_steps"] == 4 == sum(m["acceptance_histogram"])


def test_the_wire_carries_them():
    s = rounds(SpecStats.per_generation(3), [(3, 1), (2, 2), (0, 0), (3, 3)])
    back = wire.stats_from_pb(common_pb2.SpecStats.FromString(wire.stats_to_pb(s).SerializeToString()))
    assert back == s
    assert wire.stats_from_pb(wire.stats_to_pb(SpecStats())) == SpecStats()  # nothing kept reads as nothing kept


def test_a_peers_draft_lengths_beyond_any_verifier_are_dropped():
    pb = common_pb2.SpecStats(num_spec_tokens=1 << 30)
    pb.accepted_by_draft_length[1 << 30].rounds.extend([1, 0])
    pb.accepted_by_draft_length[2].rounds.extend([0, 1, 0])
    s = wire.stats_from_pb(pb)
    assert s.num_spec_tokens == MAX_SPEC_LEN and s.accepted_by_draft_length == {2: [0, 1, 0]}
    assert len(s.acceptance_histogram()) == MAX_SPEC_LEN + 1


@pytest.mark.parametrize("seed", range(5))
def test_random_generations_hold_aiperfs_invariants(seed):
    rng = random.Random(seed)
    cap = rng.randint(1, 8)
    s = SpecStats.per_generation(cap)
    for _ in range(rng.randint(0, 50)):
        k = rng.choice([0, *range(1, cap + 1)])
        s.record(k, rng.randint(0, k))
    for detailed in (False, True):
        aiperf_invariants(speculative_decoding(s, detailed))


def test_no_rounds_is_a_zero_histogram():
    m = speculative_decoding(SpecStats.per_generation(0), detailed=True)
    assert m["acceptance_histogram"] == [0] and m["mean_acceptance_length"] == 1.0 and m["draft_acceptance_rate"] == 0
    assert m["per_step_accepted"] == m["per_step_drafted"] == []
    aiperf_invariants(m)


def test_serve_passes_the_level_to_the_gateway():
    assert cli.SPEC_DECODE_METRICS_LEVELS == SPEC_DECODE_METRICS_LEVELS
    args = ["serve", "--model-path", "T", "--draft-model", "D"]
    plan = cli.plan_from_args(cli.parser().parse_args([*args, "--per-request-spec-decode-metrics", "detailed"]))
    assert plan.gateway_args[-2:] == ["--per-request-spec-decode-metrics", "detailed"]
    plain = cli.plan_from_args(cli.parser().parse_args(args))
    assert "--per-request-spec-decode-metrics" not in plain.gateway_args  # the gateway's default, summary
    with pytest.raises(SystemExit):
        cli.parser().parse_args([*args, "--per-request-spec-decode-metrics", "full"])
