"""Unauthenticated operational routes: ``/healthz``, ``/readyz``, ``/metrics``, ``/.well-known/jwks.json``."""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from sqlalchemy import text

from auditor.ledger import Integrity
from auditor.metrics import CONTENT_TYPE
from auditor.routes.deps import Services


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz")
async def readyz(services: Services) -> Response[dict[str, Any]]:
    """200 when the engine is up (with several worker processes: in every worker), the database answers and
    the log passed its self-check; else 503
    with ``checks`` and the reasons (``engine_error``; ``log``: the self-check state and, after a
    mismatch, the failed check, the first bad index and what differs)."""
    stats = services.ledger.stats
    checks = {"engine": services.completions is not None, "database": await _database_ok(services),
              "log": stats.integrity is Integrity.OK}
    workers = services.settings.workers
    if workers > 1:  # the port is every worker's: ready when each of them has its engine
        ready = services.settings.run_dir / "ready"
        checks["workers"] = ready.is_dir() and sum(1 for _ in ready.iterdir()) >= workers
    body: dict[str, Any] = {"status": "ready" if all(checks.values()) else "not_ready", "checks": checks,
                            "log": {"integrity": stats.integrity.value, "tree_size": stats.tree_size}}
    if stats.fault is not None:
        body["log"]["fault"] = stats.fault.to_json()
    if services.engine_error:
        body["engine_error"] = services.engine_error
    return Response(body, status_code=200 if all(checks.values()) else 503)


async def _database_ok(services: Services) -> bool:
    try:
        async with services.db.connect() as connection:
            await connection.execute(text("SELECT 1"))
    except Exception:  # noqa: BLE001 - any failure means not ready
        return False
    return True


@get("/metrics", media_type=CONTENT_TYPE)
async def metrics(services: Services) -> bytes:
    return services.metrics.render()


@get("/.well-known/jwks.json")
async def jwks(services: Services) -> dict[str, Any]:
    return services.keyring.jwks()


ROUTES = [healthz, readyz, metrics, jwks]
