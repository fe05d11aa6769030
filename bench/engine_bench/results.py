"""The one results writer of the engine benchmarks: `<out>/<name>.json`, indented, every value JSON-safe.

Every benchmark of this package (the GPU sections, replay cost, the CPU throughput run, the GEMM probe) writes
through `write_result`, so a result file always has the same layout and is rewritten whole (a run killed by a
time limit leaves the last complete write)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def result_path(out_dir: str | Path, name: str) -> Path:
    """`<out_dir>/<name>.json`, the folder created."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.json"


def write_result(result: dict[str, Any], out_dir: str | Path, name: str) -> Path:
    """Write `result` to `<out_dir>/<name>.json` (values json cannot encode are written as str); the path."""
    path = result_path(out_dir, name)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path
