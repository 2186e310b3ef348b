"""`specmesh widen`: a function-preserving widening of a Llama checkpoint, so that a real-size pair can be
measured where no model hub is reachable.

The widened model computes exactly the source's logits while every forward does the larger shape's work:

* **Residual stream** h -> H: the embeddings' new columns are zero, and everything written into the stream
  (o_proj's and down_proj's new rows) is zero, so the stream's new dimensions stay zero in every layer.
* **RMSNorm**: over H dimensions of which h are non-zero the mean square is h/H of the source's; with eps
  scaled by h/H as well (`rms_norm_eps` is one value for every norm), rms' = sqrt(h/H) x rms, which the norm
  weights undo (x sqrt(h/H)).
* **Attention**: each source query head goes to a slot whose KV group holds a copy of its source KV head
  (copies where the new grouping is narrower: never fewer KV heads than the source). A head of D = r x d
  dimensions holds the source's d: HF's rotary embedding pairs dimension j with j + D/2 at frequency
  theta^(-2j/D), so source pair j' (frequency theta^(-2j'/d)) goes to j = r x j', at the same theta; every
  other query and key dimension is zero. Queries are scaled by sqrt(D / d), which keeps the softmax's
  1/sqrt(head_dim). Values take a head's first d dimensions, and o_proj reads those alone.
* **MLP** m -> M: the new units' down_proj columns are zero. **Layers** L -> L': the new ones, last, have zero
  o_proj and down_proj, so they add nothing to the stream.
* Weights that cannot reach the output (the new heads' queries, the new units' gates, the new layers' other
  matrices, columns that read the stream's zero dimensions) are random, as a trained model's would be.

The vocabulary stays the source's, so the widened pair leaves out the real models' embedding and LM-head work
(`vocab_share` says how much). Written layer by layer into safetensors shards: an 8B-class widening never
holds more than a shard in memory.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from specmesh.errors import ConfigError

SHAPE_FIELDS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
)


@dataclass(frozen=True)
class Shape:
    """A Llama's shape under transformers' config names."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int

    @classmethod
    def of(cls, config: dict) -> Shape:
        heads = config["num_attention_heads"]
        return cls(
            config["hidden_size"],
            config["num_hidden_layers"],
            heads,
            config.get("num_key_value_heads") or heads,
            config.get("head_dim") or config["hidden_size"] // heads,
            config["intermediate_size"],
        )

    def layer_params(self) -> int:
        """Parameters of one decoder layer (no biases: Llama has none)."""
        h, d = self.hidden_size, self.head_dim
        attention = h * d * (2 * self.num_attention_heads + 2 * self.num_key_value_heads)
        return attention + 3 * h * self.intermediate_size + 2 * h

    def params_less_vocab(self) -> int:
        """Every parameter but the embeddings and the LM head."""
        return self.num_hidden_layers * self.layer_params() + self.hidden_size


# The real models' shapes, and their parameters less the vocabulary (embeddings, and the LM head where it is
# untied), from their published configs: Llama 3.1 8B has 8.03B parameters of which 2 x 128,256 x 4,096 are
# the untied embeddings and head; Llama 3.2 1B 1.24B of which 128,256 x 2,048 are its tied embeddings.
PRESETS = {
    "llama-3.1-8b": Shape(4096, 32, 32, 8, 128, 14336),
    "llama-3.2-1b": Shape(2048, 16, 32, 8, 64, 8192),
}
REAL_PARAMS_LESS_VOCAB = {
    "llama-3.1-8b": 8_030_261_248 - 2 * 128_256 * 4096,
    "llama-3.2-1b": 1_235_814_400 - 128_256 * 2048,
}
ROPE_TYPES = ("default", "linear", "llama3")  # scalings that depend on each frequency alone
SHARD_BYTES = 2 << 30


@dataclass(frozen=True)
class Plan:
    """Where each source head goes (see the module docstring)."""

    source: Shape
    target: Shape
    kv_copies: int  # KV slots per source KV head

    @classmethod
    def check(cls, source: Shape, target: Shape) -> Plan:
        """The plan, or ConfigError naming the flag that cannot be honoured."""
        for name in SHAPE_FIELDS:
            if getattr(target, name) < getattr(source, name):
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag} {getattr(target, name)}: below the source's {getattr(source, name)}")
        d, big_d = source.head_dim, target.head_dim
        if d % 2 or big_d % d:
            raise ConfigError(
                f"--head-dim {big_d}: must be a multiple of the source's {d} to hold its RoPE pairs at their "
                "frequencies"
            )
        if target.hidden_size % target.num_attention_heads:  # transformers refuses such a config
            raise ConfigError(
                f"--hidden-size {target.hidden_size}: not a multiple of --num-attention-heads "
                f"{target.num_attention_heads}"
            )
        if target.num_attention_heads % target.num_key_value_heads:
            raise ConfigError(
                f"--num-attention-heads {target.num_attention_heads}: not a multiple of --num-key-value-heads "
                f"{target.num_key_value_heads}"
            )
        group = source.num_attention_heads // source.num_key_value_heads
        new_group = target.num_attention_heads // target.num_key_value_heads
        copies = math.ceil(group / new_group)
        if source.num_key_value_heads * copies > target.num_key_value_heads:
            raise ConfigError(
                f"--num-key-value-heads {target.num_key_value_heads}: the source's {source.num_key_value_heads} KV "
                f"heads of {group} query heads each need {source.num_key_value_heads * copies} in groups of {new_group}"
            )
        return cls(source, target, copies)

    def rope_dims(self) -> list[int]:
        """The widened head's dimension of each source query/key dimension."""
        d, big_d = self.source.head_dim, self.target.head_dim
        r, half = big_d // d, d // 2
        return [r * j for j in range(half)] + [big_d // 2 + r * j for j in range(half)]

    def kv_slot(self, kv_head: int, copy: int) -> int:
        return kv_head * self.kv_copies + copy

    def q_slot(self, head: int) -> int:
        """The widened query head of source query head `head`: in the group of a copy of its KV head."""
        group = self.source.num_attention_heads // self.source.num_key_value_heads
        new_group = self.target.num_attention_heads // self.target.num_key_value_heads
        kv, t = divmod(head, group)
        return self.kv_slot(kv, t // new_group) * new_group + t % new_group


def _widen_layer(plan: Plan, src: dict | None, rnd, std: float) -> dict:
    """One decoder layer's widened tensors (fp32) from the source layer's (`src`: q, k, v, o, gate, up, down,
    input_norm, post_norm; None for a new layer)."""
    import torch

    s, t = plan.source, plan.target
    h, big_h, d, big_d = s.hidden_size, t.hidden_size, s.head_dim, t.head_dim
    out = {
        "q": rnd(t.num_attention_heads * big_d, big_h) * std,
        "k": rnd(t.num_key_value_heads * big_d, big_h) * std,
        "v": rnd(t.num_key_value_heads * big_d, big_h) * std,
        "o": torch.zeros(big_h, t.num_attention_heads * big_d),
        "gate": rnd(t.intermediate_size, big_h) * std,
        "up": rnd(t.intermediate_size, big_h) * std,
        "down": torch.zeros(big_h, t.intermediate_size),
        "input_norm": torch.ones(big_h),
        "post_norm": torch.ones(big_h),
    }
    if src is None:  # a new layer: its o_proj and down_proj stay zero
        return out
    norm = math.sqrt(h / big_h)
    out["input_norm"] *= norm
    out["post_norm"] *= norm
    out["input_norm"][:h] = src["input_norm"] * norm
    out["post_norm"][:h] = src["post_norm"] * norm
    rope = torch.tensor(plan.rope_dims())
    q_scale = math.sqrt(big_d / d)
    for i in range(s.num_attention_heads):
        slot = plan.q_slot(i)
        block = torch.zeros(big_d, big_h)
        block[rope, :h] = src["q"][i * d : (i + 1) * d] * q_scale
        out["q"][slot * big_d : (slot + 1) * big_d] = block
        out["o"][:h, slot * big_d : slot * big_d + d] = src["o"][:, i * d : (i + 1) * d]
    for j in range(s.num_key_value_heads):
        for c in range(plan.kv_copies):
            slot = plan.kv_slot(j, c)
            block = torch.zeros(big_d, big_h)
            block[rope, :h] = src["k"][j * d : (j + 1) * d]
            out["k"][slot * big_d : (slot + 1) * big_d] = block
            out["v"][slot * big_d : slot * big_d + d, :h] = src["v"][j * d : (j + 1) * d]
    m = s.intermediate_size
    out["gate"][:m, :h] = src["gate"]
    out["up"][:m, :h] = src["up"]
    out["down"][:h, :m] = src["down"]
    return out


LAYER_KEYS = {
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "input_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
}


def _config(path: Path) -> dict:
    """The source's config; ConfigError unless it is a Llama without biases, with a rotary scaling kept."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"--source {path}: no readable config.json ({e})") from None
    if config.get("model_type") != "llama":
        raise ConfigError(f"--source {path}: model_type {config.get('model_type')!r}; widen takes Llama checkpoints")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ConfigError(f"--source {path}: a Llama with biases is not supported")
    rope = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get("rope_type", "default")
    if rope not in ROPE_TYPES:
        raise ConfigError(f"--source {path}: rope_type {rope!r}; widen keeps {', '.join(ROPE_TYPES)}")
    return config


def _state(path: Path) -> dict:
    """The source's weights in fp32."""
    import torch
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"--source {path}: no *.safetensors weights")
    state: dict = {}
    for f in files:
        state.update({k: v.to(torch.float32) for k, v in load_file(str(f)).items()})
    return state


class _Shards:
    """Tensors into safetensors shards of at most SHARD_BYTES, each written as soon as it is full (memory holds
    one), named and indexed as transformers reads them once the last is written."""

    def __init__(self, out: Path, dtype):
        self.out, self.dtype = out, dtype
        self.pending: dict = {}
        self.size = 0
        self.written: list[tuple[Path, list[str]]] = []  # each shard's file and tensor names

    def put(self, name: str, tensor) -> None:
        tensor = tensor.to(self.dtype).contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > SHARD_BYTES:
            self._flush()
        self.pending[name] = tensor
        self.size += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out / f"shard-{len(self.written):05d}.tmp"
        save_file(self.pending, str(path), metadata={"format": "pt"})
        self.written.append((path, list(self.pending)))
        self.pending, self.size = {}, 0

    def close(self) -> None:
        if self.pending:
            self._flush()
        n = len(self.written)
        weight_map: dict[str, str] = {}
        for i, (tmp, names) in enumerate(self.written):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            tmp.rename(self.out / name)
            weight_map.update(dict.fromkeys(names, name))
        if n > 1:
            total = sum((self.out / name).stat().st_size for name in set(weight_map.values()))
            body = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (self.out / "model.safetensors.index.json").write_text(json.dumps(body, indent=2) + "\n")


DTYPES = ("float32", "bfloat16", "float16")


def widen(source: Path, out: Path, target: Shape, dtype: str = "float32", seed: int = 0) -> dict:
    """Write the widening of `source` to `target`'s shape into `out` (a new or empty directory); returns
    the widened config."""
    import torch

    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out}: exists and is not empty")
    if dtype not in DTYPES:
        raise ConfigError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    config = _config(source)
    plan = Plan.check(Shape.of(config), target)
    state = _state(source)
    s, t = plan.source, plan.target
    g = torch.Generator().manual_seed(seed)
    std = float(config.get("initializer_range", 0.02))

    def rnd(*shape):
        return torch.randn(*shape, generator=g)

    out.mkdir(parents=True, exist_ok=True)
    shards = _Shards(out, getattr(torch, dtype))
    h, big_h = s.hidden_size, t.hidden_size
    embed = torch.zeros(state["model.embed_tokens.weight"].shape[0], big_h)
    embed[:, :h] = state["model.embed_tokens.weight"]
    shards.put("model.embed_tokens.weight", embed)
    for i in range(t.num_hidden_layers):
        prefix = f"model.layers.{i}."
        src = {k: state[prefix + name] for k, name in LAYER_KEYS.items()} if i < s.num_hidden_layers else None
        for k, tensor in _widen_layer(plan, src, rnd, std).items():
            shards.put(prefix + LAYER_KEYS[k], tensor)
    norm = torch.full((big_h,), math.sqrt(h / big_h))
    norm[:h] = state["model.norm.weight"] * math.sqrt(h / big_h)
    shards.put("model.norm.weight", norm)
    if not config.get("tie_word_embeddings") and "lm_head.weight" in state:
        head = rnd(state["lm_head.weight"].shape[0], big_h) * std
        head[:, :h] = state["lm_head.weight"]
        shards.put("lm_head.weight", head)
    shards.close()

    widened = {**config, **asdict(t)}
    widened["rms_norm_eps"] = float(config.get("rms_norm_eps", 1e-6)) * h / big_h
    widened["dtype"] = dtype
    widened["specmesh_widened_from"] = {"source": str(source), **asdict(s)}
    (out / "config.json").write_text(json.dumps(widened, indent=2) + "\n")
    for f in source.iterdir():  # the tokenizer and the generation config, as they are
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out / f.name)
    return widened


def vocab_share(config: dict) -> float:
    """The share of a forward's weights that are the embeddings and the LM head (per token, the LM head's
    matmul and one embedding row): what a widened pair with the source's vocabulary leaves out of the real
    model's, for this shape with the real model's vocabulary."""
    shape = Shape.of(config)
    head = config["vocab_size"] * shape.hidden_size
    return head / (head + shape.params_less_vocab())


def add_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--source", required=True, help="the Llama checkpoint to widen (a directory)")
    ap.add_argument("--out", required=True, help="a new or empty directory for the widened checkpoint")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a real model's shape; the flags below override it")
    for name in SHAPE_FIELDS:
        ap.add_argument(
            "--" + name.replace("_", "-"), type=int, help=f"{name} (default: the preset's, else the source's)"
        )
    ap.add_argument("--dtype", default="float32", choices=DTYPES, help="the widened weights' dtype")
    ap.add_argument("--seed", type=int, default=0, help="seed of the weights that cannot reach the output")


def run(args: argparse.Namespace) -> int:
    source = Path(args.source)
    base = PRESETS[args.preset] if args.preset else Shape.of(_config(source))
    target = replace(base, **{f.name: getattr(args, f.name) for f in fields(Shape) if getattr(args, f.name)})
    widened = widen(source, Path(args.out), target, args.dtype, args.seed)
    shape = Shape.of(widened)
    print(
        f"wrote {args.out}: {shape.params_less_vocab() / 1e9:.3f}B parameters less the vocabulary "
        f"({', '.join(f'{k} {v}' for k, v in asdict(shape).items())}; {args.dtype}); the vocabulary's "
        f"{vocab_share(widened):.1%} of the weights a token reads"
    )
    return 0
