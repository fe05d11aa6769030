"""Replay service against the fake engine (fast): verdicts, refusals, tampering, batching, limits,
access log, attestation in the log, and jobs surviving a restart.

``ReplayFakeEngine`` counts the fake engine's ``replay`` calls and can hold them; the fake predicts each
recorded position with its own pure token function, so a faithful record replays as ``match``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from auditor import canonical as cn
from auditor.attestation import verify_replay_attestation
from auditor.verify import verify_document
from engine import EngineConfig
from engine.async_engine import ReplayProgress
from engine.replay import ReplayRequest, ReplayResult, check_replay
from auditor.settings import Settings
from tests.auditor.conftest import DEFAULT_KEYS, LiveServer, _pg_execute, restarted, serving, sqlite_settings
from tests.auditor.fake_engine import FakeAsyncEngine

ROOT = Path(__file__).resolve().parents[2]


class ReplayFakeEngine(FakeAsyncEngine):
    """The fake engine plus ``replay``; ``hold`` blocks replays until cleared, ``extra`` joins the fingerprint."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.replay_calls: list[int] = []
        self.hold = False
        self.extra: dict[str, Any] = {}

    def runtime_fingerprint(self) -> dict[str, str | int]:
        return {**super().runtime_fingerprint(), **self.extra}

    async def replay(self, requests: list[ReplayRequest],
                     on_progress: ReplayProgress | None = None) -> list[ReplayResult]:
        for r in requests:
            check_replay(r, self.group, self.window)
        self.replay_calls.append(len(requests))
        while self.hold:
            await asyncio.sleep(0.01)
        return await super().replay(requests, on_progress)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[LiveServer]:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    async with serving(settings, ReplayFakeEngine(), DEFAULT_KEYS) as live:
        yield live


async def complete(client: httpx.AsyncClient, **extra: Any) -> str:
    body = {"model": "fake-model", "prompt": "the quick brown fox", "max_tokens": 30, "ignore_eos": True, **extra}
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["transcript"]["id"]


async def replay(client: httpx.AsyncClient, transcript_id: str, wait: bool = True) -> httpx.Response:
    return await client.post(f"/v1/transcripts/{transcript_id}/replay", params={"wait": "true"} if wait else {})


async def until_status(client: httpx.AsyncClient, replay_id: str, statuses: tuple[str, ...],
                       timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job: dict[str, Any] = {}
    while time.monotonic() < deadline:
        response = await client.get(f"/v1/replays/{replay_id}")
        if response.status_code == 429:  # polling shares the key's rate limit with the test's other calls
            await asyncio.sleep(float(response.headers.get("Retry-After", "0.5")))
            continue
        job = response.json()
        if job["status"] in statuses:
            return job
        await asyncio.sleep(0.1)
    raise AssertionError(f"replay {replay_id} never reached {statuses}: {job}")


def db_path(live: LiveServer) -> Path:
    return live.settings.data_dir / "verbatim.db"


def alter_output_token(live: LiveServer, transcript_id: str, position: int) -> tuple[int, int]:
    """Change one stored output token id in the database; returns (original, altered)."""
    with sqlite3.connect(db_path(live)) as db:
        (raw,) = db.execute("SELECT output_token_ids FROM transcript_contents WHERE transcript_id = ?",
                            (transcript_id,)).fetchone()
        ids = json.loads(raw)
        original = ids[position]
        ids[position] = (original + 1) % 26
        db.execute("UPDATE transcript_contents SET output_token_ids = ? WHERE transcript_id = ?",
                   (json.dumps(ids), transcript_id))
    return original, ids[position]


# --- verdicts ------------------------------------------------------------------------------------------


async def test_replay_matches_and_attestation_is_signed_and_logged(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as client:
        tid = await complete(client)
        doc = (await client.get(f"/v1/transcripts/{tid}")).json()
        response = await replay(client, tid)
        jwks = (await client.get("/.well-known/jwks.json")).json()
        job = (await client.get(f"/v1/replays/{response.json()['id']}")).json()
    assert response.status_code == 200, response.text
    assert job["status"] == "done" and job["result"] == "match", job
    assert job["details"]["tokens_match"] and job["details"]["logprob_digest_match"]
    assert job["details"]["output_commitment_match"] and all(job["details"]["record_checks"].values())
    statement = verify_replay_attestation(job["attestation"], jwks, doc["transcript"]["payload_digest"])
    assert statement["predicate"]["result"] == "match" and statement["predicate"]["transcript_id"] == tid
    assert job["log_index"] == doc["transcript"]["log_index"] + 1
    report = verify_document(job["evidence"], jwks)
    assert report.ok and report.kind == "replay_attestation", report.render()
    assert cn.envelope_digest(job["attestation"]) == cn.envelope_digest(job["evidence"]["envelope"])


async def test_replay_without_wait_answers_202_then_finishes(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as maker, server.client(server.keys["auditor"]) as client:
        tid = await complete(maker, seed=7)
        response = await replay(client, tid, wait=False)
        assert response.status_code == 202 and response.json()["status"] in ("queued", "running")
        assert response.headers["location"] == f"/v1/replays/{response.json()['id']}"
        job = await until_status(client, response.json()["id"], ("done", "failed"))
    assert job["result"] == "match" and job["requested_by"]


async def test_altered_token_ids_fail_verification_and_replay_mismatches_there(server: LiveServer,
                                                                              tmp_path: Path) -> None:
    async with server.client(server.keys["client"]) as client:
        tid = await complete(client)
        original, altered = alter_output_token(server, tid, 13)
        doc = (await client.get(f"/v1/transcripts/{tid}", params={"include_content": "true",
                                                                   "verify": "true"})).json()
        jwks = (await client.get("/.well-known/jwks.json")).json()
        job = (await replay(client, tid)).json()
    checks = {c["name"]: c for c in doc["verification"]["checks"]}
    assert not checks["output_commitment"]["ok"] and "do not match the signed commitment" in \
        checks["output_commitment"]["detail"]
    assert checks["prompt_commitment"]["ok"] and checks["signature"]["ok"]
    exported = tmp_path / "altered.json"
    exported.write_text(json.dumps(doc))
    (tmp_path / "jwks.json").write_text(json.dumps(jwks))
    cli = subprocess.run([sys.executable, "-m", "auditor", "verify", str(exported), "--jwks",
                          str(tmp_path / "jwks.json")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert cli.returncode == 1 and "FAIL  output_commitment" in cli.stdout, cli.stdout + cli.stderr
    assert job["result"] == "mismatch", job
    details = job["details"]
    assert (details["position"], details["expected_token"], details["replayed_token"]) == (13, altered, original)
    assert details["window_index"] == 1 and details["window"] == [9, 17]  # fake windows: [1,9), [9,17), ...
    assert details["corrected_matches_commitment"] is True  # altered exactly there; the rest is as signed
    assert details["record_checks"]["output_commitment"] is False


async def test_exported_transcript_with_content_verifies_offline(server: LiveServer, tmp_path: Path) -> None:
    async with server.client(server.keys["client"]) as maker, server.client(server.keys["auditor"]) as client:
        tid = await complete(maker, temperature=0.7, seed=99)
        doc = (await client.get(f"/v1/transcripts/{tid}", params={"include_content": "true"})).json()
        jwks = (await client.get("/.well-known/jwks.json")).json()
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    (tmp_path / "jwks.json").write_text(json.dumps(jwks))
    cli = subprocess.run([sys.executable, "-m", "auditor", "verify", str(path), "--jwks", str(tmp_path / "jwks.json")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    for check in ("signature", "inclusion", "prompt_commitment", "output_commitment", "window_chain", "windows",
                  "logprob_digest"):
        assert f"PASS  {check}:" in cli.stdout, cli.stdout
    assert "VALID transcript" in cli.stdout


async def test_different_window_or_group_is_inconclusive_environment(server: LiveServer) -> None:
    engine = server.engine
    async with server.client(server.keys["client"]) as client:
        tid = await complete(client)
        recorded = engine.config
        engine.config = EngineConfig(window=4, group=recorded.group, device="cpu")
        try:
            w_job = (await replay(client, tid)).json()
        finally:
            engine.config = recorded
        engine.config = EngineConfig(window=recorded.window, group=2, device="cpu")
        try:
            g_job = (await replay(client, tid)).json()
        finally:
            engine.config = recorded
    for job, field, recorded, current in ((w_job, "window", 8, 4), (g_job, "group", 4, 2)):
        assert job["status"] == "done" and job["result"] == "inconclusive_environment", job
        differences = job["details"]["differences"]
        assert differences[field] == {"recorded": recorded, "current": current}
        assert "window_shape" in differences and job["details"]["executed"] is False
        assert job["attestation"] is not None and job["log_index"] is not None


async def test_other_fingerprint_field_still_runs_and_reports_the_field(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as client:
        tid = await complete(client)
        server.engine.extra = {"threads": 16}
        try:
            job = (await replay(client, tid)).json()
        finally:
            server.engine.extra = {}
    assert job["result"] == "inconclusive_environment", job
    assert job["details"]["differences"] == {"threads": {"recorded": 1, "current": 16}}
    assert job["details"]["executed"] is True and job["details"]["tokens_match"] is True


async def test_other_tensor_parallel_layout_is_not_executed(server: LiveServer) -> None:
    """A transcript replays only at its tensor-parallel size and reduction (absent: one rank); otherwise the
    verdict is inconclusive_environment and the engine never runs it."""
    engine = server.engine
    tp2 = {"tensor_parallel_size": 2, "tp_reduction": "gather_sum"}
    async with server.client(server.keys["client"]) as client:
        one_rank = await complete(client)
        engine.extra = tp2
        try:
            two_ranks = await complete(client)
        finally:
            engine.extra = {}
        calls = len(engine.replay_calls)
        jobs = []
        for tid, current in ((one_rank, tp2), (two_ranks, {}),
                             (two_ranks, {**tp2, "tp_reduction": "nccl:Ring/Simple"})):
            engine.extra = current
            try:
                jobs.append((await replay(client, tid)).json())
            finally:
                engine.extra = {}
        refused_calls = len(engine.replay_calls)
        engine.extra = tp2
        try:
            same = (await replay(client, two_ranks)).json()
        finally:
            engine.extra = {}
    assert refused_calls == calls, "a replay under another tensor-parallel layout reached the engine"
    for job, differing in zip(jobs, (("tensor_parallel_size", "tp_reduction"),
                                     ("tensor_parallel_size", "tp_reduction"), ("tp_reduction",))):
        assert job["status"] == "done" and job["result"] == "inconclusive_environment", job
        assert job["details"]["executed"] is False and "tensor_parallel_size" in job["details"]["reason"]
        assert sorted(job["details"]["differences"]) == sorted(differing), job["details"]
        assert job["attestation"] is not None and job["log_index"] is not None
    assert jobs[0]["details"]["differences"]["tensor_parallel_size"] == {"recorded": None, "current": 2}
    assert same["result"] == "match" and same["details"]["executed"] is True, same
    assert len(engine.replay_calls) == calls + 1


async def test_different_model_is_409(server: LiveServer) -> None:
    engine = server.engine
    async with server.client(server.keys["client"]) as client:
        tid = await complete(client)
        engine.model_info = dataclasses.replace(engine.model_info, weights_digest="sha256:" + "44" * 32)
        response = await replay(client, tid)
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "model_mismatch" and "sha256:" + "11" * 32 in error["message"]
    assert engine.replay_calls == []


async def test_non_deterministic_transcript_is_409_not_replayable(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as client:
        tid = await complete(client, deterministic=False)
        response = await replay(client, tid)
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "not_replayable" and "deterministic=false" in error["message"]


async def test_erased_content_is_409_not_replayable(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as client:
        tid = await complete(client)
        with sqlite3.connect(db_path(server)) as db:
            db.execute("DELETE FROM transcript_contents WHERE transcript_id = ?", (tid,))
        response = await replay(client, tid)
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "not_replayable" and "erased" in error["message"]
    assert server.engine.replay_calls == []


# --- access, tenants, limits, batching --------------------------------------------------------------


async def test_tenants_cannot_replay_or_read_each_others_replays(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as mine, server.client(server.keys["other"]) as theirs, \
            server.client(server.keys["other_auditor"]) as their_auditor:
        tid = await complete(mine)
        job = (await replay(mine, tid)).json()
        assert (await replay(theirs, tid)).status_code == 404
        assert (await replay(their_auditor, tid)).status_code == 404
        assert (await theirs.get(f"/v1/replays/{job['id']}")).status_code == 404
        assert (await mine.get(f"/v1/replays/{job['id']}")).status_code == 200
        async with server.client() as anonymous:
            assert (await anonymous.post(f"/v1/transcripts/{tid}/replay")).status_code == 401
        assert (await replay(mine, "0190a0a0-0000-7000-8000-000000000000")).status_code == 404
    with sqlite3.connect(db_path(server)) as db:
        rows = db.execute("SELECT tenant, target FROM access_log WHERE action = 'replay'").fetchall()
    assert rows == [("acme", f"transcript:{tid} replay:{job['id']}")]


async def test_queue_limit_per_tenant_is_429_and_jobs_share_one_engine_call(server: LiveServer) -> None:
    engine = server.engine
    server.app.state.replays.max_queued = 3
    async with server.client(server.keys["client"]) as client, server.client(server.keys["other"]) as other:
        tids = [await complete(client, seed=s) for s in range(4)]
        other_tid = await complete(other)
        engine.hold = True
        first = (await replay(client, tids[0], wait=False)).json()
        await until_status(client, first["id"], ("running",))
        queued = [(await replay(client, t, wait=False)).json() for t in tids[1:3]]
        refused = await replay(client, tids[3], wait=False)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "replay_queue_full"
        assert (await replay(other, other_tid, wait=False)).status_code == 202
        engine.hold = False
        jobs = [await until_status(client, j["id"], ("done", "failed")) for j in [first, *queued]]
    assert [j["result"] for j in jobs] == ["match"] * 3
    assert engine.replay_calls[0] == 1 and max(engine.replay_calls[1:]) >= 2, engine.replay_calls


# --- restart --------------------------------------------------------------------------------------------


async def test_job_running_at_shutdown_is_rerun_after_restart(tmp_path: Path) -> None:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    engine = ReplayFakeEngine()
    async with serving(settings, engine, DEFAULT_KEYS) as first, first.client(first.keys["client"]) as client:
        tid = await complete(client)
        engine.hold = True
        job = (await replay(client, tid, wait=False)).json()
        await until_status(client, job["id"], ("running",))
        for _ in range(500):  # claimed ("running") comes before the engine call: wait for the call itself
            if engine.replay_calls:
                break
            await asyncio.sleep(0.02)
        assert engine.replay_calls == [1]
    with sqlite3.connect(tmp_path / "verbatim.db") as db:
        # A clean stop hands the job back at once (a killed process's lease would expire instead).
        row = db.execute("SELECT status, claimed_by FROM replay_jobs WHERE id = ?", (job["id"],)).fetchone()
        assert row == ("queued", None)
    engine.hold = False
    async with restarted(first) as second, second.client(second.keys["client"]) as client:
        done = await until_status(client, job["id"], ("done", "failed"))
    assert done["result"] == "match", done
    assert engine.replay_calls == [1, 1]


# --- PostgreSQL ------------------------------------------------------------------------------------------


async def test_replay_on_postgresql_match_mismatch_and_requeue(pg_schema: tuple[str, str],
                                                               pg_settings: Settings) -> None:
    url, schema = pg_schema
    settings = pg_settings
    engine = ReplayFakeEngine()
    async with serving(settings, engine, DEFAULT_KEYS) as live, live.client(live.keys["client"]) as client:
        tids = [await complete(client, seed=s) for s in (1, 2)]
        assert (await replay(client, tids[0])).json()["result"] == "match"
        await _pg_execute(url, f"UPDATE {schema}.transcript_contents SET output_token_ids = jsonb_set("
                          f"output_token_ids::jsonb, '{{20}}', '0')::json WHERE transcript_id = '{tids[1]}'")
        mismatch = (await replay(client, tids[1])).json()
        engine.hold = True
        held = (await replay(client, tids[0], wait=False)).json()
        await until_status(client, held["id"], ("running",))
    assert mismatch["result"] == "mismatch" and mismatch["details"]["position"] == 20, mismatch
    engine.hold = False
    async with restarted(live) as again, again.client(again.keys["auditor"]) as client:
        done = await until_status(client, held["id"], ("done", "failed"))
        checkpoint = (await client.get("/v1/log/checkpoint")).json()
    assert done["result"] == "match" and done["log_index"] == checkpoint["tree_size"] - 1


async def test_cli_replays_over_http_and_prints_the_verdict(server: LiveServer) -> None:
    async with server.client(server.keys["client"]) as client:
        tid = await complete(client)
    cli = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "auditor", "replay", tid, "--url", server.url, "--api-key", server.keys["auditor"]],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert f"of transcript {tid}: MATCH" in cli.stdout and "30 tokens in 4 windows; tokens match: yes" in cli.stdout
    refused = await asyncio.to_thread(subprocess.run, [
        sys.executable, "-m", "auditor", "replay", tid, "--url", server.url, "--api-key", server.keys["other"]],
        capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert refused.returncode == 2 and "HTTP 404" in refused.stderr, refused.stdout + refused.stderr


async def test_in_process_replay_as_the_cli_runs_it(server: LiveServer) -> None:
    from auditor.app import attach_engine, build_services
    from auditor.replay import ReplayService
    from auditor.replay_cli import render

    async with server.client(server.keys["client"]) as client:
        tid = await complete(client)
    await asyncio.to_thread(server.stop)
    services = build_services(server.settings)
    attach_engine(services, ReplayFakeEngine())
    try:
        job = await ReplayService(services).run_now(tid)
    finally:
        await services.db.dispose()
    assert job["status"] == "done" and job["result"] == "match" and job["requested_by"] == "cli"
    text = render(job)
    assert text.startswith(f"replay {job['id']} of transcript {tid}: MATCH")
    assert f"appended to the log at index {job['log_index']}" in text
    with sqlite3.connect(db_path(server)) as db:
        rows = db.execute("SELECT key_id, tenant FROM access_log WHERE action = 'replay'").fetchall()
    assert rows == [("cli", "acme")]
