"""Which SDPA kernels the hand-written decoders may call: `--attention-backend`.

* `auto` (the default): on CUDA every SDPA backend but cuDNN; on a CPU in float32 the paged runner attends
  decode steps and verify blocks by its block-table C kernel (`specmesh.runtime.cpu_kernels`) and the rest
  by torch's own SDPA choice.
* `default`: torch's own SDPA choice everywhere, cuDNN included (on a CPU: no C kernel).
* `no-cudnn`: flash, memory-efficient or math, whichever torch finds fit.
* `math`: the reference kernel only (slow; for diagnosis).

Why not cuDNN by default: on Hopper and later, torch (2.10 on, with its bundled cuDNN >= 9.15) prefers cuDNN
attention, which builds an execution plan the first time it meets each (query length, key length) pair and
caches it. A decode meets a new key length on nearly every forward (each sequence's cache grows by what it
committed), so a server would pay a plan build on most forwards until every length has been seen. The
flash and memory-efficient kernels take any length with no plan.
"""

from __future__ import annotations

import contextlib

import torch

ATTENTION_BACKENDS = ("auto", "default", "no-cudnn", "math")


def check_attention_backend(name: str) -> str:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, not {name!r}")
    return name


def sdpa_context(name: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context a forward runs its SDPA calls in, for setting `name` on `device`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    check_attention_backend(name)
    if name == "auto":
        name = "no-cudnn" if device.type == "cuda" else "default"
    if name == "no-cudnn":
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    if name == "math":
        return sdpa_kernel([SDPBackend.MATH])
    return contextlib.nullcontext()
