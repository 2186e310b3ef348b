"""`specmesh widen`: the widened checkpoint's logits equal the source's (fp32, within 1e-3) and its greedy output
token for token, in transformers and in our paged runtime, for widenings of every dimension (a head_dim change
among them), GQA narrower and wider than the source's; sharded output; the presets' sizes; bad shapes a clear
error with exit 2."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from specmesh import cli, widen
from specmesh.runtime.paged import PagedRunner
from tests.support.models import full_logits

VOCAB = 96


def source(tmp_path, name="src", **overrides):
    """A tiny random Llama (peaked logits, so greedy has few near-ties) saved as a checkpoint directory."""
    torch.manual_seed(0)
    kw = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    model = LlamaForCausalLM(LlamaConfig(**{**kw, **overrides})).eval()
    path = tmp_path / name
    model.save_pretrained(path)
    return path, model


def load(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def greedy(model, ids, n=24):
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


IDS = [3, 17, 42, 5, 9, 77, 21, 60, 11, 2, 33, 48]

WIDENINGS = {
    # every dimension at once, the head_dim doubled (RoPE pairs moved to every other pair), GQA group 2 -> 4
    "all": widen.Shape(96, 4, 8, 2, 32, 320),
    # the head_dim alone, x4
    "head_dim": widen.Shape(64, 2, 4, 2, 64, 128),
    # more KV heads than query groups need: GQA group 2 -> 1 (no grouping), extra layers
    "mha": widen.Shape(96, 3, 6, 6, 16, 128),
}


@pytest.mark.parametrize("name", sorted(WIDENINGS))
def test_the_widened_model_computes_the_sources_logits(tmp_path, name):
    src_path, src = source(tmp_path)
    target = WIDENINGS[name]
    config = widen.widen(src_path, tmp_path / "wide", target)
    assert widen.Shape.of(config) == target
    wide = load(tmp_path / "wide")
    assert sum(p.numel() for p in wide.parameters()) > sum(p.numel() for p in src.parameters())
    ref = full_logits(src, IDS, len(IDS))
    got = full_logits(wide, IDS, len(IDS))
    torch.testing.assert_close(got, ref, atol=1e-3, rtol=0)
    assert greedy(wide, IDS) == greedy(src, IDS)
    # Our runtime over the widened model: the source's logits too (its own checks against HF, the paged path).
    runner = PagedRunner(wide, 32, 8)
    seq = runner.new_sequence(IDS[:-3])
    runner.prefill(seq)
    torch.testing.assert_close(runner.forward([seq], [IDS[-3:]])[0], full_logits(src, IDS, 4), atol=1e-3, rtol=0)


def test_a_narrower_query_grouping_copies_the_kv_heads(tmp_path):
    """Source 8 query heads over 2 KV heads (groups of 4); widened to groups of 2: each KV head twice."""
    src_path, src = source(tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    plan = widen.Plan.check(
        widen.Shape.of(json.loads((src_path / "config.json").read_text())), widen.Shape(64, 2, 8, 4, 8, 128)
    )
    assert plan.kv_copies == 2 and sorted(plan.q_slot(i) for i in range(8)) == list(range(8))
    widen.widen(src_path, tmp_path / "wide", plan.target)
    torch.testing.assert_close(
        full_logits(load(tmp_path / "wide"), IDS, 5), full_logits(src, IDS, 5), atol=1e-3, rtol=0
    )


def test_shards_tied_embeddings_bf16_and_the_tokenizer_files(tmp_path, monkeypatch):
    src_path, src = source(tmp_path, tie_word_embeddings=True)
    (src_path / "tokenizer_config.json").write_text("{}")
    monkeypatch.setattr(widen, "SHARD_BYTES", 64 << 10)
    widen.widen(src_path, tmp_path / "wide", widen.Shape(96, 3, 4, 2, 16, 192))
    index = json.loads((tmp_path / "wide" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 3 and (tmp_path / "wide" / "tokenizer_config.json").exists()
    wide = load(tmp_path / "wide")
    assert wide.config.tie_word_embeddings and "lm_head.weight" not in index["weight_map"]
    torch.testing.assert_close(full_logits(wide, IDS, 4), full_logits(src, IDS, 4), atol=1e-3, rtol=0)
    widen.widen(src_path, tmp_path / "bf16", widen.Shape(96, 3, 4, 2, 16, 192), dtype="bfloat16")
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16").eval()
    assert half.dtype == torch.bfloat16
    assert greedy(half, IDS, 8)[:4] == greedy(src, IDS, 8)[:4]


@pytest.mark.parametrize("preset", sorted(widen.PRESETS))
def test_the_presets_are_the_real_models_size_less_the_vocabulary(preset):
    ours = widen.PRESETS[preset].params_less_vocab()
    real = widen.REAL_PARAMS_LESS_VOCAB[preset]
    assert abs(ours - real) / real < 0.05


def test_the_presets_widen_the_demo_pair():
    """The GPU script's widenings are legal plans: the demo target to 8B's shape, the demo draft to 1B's."""
    from tests.support.models import ROOT

    for model, preset in (("target", "llama-3.1-8b"), ("draft", "llama-3.2-1b")):
        config = json.loads((ROOT / "models" / "demo" / model / "config.json").read_text())
        plan = widen.Plan.check(widen.Shape.of(config), widen.PRESETS[preset])
        assert len(set(plan.q_slot(i) for i in range(config["num_attention_heads"]))) == config["num_attention_heads"]


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--num-attention-heads", "2"], "--num-attention-heads 2"),  # fewer heads than the source
        (["--head-dim", "24"], "--head-dim 24"),  # cannot hold the source's 16-dimension heads' RoPE pairs
        (["--num-attention-heads", "16", "--num-key-value-heads", "1"], "--num-key-value-heads 1"),
        (["--hidden-size", "32"], "--hidden-size 32"),
        (["--hidden-size", "66"], "--hidden-size 66"),  # not a multiple of the 4 heads (transformers refuses it)
    ],
)
def test_bad_shapes_exit_2_naming_the_flag(tmp_path, capsys, flags, named):
    src_path, _ = source(tmp_path)
    code = cli.main(["widen", "--source", str(src_path), "--out", str(tmp_path / "wide"), *flags])
    assert code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "wide").exists()


def test_the_cli_writes_a_widening(tmp_path, capsys):
    src_path, src = source(tmp_path)
    out = tmp_path / "wide"
    assert cli.main(["widen", "--source", str(src_path), "--out", str(out), "--hidden-size", "128", "--seed", "3"]) == 0
    assert "parameters less the vocabulary" in capsys.readouterr().out
    torch.testing.assert_close(full_logits(load(out), IDS, 3), full_logits(src, IDS, 3), atol=1e-3, rtol=0)
    assert cli.main(["widen", "--source", str(src_path), "--out", str(out)]) == 2  # not empty
