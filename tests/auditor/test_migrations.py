"""Alembic: upgrade from empty to head and back down on SQLite and PostgreSQL, models match the
migrations (``alembic check``), and on PostgreSQL the append-only tables refuse UPDATE / DELETE."""

from __future__ import annotations

import asyncio
import datetime as dt
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import inspect, text

from auditor.db import migrate
from auditor.db.models import APPEND_ONLY_TABLES, Base
from auditor.db.session import create_engine

ROOT = Path(__file__).resolve().parents[2]
TABLES = set(Base.metadata.tables)


async def _tables(url: str, schema: str | None = None) -> set[str]:
    engine = create_engine(url, schema=schema)
    try:
        async with engine.connect() as connection:
            names = await connection.run_sync(lambda c: inspect(c).get_table_names())
    finally:
        await engine.dispose()
    return set(names) - {"alembic_version"}


def test_sqlite_upgrade_check_downgrade(tmp_path: Path) -> None:
    url = f"sqlite+aiosqlite:///{tmp_path / 'm.db'}"
    migrate.upgrade(url)
    assert asyncio.run(_tables(url)) == TABLES
    migrate.check(url)
    migrate.downgrade(url)
    assert asyncio.run(_tables(url)) == set()
    migrate.upgrade(url)
    assert asyncio.run(_tables(url)) == TABLES


def test_alembic_command_line_check(tmp_path: Path) -> None:
    """The plain ``alembic`` CLI (as CI would run it) upgrades and finds no drift."""
    env = {"VERBATIM_DATABASE_URL": f"sqlite+aiosqlite:///{tmp_path / 'cli.db'}", "PATH": "/usr/bin:/bin"}
    alembic = [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini")]
    for args in (["upgrade", "head"], ["check"], ["downgrade", "base"]):
        result = subprocess.run([*alembic, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr


@pytest.mark.postgres
def test_postgres_upgrade_check_downgrade(pg_schema: tuple[str, str]) -> None:
    url, schema = pg_schema
    migrate.upgrade(url, schema=schema)
    assert asyncio.run(_tables(url, schema)) == TABLES
    migrate.check(url, schema=schema)
    migrate.downgrade(url, schema=schema)
    assert asyncio.run(_tables(url, schema)) == set()
    migrate.upgrade(url, schema=schema)
    assert asyncio.run(_tables(url, schema)) == TABLES


async def _try(url: str, schema: str, statement: str) -> str | None:
    engine = create_engine(url, schema=schema)
    try:
        async with engine.begin() as connection:
            await connection.execute(text(statement))
    except Exception as exc:  # noqa: BLE001 - the refusal is what we look for
        return str(exc)
    finally:
        await engine.dispose()
    return None


@pytest.mark.postgres
def test_postgres_append_only_tables_refuse_update_and_delete(pg_schema: tuple[str, str]) -> None:
    url, schema = pg_schema
    migrate.upgrade(url, schema=schema)
    now = dt.datetime.now(dt.UTC).isoformat()
    inserts = {
        "access_log": f"INSERT INTO access_log (key_id, tenant, action, target, at) VALUES ('k', 't', 'read', 'x', '{now}')",
        "log_checkpoints": f"INSERT INTO log_checkpoints VALUES (1, '\\x00', 'note', '{now}')",
        "transcripts": "INSERT INTO transcripts VALUES ('id1', 't', 1, NULL, 'completions', 'm', true, 'completed', "
                       f"'stop', '1', 1, 1, 'fp', 'kid', NULL, '\\x00', 'pd', 'ed', 0, '{now}', '{now}')",
        "log_leaves": f"INSERT INTO log_leaves VALUES (0, '\\x00', '\\x00', 'transcript', 'id1', NULL, '{now}')",
        "checkpoint_cosignatures": "INSERT INTO checkpoint_cosignatures VALUES (1, 'w.example/w1', 1, '— w x', "
                                   f"'{now}')",
    }
    for table in ("access_log", "log_checkpoints", "transcripts", "log_leaves", "checkpoint_cosignatures"):
        assert asyncio.run(_try(url, schema, inserts[table])) is None, table
    assert set(inserts) == set(APPEND_ONLY_TABLES)
    for table in APPEND_ONLY_TABLES:
        for statement in (f"UPDATE {table} SET created_at = created_at" if table not in ("access_log",)
                          else f"UPDATE {table} SET at = at", f"DELETE FROM {table}", f"TRUNCATE {table} CASCADE"):
            error = asyncio.run(_try(url, schema, statement))
            assert error is not None and "append-only" in error, (statement, error)
    # Content stays erasable: deleting it leaves the signed record in place.
    assert asyncio.run(_try(url, schema, "DELETE FROM transcript_contents")) is None
