"""`python -m engine` command line: help texts and a real generate with JSON output."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.cli import main


@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"]])
def test_help(argv) -> None:
    proc = subprocess.run([sys.executable, "-m", "engine", *argv], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: python -m engine" in proc.stdout


def test_generate_deterministic_json(capsys, smollm2_source) -> None:
    argv = ["generate", "The capital of France is", "--deterministic", "--max-tokens", "6", "--seed", "5",
            "--window", "4", "--group", "2", "--kv-blocks", "16", "--json", "--ignore-eos"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["deterministic"] and out["seed"] == 5 and len(out["token_ids"]) == 6
    assert out["window_shape"] == [2, 4] and out["windows"][0][0] == 1 and out["windows"][-1][1] == 6


def test_bad_flag_value_exits_2(capsys) -> None:
    assert main(["generate", "x", "--window", "1"]) == 2
    assert "window" in capsys.readouterr().err
