"""The packed canonical decode kernel's 64-key chunks and their programs under the Triton interpreter
(test_canonical_decode.py's "chunks" part: the checks live there, this file gives them a worker of their own)."""
from __future__ import annotations

import pytest

from tests.engine.test_canonical_decode import run_under_triton_interpreter

pytestmark = pytest.mark.slow


def test_chunked_canonical_rows_under_the_triton_interpreter() -> None:
    run_under_triton_interpreter("tests.engine.test_canonical_decode", "chunks")
