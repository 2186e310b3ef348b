"""How the benchmarks write their results: one JSON file each (bench/results by default, or --out)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


def write_json(path: Path, data: dict, indent: int = 2) -> None:
    """`data` as JSON at `path`, its folder made if missing; a trailing newline, as committed files end."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent) + "\n")


def machine(device: str, load_start: tuple[float, ...], cores: int) -> dict:
    """What a result was measured on: `device` (torch's), the 1-minute load average at the start (and now),
    `cores` (those the benchmark may use)."""
    import torch
    import transformers

    return {
        "cores": cores,
        "cpu_count": os.cpu_count(),
        "processor": platform.processor() or platform.machine(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": device,
        "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
        "loadavg_1m_start_end": [round(load_start[0], 2), round(os.getloadavg()[0], 2)],
    }
