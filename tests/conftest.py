"""Scheduling of the suite over pytest-xdist workers (`make test`: `-n auto --dist loadgroup`).

Every test joins the group of its file, so a file runs on one worker and its module fixtures (a live server,
a reference run) are built once, as with `--dist loadfile`. A test marked `xdist_group` keeps its own group,
so a long test can be moved off its file's worker.
"""
from __future__ import annotations

import pytest


@pytest.hookimpl(tryfirst=True)  # before xdist reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::", 1)[0]))
