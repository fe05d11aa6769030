"""Group commit in the ledger, on SQLite and PostgreSQL: concurrent appends share one transaction and
one signed checkpoint, every caller gets its own transcript id, log index and the size of the
checkpoint that covers it (already served when the response arrives), chains stay per tenant, and a
bad draft fails alone."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from auditor.crypto import KeyRing
from auditor.db import migrate
from auditor.db.session import create_engine, create_sessionmaker
from auditor.ledger import Appended, Ledger, TranscriptDraft
from auditor.transcript import Api, DvrStats, Status, new_salt, uuid7
from tests.auditor import independent
from tests.auditor.conftest import DEFAULT_KEYS, LiveServer, serving, sqlite_settings
from tests.auditor.fake_engine import FakeAsyncEngine
from tests.auditor.reports_support import MODEL, RUNTIME


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def database(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, str | None]:
    """(url, schema) of a migrated, empty database."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'ledger.db'}"
        migrate.upgrade(url)
        return url, None
    url, schema = request.getfixturevalue("pg_schema")
    migrate.upgrade(url, schema=schema)
    return url, schema


@pytest.fixture
async def ledger(database: tuple[str, str | None], tmp_path: Path) -> AsyncIterator[Ledger]:
    url, schema = database
    reads, writes = create_engine(url, schema=schema), create_engine(url, schema=schema, connections=1)
    ledger = Ledger(create_sessionmaker(reads), KeyRing.open(tmp_path / "keys"), "verbatim.test/log",
                    writer=create_sessionmaker(writes))
    await ledger.start(0)
    try:
        yield ledger
    finally:
        await ledger.stop()
        await writes.dispose()
        await reads.dispose()


def draft(tenant: str, k: int, *, windows: list[tuple[int, int]] | None = None) -> TranscriptDraft:
    output = [10 + i for i in range(6)]
    inputs = dict(
        transcript_id=str(uuid7()), tenant=tenant, api=Api.COMPLETIONS, received_at="2026-12-01T00:00:00.000000Z",
        completed_at="2026-12-01T00:00:01.000000Z", status=Status.COMPLETED, model=MODEL, runtime=RUNTIME,
        sampling_params={"max_tokens": 6, "temperature": 0.0, "top_p": 1.0, "top_k": 0}, seed=k,
        deterministic=True, prompt_ids=[1, 2, k], output_ids=output, salt=new_salt(), finish_reason="length",
        windows=windows if windows is not None else [(1, 6)], window_shape=(4, 8), logprobs=[-0.5] * len(output),
        dvr=DvrStats(1, 0, 0))
    return TranscriptDraft(inputs, "key_test", "fp_000000000000", {"prompt": [1, 2, k]}, "prompt", "output")


def payloads(appended: list[Appended], tenant: str) -> list[dict[str, Any]]:
    statements = [json.loads(base64.b64decode(a.envelope["payload"])) for a in appended]
    mine = [s["predicate"]["transcript"] for s in statements if s["predicate"]["transcript"]["tenant"] == tenant]
    return sorted(mine, key=lambda t: t["sequence"])


def check_chains(appended: list[Appended], tenants: set[str]) -> None:
    digests = {json.loads(base64.b64decode(a.envelope["payload"]))["predicate"]["transcript"]["id"]:
               hashlib.sha256(base64.b64decode(a.envelope["payload"])).hexdigest() for a in appended}
    for tenant in tenants:
        links = payloads(appended, tenant)
        assert [t["sequence"] for t in links] == list(range(1, len(links) + 1)), tenant
        assert [t["previous_digest"] for t in links] == [None, *(digests[t["id"]] for t in links[:-1])], tenant


async def test_concurrent_appends_share_one_transaction_and_checkpoint(ledger: Ledger) -> None:
    # Queued before the writer task first runs, so they form one batch.
    appended = await asyncio.gather(*(ledger.append(draft(f"tenant-{k % 3}", k)) for k in range(20)))
    assert [a.log_index for a in appended] == list(range(20))
    assert {a.tree_size for a in appended} == {20}
    assert (ledger.stats.batches, ledger.stats.checkpoints, ledger.stats.appends) == (1, 1, 20)
    check_chains(list(appended), {"tenant-0", "tenant-1", "tenant-2"})
    more = await asyncio.gather(*(ledger.append(draft(f"tenant-{k % 3}", k)) for k in range(20, 26)))
    assert [a.log_index for a in more] == list(range(20, 26)) and {a.tree_size for a in more} == {26}
    check_chains([*appended, *more], {"tenant-0", "tenant-1", "tenant-2"})
    async with ledger._sessionmaker() as session:
        checkpoint = await ledger.checkpoint(session)
        proofs = [await ledger.inclusion_proof(session, i, 26) for i in range(26)]
    leaves = [independent.leaf(independent.envelope_digest(a.envelope)) for a in [*appended, *more]]
    assert checkpoint.tree_size == 26 and checkpoint.root_hash == independent.mth(leaves)
    assert [list(p.hashes) for p in proofs] == [independent.path(i, leaves) for i in range(26)]


async def test_a_bad_draft_fails_alone(ledger: Ledger) -> None:
    drafts = [draft("acme", k) for k in range(8)]
    drafts[3] = draft("acme", 3, windows=[(0, 99)])  # a window past the output: the Statement is refused
    results = await asyncio.gather(*(ledger.append(d) for d in drafts), return_exceptions=True)
    assert isinstance(results[3], ValueError) and "window" in str(results[3])
    good = [r for r in results if isinstance(r, Appended)]
    assert len(good) == 7 and sorted(a.log_index for a in good) == list(range(7))
    check_chains(good, {"acme"})
    assert ledger.stats.checkpoints == 7  # the batch failed whole, then each draft went alone


async def test_http_responses_carry_a_served_covering_checkpoint(settings_sqlite_or_pg: Any) -> None:
    async with serving(settings_sqlite_or_pg, FakeAsyncEngine(), DEFAULT_KEYS) as server:
        bodies = await asyncio.gather(*(_complete_and_look(server, i) for i in range(32)))
        async with server.client(server.keys["client"]) as client:
            final = (await client.get("/v1/log/checkpoint")).json()
            checked = [await client.get(f"/v1/transcripts/{b['transcript']['id']}", params={"verify": "true"})
                       for b in bodies if b["key"] == "client"]
    indices = sorted(b["transcript"]["log_index"] for b in bodies)
    assert indices == list(range(32)) and final["tree_size"] == 32
    for body in bodies:
        transcript = body["transcript"]
        assert transcript["log_index"] < transcript["tree_size"] <= body["served_size"]
    assert checked and all(r.json()["verification"]["ok"] for r in checked)


async def _complete_and_look(server: LiveServer, i: int) -> dict[str, Any]:
    key = "client" if i % 2 else "other"
    async with server.client(server.keys[key]) as client:
        response = await client.post("/v1/completions", json={"model": "fake-model", "prompt": f"r {i}",
                                                              "max_tokens": 6, "seed": i})
        assert response.status_code == 200, response.text
        served = (await client.get("/v1/log/checkpoint")).json()["tree_size"]
    return {**response.json(), "served_size": served, "key": key}


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def settings_sqlite_or_pg(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "sqlite":
        return sqlite_settings(tmp_path)
    return request.getfixturevalue("pg_settings")


async def test_a_group_signed_ahead_is_signed_again_when_the_one_before_fails(
        ledger: Ledger, monkeypatch: pytest.MonkeyPatch) -> None:
    """Group 2 is signed while group 1 commits, chained to group 1's signatures. Group 1 then fails
    and is recorded draft by draft without its bad draft, so every later sequence number shifts: group 2
    must be signed again against what was committed."""
    from auditor import repository

    first = [draft("acme", k) for k in range(6)]
    bad = first[2].inputs["transcript_id"]
    original = repository.add_log_rows

    async def refuse_bad(session: Any, rows: repository.LogRows, checkpoint: Any) -> None:
        if any(row["id"] == bad for row in rows.transcripts):
            raise RuntimeError("injected failure for one transcript")
        await original(session, rows, checkpoint)

    warm = await ledger.append(draft("acme", 99))  # from now on the latest checkpoint is this process's
    monkeypatch.setattr(repository, "add_log_rows", refuse_bad)
    tasks = [asyncio.ensure_future(ledger.append(d)) for d in first]
    for _ in range(3):  # the writer takes group 1 and starts its transaction
        await asyncio.sleep(0)
    tasks += [asyncio.ensure_future(ledger.append(draft("acme", k))) for k in range(6, 12)]
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[2], RuntimeError)
    assert (ledger.stats.signed_ahead, ledger.stats.signed_again) == (1, 1)
    good = [warm, *(r for r in results if isinstance(r, Appended))]
    assert len(good) == 12 and sorted(a.log_index for a in good) == list(range(12))
    check_chains(good, {"acme"})


async def test_full_checks_while_appending_find_nothing(ledger: Ledger) -> None:
    """The full check reads while groups commit: what it sees committed must pass."""
    async def append_all() -> None:
        for k in range(12):
            await asyncio.gather(*(ledger.append(draft(f"tenant-{i % 2}", 4 * k + i)) for i in range(4)))

    async def check_all() -> None:
        for _ in range(12):
            assert await ledger.verify() is None
            await asyncio.sleep(0)

    await asyncio.gather(append_all(), check_all())
    assert ledger.fault is None and ledger.stats.checks["fault"] == 0
