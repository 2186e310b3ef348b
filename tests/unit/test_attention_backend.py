"""`--attention-backend`: which SDPA kernels the runtimes may call, checked where it is set."""

from __future__ import annotations

import pytest
import torch

from draft_service.engine import DraftConfig
from specmesh.runtime.attention import sdpa_context
from specmesh.runtime.batched import BatchedRunner
from tests.support.models import tiny_model
from verify_service.engine import VerifyConfig


def _flags() -> tuple[bool, bool, bool, bool]:
    b = torch.backends.cuda
    return (b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled())


@pytest.mark.parametrize(
    ("name", "device", "inside"),
    [
        ("auto", "cuda", (False, True, True, True)),  # cuDNN's plan per new length kept out on CUDA
        ("auto", "cpu", None),  # torch's own choice
        ("default", "cuda", None),
        ("no-cudnn", "cpu", (False, True, True, True)),
        ("math", "cuda", (False, False, False, True)),
    ],
)
def test_each_setting_enables_its_kernels_and_restores_them(name, device, inside):
    before = _flags()
    # The flags are process-wide and plain booleans, so they can be read on a machine without CUDA.
    with sdpa_context(name, torch.device(device)):
        assert _flags() == (before if inside is None else inside)
    assert _flags() == before


def test_an_unknown_setting_is_refused_where_it_is_configured():
    with pytest.raises(ValueError, match="attention_backend"):
        sdpa_context("flash9", torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend"):
        VerifyConfig(model_path="m", attention_backend="flash9")
    with pytest.raises(ValueError, match="attention_backend"):
        DraftConfig(model_path="m", attention_backend="flash9")
    with pytest.raises(ValueError, match="attention_backend"):
        BatchedRunner(tiny_model("llama", vocab=61, seed=0), num_slots=1, max_seq_len=16, attention_backend="x")


def test_the_math_kernel_gives_the_default_kernels_logits():
    model = tiny_model("llama", vocab=61, seed=3)
    got = []
    for name in ("auto", "math"):
        runner = BatchedRunner(model, num_slots=2, max_seq_len=32, attention_backend=name)
        seqs = [runner.new_sequence([1, 5, 9, 2]), runner.new_sequence([7, 3])]
        got.append(runner.forward(seqs, [[4, 8, 6], [2]]))
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
