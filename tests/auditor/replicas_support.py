"""Several real ``python -m auditor serve`` processes on one PostgreSQL database (and one Redis): a
database of their own, a shared data directory (keys, reports), the engine chosen by a settings hook.
Used by the replica tests and by ``bench/replicas_bench.py``."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sqlalchemy.engine import make_url

from tests.auditor.conftest import free_port
from tests.auditor.processes import Process

FAKE_ENGINE = "tests.auditor.fake_engine:from_settings"


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
    database_url: str
    data_dir: Path
    redis_url: str | None = None
    env: Mapping[str, str] = field(default_factory=dict)
    replicas: list[Process] = field(default_factory=list)
    urls: list[str] = field(default_factory=list)

    def base_env(self) -> dict[str, str]:
        env = {"VERBATIM_DATABASE_URL": self.database_url, "VERBATIM_DATA_DIR": str(self.data_dir),
               "VERBATIM_ENGINE_FACTORY": FAKE_ENGINE, "VERBATIM_LOG_LEVEL": "WARNING",
               "VERBATIM_LOG_ORIGIN": "verbatim.test/replicas"}
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
