"""The suite's pytest plugin: process set-up and the fixtures every layer of tests shares.

Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1), set here before any kernel is
defined; that is how the kernel is tested on CPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.support.models import noisy_copy, tiny_model

# Tiny models gain nothing from intra-op threads; one thread keeps runs deterministic and leaves a core free.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, 0.03)
