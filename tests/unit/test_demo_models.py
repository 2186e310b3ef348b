"""The committed demo pair: loadable with stock HF classes, one vocabulary, speculative greedy == target greedy."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from specmesh.engine import SpeculativeEngine
from specmesh.sampling import SamplingParams
from specmesh.training.corpus import read_text, stdlib_files

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


@pytest.fixture(scope="module")
def demo():
    target = AutoModelForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(DEMO / "draft", dtype=torch.float32).eval()
    return target, draft, AutoTokenizer.from_pretrained(DEMO / "target"), AutoTokenizer.from_pretrained(DEMO / "draft")


def test_demo_pair_loads_and_shares_a_vocabulary(demo):
    target, draft, tok_t, tok_d = demo
    assert tok_t.get_vocab() == tok_d.get_vocab()
    assert target.config.vocab_size == draft.config.vocab_size == len(tok_t)
    assert target.config.model_type == "llama"
    n_target = sum(p.numel() for p in target.parameters())
    n_draft = sum(p.numel() for p in draft.parameters())
    assert 30e6 < n_target < 45e6 and 2e6 < n_draft < 5e6
    text = "def f(x):\n    return x + 1\n"
    assert tok_t.decode(tok_t(text)["input_ids"]) == text  # byte-level BPE round-trips


def test_demo_speculative_greedy_equals_target_greedy(demo):
    """12 held-out prompts x 64 new tokens, token for token."""
    target, draft, tok, _ = demo
    engine = SpeculativeEngine.from_models(target, draft, tokenizer=tok)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompts = []
    for path in stdlib_files()[1]:
        ids = tok(read_text(path) or "", add_special_tokens=False)["input_ids"]
        for start in range(0, max(0, len(ids) - 32), 400):
            prompts.append(ids[start : start + 32])
    prompts = prompts[:12]
    assert len(prompts) == 12
    accepted = drafted = 0
    for p in prompts:
        base = engine.generate(p, params, num_speculative_tokens=0)
        spec = engine.generate(p, params, num_speculative_tokens=4)
        assert spec.token_ids == base.token_ids
        accepted += spec.stats.accepted
        drafted += spec.stats.drafted
    assert accepted / drafted > 0.3  # the distilled draft really helps on held-out code
