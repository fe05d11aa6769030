"""Alembic environment: runs migrations over the async engine of the configured URL.

``config.attributes`` may carry ``url`` (set by ``auditor.cli``/tests) and ``schema`` (a PostgreSQL
search_path, used by tests to work in a fresh schema). Without them the URL is
``VERBATIM_DATABASE_URL`` or alembic.ini's ``sqlalchemy.url``.
"""

from __future__ import annotations

import asyncio
import logging.config
import os

from alembic import context
from sqlalchemy import text
from sqlalchemy.engine import Connection

from auditor.db import filelock
from auditor.db.models import Base
from auditor.db.session import create_engine

config = context.config
if config.config_file_name is not None and not config.attributes.get("skip_logging"):
    logging.config.fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    return (
        config.attributes.get("url")
        or os.environ.get("VERBATIM_DATABASE_URL")
        or config.get_main_option("sqlalchemy.url")
    )


def _configure(connection: Connection | None = None) -> None:
    context.configure(
        connection=connection,
        url=None if connection is not None else _url(),
        target_metadata=target_metadata,
        render_as_batch=True,
        compare_type=True,
        literal_binds=connection is None,
    )


MIGRATION_LOCK = 7262010302
"""PostgreSQL advisory lock held while migrating: replicas starting together migrate one at a time."""


def _run_sync(connection: Connection) -> None:
    """Replicas starting together migrate one at a time: a PostgreSQL advisory lock, or on a SQLite
    file a file lock beside it (two processes that both found no ``alembic_version`` would both run
    the first migration); the next to get the lock finds the schema at head."""
    _configure(connection)
    with filelock.held(connection.engine.url, "migrate"), context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(text(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"))
        context.run_migrations()


async def _run_async() -> None:
    engine = create_engine(_url(), schema=config.attributes.get("schema"))
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
    finally:
        await engine.dispose()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run_sync(connection)
        return
    asyncio.run(_run_async())


if context.is_offline_mode():
    _configure()
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
