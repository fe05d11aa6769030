"""Console sign-in sessions: an opaque random cookie mapped, in this process only, to the API key.

The key never goes back to the browser; every page re-authenticates it through the API, so a revoked
key ends its sessions at once. Sessions last ``ttl`` seconds and do not survive a restart (sign in
again). One ``SessionStore`` per app, kept on ``app.state``.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

COOKIE = "verbatim_console"
DEFAULT_TTL_S = 8 * 3600


@dataclass(frozen=True)
class Session:
    api_key: str
    key_id: str
    tenant: str
    role: str
    expires_at: float


class SessionStore:
    def __init__(self, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.ttl_s = ttl_s
        self._sessions: dict[str, Session] = {}

    @classmethod
    def for_app(cls, app: Any) -> SessionStore:
        store = getattr(app.state, "ui_sessions", None)
        if store is None:
            store = app.state.ui_sessions = cls()
        return store

    def create(self, api_key: str, key_id: str, tenant: str, role: str) -> str:
        token = secrets.token_urlsafe(32)
        self._sessions[token] = Session(api_key, key_id, tenant, role, time.monotonic() + self.ttl_s)
        return token

    def get(self, token: str | None) -> Session | None:
        session = self._sessions.get(token or "")
        if session is None:
            return None
        if session.expires_at < time.monotonic():
            del self._sessions[token or ""]
            return None
        return session

    def end(self, token: str | None) -> None:
        self._sessions.pop(token or "", None)
