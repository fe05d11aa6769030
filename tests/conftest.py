"""Test order for parallel runs: the files that hold `slow` tests first.

`make test` runs pytest-xdist with `--dist loadfile --no-loadscope-reorder`: every file is one unit of work,
handed to the workers in collection order. Longest units first keeps one worker from starting a minute-long
file while the other has nothing left, so the files with the most `slow` tests come first, then the other
files by number of tests; the order of tests inside a file does not change. Mark a test `slow` when it takes
more than about ten seconds on two cores (`make test-fast` leaves those out)."""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config,
                                  items: list[pytest.Item]) -> None:
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def weight(entry: tuple[int, tuple[str, list[pytest.Item]]]) -> tuple[int, int, int]:
        first, (_, its) = entry
        slow = sum(1 for it in its if it.get_closest_marker("slow") is not None
                   and it.get_closest_marker("gpu") is None)  # a gpu test is skipped without CUDA
        return (-slow, -len(its), first)

    ordered = sorted(enumerate(files.items()), key=weight)
    items[:] = [it for _, (_, its) in ordered for it in its]
