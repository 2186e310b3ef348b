"""bench.draft_speed drives the drafter through its current API: a run of a few rounds on a tiny model, with
every runner it times drafting the same tokens."""

from __future__ import annotations

from bench.draft_speed import run_drafter
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.hf import ModelRunner
from tests.support.models import tiny_model


def test_draft_speed_rounds_run_and_runners_agree():
    model = tiny_model()
    vocab = model.get_output_embeddings().weight.size(0)
    prompt = [1, 2, 3, 4, 5, 6]
    pooled = run_drafter(BatchedRunner(model, num_slots=2, max_seq_len=128), prompt, 12, 4, 1, vocab)
    stock = run_drafter(ModelRunner(model), prompt, 12, 4, 1, vocab)
    assert len(pooled["drafted"]) == 12 and pooled["ms_per_token"] > 0
    assert pooled["drafted"] == stock["drafted"]
