"""Named locks for the server processes that share one SQLite database file, which has no named
locks of its own: an exclusive ``flock`` on a file in ``<database>-locks/``, beside the database (as
SQLite keeps its ``-wal`` and ``-shm`` files there), so every process that opens the database finds
them. ``flock`` is released when the holder's file is closed or its process dies. PostgreSQL
deployments use advisory locks instead (``auditor.repository``).

Used for the migrations (``migrations/env.py``), for one witness round at a time per witness
(``auditor.witnessing``) and for the log's appends (``auditor.ledger``: ``AsyncHeld``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from sqlalchemy.engine import URL, make_url


def lock_dir(url: str | URL) -> Path | None:
    """The lock folder of the SQLite database file of ``url``; None for another database or an
    in-memory one (one process only)."""
    url = make_url(url)
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    database = Path(url.database).resolve()
    return database.with_name(database.name + "-locks")


def file_name(text: str) -> str:
    """A lock name for ``text`` of any characters (a witness's name): a digest of it."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _lock_file(url: str | URL, name: str) -> Path | None:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"lock name {name!r} is not a plain file name (letters, digits, '_' and '-' only)")
    folder = lock_dir(url)
    if folder is None:
        return None
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    return folder / f"{name}.lock"


@contextlib.contextmanager
def held(url: str | URL, name: str) -> Iterator[None]:
    """Wait for the lock ``name`` of the database of ``url`` and hold it for the block (nothing to hold
    for a database that is not a SQLite file)."""
    path = _lock_file(url, name)
    if path is None:
        yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def try_held(url: str | URL, name: str) -> Iterator[bool]:
    """The lock ``name`` of the database of ``url`` for the block if no process holds it: True, else
    False at once (always True for a database that is not a SQLite file)."""
    path = _lock_file(url, name)
    if path is None:
        yield True
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


class AsyncHeld:
    """The lock ``name`` of the database of ``url`` taken by a coroutine (``async with``) without blocking the
    event loop: the ``flock`` waits in a thread and wakes the moment the holder lets go, where SQLite's own
    busy handler would poll with sleeps of up to 100 ms. The file stays open for the process's lifetime. A
    waiter that is cancelled lets the lock go as soon as its thread gets it. Nothing to hold for a database
    that is not a SQLite file, or for no ``url``."""

    def __init__(self, url: str | URL | None, name: str) -> None:
        self._path = None if url is None else _lock_file(url, name)
        self._fd: int | None = None

    async def __aenter__(self) -> None:
        if self._path is None:
            return
        if self._fd is None:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        fd = self._fd
        waiting = asyncio.get_running_loop().run_in_executor(None, fcntl.flock, fd, fcntl.LOCK_EX)
        try:
            await asyncio.shield(waiting)
        except asyncio.CancelledError:
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                      or fcntl.flock(fd, fcntl.LOCK_UN))
            raise

    async def __aexit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
