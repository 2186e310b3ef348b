"""python -m verify_service --model-path DIR [--port N ...]: the target model behind a batching scheduler.

Every flag can also be set by an environment variable SPECMESH_VERIFY_<FLAG> (e.g. SPECMESH_VERIFY_PORT).
"""

from __future__ import annotations

from specmesh.config import parse_service_args
from specmesh.serving import run_service
from verify_service.engine import VerifyConfig
from verify_service.server import build_server


def parse_args(argv=None) -> tuple[VerifyConfig, dict]:
    """VerifyConfig from its flags (declared by its fields), and the process's flags."""
    return parse_service_args(
        VerifyConfig, argv, prog="python -m verify_service", description=__doc__, env_prefix="SPECMESH_VERIFY_"
    )


def main(argv=None) -> None:
    run_service("verify_service", build_server, *parse_args(argv))


if __name__ == "__main__":
    main()
