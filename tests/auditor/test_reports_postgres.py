"""Report export and content purge on PostgreSQL (fresh schema; skipped without a server)."""

from __future__ import annotations

import datetime as dt
import json

import pytest
from sqlalchemy import text

from auditor.db.session import create_engine, create_sessionmaker
from auditor.reports import verify_bundle
from auditor.reports.retention import RetentionPolicy, purge
from tests.auditor.conftest import LiveServer
from tests.auditor.test_reports_api import complete, export, unzip

pytestmark = pytest.mark.postgres


async def test_export_and_purge_on_postgres(fake_pg_server: LiveServer) -> None:
    async with fake_pg_server.client(fake_pg_server.keys["client"]) as client:
        ids = await complete(client, 3)
    async with fake_pg_server.client(fake_pg_server.keys["other"]) as other:
        await complete(other, 1)
    async with fake_pg_server.client(fake_pg_server.keys["auditor"]) as auditor:
        _, data = await export(auditor, include_content=True)
    assert verify_bundle(data).ok
    assert len(unzip(data)["transcripts.jsonl"].splitlines()) == 3

    settings = fake_pg_server.settings
    db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        async with create_sessionmaker(db)() as session, session.begin():
            later = dt.datetime.now(dt.UTC) + dt.timedelta(days=31)
            purged = await purge(session, RetentionPolicy(tenants={"acme": 30}), later, "acme")
        async with db.begin() as conn:
            left = (await conn.execute(text("SELECT count(*) FROM transcript_contents"))).scalar_one()
    finally:
        await db.dispose()
    assert sorted(purged["acme"]) == sorted(ids) and left == 1  # globex's content is untouched
    async with fake_pg_server.client(fake_pg_server.keys["auditor"]) as auditor:
        _, after = await export(auditor, include_content=True)
    result = verify_bundle(after)
    assert result.ok, result.render()
    assert all("content" not in json.loads(x) for x in unzip(after)["transcripts.jsonl"].splitlines())
