"""Several serving processes on ONE SQLite file (the default ``<data_dir>/verbatim.db``) on one host:
three real ``python -m auditor serve`` processes (the fake engine) started together on a fresh data
directory, clients of three tenants spread over them, each transcript read back at once from another
process (an access-log row, a sync of that process's tree). Afterwards no request failed, every transcript
verifies, the log is one tree whose size is the number of completions (every stored checkpoint a prefix
of it), and each tenant's chain has no duplicate and no missing sequence number. The same holds after
one process is killed with SIGKILL while requests are in flight.

Also, each lock on its own, with separate SQLAlchemy engines on one file in one process (SQLite's locks
are per connection, so they contend as processes do): two ledgers appending at once make one log, two
replay workers never claim one job twice, concurrent bootstraps create one admin key; and, with real
processes or apps, concurrent ``migrate`` commands, two apps sharing one witness, two apps replaying.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import random
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from alembic.script import ScriptDirectory
from sqlalchemy import insert, select

from auditor.cli import bootstrap_admin
from auditor.crypto import KeyRing
from auditor.db import migrate
from auditor.db.models import ReplayJob, ReplayStatus
from auditor.db.session import create_engine, create_sessionmaker
from auditor.ledger import Appended, Ledger
from auditor.replay import ReplayService
from auditor.settings import Settings
from auditor.transcript import uuid7
from tests.auditor import independent
from tests.auditor.conftest import make_key, sqlite_settings
from tests.auditor.processes import run_cli
from tests.auditor.replicas_support import (Cluster, Load, check_log, kill_under_load, replay_jobs_run_once, rows,
                                           share_one_witness)
from tests.auditor.test_ledger_batching import check_chains, draft

TENANTS = ("acme", "globex", "initech")


@pytest.mark.slow
async def test_three_processes_share_one_sqlite_file(tmp_path: Path) -> None:
    cluster = Cluster(None, tmp_path / "data", None,
                      {"VERBATIM_RATE_LIMIT_PER_SECOND": "10000", "VERBATIM_RATE_LIMIT_BURST": "10000",
                       "VERBATIM_ENGINE_OPTIONS": json.dumps({"step_delay": 0.01})})
    try:
        await asyncio.to_thread(cluster.start, 3)
        outputs = [r.output() for r in cluster.replicas]
        assert sum(o.count("Created the first admin API key") for o in outputs) == 1, [o[-500:] for o in outputs]
        keys = {t: await make_key(Settings(data_dir=cluster.data_dir), t, "client") for t in TENANTS}
        load = Load(cluster.urls, keys, read_back=True)
        requests = [(t, n) for n in range(12) for t in TENANTS]
        await _send(load, requests, seed=31)
        assert not +load.failures, load.failures
        assert len(load.received) == len(requests)
        assert await check_log(cluster, load, TENANTS) == len(requests)

        # Then one process killed with SIGKILL while requests are in flight (the clients retry elsewhere):
        # whatever it had not committed is gone, and the others go on with the same log.
        more = [(t, n) for n in range(12, 24) for t in TENANTS]
        killer = asyncio.create_task(kill_under_load(cluster, load, victim=2, after=len(requests) + 6))
        await _send(load, more, seed=37)
        await killer
        assert cluster.replicas[2].proc is not None and cluster.replicas[2].proc.returncode == -9
        assert load.failures[2] >= 1, load.failures  # requests were cut off by the kill and retried elsewhere
        assert len(load.received) == len(requests) + len(more)
        assert await check_log(cluster, load, TENANTS) >= len(load.received)  # cut-off ones may be recorded too
    finally:
        cluster.stop()
    for replica in cluster.replicas:  # nothing failed inside ("database is locked" and the like)
        assert '"level": "ERROR"' not in replica.output(), replica.output()[-3000:]


async def _send(load: Load, requests: list[tuple[str, int]], *, seed: int, clients: int = 12) -> None:
    """``requests`` in a shuffled order from ``clients`` concurrent clients."""
    queue: asyncio.Queue[tuple[str, int]] = asyncio.Queue()
    for item in random.Random(seed).sample(requests, len(requests)):
        queue.put_nowait(item)

    async def client() -> None:
        while not queue.empty():
            await load.request(*queue.get_nowait())

    await asyncio.gather(*(client() for _ in range(clients)))


# --- in one process, separate engines ----------------------------------------------------------------


@pytest.fixture
def sqlite_file(tmp_path: Path) -> str:
    url = f"sqlite+aiosqlite:///{tmp_path / 'shared.db'}"
    migrate.upgrade(url)
    return url


@pytest.fixture
async def two_ledgers(sqlite_file: str, tmp_path: Path) -> AsyncIterator[list[Ledger]]:
    engines, ledgers = [], []
    for _ in range(2):
        reads, writes = create_engine(sqlite_file), create_engine(sqlite_file, connections=1)
        engines += [reads, writes]
        ledgers.append(Ledger(create_sessionmaker(reads), KeyRing.open(tmp_path / "keys"), "verbatim.test/log",
                              writer=create_sessionmaker(writes), max_batch=4))
    for ledger in ledgers:
        await ledger.start(0)
    try:
        yield ledgers
    finally:
        for ledger in ledgers:
            await ledger.stop()
        for engine in engines:
            await engine.dispose()


async def test_two_ledgers_on_one_file_make_one_log(two_ledgers: list[Ledger], sqlite_file: str) -> None:
    """Appends from two ledgers interleave: each must read the other's head and tree under the lock."""
    tenants = ("acme", "globex")
    appended: list[Appended] = list(await asyncio.gather(*(
        two_ledgers[k % 2].append(draft(tenants[k % 3 % 2], k)) for k in range(96))))
    check_chains(appended, set(tenants))
    assert sorted(a.log_index for a in appended) == list(range(96))
    leaves = await rows(sqlite_file, 'SELECT "index", leaf_hash FROM log_leaves ORDER BY "index"')
    assert [row[0] for row in leaves] == list(range(96))
    hashes = [bytes(row[1]) for row in leaves]
    checkpoints = await rows(sqlite_file, "SELECT tree_size, root_hash FROM log_checkpoints ORDER BY tree_size")
    assert checkpoints[-1][0] == 96
    for size, root in checkpoints:
        assert independent.mth(hashes[:size]) == bytes(root), f"checkpoint {size} is not a prefix of the log"
    assert all(ledger.fault is None for ledger in two_ledgers)


async def test_two_workers_never_claim_one_job(two_ledgers: list[Ledger], sqlite_file: str) -> None:
    """Two replay workers, each on its own engine, claim 120 queued jobs from many concurrent claims at
    once: every job is claimed exactly once, by the worker its row names."""
    transcript_id = (await two_ledgers[0].append(draft("acme", 0))).transcript_id
    engines = [create_engine(sqlite_file), create_engine(sqlite_file)]
    try:
        now = dt.datetime.now(dt.UTC)
        jobs = [{"id": str(uuid7()), "tenant": "acme", "transcript_id": transcript_id, "requested_by": "k",
                 "status": ReplayStatus.QUEUED.value, "created_at": now} for _ in range(120)]
        async with engines[0].begin() as connection:
            await connection.execute(insert(ReplayJob), jobs)
        workers = [ReplayService(SimpleNamespace(sessionmaker=create_sessionmaker(e)), max_batch=3) for e in engines]

        async def claim_all(worker: ReplayService) -> list[str]:
            claimed: list[str] = []
            while batch := await worker._claim():
                claimed += batch
            return claimed

        claims = await asyncio.gather(*(claim_all(workers[k % 2]) for k in range(16)))
        by_worker = {w.worker_id: [j for k, c in enumerate(claims) if k % 2 == i for j in c]
                     for i, w in enumerate(workers)}
        everything = [j for c in claims for j in c]
        assert sorted(everything) == sorted(j["id"] for j in jobs), Counter(everything).most_common(3)
        async with create_sessionmaker(engines[0])() as session:
            stored = {row.id: row.claimed_by for row in (await session.scalars(select(ReplayJob))).all()}
        assert all(stored[j] == worker for worker, ids in by_worker.items() for j in ids)
        assert all(by_worker.values()), {w: len(ids) for w, ids in by_worker.items()}  # both took part
    finally:
        for engine in engines:
            await engine.dispose()


async def test_processes_started_together_migrate_one_sqlite_file_once(tmp_path: Path) -> None:
    """Three ``migrate`` commands at once on a data directory without a database: one creates and
    migrates the file, the others find it at head."""
    env = {"VERBATIM_DATA_DIR": str(tmp_path / "data")}
    results = await asyncio.gather(*(asyncio.to_thread(run_cli, "migrate", env=env) for _ in range(3)))
    assert all(r.returncode == 0 for r in results), [r.stderr[-2000:] for r in results]
    url = Settings(data_dir=tmp_path / "data").resolved_database_url
    head = ScriptDirectory.from_config(migrate.alembic_config(url)).get_current_head()
    assert await rows(url, "SELECT version_num FROM alembic_version") == [(head,)]


async def test_one_bootstrap_admin_key_when_started_together(sqlite_file: str, tmp_path: Path) -> None:
    """``serve``'s bootstrap from several processes at once (here: engines) creates one admin key."""
    settings = Settings(data_dir=tmp_path, database_url=sqlite_file)
    created = await asyncio.gather(*(bootstrap_admin(settings) for _ in range(4)))
    assert sum(secret is not None for secret in created) == 1, created
    assert await rows(sqlite_file, "SELECT count(*) FROM api_keys WHERE role = 'admin'") == [(1,)]


async def test_two_processes_share_one_witness(tmp_path: Path) -> None:
    """Two apps on one SQLite file and one witness: one submits at a time (a file lock per witness), so
    no cosignature is stored twice and no submission is refused."""
    await share_one_witness(await asyncio.to_thread(sqlite_settings, tmp_path / "data"), tmp_path)


async def test_replay_jobs_run_once_across_processes(tmp_path: Path) -> None:
    """Two apps, each with its replay worker, on one SQLite file: every job is replayed and attested once."""
    await replay_jobs_run_once(await asyncio.to_thread(sqlite_settings, tmp_path / "data"))


async def test_the_append_file_lock_is_let_go_by_a_cancelled_waiter(tmp_path: Path) -> None:
    """``AsyncHeld`` (the log append's file lock): one holder at a time; a waiter cancelled while its thread waits
    lets the lock go once the thread gets it, so the next process is not locked out for good."""
    from auditor.db.filelock import AsyncHeld

    url = f"sqlite+aiosqlite:///{tmp_path / 'verbatim.db'}"
    first, cancelled, last = AsyncHeld(url, "log-append"), AsyncHeld(url, "log-append"), AsyncHeld(url, "log-append")
    async with first:
        async def wait() -> None:
            async with cancelled:
                raise AssertionError("got the lock while it was held")

        waiter = asyncio.ensure_future(wait())
        await asyncio.sleep(0.2)
        assert not waiter.done()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    async with asyncio.timeout(10):  # the cancelled waiter's thread took the lock and let it go
        async with last:
            pass
    async with AsyncHeld(None, "log-append"), AsyncHeld("postgresql+asyncpg://db/x", "log-append"):
        pass  # nothing to hold without a SQLite file
