"""The benchmarks' held-out prompts: the first window of every held-out standard-library file first, always
the same ones, then windows further into the same files."""

from __future__ import annotations

from bench.inprocess import heldout_prompts
from specmesh.training.corpus import read_text, stdlib_files
from tests.support.models import demo_tokenizer


def test_more_windows_per_file_keep_the_first_ones_first():
    tok = demo_tokenizer()
    first = heldout_prompts(tok, 100, 32)
    more = heldout_prompts(tok, 100, 32, per_file=3)
    assert first and more[: len(first)] == first and len(more) > len(first)
    assert heldout_prompts(tok, 5, 32, per_file=3) == first[:5]
    files = [read_text(p) for p in stdlib_files()[1]]
    encoded = [tok(t, add_special_tokens=False)["input_ids"] for t in files if t]
    for p in more[len(first) :]:
        assert len(p) == 32
        assert any(ids[64 : 64 + 32] == p or ids[128 : 128 + 32] == p for ids in encoded)  # 2 x length apart
