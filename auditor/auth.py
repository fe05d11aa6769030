"""API keys: generation, hashing at rest, authentication of a request, role checks.

A key is ``vbk_`` + 43 url-safe characters (256 random bits); only its SHA-256 is stored, so a
plain hash (no KDF) is enough. The public key id (``key_…``) is what logs and access records show.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from auditor import repository
from auditor.db.models import ApiKey, Role
from auditor.errors import ApiError
from auditor.ratelimit import Limiter

KEY_PREFIX = "vbk_"


@dataclass(frozen=True)
class Principal:
    """Who is calling: resolved from the API key on every request."""

    key_id: str
    tenant: str
    role: Role


def hash_key(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_key_material() -> tuple[str, str]:
    """A fresh (key id, secret) pair."""
    return "key_" + secrets.token_hex(8), KEY_PREFIX + secrets.token_urlsafe(32)


def check_tenant(tenant: str) -> str:
    if not tenant or len(tenant) > 64 or not all(c.isalnum() or c in "-_." for c in tenant):
        raise ValueError(f"tenant must be 1-64 characters of [A-Za-z0-9-_.], got {tenant!r}")
    return tenant


async def create_key(session: AsyncSession, tenant: str, role: Role | str, name: str | None = None) -> tuple[ApiKey, str]:
    """Insert a new key; returns the row and the secret (shown once, never stored)."""
    key_id, secret = new_key_material()
    row = ApiKey(id=key_id, key_hash=hash_key(secret), tenant=check_tenant(tenant), role=Role(role).value,
                 name=name, created_at=dt.datetime.now(dt.UTC), revoked_at=None)
    await repository.add_api_key(session, row)
    return row, secret


async def revoke_key(session: AsyncSession, key_id: str, tenant: str | None = None) -> ApiKey | None:
    """Revoke ``key_id`` (restricted to ``tenant`` when given); ``None`` if there is no such key."""
    row = await repository.get_api_key(session, key_id)
    if row is None or (tenant is not None and row.tenant != tenant):
        return None
    if row.revoked_at is None:
        row.revoked_at = dt.datetime.now(dt.UTC)
        await session.flush()
    return row


def bearer_secret(authorization: str | None) -> str:
    if not authorization:
        raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key")
    scheme, _, secret = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(401, "malformed Authorization header: expected 'Bearer <key>'", code="invalid_api_key")
    return secret.strip()


MAX_CACHED_KEYS = 10_000


class Authenticator:
    """Resolves the request's key to a ``Principal`` and applies the per-key rate limit.

    A key found valid is remembered for ``cache_seconds`` (0: every request reads the database; a
    lookup per request was what limited completions per second). A key revoked through this process
    (``revoked``) is refused at once; one revoked elsewhere (another replica, the CLI) within
    ``cache_seconds``. Unknown and revoked keys are never cached."""

    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], limiter: Limiter, *,
                 cache_seconds: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._sessionmaker = sessionmaker
        self._limiter = limiter
        self._cache_seconds = cache_seconds
        self._clock = clock
        self._cached: OrderedDict[str, tuple[float, Principal]] = OrderedDict()
        self._revoked: set[str] = set()

    async def authenticate(self, authorization: str | None) -> Principal:
        digest = hash_key(bearer_secret(authorization))
        principal = self._remembered(digest) or await self._look_up(digest)
        if principal is None or principal.key_id in self._revoked:
            raise ApiError(401, "invalid or revoked API key", code="invalid_api_key")
        wait = await self._limiter.take(principal.key_id)
        if wait is not None:
            raise ApiError(429, f"rate limit exceeded for key {principal.key_id}; retry in {wait:.2f}s",
                           code="rate_limit_exceeded", headers={"Retry-After": str(max(1, math.ceil(wait)))})
        return principal

    def revoked(self, key_id: str) -> None:
        """``key_id`` was revoked in this process: refuse it from now on, cached or not."""
        self._revoked.add(key_id)

    def _remembered(self, digest: str) -> Principal | None:
        entry = self._cached.get(digest)
        if entry is None or entry[0] < self._clock():
            return None
        return entry[1]

    async def _look_up(self, digest: str) -> Principal | None:
        async with self._sessionmaker() as session:
            row = await repository.api_key_by_hash(session, digest)
        if row is None or row.revoked_at is not None:
            return None
        principal = Principal(row.id, row.tenant, Role(row.role))
        if self._cache_seconds > 0:
            self._cached[digest] = (self._clock() + self._cache_seconds, principal)
            self._cached.move_to_end(digest)
            while len(self._cached) > MAX_CACHED_KEYS:
                self._cached.popitem(last=False)
        return principal


def require_role(principal: Principal, allowed: Sequence[Role]) -> None:
    if principal.role not in allowed:
        names = ", ".join(r.value for r in allowed)
        raise ApiError(403, f"role {principal.role.value!r} may not do this (needs one of: {names})",
                       code="forbidden")
