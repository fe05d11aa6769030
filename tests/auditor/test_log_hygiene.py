"""No log line, at any level and on any error path, carries prompt or output text, token ids,
logprobs, salts or key material (SQLite and PostgreSQL).

The root logger and SQLAlchemy's engine logger run at DEBUG, so every library logs all it has. The test drives the error paths: a
real database error on the content insert (a trigger refuses it, so SQLAlchemy's exception holds the
statement's parameters), plain, streamed and chat; an engine failure mid-stream; a client that goes
away; a library exception that quotes the prompt; a report job that fails with content in its
message; bad input. Then it scans everything logged: every record caplog saw (all attributes, the
formatted exception), the service's JSON handler output, and the process's stdout / stderr (uvicorn
runs with ``log_config=None`` as ``serve`` runs it).
"""

from __future__ import annotations

import asyncio
import base64
import io
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from sqlalchemy import text

from auditor import logs
from auditor import service as service_module
from auditor.db.session import create_engine
from auditor.reports import service as report_service
from tests.auditor.conftest import LiveServer

MODEL = "fake-model"
SECRET = "zebra quartz fjord"
NUL_SECRET = "xylophone\x00waltz"
REQUEST = {"model": MODEL, "prompt": SECRET, "max_tokens": 24, "ignore_eos": True, "seed": 7, "deterministic": True,
           "logprobs": 1}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": SECRET}], "max_tokens": 24, "ignore_eos": True,
        "seed": 8, "deterministic": True}
FAIL_SQL = {
    "sqlite": ["CREATE TRIGGER verbatim_test_fail BEFORE INSERT ON transcript_contents "
               "BEGIN SELECT RAISE(ABORT, 'forced failure'); END"],
    "postgresql": ["CREATE FUNCTION verbatim_test_fail() RETURNS trigger LANGUAGE plpgsql AS "
                   "$$ BEGIN RAISE EXCEPTION 'forced failure'; END $$",
                   "CREATE TRIGGER verbatim_test_fail BEFORE INSERT ON transcript_contents "
                   "FOR EACH ROW EXECUTE FUNCTION verbatim_test_fail()"],
}
UNFAIL_SQL = {"sqlite": ["DROP TRIGGER verbatim_test_fail"],
              "postgresql": ["DROP TRIGGER verbatim_test_fail ON transcript_contents"]}


async def _sql(server: LiveServer, statements: dict[str, list[str]]) -> None:
    engine = create_engine(server.settings.resolved_database_url, schema=server.settings.database_schema)
    try:
        async with engine.begin() as connection:
            for statement in statements[connection.dialect.name]:
                await connection.execute(text(statement))
    finally:
        await engine.dispose()


async def _events(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> list[str]:
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


async def _failing_requests(server: LiveServer, client: httpx.AsyncClient) -> None:
    """The content insert fails in the database: nothing is kept, every answer says so."""
    await _sql(server, FAIL_SQL)
    try:
        plain = await client.post("/v1/completions", json=REQUEST)
        assert plain.status_code == 500 and plain.json()["error"]["code"] == "internal_error"
        events = await _events(client, "/v1/completions", REQUEST)
        assert "recording_failed" in events[-1] and "[DONE]" not in events
        chat = await client.post("/v1/chat/completions", json=CHAT)
        assert chat.status_code == 500
        assert "recording_failed" in (await _events(client, "/v1/chat/completions", CHAT))[-1]
        assert (await client.post("/v1/completions", json={**REQUEST, "prompt": NUL_SECRET})).status_code == 500
    finally:
        await _sql(server, UNFAIL_SQL)
    assert (await client.get("/v1/transcripts")).json()["data"] == []


async def _engine_failure_and_disconnect(server: LiveServer, client: httpx.AsyncClient) -> None:
    engine = server.engine
    engine.fail_after_commits = 2
    try:
        assert (await client.post("/v1/completions", json={**REQUEST, "seed": 9})).status_code == 500
        assert "engine_error" in (await _events(client, "/v1/completions", {**REQUEST, "seed": 10}))[-2]
    finally:
        engine.fail_after_commits = None
    engine.step_delay = 0.02
    try:
        async with client.stream("POST", "/v1/completions", json={**REQUEST, "max_tokens": 300, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and '"text"' in line:
                    break
        await asyncio.sleep(0.3)
    finally:
        engine.step_delay = 0.002


async def _library_quotes_the_prompt(server: LiveServer, client: httpx.AsyncClient) -> None:
    def quoting_encode(text: str, add_special_tokens: bool = True) -> list[int]:
        raise UnicodeError(f"cannot encode {text!r}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(server.engine.tokenizer, "encode", quoting_encode)
        response = await client.post("/v1/completions", json=REQUEST)
    assert response.status_code == 500 and response.json()["error"]["message"] == "internal server error"


async def _report_fails_quoting_content(auditor: httpx.AsyncClient) -> None:
    def quoting_build(inputs: Any, signer: Any) -> bytes:
        raise RuntimeError(f"cannot render {inputs.transcripts[0].content.prompt_text}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(report_service, "build_bundle", quoting_build)
        job = (await auditor.post("/v1/reports", json={"include_content": True})).json()
        for _ in range(200):
            job = (await auditor.get(f"/v1/reports/{job['id']}", params={"format": "json"})).json()
            if job["status"] in ("done", "failed"):
                break
            await asyncio.sleep(0.05)
    assert job["status"] == "failed"


async def _content(client: httpx.AsyncClient) -> list[dict[str, Any]]:
    listed = (await client.get("/v1/transcripts", params={"limit": 100})).json()["data"]
    return [(await client.get(f"/v1/transcripts/{t['id']}", params={"include_content": "true"})).json()
            for t in listed]


def _needles(docs: list[dict[str, Any]], salts: list[bytes], server: LiveServer) -> Iterator[str]:
    """Every form in which content or a secret could show up in a log line."""
    yield from (SECRET, "xylophone")
    for doc in docs:
        if len(doc.get("output_text", "")) >= 8:
            yield doc["output_text"][:12]
        for ids in (doc["prompt_token_ids"], doc["token_ids"]):
            if len(ids) >= 6:
                yield ", ".join(map(str, ids[:6]))
                yield ",".join(map(str, ids[:6]))
        if len(doc.get("token_logprobs", [])) >= 4:
            yield ", ".join(map(repr, doc["token_logprobs"][:4]))
    for salt in salts:
        yield from (salt.hex(), base64.b64encode(salt).decode()[:40], repr(salt)[2:42])
    for pem in Path(server.settings.keys_dir).glob("*.pem"):
        key = serialization.load_pem_private_key(pem.read_bytes(), password=None)
        raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                serialization.NoEncryption())
        yield from (raw.hex(), base64.b64encode(raw).decode()[:40], base64.urlsafe_b64encode(raw).decode()[:40])
        yield from (line for line in pem.read_text().splitlines() if line and not line.startswith("-----"))
    yield from server.keys.values()


def _logged_text(records: list[logging.LogRecord]) -> str:
    parts = []
    formatter = logging.Formatter()
    for record in records:
        parts.append(record.getMessage())
        parts.extend(str(v) for v in vars(record).values())
        if record.exc_info:
            parts.append(formatter.formatException(record.exc_info))
    return "\n".join(parts)


async def test_no_content_in_any_log_on_any_error_path(fake_any_server: LiveServer, caplog: pytest.LogCaptureFixture,
                                                       capfd: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    server = fake_any_server
    salts: list[bytes] = []
    new_salt = service_module.new_salt

    def recorded_salt() -> bytes:
        salts.append(new_salt())
        return salts[-1]

    monkeypatch.setattr(service_module, "new_salt", recorded_salt)
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="sqlalchemy.engine")  # statements and rows, as verbose as it gets
    json_lines = io.StringIO()
    handler = logs.handler(json_lines)
    logging.getLogger().addHandler(handler)
    try:
        async with server.client(server.keys["client"]) as client, server.client(server.keys["auditor"]) as auditor:
            await _failing_requests(server, client)
            for request in (REQUEST, {**REQUEST, "prompt": NUL_SECRET}):
                assert (await client.post("/v1/completions", json=request)).status_code == 200
            assert "[DONE]" in await _events(client, "/v1/completions", REQUEST)
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
            await _engine_failure_and_disconnect(server, client)
            await _library_quotes_the_prompt(server, client)
            await _report_fails_quoting_content(auditor)
            for bad in ({**REQUEST, "max_tokens": -1}, {**REQUEST, "bogus": SECRET}, {**REQUEST, "stop": [""] * 5}):
                assert (await client.post("/v1/completions", json=bad)).status_code == 400
            docs = await _content(client)
    finally:
        logging.getLogger().removeHandler(handler)
    captured = capfd.readouterr()
    haystacks = {"caplog records": _logged_text(caplog.records), "caplog text": caplog.text,
                 "JSON handler": json_lines.getvalue(), "stdout": captured.out, "stderr": captured.err}
    needles = sorted(set(_needles(docs, salts, server)))
    assert len(docs) >= 6 and len(salts) >= 6 and len(needles) > 20
    leaks = [(where, needle[:20]) for needle in needles for where, hay in haystacks.items() if needle in hay]
    assert leaks == [], leaks

    messages = {r.getMessage() for r in caplog.records}
    assert {"unhandled error", "recording a streamed completion failed", "generation failed mid-stream",
            "report job failed"} <= messages, messages
    db_errors = [r.error for r in caplog.records if r.getMessage() == "unhandled error"]
    assert any(e.startswith("sqlalchemy.exc.") for e in db_errors), db_errors
    assert "SQL parameters hidden" in haystacks["caplog text"]  # the statement log ran, without its parameters
