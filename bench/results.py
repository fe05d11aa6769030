"""The results writer of the benchmarks: every result file of bench/ is written here, as indented JSON.

`write_result(result, out_dir, name)` writes `<out_dir>/<name>.json` (for scripts whose --out is a folder);
`write_result_file(result, path)` writes `path` (for scripts whose --out is a file). Both create the folder,
write indent=1 JSON with a trailing newline, encode what json cannot as str, and replace the file whole
through a temporary beside it, so a run killed by a time limit leaves the last complete write.

`git_commit()` and `machine()` are what a result records of the tree and the host that made it."""
from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


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


def git_commit() -> str:
    """HEAD of this source tree, with ``-dirty`` when tracked files differ from it; ``unknown`` without git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, check=True).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict[str, Any]:
    """The CPU model, core count, Python and platform, and the load average when the run starts."""
    cpu = "unknown"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg()}
