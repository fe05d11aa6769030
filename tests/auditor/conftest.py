"""Fixtures for the service tests: migrated databases (SQLite file, PostgreSQL in a fresh schema),
API keys, and a live uvicorn server on a free local port running ``create_app``."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn

from auditor import auth
from auditor.app import create_app
from auditor.db import migrate
from auditor.db.session import create_engine, create_sessionmaker
from auditor.settings import Settings

from tests.auditor.fake_engine import FakeAsyncEngine

POSTGRES_ENV = "VERBATIM_TEST_POSTGRES_URL"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def sqlite_settings(tmp: Path, **overrides: Any) -> Settings:
    settings = Settings(data_dir=tmp, port=free_port(), **overrides)
    migrate.upgrade(settings.resolved_database_url)
    return settings


# --- PostgreSQL ---------------------------------------------------------------------------------


def postgres_url() -> str:
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        pytest.skip(f"{POSTGRES_ENV} is not set; PostgreSQL tests skipped (.ci/run sets it)")
    try:
        asyncio.run(_pg_execute(url, "SELECT 1"))
    except Exception as exc:  # noqa: BLE001 - any connection failure means skip
        pytest.skip(f"PostgreSQL at {POSTGRES_ENV} unreachable ({type(exc).__name__}: {exc}); skipped")
    return url


async def _pg_execute(url: str, *statements: str) -> None:
    import asyncpg

    dsn = url.replace("postgresql+asyncpg://", "postgresql://")
    connection = await asyncpg.connect(dsn, timeout=5)
    try:
        for statement in statements:
            await connection.execute(statement)
    finally:
        await connection.close()


@contextmanager
def fresh_pg_schema() -> Iterator[tuple[str, str]]:
    """A fresh, empty PostgreSQL schema (dropped afterwards): (url, schema); skips without a server."""
    url = postgres_url()
    schema = "verbatim_test_" + secrets.token_hex(6)
    asyncio.run(_pg_execute(url, f"CREATE SCHEMA {schema}"))
    try:
        yield url, schema
    finally:
        asyncio.run(_pg_execute(url, f"DROP SCHEMA {schema} CASCADE"))


@pytest.fixture
def pg_schema() -> Iterator[tuple[str, str]]:
    """A fresh, empty PostgreSQL schema (dropped afterwards): (url, schema)."""
    with fresh_pg_schema() as url_schema:
        yield url_schema


@pytest.fixture
async def pg_settings(pg_schema: tuple[str, str], tmp_path: Path) -> Settings:
    """Settings for a migrated fresh PostgreSQL schema (``pg_schema``) on a free port."""
    url, schema = pg_schema
    settings = Settings(data_dir=tmp_path, port=free_port(), database_url=url, database_schema=schema)
    await asyncio.to_thread(migrate.upgrade, url, schema=schema)
    return settings


# --- keys -----------------------------------------------------------------------------------------


async def make_key(settings: Settings, tenant: str, role: str) -> str:
    db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        async with create_sessionmaker(db)() as session, session.begin():
            _, secret = await auth.create_key(session, tenant, role)
    finally:
        await db.dispose()
    return secret


# --- live server ------------------------------------------------------------------------------------


class LoopThread:
    """An event loop running forever in a daemon thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Any, timeout: float = 600) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)


class _Server(uvicorn.Server):
    """uvicorn.Server (0.55) that stops without idle pauses, two at every stop of every test's server:
    its main loop wakes as soon as ``request_exit`` is called (uvicorn's looks at ``should_exit`` every
    0.1 s), and its shutdown, after asking the open connections to close, waits until none is left (at
    most the 0.1 s uvicorn always sleeps there). Ticks (the date header), the graceful wait for
    connections and tasks, and the lifespan shutdown are uvicorn's."""

    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None

    def request_exit(self) -> None:
        self.should_exit = True
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with suppress(RuntimeError):  # the loop closed meanwhile: the server has stopped already
                loop.call_soon_threadsafe(wake.set)

    async def main_loop(self) -> None:
        self._wake = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        try:
            counter = 0
            should_exit = await self.on_tick(counter)
            while not should_exit:
                counter = (counter + 1) % 864000
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.1)
                should_exit = await self.on_tick(counter)
        finally:
            self._loop = self._wake = None

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if not hasattr(self, "_wait_tasks_to_complete"):  # another uvicorn than this copy follows: its own
            await super().shutdown(sockets)
            return
        logging.getLogger("uvicorn.error").info("Shutting down")
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):
            connection.shutdown()
        deadline = time.monotonic() + 0.1
        while self.server_state.connections and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        try:
            async with asyncio.timeout(self.config.timeout_graceful_shutdown):
                await self._wait_tasks_to_complete()
        except TimeoutError:
            logging.getLogger("uvicorn.error").error(
                "Cancel %s running task(s), timeout graceful shutdown exceeded", len(self.server_state.tasks))
            for task in self.server_state.tasks:
                task.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()


@dataclass
class LiveServer:
    """``create_app(settings, routes=routes)`` under uvicorn in a thread with its own event loop."""

    settings: Settings
    engine: Any
    routes: Sequence[Any] = ()
    app: Any = None
    _server: _Server | None = None
    _thread: threading.Thread | None = None
    keys: dict[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.settings.port}"

    @property
    def services(self) -> Any:
        return self.app.state.services

    _future: Any = None

    def _make_server(self) -> _Server:
        self.app = create_app(self.settings, engine=self.engine, routes=self.routes)
        # log_config=None as `serve` runs it: uvicorn's records reach the root logger (and caplog).
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.settings.port, log_level="warning",
                                log_config=None, lifespan="on", timeout_graceful_shutdown=5)
        self._server = _Server(config)
        return self._server

    def start(self) -> LiveServer:
        """Serve in a thread of its own (its own event loop)."""
        server = self._make_server()
        self._thread = threading.Thread(target=server.run, daemon=True)
        self._thread.start()
        self._wait_started(lambda: self._thread is not None and self._thread.is_alive())
        return self

    def start_in(self, loop_thread: LoopThread) -> LiveServer:
        """Serve as a task on ``loop_thread``'s event loop (where a shared real engine lives)."""
        server = self._make_server()
        self._future = asyncio.run_coroutine_threadsafe(server.serve(), loop_thread.loop)
        self._wait_started(lambda: not self._future.done())
        return self

    def _wait_started(self, alive: Any) -> None:
        deadline = time.monotonic() + 60
        while not (self._server and self._server.started):
            if time.monotonic() > deadline or not alive():
                raise RuntimeError(f"server on port {self.settings.port} did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        if self._server is not None:
            self._server.request_exit()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self._future is not None:
            self._future.result(timeout=30)

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        headers = self.headers(key) if key else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=120)


async def add_keys(server: LiveServer, tenants: dict[str, str]) -> None:
    """Create one key per (name → 'tenant:role') entry of ``tenants`` into ``server.keys``."""
    for name, spec in tenants.items():
        tenant, role = spec.split(":")
        server.keys[name] = await make_key(server.settings, tenant, role)


async def start_server(settings: Settings, engine: Any, tenants: dict[str, str] | None = None, *,
                       routes: Sequence[Any] = (), loop_thread: LoopThread | None = None) -> LiveServer:
    """Start a server (``routes`` mounted beside the defaults; on ``loop_thread``'s loop when given, else
    in a thread of its own) and create one key per (name → 'tenant:role') entry of ``tenants``."""
    server = LiveServer(settings, engine, routes)
    await add_keys(server, {"client": "acme:client"} if tenants is None else tenants)
    if loop_thread is None:
        await asyncio.to_thread(server.start)
    else:
        await asyncio.to_thread(server.start_in, loop_thread)
    return server


DEFAULT_KEYS = {"client": "acme:client", "auditor": "acme:auditor", "admin": "acme:admin",
                "other": "globex:client", "other_auditor": "globex:auditor"}


@asynccontextmanager
async def serving(settings: Settings, engine: Any, tenants: dict[str, str] | None = None, *,
                  loop_thread: LoopThread | None = None) -> AsyncIterator[LiveServer]:
    """``start_server(...)`` for the length of the ``async with`` block, stopped afterwards."""
    server = await start_server(settings, engine, tenants, loop_thread=loop_thread)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


def with_port(settings: Settings) -> Settings:
    return replace(settings, port=free_port())


@asynccontextmanager
async def restarted(server: LiveServer) -> AsyncIterator[LiveServer]:
    """A stopped ``server``'s database, engine and keys served again (a restart), on a fresh port."""
    again = LiveServer(with_port(server.settings), server.engine, server.routes, keys=server.keys)
    await asyncio.to_thread(again.start)
    try:
        yield again
    finally:
        await asyncio.to_thread(again.stop)


@pytest.fixture
async def fake_server(tmp_path: Path) -> AsyncIterator[LiveServer]:
    """A fresh SQLite database and a server on the fake engine with the ``DEFAULT_KEYS``."""
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    async with serving(settings, FakeAsyncEngine(), DEFAULT_KEYS) as server:
        yield server


@pytest.fixture
async def fake_pg_server(pg_settings: Settings) -> AsyncIterator[LiveServer]:
    """A fresh PostgreSQL schema and a server on the fake engine with the ``DEFAULT_KEYS``."""
    async with serving(pg_settings, FakeAsyncEngine(), DEFAULT_KEYS) as server:
        yield server


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def any_database(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Settings]:
    """Settings for a fresh migrated database, once on SQLite and once on PostgreSQL."""
    if request.param == "sqlite":
        yield sqlite_settings(tmp_path)
        return
    with fresh_pg_schema() as (url, schema):
        settings = Settings(data_dir=tmp_path, port=free_port(), database_url=url, database_schema=schema)
        migrate.upgrade(url, schema=schema)
        yield settings


@pytest.fixture
async def fake_any_server(any_database: Settings) -> AsyncIterator[LiveServer]:
    """A server on the fake engine with the ``DEFAULT_KEYS``, once per database (``any_database``)."""
    async with serving(any_database, FakeAsyncEngine(), DEFAULT_KEYS) as server:
        yield server


# --- the real engine ---------------------------------------------------------------------------------

# Small verify shapes keep CPU passes short: a verify pass is G x W = 8 tokens.
REAL_ENGINE_OPTIONS: dict[str, Any] = {"window": 4, "group": 2, "max_num_seqs": 16}


@pytest.fixture(scope="session")
def real_engine() -> Iterator[tuple[LoopThread, Any]]:
    """The default model, loaded once per session; it runs on one long-lived event loop thread that
    every real-engine server of the session shares."""
    from engine import AsyncEngine, EngineConfig

    loop_thread = LoopThread()
    engine = AsyncEngine(EngineConfig(**REAL_ENGINE_OPTIONS))
    loop_thread.run(engine.start())
    try:
        yield loop_thread, engine
    finally:
        loop_thread.run(engine.shutdown())
        loop_thread.close()


@pytest.fixture
async def real_server(real_engine: tuple[LoopThread, Any], tmp_path: Path) -> AsyncIterator[LiveServer]:
    """A fresh SQLite database and a server on the shared real engine, with a client and an auditor key."""
    loop_thread, engine = real_engine
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    tenants = {"client": "acme:client", "auditor": "acme:auditor"}
    async with serving(settings, engine, tenants, loop_thread=loop_thread) as server:
        yield server


@pytest.fixture
async def real_pg_server(real_engine: tuple[LoopThread, Any], pg_settings: Settings) -> AsyncIterator[LiveServer]:
    """A fresh PostgreSQL schema and a server on the shared real engine."""
    loop_thread, engine = real_engine
    async with serving(pg_settings, engine, loop_thread=loop_thread) as server:
        yield server
