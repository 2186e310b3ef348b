"""python -m verify_service --model-path DIR [--port N ...]: the target model behind a batching scheduler.

Every flag can also be set by an environment variable SPECMESH_VERIFY_<FLAG> (e.g. SPECMESH_VERIFY_PORT).
"""

from __future__ import annotations

from specmesh.config import EnvArgumentParser, add_config_flags, add_service_process_flags, parse_config
from specmesh.security import add_service_flags
from specmesh.serving import run_service
from verify_service.engine import VerifyConfig
from verify_service.server import build_server


def parse_args(argv=None) -> tuple[VerifyConfig, dict]:
    """VerifyConfig from its flags (declared by its fields), and the process's flags."""
    ap = EnvArgumentParser(prog="python -m verify_service", description=__doc__, env_prefix="SPECMESH_VERIFY_")
    add_config_flags(ap, VerifyConfig)
    add_service_process_flags(ap)
    add_service_flags(ap)
    return parse_config(ap, VerifyConfig, argv)


def main(argv=None) -> None:
    run_service("verify_service", build_server, *parse_args(argv))


if __name__ == "__main__":
    main()
