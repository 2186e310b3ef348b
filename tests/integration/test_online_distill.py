"""The predict-verify-optimize loop in the draft service: feedback from a real verify service trains the
draft while it serves, new weights swap in during the run, and the output law stays the target's."""

from concurrent.futures import ThreadPoolExecutor

from specmesh.v1 import common_pb2, draft_pb2
from tests.support.laws import (
    LAW_PROMPT,
    first_two_counts,
    law_target,
    pooled_chisquare,
    sampling_services,
    two_token_law,
)
from tests.support.services import draft_stub, generate


def test_sampled_law_holds_while_the_draft_learns_and_its_weights_swap(tmp_path):
    target = law_target()
    verify, draft = sampling_services(
        target,
        0.5,
        steps=2,
        online_distill=True,
        online_distill_dir=str(tmp_path),
        online_distill_cpu_share=1.0,
        online_distill_steps_per_version=3,
        online_distill_lr=1e-2,
        online_distill_rollback_window=200,
    )
    online = draft.server.engine.online
    prompt = LAW_PROMPT
    _, joint = two_token_law(target, prompt)
    params = common_pb2.SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    asked = common_pb2.SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logprobs=2)
    n = 2000
    stub = draft_stub(draft)
    try:
        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(lambda i: generate(stub, prompt, asked if i % 50 == 0 else params), range(n)))
        info = stub.Info(draft_pb2.DraftServiceInfoRequest())
        by_version = online.distiller.acceptance_by_version()
        updates = online.distiller.updates
    finally:
        draft.stop()
        verify.stop()
    assert info is not None
    # The loop ran during the law under test: versions were published, and several served blocks.
    assert updates >= 3
    assert sum(1 for drafted, _ in by_version.values() if drafted > 0) >= 2
    assert (tmp_path / "v1" / "weights.pt").is_file()
    # The caller sees the feedback only when it asked, and only as much as it asked for.
    for i, (_tokens, chunks) in enumerate(runs[:200]):
        logprobs = [lp for c in chunks for lp in c.tokens.logprobs]
        if i % 50 == 0:
            assert len(logprobs) == 3 and all(len(lp.top_ids) == 2 for lp in logprobs)
        else:
            assert logprobs == []
    assert pooled_chisquare(first_two_counts(runs), joint, n) > 1e-3
