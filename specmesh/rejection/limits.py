"""Bounds shared by the rejection sampler's backends and every service that checks a draft length."""

PLACEHOLDER_TOKEN_ID = -1  # pads the sampler's [B, max_K + 1] output
MAX_SPEC_LEN = 32  # compile-time bound of the Triton kernel; K per request is a runtime value
