"""The suite's pytest plugin: process set-up and the fixtures every layer of tests shares.

Without CUDA, Triton kernels run in the interpreter (TRITON_INTERPRET=1), set here before any kernel is
defined; that is how the kernel is tested on CPU.
"""

import os
import warnings

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from tests.support.models import demo_target, demo_tokenizer, greedy_decoder, noisy_copy, tiny_model

# Service processes the tests start write no KV pool up front (--no-kv-cache-prefault, through the flags'
# environment variables, which the subprocesses inherit): writing 2 GiB + 1 GiB per stack nearly doubled the
# time of the suite's stack-starting tests on 2 cores. The soak and the container test keep the default.
for _service in ("VERIFY", "DRAFT"):
    os.environ.setdefault(f"SPECMESH_{_service}_KV_CACHE_PREFAULT", "false")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test, its fixtures' set-up and teardown, out of torch's inference mode, which is per thread: a
    test that leaves the main thread in it (a with-block held across an await whose exit interleaved with
    another's) would give every model built afterwards inference tensors for weights. Such a test is named
    in a warning, and the state is put back when it ends."""
    with torch.inference_mode(False):
        yield
        if torch.is_inference_mode_enabled():
            warnings.warn(f"{item.nodeid} left the main thread in torch's inference mode", stacklevel=1)


# Tiny models gain nothing from intra-op threads; one thread keeps runs deterministic and leaves a core free.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_pair():
    target = tiny_model("llama", seed=0)
    return target, noisy_copy(target, 0.03)


# The demo stack's pieces, per module (as each module built them before): a module with another tokenizer
# or target defines its own fixture of that name, which takes precedence in it.
@pytest.fixture(scope="module")
def tokenizer():
    """The demo checkpoint's tokenizer."""
    return demo_tokenizer()


@pytest.fixture(scope="module")
def target(tokenizer):
    """A tiny Llama over the demo tokenizer's vocabulary (seed 31)."""
    return demo_target(tokenizer)


@pytest.fixture(scope="module")
def greedy(target, tokenizer):
    """`greedy(prompt_ids, max_tokens, **params)`: the target's own greedy decoding (target-only, in process),
    the answer the services must give."""
    return greedy_decoder(target, tokenizer)


@pytest.fixture(scope="module")
def demo_stack(target, tokenizer):
    """The gateway (REST and gRPC fronts) over a verify service on `target` and a draft service on a close
    copy of it."""
    from tests.support.services import speculative_gateway

    with speculative_gateway(target, tokenizer) as gw:
        yield gw
