"""The results writer of the benchmarks: every result file of bench/ is written here, as indented JSON.

`write_result(result, out_dir, name)` writes `<out_dir>/<name>.json` (for scripts whose --out is a folder);
`write_result_file(result, path)` writes `path` (for scripts whose --out is a file). Both create the folder,
write indent=1 JSON with a trailing newline, encode what json cannot as str, and replace the file whole
through a temporary beside it, so a run killed by a time limit leaves the last complete write."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def result_path(out_dir: str | Path, name: str) -> Path:
    """`<out_dir>/<name>.json`, the folder created."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{name}.json"


def write_result_file(result: Any, path: str | Path) -> Path:
    """Write `result` to `path` (values json cannot encode are written as str); the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path


def write_result(result: Any, out_dir: str | Path, name: str) -> Path:
    """Write `result` to `<out_dir>/<name>.json` (values json cannot encode are written as str); the path."""
    return write_result_file(result, result_path(out_dir, name))
