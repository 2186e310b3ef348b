"""Tiny randomly initialised Llama / Qwen2 / Qwen3 models built from a config in the test."""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM


def tiny_model(
    arch: str = "llama", vocab: int = 128, hidden: int = 64, layers: int = 2, seed: int = 0, init_range: float = 0.2
):
    """A random model whose logits are peaked enough (init_range) that greedy has few near-ties."""
    torch.manual_seed(seed)
    kw = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=init_range,
        eos_token_id=vocab - 1,
        bos_token_id=vocab - 1,
    )
    if arch == "llama":
        return LlamaForCausalLM(LlamaConfig(**kw)).eval()
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kw)).eval()
    raise ValueError(arch)


# The config fields tiny_qwen3 and tiny_llama_mha share: tiny_model's size, built from config fields directly.
_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
)


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
