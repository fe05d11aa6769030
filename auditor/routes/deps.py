"""What handlers receive by dependency injection: the app's ``Services``, the caller's
``Principal`` (API key → tenant + role, rate limited) and a DB session holding one transaction."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from litestar import Request
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from auditor.auth import Authenticator, Principal
from auditor.crypto import KeyRing
from auditor.engine_seam import ServingEngine
from auditor.errors import ApiError
from auditor.ledger import Ledger
from auditor.metrics import Metrics
from auditor.service import CompletionService
from auditor.settings import Settings
from auditor.witnessing import WitnessingError, WitnessPool


@dataclass
class Services:
    """Everything the app holds, built once by ``create_app``; ``completions`` appears when the
    engine has loaded."""

    settings: Settings
    db: AsyncEngine
    ledger_db: AsyncEngine
    """The ledger writer's own connection (``Ledger``: appends never wait for a pooled one)."""
    sessionmaker: async_sessionmaker[AsyncSession]
    keyring: KeyRing
    ledger: Ledger
    authenticator: Authenticator
    metrics: Metrics
    session_store: Any = None
    """Console sessions: a litestar ``Store`` (Redis when ``redis_url`` is set, else in memory)."""
    redis: Any = None
    witnesses: WitnessPool | None = None
    engine: ServingEngine | None = None
    completions: CompletionService | None = None
    engine_error: str | None = None
    engine_loaded: asyncio.Event = field(default_factory=asyncio.Event)

    def require_completions(self) -> CompletionService:
        if self.completions is None:
            detail = self.engine_error or "the model is still loading"
            raise ApiError(503, f"engine not ready: {detail}", code="engine_not_ready", headers={"Retry-After": "5"})
        return self.completions


async def witnessed_size(services: Services, min_size: int = 0) -> int:
    """For ``?witnessed=true``: a checkpoint size, at least ``min_size`` and the latest when asked, that a
    quorum of the configured witnesses cosigned (they are asked now if needed)."""
    if services.witnesses is None:
        raise ApiError(400, "witnessed=true needs witnesses: none is configured (VERBATIM_WITNESSES)",
                       param="witnessed", code="no_witnesses")
    try:
        return await services.witnesses.ensure_witnessed(min_size)
    except WitnessingError as exc:
        raise ApiError(503, f"witnesses unavailable: {exc}", code="witness_unavailable",
                       headers={"Retry-After": "5"}) from None


async def provide_principal(request: Request[Any, Any, Any], services: Services) -> Principal:
    principal = await services.authenticator.authenticate(request.headers.get("authorization"))
    request.scope.setdefault("state", {})["principal"] = principal
    return principal


async def provide_db_session(services: Services) -> AsyncIterator[AsyncSession]:
    """One transaction per request: committed when the handler returns, rolled back if it raises."""
    async with services.sessionmaker() as session, session.begin():
        yield session
