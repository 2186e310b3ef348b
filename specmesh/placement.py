"""Where the local stack's model processes run: torch threads per service, chosen from the machine's cores.

Within a round the draft and the verify forward alternate (the draft drafts, the target verifies), so the
verify service may use every core: they are idle while it runs. The draft's forwards are small: half the
cores, at least one. Drafting ahead while a block is verified (pipelining) only pays where the two do not
share cores: on the 2-core dev machine it made every verify forward wait for a core and cut single-stream
speed from 58 to 36 tokens/s, so the launchers turn it off when the services' threads exceed the cores.
With a CUDA device the verify service owns it and the draft stays on the CPU threads it is given.

Speculation itself only pays while the target forward is cheap against its batch: on a CPU the batched
forward is compute-bound almost at once (one sequence's K + 1 = 5 positions cost 1.5x one position, but
eight sequences' 40 cost 2.5x their 8), so the launchers turn speculation off past a small batch there
(`speculation_batch_limit`, the gateway's --speculative-disable-by-batch-size); on a GPU the forward stays
memory-bound far longer and speculation stays on.
"""

from __future__ import annotations

import argparse
import os


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not every platform can tell which cores this process may use
        return os.cpu_count() or 1


def service_threads(role: str, requested: int = 0) -> int:
    """Torch threads for `role` ("verify" | "draft"); `requested` > 0 wins."""
    if requested > 0:
        return requested
    n = cores()
    if role == "verify":
        return n
    if role == "draft":
        return max(1, n // 2)
    raise ValueError(f"unknown role {role!r}")


def add_thread_flags(ap: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--verify-threads and --draft-threads, for a launcher that starts both model services (0: as above)."""
    for role, default in (("verify", "every core"), ("draft", "half the cores, at least one")):
        help = f"torch threads of each {role} process (0 = {default}: see specmesh.placement)"
        ap.add_argument(f"--{role}-threads", type=int, default=0, help=help)


def pipeline_pays(verify_threads: int, draft_threads: int) -> bool:
    """Whether drafting ahead during verification has cores of its own (see the module docstring)."""
    return verify_threads + draft_threads <= cores()


# Measured with bench.load on the 2-core dev machine (demo pair, greedy, bench/results/load.json): one
# stream speculating gains 1.4-1.5x, but at 4 and 8 streams all speculating gave 0.85x and 0.76x target-only.
CPU_SPECULATION_BATCH_LIMIT = 1


def speculation_batch_limit(on_cuda: bool) -> int:
    """The gateway's --speculative-disable-by-batch-size for a stack on this device (0: never off)."""
    return 0 if on_cuda else CPU_SPECULATION_BATCH_LIMIT
