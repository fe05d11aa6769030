"""Report export over HTTP and from the command line against a live server (fake engine, real DB)."""

from __future__ import annotations

import asyncio
import csv
import datetime as dt
import io
import json
import sqlite3
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import httpx

from auditor.reports import verify_bundle
from tests.auditor.conftest import LiveServer, make_key, serving, sqlite_settings
from tests.auditor.fake_engine import FakeAsyncEngine

ROOT = Path(__file__).resolve().parents[2]


async def complete(client: httpx.AsyncClient, n: int, **extra: Any) -> list[str]:
    ids = []
    for i in range(n):
        body = {"model": "fake-model", "prompt": f"tell me about item {i}", "max_tokens": 10, **extra}
        response = await client.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        ids.append(response.json()["transcript"]["id"])
    return ids


async def export(client: httpx.AsyncClient, **filters: Any) -> tuple[dict[str, Any], bytes]:
    response = await client.post("/v1/reports", json=filters)
    assert response.status_code == 202, response.text
    job = response.json()
    for _ in range(300):
        got = await client.get(f"/v1/reports/{job['id']}")
        if got.status_code == 200 and got.headers["content-type"] == "application/zip":
            return job, got.content
        assert got.status_code in (200, 202), got.text
        assert got.json()["status"] in ("queued", "running"), got.json()
        await asyncio.sleep(0.1)
    raise AssertionError(f"report {job['id']} did not finish")


def unzip(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def csv_rows(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode())))


async def test_export_over_http_verifies_offline_without_content(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        ids = await complete(client, 3)
        ids += await complete(client, 1, deterministic=False)
    async with fake_server.client(fake_server.keys["other"]) as other:
        await complete(other, 2)
    async with fake_server.client(fake_server.keys["auditor"]) as auditor:
        job, data = await export(auditor)
    result = verify_bundle(data)
    assert result.ok, result.render()
    files = unzip(data)
    lines = [json.loads(x) for x in files["transcripts.jsonl"].splitlines()]
    assert sorted(x["transcript_id"] for x in lines) == sorted(ids)
    assert all("content" not in x for x in lines)
    assert b"tell me about" not in files["report.html"] and b"tell me about" not in files["transcripts.jsonl"]
    rows = csv_rows(files["summary.csv"])
    assert [r["deterministic"] for r in rows].count("false") == 1 and {r["tenant"] for r in rows} == {"acme"}
    manifest = json.loads(files["manifest.json"])
    assert manifest["report_id"] == job["id"] and manifest["counts"]["transcripts"] == 4


async def test_content_only_when_requested_and_filters_apply(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        await complete(client, 2)
        await complete(client, 1, deterministic=False)
    async with fake_server.client(fake_server.keys["auditor"]) as auditor:
        _, data = await export(auditor, include_content=True, deterministic_only=True)
    assert verify_bundle(data).ok
    files = unzip(data)
    lines = [json.loads(x) for x in files["transcripts.jsonl"].splitlines()]
    assert len(lines) == 2 and all("tell me about" in x["content"]["prompt_text"] for x in lines)
    assert b"tell me about" in files["report.html"]


async def test_roles_and_tenant_isolation(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        await complete(client, 1)
        denied = await client.post("/v1/reports", json={})
        assert denied.status_code == 403 and denied.json()["error"]["code"] == "forbidden"
    async with fake_server.client(fake_server.keys["auditor"]) as auditor:
        job, _ = await export(auditor)
        bad = await auditor.post("/v1/reports", json={"since": "2026-01-01T00:00:00"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "since"
        unknown = await auditor.post("/v1/reports", json={"tenant": "globex"})
        assert unknown.status_code == 400
    async with fake_server.client(fake_server.keys["other_auditor"]) as other:
        assert (await other.get(f"/v1/reports/{job['id']}")).status_code == 404
        assert (await other.get("/v1/reports")).json()["data"] == []
        _, data = await export(other)
    assert json.loads(unzip(data)["manifest.json"])["counts"]["transcripts"] == 0
    assert verify_bundle(data).ok


async def test_access_log_records_reads_and_exports(fake_server: LiveServer) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        (tid,) = await complete(client, 1)
    async with fake_server.client(fake_server.keys["auditor"]) as auditor:
        assert (await auditor.get(f"/v1/transcripts/{tid}")).status_code == 200
        first, _ = await export(auditor)
        _, data = await export(auditor)
    rows = csv_rows(unzip(data)["access_log.csv"])
    actions = {(r["action"], r["target"]) for r in rows}
    assert ("read", tid) in actions
    assert ("export", f"report:{first['id']}") in actions
    assert ("read", f"report:{first['id']}/report.zip") in actions
    assert {r["tenant"] for r in rows} == {"acme"}


async def test_cli_export_verify_and_purge(fake_server: LiveServer, tmp_path: Path) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        await complete(client, 2)
    data_dir = str(fake_server.settings.data_dir)
    out = tmp_path / "cli-report.zip"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "auditor", *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=300)

    done = await asyncio.to_thread(run, "export", "--tenant", "acme", "--include-content", "--data-dir", data_dir,
                                   "-o", str(out))
    assert done.returncode == 0, done.stderr
    assert "transcripts" in done.stderr and "100%" in done.stderr  # the progress bar
    checked = await asyncio.to_thread(run, "verify-bundle", str(out))
    assert checked.returncode == 0 and "VALID bundle" in checked.stdout, checked.stdout
    async with httpx.AsyncClient(base_url=fake_server.url) as anonymous:
        (tmp_path / "jwks.json").write_text((await anonymous.get("/.well-known/jwks.json")).text)
    pinned = await asyncio.to_thread(run, "verify-bundle", str(out), "--jwks", str(tmp_path / "jwks.json"), "--json")
    assert pinned.returncode == 0 and json.loads(pinned.stdout)["ok"] is True, pinned.stdout

    tampered = tmp_path / "tampered.zip"
    files = unzip(out.read_bytes())
    files["summary.csv"] = files["summary.csv"].replace(b",completed,", b",error,", 1)
    with zipfile.ZipFile(tampered, "w") as zf:
        for name, blob in files.items():
            zf.writestr(name, blob)
    failed = await asyncio.to_thread(run, "verify-bundle", str(tampered))
    assert failed.returncode == 1 and "summary.csv:2" in failed.stdout and "INVALID" in failed.stdout

    assert (await asyncio.to_thread(run, "retention", "set", "--tenant", "acme", "--days", "1", "--data-dir",
                                    data_dir)).returncode == 0
    db = fake_server.settings.data_dir / "verbatim.db"
    with sqlite3.connect(db) as conn:  # age the records past the retention (as time would)
        conn.execute("UPDATE transcripts SET completed_at = '2020-01-01 00:00:00.000000'")
    purged = await asyncio.to_thread(run, "purge", "--tenant", "acme", "--data-dir", data_dir)
    assert purged.returncode == 0 and "purged content of 2 transcripts" in purged.stdout, purged.stdout
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM transcript_contents").fetchone() == (0,)
    async with fake_server.client(fake_server.keys["auditor"]) as auditor:
        _, after = await export(auditor, include_content=True)
    result = verify_bundle(after)
    assert result.ok, result.render()
    assert all("content" not in json.loads(x) for x in unzip(after)["transcripts.jsonl"].splitlines())


async def test_unfinished_job_is_resumed_after_restart(tmp_path: Path) -> None:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    from auditor.reports.inputs import ReportFilters
    from auditor.reports.jobs import JobStore

    store = JobStore(settings.data_dir / "reports")
    job = store.create("acme", "key_x", ReportFilters("acme"), dt.datetime.now(dt.UTC))
    key = await make_key(settings, "acme", "auditor")
    async with serving(settings, FakeAsyncEngine(), {}) as live, live.client(key) as auditor:
        for _ in range(300):
            got = await auditor.get(f"/v1/reports/{job.id}", params={"format": "json"})
            if got.json()["status"] == "done":
                break
            await asyncio.sleep(0.1)
        assert got.json()["status"] == "done", got.json()
        bundle = await auditor.get(f"/v1/reports/{job.id}")
    assert bundle.headers["content-type"] == "application/zip", bundle.text
    result = verify_bundle(bundle.content)
    assert result.ok and json.loads(unzip(bundle.content)["manifest.json"])["report_id"] == job.id, result.render()
