"""Runs tests/engine/test_fused_kernels.py (the fused row kernels under the Triton interpreter) in its own
Python process with TRITON_INTERPRET=1 set before triton is imported, so the result does not depend on
which kernels other tests of this process compiled first."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: test_fused_gpu.py runs the kernels compiled")
@pytest.mark.slow
def test_fused_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", VERBATIM_FUSED_INTERPRETED="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/engine/test_fused_kernels.py"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1200)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert " passed" in tail and "skipped" not in tail.splitlines()[-1], tail
