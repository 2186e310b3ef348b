"""The rejection sampler of speculative decoding: one interface, a torch reference and a Triton kernel.

`RejectionSampler` (sampler.py) prepares a batch with shared torch code and runs the accept loop on the
chosen backend: `torch` (the reference, the CPU path) or `triton` (triton_kernel.py, one launch per batch).
"""

from specmesh.rejection.limits import MAX_SPEC_LEN, PLACEHOLDER_TOKEN_ID
from specmesh.rejection.sampler import (
    RejectionInput,
    RejectionOutput,
    RejectionSampler,
    prepare,
    rejection_sample_torch,
    token_logprobs,
    validate_block,
)

__all__ = [
    "MAX_SPEC_LEN",
    "PLACEHOLDER_TOKEN_ID",
    "RejectionInput",
    "RejectionOutput",
    "RejectionSampler",
    "prepare",
    "rejection_sample_torch",
    "token_logprobs",
    "validate_block",
]
