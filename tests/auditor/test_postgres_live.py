"""The service on PostgreSQL (fresh schema per test): concurrent appends keep one dense log and one
chain per tenant, a failure between writes leaves nothing, and the stored rows cannot be altered."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from typing import Any

import pytest
from sqlalchemy import text

from auditor import repository
from auditor.db.session import create_engine
from tests.auditor import independent
from tests.auditor.conftest import LiveServer

pytestmark = pytest.mark.postgres


async def _sql(server: LiveServer, statement: str) -> Any:
    engine = create_engine(server.settings.resolved_database_url, schema=server.settings.database_schema)
    try:
        async with engine.begin() as connection:
            return (await connection.execute(text(statement))).all()
    finally:
        await engine.dispose()


async def test_concurrent_appends_on_postgres(fake_pg_server: LiveServer) -> None:
    async def one(i: int) -> dict[str, Any]:
        key = fake_pg_server.keys["client" if i % 2 else "other"]
        async with fake_pg_server.client(key) as client:
            response = await client.post("/v1/completions", json={
                "model": "fake-model", "prompt": f"request {i}", "max_tokens": 6, "seed": i})
            assert response.status_code == 200, response.text
            return response.json()

    bodies = await asyncio.gather(*(one(i) for i in range(20)))
    assert sorted(b["transcript"]["log_index"] for b in bodies) == list(range(20))
    async with fake_pg_server.client(fake_pg_server.keys["client"]) as client:
        checkpoint = (await client.get("/v1/log/checkpoint")).json()
        assert checkpoint["tree_size"] == 20
        leaves = []
        for index in range(20):
            proof = (await client.get("/v1/log/proofs/inclusion", params={"index": index})).json()
            leaves.append(proof["leaf_hash"])
        jwks = (await client.get("/.well-known/jwks.json")).json()
    leaf_hashes = [base64.b64decode(h) for h in leaves]
    assert independent.mth(leaf_hashes) == base64.b64decode(checkpoint["root_hash"])
    for parity, name in ((1, "client"), (0, "other")):
        async with fake_pg_server.client(fake_pg_server.keys[name]) as client:
            docs = [(await client.get(f"/v1/transcripts/{b['transcript']['id']}")).json()
                    for i, b in enumerate(bodies) if i % 2 == parity]
        payloads = sorted((independent.verify_dsse(d["envelope"], jwks) for d in docs),
                          key=lambda p: json.loads(p)["predicate"]["transcript"]["sequence"])
        links = [json.loads(p)["predicate"]["transcript"] for p in payloads]
        assert [link["sequence"] for link in links] == list(range(1, 11)), name
        previous = [None, *(hashlib.sha256(p).hexdigest() for p in payloads[:-1])]
        assert [link["previous_digest"] for link in links] == previous, name


async def test_failed_append_leaves_nothing_on_postgres(fake_pg_server: LiveServer,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.auditor.test_api_fake import fail_after_transcript_rows

    monkeypatch.setattr(repository, "add_log_rows", fail_after_transcript_rows)
    async with fake_pg_server.client(fake_pg_server.keys["client"]) as client:
        assert (await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})).status_code == 500
        counts = await _sql(fake_pg_server, "SELECT (SELECT count(*) FROM transcripts), (SELECT count(*) FROM "
                                            "transcript_contents), (SELECT count(*) FROM log_leaves)")
        assert tuple(counts[0]) == (0, 0, 0)
        monkeypatch.undo()
        body = (await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})).json()
    assert body["transcript"]["log_index"] == 0


async def test_stored_transcripts_cannot_be_altered_on_postgres(fake_pg_server: LiveServer) -> None:
    async with fake_pg_server.client(fake_pg_server.keys["client"]) as client:
        await client.post("/v1/completions", json={"model": "fake-model", "prompt": "x"})
        await client.get("/v1/transcripts")
    for statement in ("UPDATE transcripts SET status = 'error'", "DELETE FROM log_leaves",
                      "UPDATE log_checkpoints SET note = 'forged'", "DELETE FROM access_log"):
        with pytest.raises(Exception, match="append-only"):
            await _sql(fake_pg_server, statement)
    assert (await _sql(fake_pg_server, "SELECT count(*) FROM access_log"))[0][0] >= 1
