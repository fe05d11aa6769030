"""bench/results.py, the benchmarks' results writer: `<out>/<name>.json` and a given file path, both
indent=1 JSON with a trailing newline, values json cannot encode written as str, no temporary left."""
from __future__ import annotations

import json
from datetime import date
from pathlib import Path

from bench.results import write_result, write_result_file

RESULT = {"tok_per_s": 123.5, "runs": [1, 2], "when": date(2026, 12, 6), "path": Path("a/b")}
EXPECTED = {"tok_per_s": 123.5, "runs": [1, 2], "when": "2026-12-06", "path": "a/b"}


def check(path: Path) -> None:
    text = path.read_text()
    assert json.loads(text) == EXPECTED
    assert text == json.dumps(EXPECTED, indent=1) + "\n"
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]


def test_write_result_writes_name_json_in_a_new_folder(tmp_path: Path) -> None:
    path = write_result(RESULT, tmp_path / "out" / "nested", "bench-x")
    assert path == tmp_path / "out" / "nested" / "bench-x.json"
    check(path)


def test_write_result_file_writes_the_given_path(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "ledger-sqlite.json"
    path = write_result_file(RESULT, str(target))
    assert path == target
    check(path)


def test_a_rewrite_replaces_the_whole_file(tmp_path: Path) -> None:
    write_result({"runs": list(range(100))}, tmp_path, "r")
    path = write_result({"runs": []}, tmp_path, "r")
    assert json.loads(path.read_text()) == {"runs": []}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]
