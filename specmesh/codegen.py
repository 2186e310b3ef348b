"""Generate the gRPC/protobuf Python code of `proto/specmesh/v1/*.proto` into `specmesh/v1/`.

`python -m specmesh.codegen` (or `make proto`) rewrites the committed stubs; `tests/unit/test_proto.py`
regenerates into a temporary folder and fails if the committed files differ, so they are never stale.
grpcio-tools is pinned in pyproject.toml because its bundled protoc decides the exact output.
"""

from __future__ import annotations

import sys
from pathlib import Path

import grpc_tools
from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def proto_files() -> list[Path]:
    return sorted((PROTO_ROOT / "specmesh" / "v1").glob("*.proto"))


def generate(out_root: Path) -> list[Path]:
    """Write *_pb2.py, *_pb2.pyi and *_pb2_grpc.py under out_root/specmesh/v1; return the files written."""
    out_root.mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(PROTO_ROOT)) for p in proto_files()]
    rc = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            *files,
        ]
    )
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}")
    return sorted((out_root / "specmesh" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    written = generate(ROOT)
    print("\n".join(str(p.relative_to(ROOT)) for p in written), file=sys.stderr)


if __name__ == "__main__":
    main()
