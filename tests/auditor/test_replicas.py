"""Several replicas on one PostgreSQL: three real ``python -m auditor serve`` processes (each with its own
engine: the fake one, through ``VERBATIM_ENGINE_FACTORY``, since three SmolLM2 engines on two shared cores
would take minutes per request) started together on a fresh database, clients of three tenants spread
over them, one replica killed with SIGKILL while requests are in flight. Afterwards every transcript any
client received verifies, the log is one consistent tree (every stored checkpoint is a prefix of it), and
each tenant's chain has no duplicate and no missing sequence number.

Also (in-process, two apps on one database and one Redis): console sessions and rate limits are shared.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from alembic.script import ScriptDirectory

from auditor.db import migrate
from auditor.settings import Settings
from tests.auditor.conftest import LiveServer, make_key, postgres_url, serving, with_port
from tests.auditor.fake_engine import FakeAsyncEngine
from tests.auditor.processes import run_cli
from tests.auditor.replicas_support import (MODEL, Cluster, Load, check_log, create_database, drop_database,
                                           kill_under_load, replay_jobs_run_once, rows, share_one_witness)

pytestmark = pytest.mark.postgres

REDIS_ENV = "VERBATIM_TEST_REDIS_URL"
TENANTS = ("acme", "globex", "initech")


def redis_url() -> str:
    url = os.environ.get(REDIS_ENV)
    if not url:
        pytest.skip(f"{REDIS_ENV} is not set; Redis tests skipped (.ci/run sets it)")
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=2).ping()
    except redis.RedisError as exc:
        pytest.skip(f"Redis at {REDIS_ENV} unreachable ({exc}); skipped")
    return url


@pytest.fixture
def replica_database() -> Iterator[str]:
    url = create_database(postgres_url(), "verbatim_replicas")
    try:
        yield url
    finally:
        drop_database(url)


# --- three processes, one killed ----------------------------------------------------------------------


async def test_three_replicas_one_killed_under_load(replica_database: str, tmp_path: Path) -> None:
    cluster = Cluster(replica_database, tmp_path / "data", redis_url(),
                      {"VERBATIM_RATE_LIMIT_PER_SECOND": "10000", "VERBATIM_RATE_LIMIT_BURST": "10000",
                       "VERBATIM_ENGINE_OPTIONS": json.dumps({"step_delay": 0.02})})
    try:
        await asyncio.to_thread(cluster.start, 3)
        bootstraps = sum(r.output().count("Created the first admin API key") for r in cluster.replicas)
        assert bootstraps == 1, [r.output()[-500:] for r in cluster.replicas]
        keys = {t: await make_key(Settings(database_url=replica_database), t, "client") for t in TENANTS}
        load = Load(cluster.urls, keys)
        requests = [(t, n) for n in range(12) for t in TENANTS]
        random.Random(29).shuffle(requests)
        queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
        for item in requests:
            queue.put_nowait(item)

        async def client() -> None:
            while not queue.empty():
                await load.request(*queue.get_nowait())

        killer = asyncio.create_task(kill_under_load(cluster, load, victim=2, after=len(requests) // 3))
        await asyncio.gather(*(client() for _ in range(12)))
        await killer
        assert cluster.replicas[2].proc.returncode == -9
        assert load.failures[2] >= 1, load.failures  # requests were cut off by the kill and retried elsewhere
        assert len(load.received) == len(requests)
        await check_log(cluster, load, TENANTS)
    finally:
        cluster.stop()


# --- shared sessions and rate limits -----------------------------------------------------------------------


@pytest.fixture
async def two_apps(pg_settings: Settings) -> AsyncIterator[tuple[LiveServer, LiveServer]]:
    settings = replace(pg_settings, redis_url=redis_url(), rate_limit_per_second=0.05, rate_limit_burst=4)
    keys = {name: await make_key(settings, "acme", "auditor") for name in ("console", "limited")}
    async with serving(settings, FakeAsyncEngine(), {}) as a, serving(with_port(settings), FakeAsyncEngine(), {}) as b:
        a.keys.update(keys)
        yield a, b


async def test_console_sessions_and_rate_limits_are_shared(two_apps: tuple[LiveServer, LiveServer]) -> None:
    a, b = two_apps
    key = a.keys["console"]
    async with httpx.AsyncClient() as http:
        signed_in = await http.post(f"{a.url}/ui/login", data={"api_key": key})
        assert signed_in.status_code == 303, signed_in.text
        token = signed_in.cookies["verbatim_console"]
        cookie = {"Cookie": f"verbatim_console={token}"}
        page = await http.get(f"{b.url}/ui/transcripts", headers=cookie)
        assert page.status_code == 200 and "transcripts" in page.text.lower(), page.text[:300]
        stored = await _redis_values(a.settings.redis_url)
        assert stored and all(key.encode() not in v and token.encode() not in v for v in stored)
        await http.post(f"{b.url}/ui/logout", headers=cookie)
        after = await http.get(f"{a.url}/ui/transcripts", headers=cookie)
        assert after.status_code == 303 and after.headers["location"] == "/ui/login"
        limited = {"Authorization": f"Bearer {a.keys['limited']}"}
        statuses = [(await http.get(f"{(a, b)[i % 2].url}/v1/transcripts", headers=limited)).status_code
                    for i in range(6)]
    assert statuses == [200] * 4 + [429] * 2, statuses  # one bucket of 4 for both replicas


async def _redis_values(url: str) -> list[bytes]:
    """Every console session value in Redis (a client of the test's own event loop)."""
    from redis.asyncio import Redis

    redis = Redis.from_url(url)
    try:
        keys = [k async for k in redis.scan_iter("verbatim-console*")]
        return [v for v in [await redis.get(k) for k in keys] if v is not None]
    finally:
        await redis.aclose()


async def test_replicas_started_together_migrate_once(replica_database: str, tmp_path: Path) -> None:
    """Three ``migrate`` commands at once on an empty database: one applies, the others find it done."""
    env = {"VERBATIM_DATABASE_URL": replica_database, "VERBATIM_DATA_DIR": str(tmp_path)}
    results = await asyncio.gather(*(asyncio.to_thread(run_cli, "migrate", env=env) for _ in range(3)))
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    head = ScriptDirectory.from_config(migrate.alembic_config(replica_database)).get_current_head()
    assert await rows(replica_database, "SELECT version_num FROM alembic_version") == [(head,)]


# --- backup and restore -------------------------------------------------------------------------------------


def _dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


async def _complete(url: str, key: str, n: int) -> str:
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
        response = await http.post("/v1/completions", json={"model": MODEL, "prompt": f"backup {n}", "max_tokens": 4})
        assert response.status_code == 200, response.text
        return response.json()["transcript"]["id"]


@pytest.fixture
def restored_database() -> Iterator[str]:
    url = create_database(postgres_url(), "verbatim_replicas_restored")
    try:
        yield url
    finally:
        drop_database(url)


async def test_backup_and_restore_with_the_log_checked(replica_database: str, restored_database: str,
                                                       tmp_path: Path) -> None:
    """The procedure of docs/replicas.md: pg_dump, pg_restore into a new database, start on it, then
    check the restored log against a checkpoint kept from before (monitor) and verify a transcript.
    A restore that lost published entries is caught by a monitor that saw them."""
    import shutil
    import subprocess

    if not shutil.which("pg_dump") or not shutil.which("pg_restore"):
        pytest.skip("pg_dump / pg_restore not installed")
    cluster = Cluster(replica_database, tmp_path / "data", None)
    restored_url = restored_database
    try:
        await asyncio.to_thread(cluster.start, 1)
        key = await make_key(Settings(database_url=replica_database), "acme", "client")
        ids = [await _complete(cluster.urls[0], key, n) for n in range(6)]
        async with httpx.AsyncClient(base_url=cluster.urls[0]) as http:
            (tmp_path / "jwks.json").write_text((await http.get("/.well-known/jwks.json")).text)
        monitor = ["monitor", "--jwks", str(tmp_path / "jwks.json"), "--once"]
        kept = run_cli(*monitor, cluster.urls[0], "--state", str(tmp_path / "before.json"))
        assert kept.returncode == 0, kept.stderr
        dump = subprocess.run(["pg_dump", "-Fc", "-d", _dsn(replica_database), "-f", str(tmp_path / "log.dump")],
                              capture_output=True, text=True)
        assert dump.returncode == 0, dump.stderr
        await _complete(cluster.urls[0], key, 6)  # published after the backup: lost by the restore
        later = run_cli(*monitor, cluster.urls[0], "--state", str(tmp_path / "after.json"))
        assert later.returncode == 0 and "size 7" in later.stdout, later.stdout
        restore, _ = await asyncio.gather(
            asyncio.to_thread(subprocess.run, ["pg_restore", "--no-owner", "-d", _dsn(restored_url),
                                               str(tmp_path / "log.dump")], capture_output=True, text=True),
            asyncio.to_thread(cluster.stop))
        assert restore.returncode == 0, restore.stderr
        restored = Cluster(restored_url, tmp_path / "data", None)
        await asyncio.to_thread(restored.start, 1)
        try:
            async with httpx.AsyncClient(base_url=restored.urls[0], headers={"Authorization": f"Bearer {key}"}) as http:
                (tmp_path / "doc.json").write_text((await http.get(f"/v1/transcripts/{ids[0]}")).text)
            # three independent commands (separate state files), run side by side
            checked, verified, shrunk = await asyncio.gather(
                asyncio.to_thread(run_cli, *monitor, restored.urls[0], "--state", str(tmp_path / "before.json")),
                asyncio.to_thread(run_cli, "verify", str(tmp_path / "doc.json"), "--jwks", str(tmp_path / "jwks.json")),
                asyncio.to_thread(run_cli, *monitor, restored.urls[0], "--state", str(tmp_path / "after.json")))
            assert checked.returncode == 0 and "size 6" in checked.stdout, checked.stdout + checked.stderr
            assert verified.returncode == 0, verified.stdout
            assert shrunk.returncode == 1 and "the log shrank from size 7 to 6" in shrunk.stderr, shrunk.stderr
        finally:
            restored.stop()
    finally:
        cluster.stop()


# --- replay jobs across replicas ---------------------------------------------------------------------------


async def test_replay_jobs_run_once_across_replicas(pg_settings: Settings) -> None:
    """Two apps (each with its replay worker and engine) on one database: every job is replayed and
    attested exactly once, whichever app took it; a job left running by a dead process is taken back
    once its lease has passed."""
    await replay_jobs_run_once(pg_settings)


# --- witnessing from several replicas ------------------------------------------------------------------------


async def test_two_replicas_share_one_witness(pg_settings: Settings, tmp_path: Path) -> None:
    """Both apps submit to the same witness (one at a time, by an advisory lock per witness): every
    submission is cosigned or answered with the witness's newer size, never refused as inconsistent."""
    await share_one_witness(pg_settings, tmp_path)
