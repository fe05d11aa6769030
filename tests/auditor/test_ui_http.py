"""The console over plain HTTP (no browser): sessions, tenant isolation, the key never sent back,
and console reads landing in the access log because they go through the API."""

from __future__ import annotations

import sqlite3

import httpx

from auditor.ui.sessions import COOKIE
from tests.auditor.conftest import LiveServer


async def transcript_of(server: LiveServer, key: str) -> str:
    async with server.client(server.keys[key]) as client:
        response = await client.post("/v1/completions", json={"model": "fake-model", "prompt": "hello", "max_tokens": 8})
    assert response.status_code == 200, response.text
    return response.json()["transcript"]["id"]


async def sign_in(client: httpx.AsyncClient, server: LiveServer, key: str) -> None:
    response = await client.post("/ui/login", data={"api_key": server.keys[key]})
    assert response.status_code == 303 and response.headers["location"] == "/ui/transcripts"
    cookie = response.headers["set-cookie"]
    assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and "Path=/ui" in cookie
    assert server.keys[key] not in cookie


async def test_console_is_tenant_scoped_and_never_echoes_the_key(fake_server: LiveServer) -> None:
    mine = await transcript_of(fake_server, "client")
    theirs = await transcript_of(fake_server, "other")
    async with httpx.AsyncClient(base_url=fake_server.url, timeout=60) as client:
        await sign_in(client, fake_server, "auditor")
        listing = await client.get("/ui/transcripts")
        assert listing.status_code == 200 and mine in listing.text and theirs not in listing.text
        detail = await client.get(f"/ui/transcripts/{mine}")
        assert detail.status_code == 200 and "signature: valid" in detail.text
        foreign = await client.get(f"/ui/transcripts/{theirs}")
        assert foreign.status_code == 404 and "not found" in foreign.text
        for page in (listing, detail, foreign):
            assert fake_server.keys["auditor"] not in page.text
        await client.post("/ui/logout")
        assert (await client.get("/ui/transcripts")).status_code == 303


async def test_console_reads_are_in_the_access_log(fake_server: LiveServer) -> None:
    tid = await transcript_of(fake_server, "client")
    async with httpx.AsyncClient(base_url=fake_server.url, timeout=60) as client:
        await sign_in(client, fake_server, "auditor")
        assert (await client.get(f"/ui/transcripts/{tid}")).status_code == 200
    with sqlite3.connect(fake_server.settings.data_dir / "verbatim.db") as db:
        rows = db.execute("SELECT action, target, tenant FROM access_log").fetchall()
    assert ("read", tid, "acme") in rows


async def test_forged_or_missing_session_goes_to_sign_in(fake_server: LiveServer) -> None:
    for cookies in ({COOKIE: "forged"}, {}):
        async with httpx.AsyncClient(base_url=fake_server.url, cookies=cookies) as client:
            for path in ("/ui/transcripts", "/ui/reports", "/ui/reports/x/download"):
                response = await client.get(path)
                assert response.status_code == 303 and response.headers["location"] == "/ui/login", (path, cookies)
            replay = await client.post("/ui/transcripts/x/replay")
            assert replay.status_code == 401, cookies


async def test_script_endpoints_answer_the_api_document_or_its_error(fake_server: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=fake_server.url, timeout=60) as client:
        await sign_in(client, fake_server, "auditor")
        exported = await client.post("/ui/reports", data={})
        assert exported.status_code == 303 and exported.headers["location"].startswith("/ui/reports/")
        report_id = exported.headers["location"].rsplit("/", 1)[1]
        status = await client.get(f"/ui/reports/{report_id}/status")
        assert status.status_code == 200 and status.json()["id"] == report_id, status.text
        missing = await client.get("/ui/replays/no-such-replay")
        assert missing.status_code == 404 and set(missing.json()) == {"error"}, missing.text


async def test_revoked_key_sends_every_report_page_back_to_sign_in(fake_server: LiveServer) -> None:
    """A console session whose API key is revoked: the report pages, the export POST and the download go
    back to sign-in (303), like the transcript pages, instead of rendering an error page."""
    async with fake_server.client(fake_server.keys["admin"]) as admin:
        made = await admin.post("/v1/admin/keys", json={"role": "auditor", "name": "short-lived"})
    assert made.status_code == 201, made.text
    async with httpx.AsyncClient(base_url=fake_server.url, timeout=60) as client:
        signed_in = await client.post("/ui/login", data={"api_key": made.json()["key"]})
        assert signed_in.status_code == 303 and signed_in.headers["location"] == "/ui/transcripts"
        exported = await client.post("/ui/reports", data={})
        assert exported.status_code == 303, exported.text
        report_id = exported.headers["location"].rsplit("/", 1)[1]
        assert (await client.get(f"/ui/reports/{report_id}")).status_code == 200
        async with fake_server.client(fake_server.keys["admin"]) as admin:
            assert (await admin.delete(f"/v1/admin/keys/{made.json()['id']}")).status_code == 200
        for response in (await client.get("/ui/reports"), await client.post("/ui/reports", data={}),
                         await client.get(f"/ui/reports/{report_id}"),
                         await client.get(f"/ui/reports/{report_id}/download"),
                         await client.get("/ui/transcripts")):
            assert response.status_code == 303 and response.headers["location"] == "/ui/login", (
                response.request.method, response.request.url.path, response.status_code, response.text[:200])
