"""The server verifies its own log before it signs (``auditor.logcheck``), on SQLite and PostgreSQL.

Each test tampers with the real database behind the server's back (with the server stopped and then
restarted, or while it runs, for the scheduled and the per-checkpoint checks) and asserts what a
client and an operator see: appends refused with a 503, ``/readyz`` naming the failed check and the
first bad index, the metric, the log line, no checkpoint signed, and ``verify=true`` failing.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import logging
import re
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from auditor.settings import Settings
from tests.auditor.conftest import DEFAULT_KEYS, LiveServer, _pg_execute, restarted, serving, sqlite_settings
from tests.auditor.fake_engine import FakeAsyncEngine

MODEL = "fake-model"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    if request.param == "sqlite":
        return sqlite_settings(tmp_path)
    return request.getfixturevalue("pg_settings")


@pytest.fixture
async def server(settings: Settings) -> AsyncIterator[LiveServer]:
    async with serving(settings, FakeAsyncEngine(), DEFAULT_KEYS) as live:
        yield live


# --- helpers -------------------------------------------------------------------------------------------


async def tamper(settings: Settings, *statements: str) -> None:
    """Run ``statements`` on the server's database as an attacker with write access would: foreign
    keys and (on PostgreSQL) the append-only triggers switched off."""
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        with sqlite3.connect(url.split("///", 1)[1]) as connection:
            connection.execute("PRAGMA foreign_keys=OFF")
            for statement in statements:
                connection.execute(statement)
        return
    await _pg_execute(url, f"SET search_path TO {settings.database_schema}",
                      "SET session_replication_role = replica", *statements)


async def query(settings: Settings, statement: str) -> list[tuple[Any, ...]]:
    url = settings.resolved_database_url
    if url.startswith("sqlite"):
        with sqlite3.connect(url.split("///", 1)[1]) as connection:
            return [tuple(row) for row in connection.execute(statement).fetchall()]
    import asyncpg

    connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"))
    try:
        await connection.execute(f"SET search_path TO {settings.database_schema}")
        return [tuple(row) for row in await connection.fetch(statement)]
    finally:
        await connection.close()


def blob(settings: Settings, data: bytes) -> str:
    """A SQL literal for ``data`` in the server's dialect."""
    if settings.resolved_database_url.startswith("sqlite"):
        return f"X'{data.hex()}'"
    return f"'\\x{data.hex()}'::bytea"


async def complete(server: LiveServer, n: int) -> list[dict[str, Any]]:
    """``n`` completions, one after the other (one checkpoint each)."""
    out = []
    async with server.client(server.keys["client"]) as client:
        for i in range(n):
            response = await client.post("/v1/completions", json={"model": MODEL, "prompt": f"request {i}",
                                                                  "max_tokens": 8, "seed": i,
                                                                  "ignore_eos": True})
            assert response.status_code == 200, response.text
            out.append(response.json()["transcript"])
    return out


async def checkpoint_count(settings: Settings) -> int:
    return (await query(settings, "SELECT count(*) FROM log_checkpoints"))[0][0]


def metric(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric in a Prometheus text exposition."""
    pattern = re.compile(rf"^{name}(\{{[^}}]*\}})? (\S+)$", re.M)
    return {labels or "": float(value) for labels, value in pattern.findall(text)}


async def assert_refused(server: LiveServer, check: str, first_bad_index: int) -> dict[str, Any]:
    """A completion is refused with a 503 naming the check; /readyz and /metrics say why."""
    before = await checkpoint_count(server.settings)
    async with server.client(server.keys["client"]) as client:
        refused = await client.post("/v1/completions", json={"model": MODEL, "prompt": "after", "max_tokens": 4})
        streamed = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "after"}], "stream": True})
        ready = await client.get("/readyz")
        metrics = (await client.get("/metrics")).text
    assert refused.status_code == 503, refused.text
    error = refused.json()["error"]
    assert error["code"] == "log_integrity_failure" and f"{check} at log index {first_bad_index}" in error["message"]
    assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "log_integrity_failure"
    assert ready.status_code == 503
    body = ready.json()
    assert body["checks"]["log"] is False and body["log"]["integrity"] == "fault"
    assert body["log"]["fault"]["check"] == check and body["log"]["fault"]["first_bad_index"] == first_bad_index
    assert metric(metrics, "verbatim_log_integrity_ok") == {"": 0.0}
    assert metric(metrics, "verbatim_log_integrity_first_bad_index") == {f'{{check="{check}"}}': float(first_bad_index)}
    assert await checkpoint_count(server.settings) == before, "a checkpoint was signed over a failing log"
    return body["log"]["fault"]


async def verification(server: LiveServer, transcript_id: str) -> dict[str, Any]:
    async with server.client(server.keys["client"]) as client:
        response = await client.get(f"/v1/transcripts/{transcript_id}", params={"verify": "true"})
    assert response.status_code == 200, response.text
    return response.json()["verification"]


def failed(report: dict[str, Any]) -> set[str]:
    return {c["name"] for c in report["checks"] if not c["ok"]}


def fault_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", None) == "log_integrity"]


# --- a sound log -------------------------------------------------------------------------------------------


async def test_a_sound_log_passes_and_says_so(server: LiveServer) -> None:
    transcripts = await complete(server, 3)
    async with server.client(server.keys["client"]) as client:
        ready = (await client.get("/readyz")).json()
        metrics = (await client.get("/metrics")).text
    assert ready["checks"]["log"] is True and ready["log"] == {"integrity": "ok", "tree_size": 3}
    assert metric(metrics, "verbatim_log_integrity_ok") == {"": 1.0}
    assert metric(metrics, "verbatim_log_integrity_checks_total")['{result="ok"}'] >= 1
    assert metric(metrics, "verbatim_log_checkpoints_total") == {"": 3.0}
    report = await verification(server, transcripts[1]["id"])
    assert report["ok"], report
    names = {c["name"] for c in report["checks"]}
    assert {"output_commitment", "prompt_commitment", "window_chain", "logprob_digest", "log_self_check"} <= names


# --- tampered at rest, found at start -------------------------------------------------------------------


async def test_rewritten_leaf_hash_is_refused_after_restart(server: LiveServer,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    transcripts = await complete(server, 4)
    await asyncio.to_thread(server.stop)
    await tamper(server.settings, f"UPDATE log_leaves SET leaf_hash = {blob(server.settings, bytes(32))} "
                                  "WHERE \"index\" = 2")
    caplog.set_level(logging.INFO)
    async with restarted(server) as again:
        fault = await assert_refused(again, "leaf_hash", 2)
        assert "000000" in fault["detail"]
        report = await verification(again, transcripts[0]["id"])
    assert not report["ok"] and {"log_self_check", "inclusion"} <= failed(report), report
    lines = fault_lines(caplog)
    assert lines and lines[0].levelno == logging.ERROR and lines[0].log_index == 2


async def test_deleted_transcript_row_is_refused_after_restart(server: LiveServer) -> None:
    transcripts = await complete(server, 3)
    await asyncio.to_thread(server.stop)
    gone = transcripts[1]["id"]
    await tamper(server.settings, f"DELETE FROM transcript_contents WHERE transcript_id = '{gone}'",
                 f"DELETE FROM transcripts WHERE id = '{gone}'")
    async with restarted(server) as again:
        fault = await assert_refused(again, "leaf_record", 1)
        assert gone in fault["detail"]
        report = await verification(again, transcripts[0]["id"])
    assert failed(report) == {"log_self_check"}, report


async def test_deleted_leaf_leaves_its_transcript_without_one(server: LiveServer) -> None:
    transcripts = await complete(server, 3)
    await asyncio.to_thread(server.stop)
    await tamper(server.settings, 'DELETE FROM log_leaves WHERE "index" = 2')
    async with restarted(server) as again:
        fault = await assert_refused(again, "transcript_leaf", 2)
    assert transcripts[2]["id"] in fault["detail"]


async def test_consistently_rewritten_leaf_is_found_by_the_root(server: LiveServer) -> None:
    """Leaf, entry, envelope and its digest rewritten together (every leaf matches its record): only the
    signed checkpoints show it, and the stored ones pin the first changed index."""
    transcripts = await complete(server, 6)
    await asyncio.to_thread(server.stop)
    target = transcripts[3]["id"]
    (envelope,) = (await query(server.settings, f"SELECT envelope FROM transcripts WHERE id = '{target}'"))[0]
    forged = json.dumps({**json.loads(bytes(envelope)), "payloadType": "forged"}).encode()
    entry = hashlib.sha256(forged).digest()
    leaf = hashlib.sha256(b"\x00" + entry).digest()
    s = server.settings
    await tamper(s, f"UPDATE transcripts SET envelope = {blob(s, forged)}, envelope_digest = '{entry.hex()}' "
                    f"WHERE id = '{target}'",
                 f"UPDATE log_leaves SET entry = {blob(s, entry)}, leaf_hash = {blob(s, leaf)} WHERE \"index\" = 3")
    async with restarted(server) as again:
        fault = await assert_refused(again, "checkpoint_root", 3)
    assert "up to size 3" in fault["detail"]


# --- tampered while running: the scheduled check and the per-checkpoint check --------------------------


async def test_scheduled_check_finds_a_leaf_rewritten_while_running(settings: Settings) -> None:
    quick = replace(settings, log_check_interval_seconds=0.2)
    async with serving(quick, FakeAsyncEngine(), DEFAULT_KEYS) as live:
        await complete(live, 3)
        await tamper(quick, f"UPDATE log_leaves SET leaf_hash = {blob(quick, bytes(32))} WHERE \"index\" = 0")
        async with live.client() as anonymous:
            for _ in range(100):
                if (await anonymous.get("/readyz")).status_code == 503:
                    break
                await asyncio.sleep(0.05)
        await assert_refused(live, "leaf_hash", 0)


async def test_checkpoint_altered_while_running_stops_the_next_append(server: LiveServer) -> None:
    """The incremental check: the next checkpoint must extend the stored one."""
    await complete(server, 3)
    s = server.settings
    await tamper(s, f"UPDATE log_checkpoints SET root_hash = {blob(s, bytes(32))} WHERE tree_size = 3")
    fault = await assert_refused(server, "consistency", 2)
    assert "does not extend the latest signed checkpoint (size 3)" in fault["detail"]


# --- content: verify=true checks the stored token ids ------------------------------------------------------


async def test_verify_true_checks_stored_token_ids(server: LiveServer) -> None:
    (transcript,) = await complete(server, 1)
    (ids,) = (await query(server.settings, "SELECT output_token_ids FROM transcript_contents"))[0]
    ids = json.loads(ids) if isinstance(ids, str) else ids
    ids[3] = (ids[3] + 1) % 26
    cast = "" if server.settings.resolved_database_url.startswith("sqlite") else "::json"
    await tamper(server.settings, f"UPDATE transcript_contents SET output_token_ids = '{json.dumps(ids)}'{cast}")
    report = await verification(server, transcript["id"])
    assert not report["ok"] and "output_commitment" in failed(report), report
    detail = next(c["detail"] for c in report["checks"] if c["name"] == "output_commitment")
    assert "do not match the signed commitment" in detail
    async with server.client(server.keys["client"]) as client:
        plain = (await client.get(f"/v1/transcripts/{transcript['id']}")).json()
    assert "token_ids" not in plain and "verification" not in plain


async def test_erased_content_still_verifies(server: LiveServer) -> None:
    (transcript,) = await complete(server, 1)
    await tamper(server.settings, "DELETE FROM transcript_contents")
    report = await verification(server, transcript["id"])
    assert report["ok"], report
    assert any(c["name"] == "content" and "erased" in c["detail"] for c in report["checks"])


def test_fault_detail_names_hashes_not_content() -> None:
    """What the fault says is built from indices, ids and hashes (module docstring of logcheck)."""
    from auditor.logcheck import check_leaf
    from auditor.repository import LeafRecord

    entry = hashlib.sha256(b"envelope").digest()
    record = LeafRecord(5, bytes(32), entry, "transcript", "t-1", None, b"envelope", 5, entry.hex())
    fault = check_leaf(record, 5)
    assert fault is not None and fault.check == "leaf_hash" and fault.first_bad_index == 5
    assert base64.b64encode(b"envelope").decode() not in fault.detail and "envelope" not in fault.detail
