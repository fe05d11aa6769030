"""Start-up and replay progress: what the engine is doing while a user waits.

Every stage (resolving the model, reading it, the weights digest, loading the weights, CUDA graph
capture, ready) is one log line on the `engine.load` logger when it starts and one when it ends, with
its duration. Long loops over a known total (tensors, replayed tokens) also draw a tqdm bar when stderr
is a terminal; elsewhere (a service's log, a pipe) they log a line at most every `LOG_EVERY_S` seconds.
Nothing is shown unless the edge (a CLI, the service's logging) attaches a handler: as a library the
engine stays silent.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

T = TypeVar("T")

log = logging.getLogger("engine.load")
LOG_EVERY_S = 10.0


@contextmanager
def stage(what: str) -> Iterator[None]:
    """Log `what ...` when the stage starts and `what: done (N s)` when it ends (nothing on failure: the
    exception says what went wrong)."""
    log.info("%s ...", what)
    started = time.perf_counter()
    yield
    log.info("%s: done (%.1f s)", what, time.perf_counter() - started)


def ready(config: Any, model_name: str, started: float) -> None:
    """The last start-up line: the engine can take requests."""
    log.info("engine: ready, model %r, mode %s, W=%d G=%d, %s, %s (%.1f s)", model_name, config.mode.value,
             config.window, config.group, config.torch_device, config.attention_backend.value,
             time.perf_counter() - started)


class Meter:
    """Progress through `total` units: a tqdm bar on stderr when it is a terminal, else a log line at most
    every `every_s` seconds (and one at the end)."""

    def __init__(self, desc: str, unit: str, every_s: float = LOG_EVERY_S) -> None:
        self.desc, self.unit, self.every_s = desc, unit, every_s
        self._bar: Any = None
        self._terminal = sys.stderr.isatty()
        self._done, self._total = 0, 0
        self._logged_at = time.perf_counter()

    def update(self, done: int, total: int) -> None:
        """`done` of `total` units so far (absolute, not an increment)."""
        self._done, self._total = done, total
        if self._terminal:
            if self._bar is None:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc=self.desc, unit=f" {self.unit}", file=sys.stderr, leave=False)
            self._bar.total = total
            self._bar.update(done - self._bar.n)
            return
        now = time.perf_counter()
        if now - self._logged_at >= self.every_s and done < total:
            self._logged_at = now
            log.info("%s: %d/%d %ss (%d %%)", self.desc, done, total, self.unit, 100 * done // max(total, 1))

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def track(items: Iterable[T], desc: str, total: int, unit: str) -> Iterator[T]:
    """`items`, unchanged, with a Meter counting them."""
    meter = Meter(desc, unit)
    try:
        for done, item in enumerate(items, 1):
            yield item
            meter.update(done, total)
    finally:
        meter.close()


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to whatever `sys.stderr` is when a record is emitted (test runners swap it)."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def log_to_stderr(level: int = logging.INFO) -> None:
    """Show the engine's progress lines on stderr as plain text (command-line edge). A service that
    configures the root logger (structured logs) does not call this: its handler gets the lines."""
    logger = logging.getLogger("engine")
    if any(isinstance(h, _CurrentStderr) for h in logger.handlers):
        return
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)
