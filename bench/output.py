"""How the benchmarks write their results: one JSON file each (bench/results by default, or --out)."""

from __future__ import annotations

import json
from pathlib import Path


def write_json(path: Path, data: dict, indent: int = 2) -> None:
    """`data` as JSON at `path`, its folder made if missing; a trailing newline, as committed files end."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")
