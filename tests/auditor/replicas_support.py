"""Several real ``python -m auditor serve`` processes on one database (a PostgreSQL database of their own,
or the SQLite file of their data directory), a shared data directory (keys, reports), the engine chosen
by a settings hook; clients that spread requests over them, and the check of the log they leave.
Used by the replica tests and by ``bench/replicas_bench.py``."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import json
import re
import secrets
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text
from sqlalchemy.engine import make_url

from auditor.crypto import KeyRing
from auditor.db.session import create_engine
from auditor.settings import Settings
from auditor.verify import verify_document
from tests.auditor import independent
from tests.auditor.conftest import free_port, make_key, serving, with_port
from tests.auditor.fake_engine import FakeAsyncEngine
from tests.auditor.processes import Process

FAKE_ENGINE = "tests.auditor.fake_engine:from_settings"
MODEL = "fake-model"


async def _admin(url: str, statement: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"), timeout=10)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


def create_database(base_url: str, prefix: str) -> str:
    """A fresh database named ``<prefix>_<random>`` on the server of ``base_url``; returns its URL."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    asyncio.run(_admin(base_url, f"CREATE DATABASE {name}"))
    return make_url(base_url).set(database=name).render_as_string(hide_password=False)


def drop_database(url: str) -> None:
    name = make_url(url).database
    base = make_url(url).set(database="postgres").render_as_string(hide_password=False)
    asyncio.run(_admin(base, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))


@dataclass
class Cluster:
    database_url: str | None
    """None: the replicas' default, the SQLite file of ``data_dir``."""
    data_dir: Path
    redis_url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    replicas: list[Process] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    @property
    def resolved_database_url(self) -> str:
        return Settings(data_dir=self.data_dir, database_url=self.database_url).resolved_database_url

    def base_env(self) -> dict[str, str]:
        env = {"VERBATIM_DATA_DIR": str(self.data_dir), "VERBATIM_ENGINE_FACTORY": FAKE_ENGINE,
               "VERBATIM_LOG_LEVEL": "WARNING", "VERBATIM_LOG_ORIGIN": "verbatim.test/replicas"}
        if self.database_url:
            env["VERBATIM_DATABASE_URL"] = self.database_url
        if self.redis_url:
            env["VERBATIM_REDIS_URL"] = self.redis_url
        env.update(self.env)
        return env

    def start(self, n: int) -> Cluster:
        """Start ``n`` replicas at once (they migrate and bootstrap concurrently) and wait until ready."""
        for i in range(n):
            port = free_port()
            self.urls.append(f"http://127.0.0.1:{port}")
            self.replicas.append(Process(("serve",), self.data_dir.parent / f"replica-{i}.log",
                                         {**self.base_env(), "VERBATIM_PORT": str(port)}).start())
        for replica, url in zip(self.replicas, self.urls):
            replica.wait_http(url + "/readyz", timeout=180)
        return self

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()


class Load:
    """Clients that spread requests over the live replicas and retry elsewhere when one fails
    (``failures``: per replica, requests cut off or answered with another status than 200).
    ``read_back``: each transcript received is read at once from another replica (its access-log row
    and its sync with the log run while the others append)."""

    def __init__(self, urls: list[str], keys: dict[str, str], *, read_back: bool = False) -> None:
        self.urls = urls
        self.keys = keys
        self.read_back = read_back
        self.dead: set[int] = set()
        self.in_flight = Counter[int]()
        self.failures = Counter[int]()
        self.received: list[tuple[str, str]] = []
        self.done = 0

    async def request(self, tenant: str, n: int) -> None:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 24 if n % 3 == 0 else 8, "seed": n,
                                "deterministic": n % 2 == 0, "stream": n % 3 == 0}
        if n % 4 == 0:
            body["messages"] = [{"role": "user", "content": f"request {n} of {tenant}"}]
        else:
            body["prompt"] = f"request {n} of {tenant}"
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        for attempt in range(6):
            replica = (n + attempt) % len(self.urls)
            if replica in self.dead:
                continue
            transcript = await self._once(replica, path, body, self.keys[tenant])
            if transcript is not None:
                self.received.append((tenant, transcript))
                self.done += 1
                if self.read_back:
                    await self._read(replica + 1 + n % (len(self.urls) - 1), transcript, self.keys[tenant])
                return
        raise AssertionError(f"request {n} of {tenant} failed on every replica")

    async def _once(self, replica: int, path: str, body: dict[str, Any], key: str) -> str | None:
        self.in_flight[replica] += 1
        try:
            async with httpx.AsyncClient(base_url=self.urls[replica], timeout=60,
                                         headers={"Authorization": f"Bearer {key}"}) as client:
                if not body["stream"]:
                    response = await client.post(path, json=body)
                    transcript = response.json()["transcript"]["id"] if response.status_code == 200 else None
                else:
                    transcript = await _streamed_transcript(client, path, body)
        except (httpx.TransportError, ValueError, KeyError):
            transcript = None
        finally:
            self.in_flight[replica] -= 1
        if transcript is None:
            self.failures[replica] += 1
        return transcript


    async def _read(self, replica: int, transcript_id: str, key: str) -> None:
        replica %= len(self.urls)
        if replica in self.dead:
            return
        try:
            async with httpx.AsyncClient(base_url=self.urls[replica], timeout=60,
                                         headers={"Authorization": f"Bearer {key}"}) as client:
                response = await client.get(f"/v1/transcripts/{transcript_id}")
            ok = response.status_code == 200 and response.json()["transcript"]["id"] == transcript_id
        except (httpx.TransportError, ValueError, KeyError):
            ok = False
        if not ok:
            self.failures[replica] += 1


async def kill_under_load(cluster: Cluster, load: Load, victim: int, after: int) -> None:
    """SIGKILL replica ``victim`` once ``after`` requests are done and it has one in flight."""
    while load.done < after or load.in_flight[victim] == 0:
        await asyncio.sleep(0.005)
    load.dead.add(victim)
    cluster.replicas[victim].kill()


async def _streamed_transcript(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> str | None:
    transcript, done = None, False
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            return None
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                transcript = json.loads(line[6:]).get("transcript", {}).get("id") or transcript
    return transcript if done else None


async def rows(url: str, query: str) -> list[Any]:
    engine = create_engine(url)
    try:
        async with engine.connect() as connection:
            return list((await connection.execute(text(query))).all())
    finally:
        await engine.dispose()


async def check_log(cluster: Cluster, load: Load, tenants: Sequence[str]) -> int:
    """Every transcript a client received verifies (through replica 0); the leaves are dense and each
    the digest of its envelope; every stored checkpoint is a prefix of the latest one, which covers
    every leaf; each tenant's sequence numbers are 1..n with unbroken ``previous_digest`` links.
    Returns the number of leaves."""
    survivor = cluster.urls[0]
    async with httpx.AsyncClient(base_url=survivor, timeout=60) as http:
        jwks = (await http.get("/.well-known/jwks.json")).json()
        checkpoint = (await http.get("/v1/log/checkpoint")).json()
        for tenant, tid in load.received:
            doc = (await http.get(f"/v1/transcripts/{tid}", headers={"Authorization": f"Bearer {load.keys[tenant]}"},
                                  params={"include_content": "true"})).json()
            report = verify_document(doc, jwks)
            assert report.ok, report.render()
    assert len([k for k in jwks["keys"] if k["role"] == "checkpoint"]) == 1  # one shared key ring

    url = cluster.resolved_database_url
    leaves = await rows(url, 'SELECT "index", leaf_hash, entry, kind, transcript_id FROM log_leaves ORDER BY "index"')
    assert [row[0] for row in leaves] == list(range(len(leaves)))
    hashes = [bytes(row[1]) for row in leaves]
    assert checkpoint["tree_size"] == len(leaves)
    assert independent.mth(hashes) == base64.b64decode(checkpoint["root_hash"])
    for size, root in await rows(url, "SELECT tree_size, root_hash FROM log_checkpoints"):
        assert independent.mth(hashes[:size]) == bytes(root), f"checkpoint {size} is not a prefix of the log"

    transcripts = await rows(url, "SELECT id, tenant, sequence, previous_digest, payload_digest, log_index, "
                                  "envelope FROM transcripts ORDER BY tenant, sequence")
    assert {row[0] for row in transcripts} >= {tid for _, tid in load.received}
    assert sorted(row[5] for row in transcripts) == sorted(r[0] for r in leaves if r[3] == "transcript")
    for tenant in tenants:
        chain = [row for row in transcripts if row[1] == tenant]
        assert [row[2] for row in chain] == list(range(1, len(chain) + 1)), tenant
        assert [row[3] for row in chain] == [None, *(row[4] for row in chain[:-1])], tenant
    for row in transcripts:
        envelope = json.loads(row[6])
        payload = independent.verify_dsse(envelope, jwks)
        assert hashlib.sha256(payload).hexdigest() == row[4]
        assert independent.envelope_digest(envelope) == bytes(leaves[row[5]][2])
    return len(leaves)


async def share_one_witness(settings: Settings, tmp_path: Path) -> None:
    """Two apps on the database of ``settings`` submit to the same witness while completions go to both
    in turn: both end at the latest checkpoint witnessed, no submission failed or was refused."""
    from tests.auditor.test_witness_live import ORIGIN, start_witness

    (tmp_path / "jwks.json").write_text(json.dumps(KeyRing.open(settings.keys_dir).jwks()))
    witness, url, vkey = start_witness(tmp_path, tmp_path / "jwks.json")
    settings = replace(settings, log_origin=ORIGIN, witnesses=((url, vkey),), witness_interval=0.05)
    key = await make_key(settings, "acme", "client")
    try:
        async with serving(settings, FakeAsyncEngine(), {}) as a, \
                serving(with_port(settings), FakeAsyncEngine(), {}) as b:
            async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
                for n in range(12):
                    body = {"model": MODEL, "prompt": f"witnessed {n}", "max_tokens": 4}
                    assert (await http.post(f"{(a, b)[n % 2].url}/v1/completions", json=body)).status_code == 200
                    await asyncio.sleep(0.03)
                notes = [(await http.get(f"{app.url}/v1/log/checkpoint", params={"witnessed": "true"})).json()
                         for app in (a, b)]
                metrics = [(await http.get(f"{app.url}/metrics")).text for app in (a, b)]
    finally:
        witness.stop()
    assert [n["tree_size"] for n in notes] == [12, 12]
    assert all(independent.cosignatures(n["note"], vkey) for n in notes)
    cosigned = [re.search(r'outcome="cosigned"[^}]*\} (\d+)', m) for m in metrics]
    assert all(cosigned) and sum(int(c.group(1)) for c in cosigned) >= 2, metrics
    assert not any('outcome="refused"' in m or 'outcome="error"' in m for m in metrics), metrics
    assert not (tmp_path / "witness" / "evidence.jsonl").exists()


async def replay_jobs_run_once(settings: Settings) -> None:
    """Two apps (each with its replay worker and engine) on the database of ``settings`` replay six jobs
    submitted to either and one left running by a dead process: each is replayed and attested once."""
    from tests.auditor.test_replay_fake import ReplayFakeEngine

    engines = [ReplayFakeEngine(), ReplayFakeEngine()]
    key = await make_key(settings, "acme", "client")
    async with serving(settings, engines[0], {}) as a, serving(with_port(settings), engines[1], {}) as b:
        apps = (a, b)
        headers = {"Authorization": f"Bearer {key}"}
        async with httpx.AsyncClient(headers=headers, timeout=60) as http:
            tids = []
            for n in range(7):
                body = {"model": MODEL, "prompt": f"replay {n}", "max_tokens": 6, "deterministic": True, "seed": n}
                tids.append((await http.post(f"{apps[n % 2].url}/v1/completions", json=body)).json()["transcript"]["id"])
            jobs = [(await http.post(f"{apps[n % 2].url}/v1/transcripts/{tid}/replay")).json()
                    for n, tid in enumerate(tids[:6])]
            db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
            try:
                async with db.begin() as connection:
                    await connection.execute(text(
                        "INSERT INTO replay_jobs (id, tenant, transcript_id, requested_by, status, created_at, "
                        "claimed_by, lease_expires_at) VALUES (:id, 'acme', :tid, 'k', 'running', :now, "
                        "'dead-host:1:0', :past)"), {"id": "0190a0a0-0000-7000-8000-00000000dead", "tid": tids[6],
                                                     "now": dt.datetime.now(dt.UTC),
                                                     "past": dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)})
                ids = [j["id"] for j in jobs] + ["0190a0a0-0000-7000-8000-00000000dead"]
                done = [await _until_done(http, apps[(n + 1) % 2].url, job_id) for n, job_id in enumerate(ids)]
                async with db.connect() as connection:
                    leaves = (await connection.execute(text(
                        "SELECT replay_job_id FROM log_leaves WHERE kind = 'replay_attestation'"))).all()
            finally:
                await db.dispose()
    assert [d["result"] for d in done] == ["match"] * 7, done
    assert sorted(row[0] for row in leaves) == sorted(ids)
    assert sum(sum(e.replay_calls) for e in engines) == 7, [e.replay_calls for e in engines]


async def _until_done(http: httpx.AsyncClient, url: str, job_id: str) -> dict[str, Any]:
    for _ in range(300):
        job = (await http.get(f"{url}/v1/replays/{job_id}")).json()
        if job["status"] in ("done", "failed"):
            return job
        await asyncio.sleep(0.1)
    raise AssertionError(f"replay {job_id} did not finish: {job}")
