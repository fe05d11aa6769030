"""API keys remembered for ``api_key_cache_seconds``: revoked here, refused at once; revoked by another
process, refused once the entry expires; unknown keys never remembered."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from auditor import auth
from auditor.db import migrate
from auditor.db.session import create_engine, create_sessionmaker
from auditor.errors import ApiError
from auditor.ratelimit import RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def sessions(tmp_path: Path) -> AsyncIterator[async_sessionmaker[AsyncSession]]:
    url = f"sqlite+aiosqlite:///{tmp_path / 'keys.db'}"
    await asyncio.to_thread(migrate.upgrade, url)
    db = create_engine(url)
    try:
        yield create_sessionmaker(db)
    finally:
        await db.dispose()


async def new_key(sessions: async_sessionmaker[AsyncSession]) -> tuple[str, str]:
    async with sessions() as session, session.begin():
        row, secret = await auth.create_key(session, "acme", "client")
    return row.id, secret


async def revoke_elsewhere(sessions: async_sessionmaker[AsyncSession], key_id: str) -> None:
    async with sessions() as session, session.begin():
        assert await auth.revoke_key(session, key_id) is not None


def authenticator(sessions: async_sessionmaker[AsyncSession], clock: Clock, seconds: float) -> auth.Authenticator:
    return auth.Authenticator(sessions, RateLimiter(1000.0, 1000), cache_seconds=seconds, clock=clock)


async def test_revoked_elsewhere_is_refused_once_the_entry_expires(sessions: async_sessionmaker[AsyncSession]) -> None:
    clock = Clock()
    authn = authenticator(sessions, clock, 1.0)
    key_id, secret = await new_key(sessions)
    assert (await authn.authenticate(f"Bearer {secret}")).key_id == key_id
    await revoke_elsewhere(sessions, key_id)
    assert (await authn.authenticate(f"Bearer {secret}")).key_id == key_id  # remembered
    clock.now += 1.01
    with pytest.raises(ApiError) as refused:
        await authn.authenticate(f"Bearer {secret}")
    assert refused.value.status == 401


async def test_without_a_cache_revocation_is_immediate(sessions: async_sessionmaker[AsyncSession]) -> None:
    authn = authenticator(sessions, Clock(), 0.0)
    key_id, secret = await new_key(sessions)
    await authn.authenticate(f"Bearer {secret}")
    await revoke_elsewhere(sessions, key_id)
    with pytest.raises(ApiError):
        await authn.authenticate(f"Bearer {secret}")


async def test_revoked_here_is_refused_at_once(sessions: async_sessionmaker[AsyncSession]) -> None:
    authn = authenticator(sessions, Clock(), 60.0)
    key_id, secret = await new_key(sessions)
    await authn.authenticate(f"Bearer {secret}")
    authn.revoked(key_id)
    with pytest.raises(ApiError):
        await authn.authenticate(f"Bearer {secret}")


async def test_unknown_keys_are_not_remembered(sessions: async_sessionmaker[AsyncSession]) -> None:
    authn = authenticator(sessions, Clock(), 60.0)
    for _ in range(3):
        with pytest.raises(ApiError):
            await authn.authenticate("Bearer vbk_not-a-key")
    assert not authn._cached
