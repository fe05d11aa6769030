"""Async engine and session factory for a database URL (SQLite file or PostgreSQL).

SQL parameters are content (prompt and output text, token ids, logprobs, salts): the engine is built
with ``hide_parameters`` so no SQLAlchemy error message or statement log carries them, and the DEBUG
lines that carry data (the SQLite driver's calls with their arguments, SQLAlchemy's result rows) are
dropped (``auditor.logs.quiet_drivers``).
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

from auditor.logs import quiet_drivers


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def create_engine(url: str, *, schema: str | None = None, connections: int | None = None) -> AsyncEngine:
    """Build the async engine. ``schema`` sets the PostgreSQL search_path (tests use a fresh one).

    ``connections``: a pool of exactly that many connections, without the ping at each checkout (the
    ledger's writer: its own connection, so appends never queue behind reads for one; a connection
    found dead fails that transaction, is discarded, and the retry gets a fresh one)."""
    # A SQLite file cannot drop a connection: no ping (on aiosqlite each one is a hop to its thread).
    kwargs: dict[str, Any] = {"pool_pre_ping": connections is None and not is_sqlite(url), "hide_parameters": True}
    if connections is not None:
        kwargs.update(pool_size=connections, max_overflow=0)
    quiet_drivers()
    if is_sqlite(url):
        database = make_url(url).database
        if database and database != ":memory:":
            Path(database).parent.mkdir(parents=True, exist_ok=True)
            _enable_wal(database)
        # One writer at a time; wait for the lock instead of failing with "database is locked".
        kwargs["connect_args"] = {"timeout": 30}
    elif schema is not None:
        kwargs["connect_args"] = {"server_settings": {"search_path": schema}}
    engine = create_async_engine(url, **kwargs)
    if is_sqlite(url):
        event.listen(engine.sync_engine, "connect", _sqlite_pragmas)
    return engine


WAL_WAIT_S = 30.0
"""How long ``_enable_wal`` retries while other connections hold the file's write lock."""


def _enable_wal(database: str) -> None:
    """Put the SQLite file in WAL mode (a property of the file, kept once set). Switching takes an exclusive lock,
    and while another connection holds the write lock SQLite refuses at once with "database is locked" instead
    of waiting in its busy handler (several processes starting on a new file: replicas, ``serve``'s workers).
    So the switch is retried here, once per engine, before any connection of the pool exists."""
    deadline = time.monotonic() + WAL_WAIT_S
    with contextlib.closing(sqlite3.connect(database, timeout=WAL_WAIT_S)) as conn:
        while True:
            try:
                if conn.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() == "wal":
                    return
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
            if time.monotonic() > deadline:
                raise sqlite3.OperationalError(f"{database}: could not switch to WAL mode in {WAL_WAIT_S:.0f} s: "
                                               "another connection kept the write lock")
            time.sleep(0.05)


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.close()


def create_sessionmaker(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
