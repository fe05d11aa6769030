"""Strict inputs and safe storage, on SQLite and on PostgreSQL (the same answers on both).

Every route refuses what it does not take (unknown, repeated or empty query parameters, bodies that
are not application/json, bodies on routes that take none) with a 400 naming the parameter; text a
client sends is either stored and signed exactly (NUL, controls, astral characters) or refused
before generation (lone surrogates, NUL in identifiers and filters).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from sqlalchemy import text

from auditor.db import migrate
from auditor.db.session import create_engine
from tests.auditor.conftest import LiveServer, free_port, fresh_pg_schema
from auditor.settings import Settings

MODEL = "fake-model"
ZERO_ID = "01900000-0000-7000-8000-000000000000"


def raw(body: bytes) -> dict[str, Any]:
    return {"content": body, "headers": {"Content-Type": "application/json"}}


# (method, path, request kwargs, status, param): each must answer exactly this on both databases.
REFUSED: list[tuple[str, str, dict[str, Any], int, str | None]] = [
    ("POST", "/v1/completions", {"content": json.dumps({"model": MODEL, "prompt": "x"}),
                                 "headers": {"Content-Type": "text/plain"}}, 400, "content-type"),
    ("POST", "/v1/completions", {"content": json.dumps({"model": MODEL, "prompt": "x"}),
                                 "headers": {"Content-Type": "application/x-www-form-urlencoded"}}, 400, "content-type"),
    ("POST", "/v1/completions", {"content": json.dumps({"model": MODEL, "prompt": "x"}),
                                 "headers": {"Content-Type": "application/json; charset=latin-1"}}, 400, "content-type"),
    ("POST", "/v1/chat/completions", {"content": b'{"model": "fake-model", "messages": [{"role": "user", '
                                                 b'"content": "x"}]}'}, 400, "content-type"),
    ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": [{"role": "user"}]}},
     400, "messages[0].content"),
    ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": [{"role": "user", "content": None}]}},
     400, "messages[0].content"),
    ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": ""}]}}, 400, "messages[1].content"),
    ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": ""}]}]}}, 400, "messages[0].content"),
    ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": [
        {"role": "user", "content": "x", "colour": "red"}]}}, 400, "messages[0].colour"),
    ("POST", "/v1/chat/completions", {"json": {"model": MODEL, "messages": [
        {"role": "assistant", "content": "x", "tool_calls": [{"id": "t"}]}]}}, 400, "messages[0].tool_calls[0].type"),
    ("POST", "/v1/completions", raw(b'{"model": "fake-model", "prompt": "a\\ud800b"}'), 400, "prompt"),
    ("POST", "/v1/completions", raw(b'{"model": "fake-model", "prompt": "x", "stop": ["\\udfff"]}'), 400, "stop[0]"),
    ("POST", "/v1/chat/completions", raw(b'{"model": "fake-model", "messages": [{"role": "user", '
                                         b'"content": "\\ud83d"}]}'), 400, "messages[0].content"),
    ("POST", "/v1/completions", raw(b'{"model": "fake-model", "prompt": "caf\xe9"}'), 400, None),
    ("GET", "/v1/transcripts?after=garbage", {}, 400, "after"),
    ("GET", "/v1/transcripts?after=%27%20OR%201%3D1--", {}, 400, "after"),
    ("GET", "/v1/transcripts?limit=2&limit=3", {}, 400, "limit"),
    ("GET", "/v1/transcripts?model=", {}, 400, "model"),
    ("GET", "/v1/transcripts?model=a%00b", {}, 400, "model"),
    ("GET", "/v1/transcripts?model=%ED%A0%80", {}, 400, "model"),
    ("GET", "/v1/transcripts?status=done", {}, 400, "status"),
    ("GET", "/v1/transcripts?bogus=1&Limit=3", {}, 400, "Limit,bogus"),
    ("GET", "/v1/transcripts?since=0001-01-01T00:00:00%2B01:00", {}, 400, "since"),
    ("GET", "/v1/transcripts/a%00b", {}, 400, "transcript_id"),
    ("GET", "/v1/transcripts/%FF", {}, 400, "path"),
    ("GET", f"/v1/transcripts/{ZERO_ID}?verify=true&includeContent=true", {}, 400, "includeContent"),
    ("GET", "/v1/log/proofs/inclusion?size=1&index=0", {}, 400, "size"),
    ("GET", "/v1/log/proofs/inclusion?index=0&tree_size=99", {}, 400, "tree_size"),
    ("GET", "/v1/log/proofs/inclusion?index=7", {}, 400, "index"),
    ("GET", "/v1/log/proofs/inclusion?index=-1", {}, 400, "index"),
    ("GET", "/v1/log/proofs/inclusion?envelope_digest=abcd", {}, 400, "envelope_digest"),
    ("GET", "/v1/log/proofs/consistency?first=0", {}, 400, "first"),
    ("GET", "/v1/log/proofs/consistency?first=1&second=99", {}, 400, "second"),
    ("GET", "/v1/log/proofs/consistency?first=3&second=2", {}, 400, "first"),
    ("GET", "/v1/log/checkpoint?format=xml", {}, 400, "format"),
    ("GET", "/v1/log/checkpoint?size=1", {}, 400, "size"),
    ("GET", "/healthz?verbose=1", {}, 400, "verbose"),
    ("POST", f"/v1/transcripts/{ZERO_ID}/replay", {"json": {"wait": True}}, 400, "body"),
    ("POST", f"/v1/transcripts/{ZERO_ID}/replay?wait=maybe", {}, 400, "wait"),
    ("GET", f"/v1/replays/{ZERO_ID}?verbose=true", {}, 400, "verbose"),
    ("GET", "/v1/replays/a%00b", {}, 400, "replay_id"),
    ("POST", "/v1/admin/keys", {"json": {"role": "root"}}, 400, "role"),
    ("POST", "/v1/admin/keys", {"json": {"role": "client", "name": "a\x00b"}}, 400, "name"),
    ("POST", "/v1/admin/keys", {"json": {"role": "client", "name": "n" * 129}}, 400, "name"),
    ("POST", "/v1/admin/keys", {"json": {"role": "client", "tenant": "other"}}, 400, "tenant"),
    ("DELETE", "/v1/admin/keys/a%00b", {}, 400, "key_id"),
    ("POST", "/v1/reports", {"json": {"since": "yesterday"}}, 400, "since"),
    ("POST", "/v1/reports", {"json": {"since": "2026-01-01T00:00:00"}}, 400, "since"),
    ("POST", "/v1/reports", {"json": {"since": "2026-02-01T00:00:00Z", "until": "2026-01-01T00:00:00Z"}}, 400, "until"),
    ("POST", "/v1/reports", {"json": {"model": "a\x00"}}, 400, "model"),
    ("POST", "/v1/reports", {"json": {"tenant": "globex"}}, 400, "tenant"),
    ("POST", "/v1/reports", {"json": {"deterministic_only": "yes"}}, 400, "deterministic_only"),
    ("POST", "/v1/reports", {"content": b'{"model": "m"}', "headers": {"Content-Type": "text/plain"}},
     400, "content-type"),
    ("GET", f"/v1/reports/{ZERO_ID}?format=pdf", {}, 400, "format"),
]

# Text that must be stored and signed exactly as sent.
FAITHFUL = ["ab\x00c", "\x00", "tab\there\r\nnew\x1b[31m", "emoji \U0001F600 astral \U00010348", "\ufeff\ufffe\uffff",
            "\u202eright-to-left\u202c", "caf\u00e9 \u0301"]


async def test_refused_with_the_parameter_named(fake_any_server: LiveServer) -> None:
    answers = []
    async with fake_any_server.client(fake_any_server.keys["admin"]) as client:
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        for method, path, kwargs, _, _ in REFUSED:
            response = await client.request(method, path, **kwargs)
            is_json = response.headers["content-type"].startswith("application/json")
            error = response.json()["error"] if is_json else {}
            answers.append((method, path, response.status_code, error.get("param"), error.get("type")))
        listed = (await client.get("/v1/transcripts")).json()["data"]
    expected = [(m, p, status, param, "invalid_request_error") for m, p, _, status, param in REFUSED]
    assert [a for a, e in zip(answers, expected) if a != e] == [], "answers differ from the expected ones"
    assert len(listed) == 1  # nothing refused was generated or recorded


async def _document(client: httpx.AsyncClient, transcript_id: str) -> dict[str, Any]:
    response = await client.get(f"/v1/transcripts/{transcript_id}", params={"include_content": "true",
                                                                            "verify": "true"})
    assert response.status_code == 200, response.text
    return response.json()


async def _streamed_id(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    async with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        events = [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]
        return response.headers["Verbatim-Transcript-Id"], events


async def test_text_is_stored_and_signed_exactly(fake_any_server: LiveServer) -> None:
    async with fake_any_server.client(fake_any_server.keys["client"]) as client:
        for prompt in FAITHFUL:
            await _round_trip(fake_any_server, client, prompt)


async def _round_trip(server: LiveServer, client: httpx.AsyncClient, prompt: str) -> None:
    """One prompt through completions and chat, plain and streamed: each transcript verifies
    (signature and content commitments) and holds the prompt as sent."""
    plain = await client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 5,
                                                       "stop": [prompt[:1] + "\x00"], "user": prompt})
    assert plain.status_code == 200, (ascii(prompt), plain.text)
    streamed, events = await _streamed_id(client, "/v1/completions", {"model": MODEL, "prompt": prompt,
                                                                      "max_tokens": 5})
    chat = await client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 5, "messages": [
        {"role": "system", "content": prompt}, {"role": "user", "content": [{"type": "text", "text": prompt}]}]})
    assert chat.status_code == 200, (ascii(prompt), chat.text)
    chat_streamed, _ = await _streamed_id(client, "/v1/chat/completions", {
        "model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": prompt}]})
    docs = [await _document(client, t) for t in (plain.json()["transcript"]["id"], streamed,
                                                 chat.json()["transcript"]["id"], chat_streamed)]
    assert events[-1] == "[DONE]"
    for doc in docs:
        assert doc["verification"]["ok"], (ascii(prompt), doc["verification"])
        assert {c["name"] for c in doc["verification"]["checks"] if c["ok"]} >= {"signature", "prompt_commitment",
                                                                                   "output_commitment"}
    assert docs[0]["prompt_text"] == prompt and docs[1]["prompt_text"] == prompt, ascii(prompt)
    assert docs[2]["prompt_text"].count(prompt) == 2 and prompt in docs[3]["prompt_text"], ascii(prompt)
    assert await _stored_request(server, docs[0]["transcript"]["id"]) == {
        "prompt": prompt, "user": prompt, "stop": [prompt[:1] + "\x00"]}


async def _stored_request(server: LiveServer, transcript_id: str) -> dict[str, Any]:
    """The stored request's text fields, read from the database directly."""
    engine = create_engine(server.settings.resolved_database_url, schema=server.settings.database_schema)
    try:
        async with engine.connect() as connection:
            raw = (await connection.execute(text("SELECT request_json FROM transcript_contents WHERE transcript_id = "
                                                 ":id"), {"id": transcript_id})).scalar_one()
    finally:
        await engine.dispose()
    stored = raw if isinstance(raw, dict) else json.loads(raw)
    return {k: stored[k] for k in ("prompt", "user", "stop")}


async def test_prompt_given_as_token_ids_is_stored_with_its_decoded_text(fake_any_server: LiveServer) -> None:
    async with fake_any_server.client(fake_any_server.keys["client"]) as client:
        body = (await client.post("/v1/completions", json={"model": MODEL, "prompt": [0, 1, 26, 2],
                                                           "max_tokens": 4})).json()
        doc = await _document(client, body["transcript"]["id"])
    assert doc["prompt_token_ids"] == [0, 1, 26, 2] and doc["prompt_text"] == "ab c"
    assert doc["verification"]["ok"]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def test_migration_keeps_stored_text_and_refuses_to_drop_nul(kind: str, tmp_path: Any) -> None:
    """0002 -> head (0003) turns stored text into its UTF-8 bytes unchanged; a downgrade refuses while a
    stored text holds NUL (a text column cannot hold it) and converts back once none does."""
    if kind == "sqlite":
        _migration_round_trip(Settings(data_dir=tmp_path, port=free_port()))
        return
    with fresh_pg_schema() as (url, schema):
        _migration_round_trip(Settings(data_dir=tmp_path, port=free_port(), database_url=url, database_schema=schema))


def _migration_round_trip(settings: Settings) -> None:
    url, schema = settings.resolved_database_url, settings.database_schema
    migrate.upgrade(url, "0002", schema=schema)
    asyncio.run(_sql(settings, _INSERT_TRANSCRIPT, "INSERT INTO transcript_contents VALUES ('t1', :salt, '[1]', '[2]', "
                                                   "'[-0.5]', '{}', 'prompt \u00e9\U0001F600', 'output')"))
    migrate.upgrade(url, schema=schema)
    assert asyncio.run(_texts(settings)) == ("prompt \u00e9\U0001F600", "output")
    asyncio.run(_sql(settings, "UPDATE transcript_contents SET output_text = :nul", nul="a\x00b".encode()))
    with pytest.raises(RuntimeError, match="1 rows of transcript_contents hold NUL"):
        migrate.downgrade(url, "0002", schema=schema)
    asyncio.run(_sql(settings, "UPDATE transcript_contents SET output_text = :ok", ok=b"fine"))
    migrate.downgrade(url, "0002", schema=schema)
    assert asyncio.run(_texts(settings)) == ("prompt \u00e9\U0001F600", "fine")


_INSERT_TRANSCRIPT = ("INSERT INTO transcripts (id, tenant, sequence, api, model, deterministic, status, prompt_tokens, "
                      "completion_tokens, system_fingerprint, key_id, envelope, payload_digest, envelope_digest, "
                      "log_index, created_at, completed_at) VALUES ('t1', 'acme', 1, 'completions', 'm', true, "
                      "'completed', 1, 1, 'fp', 'k', :envelope, 'p', 'e', 0, :at, :at)")


async def _sql(settings: Settings, *statements: str, **params: Any) -> None:
    import datetime as dt

    values = {"salt": b"s" * 32, "envelope": b"{}", "at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), **params}
    engine = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        async with engine.begin() as connection:
            for statement in statements:
                names = {k: v for k, v in values.items() if f":{k}" in statement}
                await connection.execute(text(statement), names)
    finally:
        await engine.dispose()


async def _texts(settings: Settings) -> tuple[str, str]:
    from auditor.db.models import TranscriptContent
    from auditor.db.session import create_sessionmaker

    engine = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        async with engine.connect() as connection:
            row = (await connection.execute(text("SELECT prompt_text, output_text FROM transcript_contents"))).one()
        if isinstance(row[0], str):  # downgraded: text columns
            return row[0], row[1]
        async with create_sessionmaker(engine)() as session:
            content = await session.get(TranscriptContent, "t1")
            assert content is not None
            return content.prompt_text, content.output_text
    finally:
        await engine.dispose()
