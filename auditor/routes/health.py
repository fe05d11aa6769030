"""Unauthenticated operational routes: ``/healthz``, ``/readyz``, ``/metrics``, ``/.well-known/jwks.json``."""

from __future__ import annotations

from typing import Any

from litestar import Response, get
from sqlalchemy import text

from auditor.metrics import CONTENT_TYPE
from auditor.routes.deps import Services


@get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@get("/readyz")
async def readyz(services: Services) -> Response[dict[str, Any]]:
    checks = {"engine": services.completions is not None, "database": await _database_ok(services)}
    body: dict[str, Any] = {"status": "ready" if all(checks.values()) else "not_ready", "checks": checks}
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
