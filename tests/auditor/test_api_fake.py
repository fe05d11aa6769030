"""HTTP behaviour of the service against the fake engine (fast): response shapes, streaming, auth,
tenant isolation, rate limits, bad input, disconnects, atomic appends, tampering, chains, listing."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pytest

from auditor import repository
from tests.auditor import independent
from tests.auditor.conftest import LiveServer, sqlite_settings, start_server
from tests.auditor.fake_engine import FakeAsyncEngine

MODEL = "fake-model"


def completion(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 12, **extra}


async def sse_events(response: httpx.Response) -> list[str]:
    return [line[len("data: "):] async for line in response.aiter_lines() if line.startswith("data: ")]


# --- happy paths -------------------------------------------------------------------------------------


async def test_completion_response_carries_transcript_seed_fingerprint(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        response = await client.post("/v1/completions", json=completion())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert body["system_fingerprint"].startswith("fp_")
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    transcript = body["transcript"]
    assert transcript == {"id": response.headers["Verbatim-Transcript-Id"], "log_index": 0, "tree_size": 1,
                          "replayable": True}
    assert isinstance(body["seed"], int) and 0 <= body["seed"] < 2**64


async def test_drawn_seed_is_signed_and_reproduces(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        first = (await client.post("/v1/completions", json=completion())).json()
        again = (await client.post("/v1/completions", json=completion(seed=first["seed"]))).json()
        doc = (await client.get(f"/v1/transcripts/{first['transcript']['id']}")).json()
    statement = json.loads(base64.b64decode(doc["envelope"]["payload"]))
    assert statement["predicate"]["sampling"]["seed"] == str(first["seed"])
    assert statement["predicate"]["sampling"]["deterministic"] is True
    assert again["choices"][0]["text"] == first["choices"][0]["text"]


async def test_deterministic_default_comes_from_settings(tmp_path: Path) -> None:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path, deterministic_default=False)
    server = await start_server(settings, FakeAsyncEngine())
    try:
        async with server.client(server.keys["client"]) as client:
            body = (await client.post("/v1/completions", json=completion())).json()
            forced = (await client.post("/v1/completions", json=completion(deterministic=True))).json()
    finally:
        await asyncio.to_thread(server.stop)
    assert body["transcript"]["replayable"] is False
    assert forced["transcript"]["replayable"] is True


async def test_chat_streaming_sends_header_chunks_transcript_and_done(fake_server: LiveServer) -> None:
    request = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 20, "stream": True}
    async with fake_server.client(fake_server.keys["client"]) as client:
        async with client.stream("POST", "/v1/chat/completions", json=request) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            transcript_id = response.headers["Verbatim-Transcript-Id"]
            events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert any(c["choices"] and c["choices"][0]["finish_reason"] for c in chunks)
    assert chunks[-1]["choices"] == [] and chunks[-1]["transcript"]["id"] == transcript_id
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    async with fake_server.client(fake_server.keys["client"]) as client:
        doc = (await client.get(f"/v1/transcripts/{transcript_id}", params={"include_content": "true"})).json()
    assert doc["output_text"] == text and doc["transcript"]["status"] == "completed"


async def test_models_health_jwks_metrics(fake_server: LiveServer) -> None:
    async with fake_server.client() as anonymous:
        assert (await anonymous.get("/healthz")).status_code == 200
        assert (await anonymous.get("/readyz")).json()["status"] == "ready"
        jwks = (await anonymous.get("/.well-known/jwks.json")).json()
        assert {k["role"] for k in jwks["keys"]} >= {"transcript", "checkpoint"}
        assert all("d" not in k for k in jwks["keys"])
        assert (await anonymous.get("/v1/models")).status_code == 401
        note = await anonymous.get("/v1/log/checkpoint", params={"format": "note"})
        assert note.headers["content-type"].startswith("text/plain") and note.text.startswith("verbatim.local/log\n0\n")
    async with fake_server.client(fake_server.keys["client"]) as client:
        models = (await client.get("/v1/models")).json()
        await client.post("/v1/completions", json=completion())
        metrics = (await client.get("/metrics")).text
    assert models["data"][0]["id"] == MODEL
    for name in ("verbatim_http_requests_total", "verbatim_tokens_total", "verbatim_engine_rollbacks_total",
                 "verbatim_engine_steps_total", "verbatim_engine_step_seconds_total",
                 "verbatim_engine_command_seconds_total", "verbatim_engine_publish_seconds_total",
                 "verbatim_engine_prefill_passes_total", "verbatim_engine_decode_passes_total",
                 "verbatim_engine_verify_seconds_total", "verbatim_engine_waiting", "verbatim_completions_total",
                 "verbatim_engine_verify_pass_mean_seconds", "verbatim_http_request_seconds_bucket"):
        assert name in metrics


# --- auth, roles, tenants ------------------------------------------------------------------------------


async def test_auth_failures(fake_server: LiveServer) -> None:
    async with fake_server.client() as anonymous:
        missing = await anonymous.post("/v1/completions", json=completion())
        wrong = await anonymous.post("/v1/completions", json=completion(), headers={"Authorization": "Bearer vbk_nope"})
        malformed = await anonymous.get("/v1/transcripts", headers={"Authorization": "Basic abc"})
    for response in (missing, wrong, malformed):
        assert response.status_code == 401
        assert response.json()["error"]["type"] == "authentication_error"
    async with fake_server.client(fake_server.keys["auditor"]) as auditor:
        forbidden = await auditor.post("/v1/completions", json=completion())
        keys = await auditor.get("/v1/admin/keys")
    assert forbidden.status_code == 403 and keys.status_code == 403
    assert forbidden.json()["error"]["type"] == "permission_error"


async def test_admin_creates_and_revokes_keys_in_its_tenant(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["admin"]) as admin:
        created = await admin.post("/v1/admin/keys", json={"role": "client", "name": "ci"})
        assert created.status_code == 201, created.text
        new = created.json()
        assert new["tenant"] == "acme" and new["key"].startswith("vbk_")
        listed = (await admin.get("/v1/admin/keys")).json()["data"]
        assert new["id"] in {k["id"] for k in listed} and all("key" not in k for k in listed)
        async with fake_server.client(new["key"]) as fresh:
            assert (await fresh.post("/v1/completions", json=completion())).status_code == 200
            assert (await admin.delete(f"/v1/admin/keys/{new['id']}")).status_code == 200
            assert (await fresh.post("/v1/completions", json=completion())).status_code == 401
        bad_role = await admin.post("/v1/admin/keys", json={"role": "root"})
    assert bad_role.status_code == 400


async def test_tenants_never_see_each_other(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as acme, \
            fake_server.client(fake_server.keys["other"]) as globex, \
            fake_server.client(fake_server.keys["other_auditor"]) as globex_auditor, \
            fake_server.client(fake_server.keys["auditor"]) as acme_auditor:
        mine = (await acme.post("/v1/completions", json=completion())).json()["transcript"]["id"]
        theirs = (await globex.post("/v1/completions", json=completion())).json()["transcript"]["id"]
        assert (await globex.get(f"/v1/transcripts/{mine}")).status_code == 404
        assert (await globex_auditor.get(f"/v1/transcripts/{mine}")).status_code == 404
        assert (await acme_auditor.get(f"/v1/transcripts/{mine}")).status_code == 200
        assert [t["id"] for t in (await acme.get("/v1/transcripts")).json()["data"]] == [mine]
        assert [t["id"] for t in (await globex_auditor.get("/v1/transcripts")).json()["data"]] == [theirs]


async def test_rate_limit_per_key(tmp_path: Path) -> None:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path, rate_limit_per_second=0.01, rate_limit_burst=3)
    server = await start_server(settings, FakeAsyncEngine(), {"a": "acme:client", "b": "acme:client"})
    try:
        async with server.client(server.keys["a"]) as a, server.client(server.keys["b"]) as b:
            statuses = [(await a.get("/v1/transcripts")).status_code for _ in range(4)]
            other = await b.get("/v1/transcripts")
            limited = await a.get("/v1/transcripts")
    finally:
        await asyncio.to_thread(server.stop)
    assert statuses == [200, 200, 200, 429] and other.status_code == 200
    assert limited.json()["error"]["type"] == "rate_limit_error" and int(limited.headers["Retry-After"]) >= 1


# --- bad input ---------------------------------------------------------------------------------------------

BAD_REQUESTS = [
    (b"{not json", 400, None),
    (b"", 400, None),
    (b"[1, 2]", 400, None),
    (json.dumps({"prompt": "x"}).encode(), 400, "model"),
    (json.dumps(completion(max_tokens="12")).encode(), 400, "max_tokens"),
    (json.dumps(completion(max_tokens=True)).encode(), 400, "max_tokens"),
    (json.dumps(completion(temperature="hot")).encode(), 400, "temperature"),
    (json.dumps(completion(stream="yes")).encode(), 400, "stream"),
    (json.dumps(completion(prompt=None)).encode(), 400, "prompt"),
    (json.dumps(completion(prompt=[[1, 2], [3]])).encode(), 400, "prompt"),
    (json.dumps(completion(prompt=[1, 99999])).encode(), 400, "prompt"),
    (json.dumps(completion(bogus=1)).encode(), 400, "bogus"),
    (json.dumps(completion(max_tokens=0)).encode(), 400, "max_tokens"),
    (json.dumps(completion(max_tokens=100000)).encode(), 400, "max_tokens"),
    (json.dumps(completion(temperature=-1)).encode(), 400, "temperature"),
    (json.dumps(completion(top_p=0)).encode(), 400, "top_p"),
    (json.dumps(completion(top_k=-3)).encode(), 400, "top_k"),
    (json.dumps(completion(seed=-1)).encode(), 400, "seed"),
    (json.dumps(completion(seed=2**64)).encode(), 400, "seed"),
    (json.dumps(completion(logprobs=50)).encode(), 400, "logprobs"),
    (json.dumps(completion(n=0)).encode(), 400, "n"),
    (json.dumps(completion(n=9)).encode(), 400, "n"),
    (json.dumps(completion(temperature=2.5)).encode(), 400, "temperature"),
    (json.dumps(completion(presence_penalty=-2.5)).encode(), 400, "presence_penalty"),
    (json.dumps(completion(frequency_penalty=2.5)).encode(), 400, "frequency_penalty"),
    (json.dumps(completion(repetition_penalty=0)).encode(), 400, "repetition_penalty"),
    (json.dumps(completion(logit_bias={"abc": 1})).encode(), 400, "logit_bias"),
    (json.dumps(completion(logit_bias={"5": 100.5})).encode(), 400, "logit_bias"),
    (json.dumps(completion(logit_bias={"30": 1})).encode(), 400, "logit_bias"),
    (json.dumps(completion(stream_options={"include_usage": True})).encode(), 400, "stream_options"),
    (json.dumps(completion(suffix="x")).encode(), 400, "suffix"),
    (json.dumps(completion(best_of=3)).encode(), 400, "best_of"),
    (json.dumps(completion(stop=["a", "b", "c", "d", "e"])).encode(), 400, "stop"),
    (json.dumps(completion(prompt="")).encode(), 400, "prompt"),
    (json.dumps(completion(model="gpt-9")).encode(), 404, "model"),
]


@pytest.mark.parametrize(("raw", "status", "param"), BAD_REQUESTS)
async def test_bad_input_is_a_clear_4xx(fake_server: LiveServer, raw: bytes, status: int, param: str | None) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        response = await client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] is not None and param in error["param"], error


async def test_bad_chat_input(fake_server: LiveServer) -> None:
    cases = [{"model": MODEL}, {"model": MODEL, "messages": "hi"}, {"model": MODEL, "messages": []},
             {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]},
             {"model": MODEL, "messages": [{"content": "x"}]},
             {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}]
    async with fake_server.client(fake_server.keys["client"]) as client:
        for case in cases:
            response = await client.post("/v1/chat/completions", json=case)
            assert response.status_code == 400, (case, response.text)
            assert response.json()["error"]["param"], case


async def test_oversized_body_and_prompt_are_413(tmp_path: Path) -> None:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path, max_body_bytes=4096, max_prompt_tokens=50)
    server = await start_server(settings, FakeAsyncEngine())
    try:
        async with server.client(server.keys["client"]) as client:
            body = await client.post("/v1/completions", json=completion(prompt="a" * 10_000))
            prompt = await client.post("/v1/completions", json=completion(prompt="b" * 200))
            chat = await client.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "c" * 200}]})
    finally:
        await asyncio.to_thread(server.stop)
    for response in (body, prompt, chat):
        assert response.status_code == 413, response.text
        assert response.json()["error"]["message"]


async def test_bad_query_parameters_are_400(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        for params in ({"limit": "x"}, {"limit": 0}, {"since": "yesterday"}, {"order": "up"},
                       {"deterministic": "maybe"}, {"since": "2026-01-01T00:00:00"}):
            response = await client.get("/v1/transcripts", params=params)
            assert response.status_code == 400, (params, response.text)
            assert "error" in response.json()
        assert (await client.get("/v1/log/proofs/inclusion", params={"index": 5})).status_code == 400
        assert (await client.get("/v1/log/proofs/consistency", params={"first": 3, "second": 1})).status_code == 400
        assert (await client.get("/v1/transcripts/nope")).status_code == 404
        assert (await client.get("/v1/nowhere")).json()["error"]["code"] == "not_found"


# --- nothing lost ------------------------------------------------------------------------------------------


async def _count_rows(settings_db: str) -> dict[str, int]:
    path = settings_db.split("///", 1)[1]
    with sqlite3.connect(path) as connection:
        return {t: connection.execute(f"SELECT count(*) FROM {t}").fetchone()[0]
                for t in ("transcripts", "transcript_contents", "log_leaves", "log_checkpoints")}


async def fail_after_transcript_rows(session: Any, rows: repository.LogRows, _checkpoint: Any) -> None:
    """Stands in for ``repository.add_log_rows``: writes the transcript rows, then fails."""
    from sqlalchemy import insert

    from auditor.db.models import Transcript

    await session.execute(insert(Transcript), rows.transcripts)
    raise RuntimeError("injected failure between the transcript and its log leaf")


async def test_failure_between_writes_leaves_nothing(fake_server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(repository, "add_log_rows", fail_after_transcript_rows)
    async with fake_server.client(fake_server.keys["client"]) as client:
        failed = await client.post("/v1/completions", json=completion())
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        assert await _count_rows(fake_server.settings.resolved_database_url) == {
            "transcripts": 0, "transcript_contents": 0, "log_leaves": 0, "log_checkpoints": 0}
        monkeypatch.undo()
        ok = (await client.post("/v1/completions", json=completion())).json()
    assert ok["transcript"]["log_index"] == 0
    assert await _count_rows(fake_server.settings.resolved_database_url) == {
        "transcripts": 1, "transcript_contents": 1, "log_leaves": 1, "log_checkpoints": 1}


async def test_client_disconnect_records_committed_tokens(tmp_path: Path) -> None:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    server = await start_server(settings, FakeAsyncEngine(window=2, step_delay=0.05))
    request = completion(max_tokens=400, ignore_eos=True, stream=True)
    try:
        async with server.client(server.keys["client"]) as client:
            async with client.stream("POST", "/v1/completions", json=request) as response:
                transcript_id = response.headers["Verbatim-Transcript-Id"]
                seen = 0
                async for line in response.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break
            doc = await _wait_for_transcript(client, transcript_id)
    finally:
        await asyncio.to_thread(server.stop)
    assert doc["transcript"]["status"] == "client_disconnected"
    assert 0 < doc["transcript"]["completion_tokens"] < 400
    assert len(doc["token_ids"]) == doc["transcript"]["completion_tokens"]
    assert doc["verification"]["ok"], doc["verification"]


async def _wait_for_transcript(client: httpx.AsyncClient, transcript_id: str) -> dict[str, Any]:
    for _ in range(200):
        response = await client.get(f"/v1/transcripts/{transcript_id}",
                                    params={"include_content": "true", "verify": "true"})
        if response.status_code == 200:
            return response.json()
        await asyncio.sleep(0.05)
    raise AssertionError(f"transcript {transcript_id} never appeared")


# --- integrity ---------------------------------------------------------------------------------------------


async def test_tampered_transcript_is_reported_invalid(fake_server: LiveServer, tmp_path: Path) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        transcript_id = (await client.post("/v1/completions", json=completion())).json()["transcript"]["id"]
        good = (await client.get(f"/v1/transcripts/{transcript_id}", params={"verify": "true"})).json()
        assert good["verification"]["ok"]
        _tamper(fake_server.settings.resolved_database_url, transcript_id)
        bad = (await client.get(f"/v1/transcripts/{transcript_id}", params={"verify": "true"})).json()
    assert not bad["verification"]["ok"]
    failed = {c["name"] for c in bad["verification"]["checks"] if not c["ok"]}
    assert "signature" in failed, bad["verification"]


def _tamper(database_url: str, transcript_id: str) -> None:
    """Change the signed payload (one output count) in the stored envelope, keeping it well-formed."""
    path = database_url.split("///", 1)[1]
    with sqlite3.connect(path) as connection:
        (raw,) = connection.execute("SELECT envelope FROM transcripts WHERE id = ?", (transcript_id,)).fetchone()
        envelope = json.loads(raw)
        statement = json.loads(base64.b64decode(envelope["payload"]))
        statement["predicate"]["tokens"]["output_count"] += 1
        envelope["payload"] = base64.b64encode(json.dumps(statement).encode()).decode()
        connection.execute("UPDATE transcripts SET envelope = ? WHERE id = ?",
                           (json.dumps(envelope).encode(), transcript_id))


async def test_per_tenant_hash_chain_and_independent_signatures(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client, \
            fake_server.client(fake_server.keys["other"]) as other:
        ids = []
        for i in range(3):
            ids.append((await client.post("/v1/completions", json=completion(seed=i))).json()["transcript"]["id"])
            await other.post("/v1/completions", json=completion())
        docs = [(await client.get(f"/v1/transcripts/{i}")).json() for i in ids]
        jwks = (await client.get("/.well-known/jwks.json")).json()
    previous = None
    for sequence, doc in enumerate(docs, start=1):
        payload = independent.verify_dsse(doc["envelope"], jwks)
        transcript = json.loads(payload)["predicate"]["transcript"]
        assert transcript["sequence"] == sequence and transcript["tenant"] == "acme"
        assert transcript["previous_digest"] == previous
        previous = hashlib.sha256(payload).hexdigest()


async def test_list_filters_and_pagination(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        for i in range(5):
            await client.post("/v1/completions", json=completion(deterministic=i % 2 == 0, seed=i))
        everything = (await client.get("/v1/transcripts", params={"order": "asc"})).json()["data"]
        page1 = (await client.get("/v1/transcripts", params={"limit": 2, "order": "asc"})).json()
        page2 = (await client.get("/v1/transcripts", params={"limit": 2, "order": "asc",
                                                             "after": page1["last_id"]})).json()
        page3 = (await client.get("/v1/transcripts", params={"limit": 2, "order": "asc",
                                                             "after": page2["last_id"]})).json()
        nondet = (await client.get("/v1/transcripts", params={"deterministic": "false"})).json()["data"]
        later = (await client.get("/v1/transcripts", params={"since": "2999-01-01T00:00:00Z"})).json()["data"]
        window = (await client.get("/v1/transcripts", params={"since": "2000-01-01T00:00:00Z",
                                                              "until": "2999-01-01T00:00:00Z"})).json()["data"]
        earlier = (await client.get("/v1/transcripts", params={"until": "2000-01-01T00:00:00Z"})).json()["data"]
        completed = (await client.get("/v1/transcripts", params={"status": "completed"})).json()["data"]
        errored = (await client.get("/v1/transcripts", params={"status": "error"})).json()["data"]
        newest_first = (await client.get("/v1/transcripts", params={"order": "desc"})).json()["data"]
        by_model = (await client.get("/v1/transcripts", params={"model": "other"})).json()["data"]
    assert len(everything) == 5
    assert [t["id"] for t in page1["data"] + page2["data"] + page3["data"]] == [t["id"] for t in everything]
    assert page1["has_more"] and page2["has_more"] and not page3["has_more"]
    assert len(nondet) == 2 and all(not t["deterministic"] for t in nondet)
    assert later == [] and by_model == []
    assert [t["id"] for t in window] == [t["id"] for t in newest_first] and earlier == []
    assert len(completed) == 5 and errored == []
    assert [t["id"] for t in newest_first] == [t["id"] for t in reversed(everything)]


async def test_engine_failure_records_committed_tokens_with_status_error(tmp_path: Path) -> None:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    server = await start_server(settings, FakeAsyncEngine(window=2, fail_after_commits=3))
    request = completion(max_tokens=50, ignore_eos=True)
    try:
        async with server.client(server.keys["client"]) as client:
            plain = await client.post("/v1/completions", json=request)
            async with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
                streamed_id = response.headers["Verbatim-Transcript-Id"]
                events = await sse_events(response)
            listed = (await client.get("/v1/transcripts", params={"status": "error"})).json()["data"]
    finally:
        await asyncio.to_thread(server.stop)
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "server_error"
    assert json.loads(events[-2])["error"]["code"] == "engine_error" and events[-1] == "[DONE]"
    assert len(listed) == 2 and streamed_id in {t["id"] for t in listed}
    assert all(t["completion_tokens"] == 5 for t in listed)


JUNK_BODIES = [b"\xff\xfe", b"null", b"123", b'"s"', b"{" * 5000, b'{"model": 5}', b'{"model": "fake-model", "prompt": []}',
               b'{"model": "fake-model", "prompt": "x", "max_tokens": 1e400}',
               b'{"model": "fake-model", "prompt": "x", "max_tokens": 99999999999999999999999}',
               b'{"model": "fake-model", "prompt": "x", "top_p": NaN}', b'{"model": "fake-model", "prompt": "x", "stop": [""]}',
               b'{"model": "fake-model", "prompt": "x", "stream_options": {"include_usage": 1}}',
               b'{"model": "fake-model", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
               b'{"role": "admin", "name": 7}', b'{"role": "admin", "tenant": "other"}']


async def test_junk_never_gives_a_500(tmp_path: Path) -> None:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path, rate_limit_burst=1000)
    server = await start_server(settings, FakeAsyncEngine(), {"admin": "acme:admin"})
    try:
        async with server.client(server.keys["admin"]) as client:
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/admin/keys"):
                for body in JUNK_BODIES:
                    for content_type in ("application/json", "text/plain"):
                        response = await client.post(path, content=body, headers={"Content-Type": content_type})
                        assert 400 <= response.status_code < 500, (path, body[:40], response.text)
                        assert response.json()["error"]["message"]
    finally:
        await asyncio.to_thread(server.stop)


async def test_logs_carry_no_prompt_or_output_text(fake_server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    secret_prompt = "zebra quartz fjord"
    caplog.set_level("DEBUG")
    async with fake_server.client(fake_server.keys["client"]) as client:
        request = completion(prompt=secret_prompt, max_tokens=30, ignore_eos=True)
        body = (await client.post("/v1/completions", json=request)).json()
        async with client.stream("POST", "/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": secret_prompt}], "stream": True}) as response:
            await sse_events(response)
    output = body["choices"][0]["text"]
    records = [r for r in caplog.records if r.name.startswith("auditor")]
    assert any(getattr(r, "transcript_id", None) == body["transcript"]["id"] for r in records)
    for record in records:
        text = record.getMessage() + " " + " ".join(str(v) for v in vars(record).values())
        assert secret_prompt not in text and output not in text and fake_server.keys["client"] not in text


async def test_streamed_text_never_shows_a_stop_string(fake_server: LiveServer) -> None:
    request = completion(max_tokens=60, ignore_eos=True, seed=99)
    async with fake_server.client(fake_server.keys["client"]) as client:
        full = (await client.post("/v1/completions", json=request)).json()["choices"][0]["text"]
        stop = full[31:34]  # commits end at 1, 9, .., 33: the stop straddles a chunk boundary
        expected = full[:full.find(stop)]
        async with client.stream("POST", "/v1/completions", json={**request, "stop": [stop], "stream": True}) as response:
            events = await sse_events(response)
    chunks = [json.loads(e) for e in events[:-1]]
    streamed = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert streamed == expected and stop not in streamed
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "stop"


async def test_logprobs_plain_and_streamed(fake_server: LiveServer) -> None:
    request = completion(max_tokens=20, ignore_eos=True, logprobs=1, seed=5)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "ignore_eos": True,
            "logprobs": True, "top_logprobs": 1, "seed": 5}
    async with fake_server.client(fake_server.keys["client"]) as client:
        plain = (await client.post("/v1/completions", json=request)).json()["choices"][0]["logprobs"]
        async with client.stream("POST", "/v1/completions", json={**request, "stream": True}) as response:
            streamed = [json.loads(e) for e in (await sse_events(response))[:-1]]
        async with client.stream("POST", "/v1/chat/completions", json={**chat, "stream": True}) as response:
            chat_streamed = [json.loads(e) for e in (await sse_events(response))[:-1]]
        chat_plain = (await client.post("/v1/chat/completions", json=chat)).json()["choices"][0]["logprobs"]
    assert len(plain["tokens"]) == 20 and len(plain["token_logprobs"]) == 20
    pieces = [c["choices"][0]["logprobs"] for c in streamed if c["choices"] and c["choices"][0]["logprobs"]]
    assert sum((p["token_logprobs"] for p in pieces), []) == plain["token_logprobs"]
    chat_pieces = [c["choices"][0]["logprobs"]["content"] for c in chat_streamed
                   if c["choices"] and c["choices"][0]["logprobs"]]
    assert [t["logprob"] for t in sum(chat_pieces, [])] == [t["logprob"] for t in chat_plain["content"]]


def test_short_prompts_are_tokenized_in_the_event_loop_and_long_ones_in_a_thread() -> None:
    from auditor.service import INLINE_TOKENIZE_CHARS, GenerationRequest, _short
    from auditor.transcript import Api

    def request(prompt: Any = None, messages: Any = None) -> GenerationRequest:
        return GenerationRequest(api=Api.COMPLETIONS, model=MODEL, prompt=prompt, messages=messages, max_tokens=4,
                                 temperature=1, top_p=1, top_k=0, min_p=0, seed=None, stop=None, ignore_eos=False,
                                 logprobs=None, deterministic=False, stream=False, include_usage=False,
                                 request_json={})

    n = INLINE_TOKENIZE_CHARS
    assert _short(request("x" * n)) and not _short(request("x" * (n + 1)))
    assert _short(request(list(range(n)))) and not _short(request(list(range(n + 1))))
    half = {"role": "user", "content": "y" * (n // 2 - 4)}
    assert _short(request(messages=[half, half])) and not _short(request(messages=[half, half, half]))


async def test_a_long_prompt_is_tokenized_as_a_short_one_is(fake_server: LiveServer) -> None:
    """Both ways to the tokenizer (inline up to INLINE_TOKENIZE_CHARS, a thread above) count the same tokens
    (the fake tokenizer: one a character; the fake model takes 512 and the server 4096, so both are refused,
    naming the count)."""
    from auditor.service import INLINE_TOKENIZE_CHARS

    n = INLINE_TOKENIZE_CHARS
    async with fake_server.client(fake_server.keys["client"]) as client:
        inline = await client.post("/v1/completions", json=completion(prompt="z" * n, max_tokens=2))
        threaded = await client.post("/v1/completions", json=completion(prompt="z" * (n + 1), max_tokens=2))
    assert inline.status_code == 400, inline.text
    assert f"prompt ({n}) + max_tokens (2) exceeds" in inline.json()["error"]["message"]
    assert threaded.status_code == 413, threaded.text
    assert f"prompt has {n + 1} tokens" in threaded.json()["error"]["message"]
