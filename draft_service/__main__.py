"""python -m draft_service --model-path DIR --verify-address HOST:PORT [--port N ...]: the draft model and
the speculation loop. Every flag can also be set by an environment variable SPECMESH_DRAFT_<FLAG>.
"""

from __future__ import annotations

import argparse
import os
import time

from draft_service.engine import DraftConfig
from draft_service.server import build_server
from specmesh.config import parse_service_args
from specmesh.drafters import DraftBatcher
from specmesh.serving import run_service

DEBUG_DELAY_ENV = "SPECMESH_DRAFT_DEBUG_DRAFT_DELAY_MS"
DEBUG_SLOWDOWN_ENV = "SPECMESH_DRAFT_DEBUG_DRAFT_SLOWDOWN"


def parse_args(argv=None) -> tuple[DraftConfig, dict]:
    """DraftConfig from its flags (declared by its fields), and the process's flags."""
    return parse_service_args(
        DraftConfig, argv, prog="python -m draft_service", description=__doc__, env_prefix="SPECMESH_DRAFT_"
    )


def debug_draft_delay(argv=None) -> tuple[list[str], float]:
    """TEST KNOBS, not for serving: `--debug-draft-delay-ms MS` makes every batched draft forward MS slower,
    `--debug-draft-slowdown X` X times as slow (it waits X - 1 times what the forward took, so the draft stays
    X times slower however loaded the machine is), as a slower draft model would be, so that tests and
    `specmesh profile`'s checks can stage a draft-bound stack. Also SPECMESH_DRAFT_DEBUG_DRAFT_DELAY_MS /
    _SLOWDOWN. Hidden from --help; returns the other flags and the delay in ms."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--debug-draft-delay-ms", type=float, default=float(os.environ.get(DEBUG_DELAY_ENV, 0)))
    pre.add_argument("--debug-draft-slowdown", type=float, default=float(os.environ.get(DEBUG_SLOWDOWN_ENV, 1)))
    known, rest = pre.parse_known_args(argv)
    delay_s, extra = known.debug_draft_delay_ms / 1000, max(0.0, known.debug_draft_slowdown - 1)
    if delay_s > 0 or extra > 0:
        forward = DraftBatcher._forward

        def slowed(self, *args, **kw):
            t0 = time.perf_counter()
            out = forward(self, *args, **kw)
            time.sleep(delay_s + extra * (time.perf_counter() - t0))
            return out

        DraftBatcher._forward = slowed  # type: ignore[method-assign]
    return rest, known.debug_draft_delay_ms


def main(argv=None) -> None:
    argv, _delay_ms = debug_draft_delay(argv)
    config, process = parse_args(argv)
    run_service("draft_service", build_server, config, process)


if __name__ == "__main__":
    main()
