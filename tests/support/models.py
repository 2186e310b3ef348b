"""Tiny randomly initialised Llama / Qwen2 / Qwen3 models built from a config in the test, and the demo
checkpoint's tokenizer with a tiny target over its vocabulary (what the tests of text, chat and the REST and
gRPC fronts run on)."""

import copy
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parents[2]
# The demo target's checkpoint directory: its tokenizer (byte-level BPE with a chat template) is the tests'.
DEMO_TOKENIZER = ROOT / "models" / "demo" / "target"


def _tiny_config(vocab: int = 128, hidden: int = 64, layers: int = 2, init_range: float = 0.2) -> dict:
    """The config fields of every tiny model here: 4 query heads over 2 KV heads (GQA), a 2x MLP."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=init_range,
    )


def tiny_model(
    arch: str = "llama", vocab: int = 128, hidden: int = 64, layers: int = 2, seed: int = 0, init_range: float = 0.2
):
    """A random model whose logits are peaked enough (init_range) that greedy has few near-ties."""
    torch.manual_seed(seed)
    kw = _tiny_config(vocab, hidden, layers, init_range)
    kw.update(max_position_embeddings=1024, eos_token_id=vocab - 1, bos_token_id=vocab - 1)
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kw)).eval()
    raise ValueError(arch)


# The config fields tiny_qwen3 and tiny_llama_mha share: tiny_model's size, built from config fields directly.
_TINY = _tiny_config()


def tiny_qwen3(seed: int = 3, **overrides):
    """A Qwen3 (q_norm / k_norm and an explicit head_dim) of tiny_model's size; `overrides`: config fields."""
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(**{**_TINY, "head_dim": 16, **overrides})).eval()


def tiny_llama_mha(seed: int = 7, **overrides):
    """A Llama without GQA (as the demo target: as many KV heads as query heads) of tiny_model's size, for
    the attention path without the grouped-query fold; `overrides`: config fields."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**_TINY, "num_key_value_heads": 4, **overrides})).eval()


def noisy_copy(model, noise: float, seed: int = 1):
    """A draft that agrees with the target often but not always: the target plus weight noise."""
    draft = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    return draft.eval()


def demo_tokenizer():
    """The demo checkpoint's tokenizer: text, stop strings and the chat template work with it."""
    return AutoTokenizer.from_pretrained(DEMO_TOKENIZER)


def demo_target(tokenizer, seed: int = 31, tokenizer_eos: bool = False):
    """A tiny Llama over `tokenizer`'s vocabulary. `tokenizer_eos`: its EOS is the tokenizer's, as in a real
    checkpoint (a grammar's end is that special token); otherwise tiny_model's (the last id)."""
    model = tiny_model("llama", vocab=len(tokenizer), seed=seed)
    if tokenizer_eos:
        model.config.eos_token_id = model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def greedy_decoder(target, tokenizer=None):
    """The target's own greedy decoding, target-only and in process: the reference a speculative path must
    equal token for token. `decode(prompt_ids, max_tokens, **params)` -> the engine's GenerationResult."""
    from specmesh.engine import SpeculativeEngine
    from specmesh.sampling import SamplingParams

    engine = SpeculativeEngine.from_models(target, tokenizer=tokenizer)
    return lambda ids, max_tokens, **kw: engine.generate(
        ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw), 0
    )


def target_log_softmax(target, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is the target's raw log-softmax (no processing) after ids[: i + 1], in fp32."""
    with torch.no_grad():
        return torch.log_softmax(target(torch.tensor([ids])).logits[0].float(), -1)


def close_logits(got: torch.Tensor, ref: torch.Tensor) -> None:
    """A runner's logits against the HF forward's: within 1e-4 of the largest logit, and the same greedy choice
    on every row."""
    assert got.dtype == torch.float32 and got.shape == ref.shape
    tol = 1e-4 * max(1.0, float(ref.abs().max()))
    torch.testing.assert_close(got, ref, atol=tol, rtol=0)
    if ref.numel():
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def full_logits(model, ids: list[int], rows: int) -> torch.Tensor:
    """The HF forward over the whole sequence, no cache: the last `rows` rows."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0, len(ids) - rows :].float()
