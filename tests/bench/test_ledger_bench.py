"""The ledger benchmark (bench/ledger_bench.py) end to end on a few completions: through HTTP on the fake engine,
non-streamed and streamed, SQLite; every completion recorded, the log's checks pass."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_are_recorded_and_the_log_checks_pass(tmp_path: Path, stream: bool) -> None:
    out = tmp_path / "ledger.json"
    cmd = [sys.executable, "bench/ledger_bench.py", "--database", "sqlite", "--clients", "4", "--requests", "24",
           "--warmup", "4", "--max-tokens", "12", "--out", str(out), *(["--stream"] if stream else [])]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())["runs"][0]
    assert run["stream"] is stream and run["max_tokens"] == 12
    assert run["completed"] == 24 and run["errors"] == {} and run["completions_per_second"] > 0
    log = run["log"]
    assert log["checkpoint_covers_all"] and log["log_indices_unique_and_dense"] and log["verify_failures"] == []
    assert log["checkpoint_tree_size"] == log["expected_tree_size"] == 28
