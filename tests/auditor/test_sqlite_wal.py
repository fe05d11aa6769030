"""A SQLite file is put in WAL mode when an engine is built for it, even while another process writes to it in
rollback mode: SQLite refuses that switch at once ("database is locked") instead of waiting, so without a retry
one of several replicas starting on a new file can fail."""
from __future__ import annotations

import asyncio
import sqlite3
import time
from pathlib import Path

from sqlalchemy import text

from auditor.db.session import create_engine


async def test_wal_mode_waits_for_a_writer_holding_the_lock(tmp_path: Path) -> None:
    path = tmp_path / "shared.db"
    writer = sqlite3.connect(path, isolation_level=None)  # rollback mode, the write lock held
    writer.execute("CREATE TABLE t (x INTEGER)")
    writer.execute("BEGIN IMMEDIATE")
    writer.execute("INSERT INTO t VALUES (1)")
    # SQLite's own busy wait does not cover the switch: with the lock held it fails at once
    probe = sqlite3.connect(path, timeout=5)
    started = time.monotonic()
    try:
        probe.execute("PRAGMA journal_mode=WAL")
        refused = False
    except sqlite3.OperationalError as exc:
        refused = "locked" in str(exc)
    probe.close()
    assert refused and time.monotonic() - started < 1.0

    asyncio.get_running_loop().call_later(0.5, writer.execute, "COMMIT")  # on this thread, which made `writer`
    started = time.monotonic()
    engine = await asyncio.to_thread(create_engine, f"sqlite+aiosqlite:///{path}")
    waited = time.monotonic() - started
    try:
        async with engine.connect() as conn:
            assert (await conn.execute(text("PRAGMA journal_mode"))).scalar() == "wal"
            assert (await conn.execute(text("SELECT count(*) FROM t"))).scalar() == 1
            assert (await conn.execute(text("PRAGMA foreign_keys"))).scalar() == 1
            assert (await conn.execute(text("PRAGMA busy_timeout"))).scalar() == 30000
    finally:
        await engine.dispose()
        writer.close()
    assert waited >= 0.4
