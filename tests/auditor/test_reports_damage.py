"""Reports that keep to their scope and expose damage (SQLite and PostgreSQL, live server, fake engine).

* Two tenants whose prompts collide in time and content: each bundle holds only its own tenant's
  transcripts, replays, access rows, ids and digests.
* A period bundle holds every replay attested in the period, with its older transcript.
* An export over damaged records (an altered envelope payload, a deleted transcript row) completes,
  marks the damaged transcripts, and ``verify-bundle`` names the damage, the chain gap included.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import sqlite3
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from auditor.reports import verify_bundle
from auditor.settings import Settings
from tests.auditor.conftest import DEFAULT_KEYS, LiveServer, serving
from tests.auditor.test_replay_fake import ReplayFakeEngine, replay
from tests.auditor.test_reports_api import csv_rows, export, unzip

BODY = {"model": "fake-model", "prompt": "the same words at the same time", "max_tokens": 12, "ignore_eos": True,
        "seed": 42, "deterministic": True}


@pytest.fixture
async def server(any_database: Settings) -> AsyncIterator[LiveServer]:
    async with serving(any_database, ReplayFakeEngine(), DEFAULT_KEYS) as live:
        yield live


async def _complete(client: httpx.AsyncClient, **extra: Any) -> str:
    response = await client.post("/v1/completions", json={**BODY, **extra})
    assert response.status_code == 200, response.text
    return response.json()["transcript"]["id"]


async def _replayed(client: httpx.AsyncClient, transcript_id: str) -> str:
    response = await replay(client, transcript_id)
    assert response.status_code == 200 and response.json()["status"] == "done", response.text
    return response.json()["id"]


async def test_colliding_tenants_each_get_only_their_own(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as acme, server.client(server.keys["other"]) as globex:
        pairs = await asyncio.gather(*(asyncio.gather(_complete(acme), _complete(globex)) for _ in range(3)))
        mine, theirs = [a for a, _ in pairs], [g for _, g in pairs]
        my_replays = [await _replayed(acme, t) for t in mine]
        their_replays = [await _replayed(globex, t) for t in theirs]
        their_docs = [(await globex.get(f"/v1/transcripts/{t}")).json() for t in theirs]
    async with server.client(server.keys["auditor"]) as auditor:
        _, acme_zip = await export(auditor, include_content=True)
    async with server.client(server.keys["other_auditor"]) as auditor:
        _, globex_zip = await export(auditor, include_content=True)
    for data in (acme_zip, globex_zip):
        result = verify_bundle(data)
        assert result.ok, result.render()
    files = unzip(acme_zip)
    lines = [json.loads(x) for x in files["transcripts.jsonl"].splitlines()]
    assert sorted(line["transcript_id"] for line in lines) == sorted(mine)
    assert {json.loads(base64.b64decode(line["envelope"]["payload"]))["predicate"]["transcript"]["tenant"]
            for line in lines} == {"acme"}
    assert all(line["content"]["prompt_text"] == BODY["prompt"] for line in lines)
    assert sorted(json.loads(x)["replay_id"] for x in files["replays.jsonl"].splitlines()) == sorted(my_replays)
    assert {r["tenant"] for r in csv_rows(files["summary.csv"])} == {"acme"}
    assert {r["tenant"] for r in csv_rows(files["access_log.csv"])} == {"acme"}
    foreign = [*theirs, *their_replays, *(d["transcript"]["envelope_digest"] for d in their_docs),
               *(d["transcript"]["payload_digest"] for d in their_docs), "globex"]
    found = [(name, needle) for name, data in files.items() for needle in foreign if needle.encode() in data]
    assert found == []


async def test_period_bundle_holds_replays_attested_in_it(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as client:
        old, before = await _complete(client, seed=1), await _complete(client, seed=2)
        await asyncio.sleep(0.05)
        since = dt.datetime.now(dt.UTC)
        await asyncio.sleep(0.05)
        inside = await _complete(client, seed=3)
        old_replay, inside_replay = await _replayed(client, old), await _replayed(client, inside)
    async with server.client(server.keys["auditor"]) as auditor:
        _, data = await export(auditor, since=since.isoformat().replace("+00:00", "Z"))
    result = verify_bundle(data)
    assert result.ok, result.render()
    files = unzip(data)
    rows = {r["transcript_id"]: r for r in csv_rows(files["summary.csv"])}
    assert {t: (r["scope"], r["chain_status"]) for t, r in rows.items()} == {
        old: ("replayed", "first"), before: ("chain", "linked"), inside: ("report", "linked")}
    assert rows[old]["replay_status"] == "match" and rows[inside]["replay_status"] == "match"
    replays = {json.loads(x)["replay_id"]: json.loads(x) for x in files["replays.jsonl"].splitlines()}
    assert set(replays) == {old_replay, inside_replay}
    assert all(r["attestation"] is not None and r["inclusion_proof"] is not None for r in replays.values())
    access = csv_rows(files["access_log.csv"])
    assert any(a["action"] == "replay" and old in a["target"] for a in access), access
    manifest = json.loads(files["manifest.json"])
    assert manifest["counts"]["transcripts"] == 1 and manifest["counts"]["context_transcripts"] == 2
    assert b"1 further transcripts" not in files["report.html"] and b"2 further transcripts" in files["report.html"]


async def _damage(server: LiveServer, tampered: str, deleted: str) -> None:
    """Out of band, as someone with database access: one character of ``tampered``'s stored payload
    changed (no longer base64), ``deleted``'s transcript and content rows removed (its log leaf stays)."""
    settings = server.settings
    if settings.database_schema is None:
        with sqlite3.connect(settings.resolved_database_url.split("///", 1)[1]) as db:  # foreign keys off
            (raw,) = db.execute("SELECT envelope FROM transcripts WHERE id = ?", (tampered,)).fetchone()
            db.execute("UPDATE transcripts SET envelope = ? WHERE id = ?", (_altered(raw), tampered))
            db.execute("DELETE FROM transcript_contents WHERE transcript_id = ?", (deleted,))
            db.execute("DELETE FROM transcripts WHERE id = ?", (deleted,))
        return
    import asyncpg

    db = await asyncpg.connect(settings.database_url.replace("postgresql+asyncpg://", "postgresql://"),
                               server_settings={"search_path": settings.database_schema})
    try:
        await db.execute("SET session_replication_role = replica")  # triggers (append-only, foreign keys) off
        raw = await db.fetchval("SELECT envelope FROM transcripts WHERE id = $1", tampered)
        await db.execute("UPDATE transcripts SET envelope = $1 WHERE id = $2", _altered(raw), tampered)
        await db.execute("DELETE FROM transcript_contents WHERE transcript_id = $1", deleted)
        await db.execute("DELETE FROM transcripts WHERE id = $1", deleted)
    finally:
        await db.close()


def _altered(raw: bytes) -> bytes:
    envelope = json.loads(raw)
    envelope["payload"] = envelope["payload"][:20] + "!" + envelope["payload"][21:]
    return json.dumps(envelope).encode()


async def test_export_over_damaged_records_completes_and_names_the_damage(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as client:
        ids = [await _complete(client, seed=s) for s in range(1, 6)]
        await _replayed(client, ids[1])
    await _damage(server, tampered=ids[1], deleted=ids[3])
    async with server.client(server.keys["auditor"]) as auditor:
        job, data = await export(auditor, include_content=True)
        status = (await auditor.get(f"/v1/reports/{job['id']}", params={"format": "json"})).json()
    assert status["status"] == "done" and status["error"] is None
    files = unzip(data)
    rows = {r["transcript_id"]: r for r in csv_rows(files["summary.csv"])}
    assert set(rows) == set(ids) - {ids[3]}
    assert {t: (r["signature_status"], r["chain_status"]) for t, r in rows.items()} == {
        ids[0]: ("valid", "first"), ids[1]: ("invalid", "broken"), ids[2]: ("valid", "broken"),
        ids[4]: ("valid", "broken")}
    assert rows[ids[1]]["sequence"] == "" and rows[ids[1]]["log_index"] == "1"
    assert b"Damaged transcripts" in files["report.html"]

    result = verify_bundle(data)
    assert not result.ok
    failed = {(f.check, f.transcript_id) for f in result.failures()}
    assert ("signature", ids[1]) in failed and ("inclusion", ids[1]) in failed
    assert {("hash_chain", ids[1]), ("hash_chain", ids[2]), ("hash_chain", ids[4])} <= failed
    gap = next(f for f in result.failures() if f.check == "hash_chain" and f.transcript_id == ids[4])
    assert "sequence 4" in gap.detail and "missing" in gap.detail
    assert {f.check for f in result.failures()} <= {"signature", "inclusion", "hash_chain", "replay"}, result.render()
