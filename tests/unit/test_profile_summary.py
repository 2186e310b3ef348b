"""The profiler's phase summary counts what the stack decoded target-only by its own choice."""

from specmesh.profile.analysis import summarize
from specmesh.profile.collect import Phase, Result


def test_a_speculative_phase_counts_the_requests_the_stack_ran_target_only():
    results = [
        Result(1.0, 16, {"rounds": 6, "drafts": 6, "drafted": 24, "accepted": 12, "target_only": False}),
        Result(1.0, 16, {"rounds": 16, "target_only": True}),
        Result(1.0, 16, {"rounds": 16, "target_only": True}),
    ]
    s = summarize(Phase("c4", 4, True, wall=1.5, results=results), [])
    assert s.requests == 3 and s.target_only_requests == 2 and s.drafted == 24
    # the baseline asks for target-only itself: nothing there is the stack's choice
    baseline = summarize(Phase("baseline", 1, False, wall=1.0, results=results[1:]), [])
    assert baseline.target_only_requests == 0
