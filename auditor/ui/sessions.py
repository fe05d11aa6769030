"""Console sign-in sessions: an opaque random cookie mapped to the API key in a litestar ``Store``
(in memory for one process, Redis when ``VERBATIM_REDIS_URL`` is set so that every replica sees them).

The key never goes back to the browser; every page re-authenticates it through the API, so a revoked
key ends its sessions at once. The store holds the session under SHA-256(cookie), sealed (AES-GCM)
with a key derived from the cookie itself: whoever reads the store without the cookie learns neither
the cookie nor the API key. Sessions last ``ttl`` seconds (the store expires them).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from dataclasses import asdict, dataclass
from typing import Any

from litestar.stores.base import Store

from auditor.crypto import derive_key, seal, unseal

COOKIE = "verbatim_console"
DEFAULT_TTL_S = 8 * 3600
_INFO = b"verbatim-console-session-v1"


@dataclass(frozen=True)
class Session:
    api_key: str
    key_id: str
    tenant: str
    role: str


def _store_key(token: str) -> str:
    return "session:" + hashlib.sha256(token.encode("utf-8")).hexdigest()


class SessionStore:
    def __init__(self, store: Store, ttl_s: int = DEFAULT_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s

    @classmethod
    def for_app(cls, app: Any) -> SessionStore:
        store = getattr(app.state, "ui_sessions", None)
        if store is None:
            store = app.state.ui_sessions = cls(app.state.services.session_store)
        return store

    async def create(self, api_key: str, key_id: str, tenant: str, role: str) -> str:
        token = secrets.token_urlsafe(32)
        value = json.dumps(asdict(Session(api_key, key_id, tenant, role))).encode("utf-8")
        sealed = seal(derive_key(token.encode("utf-8"), _INFO), value, _INFO)
        await self.store.set(_store_key(token), sealed, expires_in=self.ttl_s)
        return token

    async def get(self, token: str | None) -> Session | None:
        if not token:
            return None
        sealed = await self.store.get(_store_key(token))
        if sealed is None:
            return None
        value = unseal(derive_key(token.encode("utf-8"), _INFO), sealed, _INFO)
        return Session(**json.loads(value)) if value is not None else None

    async def end(self, token: str | None) -> None:
        if token:
            await self.store.delete(_store_key(token))
