"""``create_app(settings)``: builds the litestar app and everything it holds (DB engine, key ring,
ledger, metrics, auth, engine). Nothing here reads the environment or a global.

The engine is either handed in (tests share one across apps; the caller owns its lifecycle) or
loaded by the app in the background at startup (``/readyz`` answers 503 until it is up). When that
load fails, ``/readyz`` reports the error and ``on_engine_error`` hears it (``serve`` stops the server
and exits non-zero, unless told to keep serving).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from litestar import Litestar
from litestar.di import Provide
from litestar.stores.base import Store
from litestar.stores.memory import MemoryStore
from litestar.types import ASGIApp, Message, Receive, Scope, Send

from auditor.auth import Authenticator
from auditor.crypto import KeyRing
from auditor.db.session import create_engine, create_sessionmaker
from auditor.engine_seam import EngineLoader, ServingEngine, load_engine
from auditor.errors import exception_handlers
from auditor.ledger import Ledger
from auditor.logs import log_failure
from auditor.metrics import Metrics
from auditor.ratelimit import FileRateLimiter, Limiter, RateLimiter, RedisRateLimiter
from auditor.replay import ReplayService
from auditor.reports.service import generator_version
from auditor.routes import default_route_handlers
from auditor.routes.deps import Services
from auditor.routes.openapi import openapi_config
from auditor.routes.validation import check_request
from auditor.service import CompletionService
from auditor.settings import Settings
from auditor.witnessing import WitnessPool

log = logging.getLogger("auditor.http")

EngineErrorHook = Callable[[str], None]


def build_services(settings: Settings) -> Services:
    db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    ledger_db = create_engine(settings.resolved_database_url, schema=settings.database_schema, connections=1)
    sessionmaker = create_sessionmaker(db)
    keyring = KeyRing.open(settings.keys_dir)
    holder: dict[str, Services] = {}
    redis, limiter, session_store = _shared_state(settings)
    ledger = Ledger(sessionmaker, keyring, settings.log_origin, writer=create_sessionmaker(ledger_db))
    metrics = Metrics(lambda: holder["services"].engine.stats() if holder["services"].engine else None,
                      lambda: ledger.stats)
    services = Services(
        settings=settings, db=db, ledger_db=ledger_db, sessionmaker=sessionmaker, keyring=keyring, ledger=ledger,
        authenticator=Authenticator(sessionmaker, limiter, cache_seconds=settings.api_key_cache_seconds),
        metrics=metrics, session_store=session_store, redis=redis,
        witnesses=WitnessPool.from_settings(settings, sessionmaker, ledger, metrics.witness_result))
    holder["services"] = services
    return services


def _shared_state(settings: Settings) -> tuple[Any, Limiter, Store]:
    """Rate limits and console sessions: in this process; in files of the run directory for the worker
    processes of one ``serve`` (``workers`` > 1); or in Redis for every replica."""
    if not settings.redis_url and settings.workers > 1:
        from litestar.stores.file import FileStore

        limiter = FileRateLimiter(settings.run_dir / "ratelimit", settings.rate_limit_per_second,
                                  settings.rate_limit_burst)
        return None, limiter, FileStore(settings.run_dir / "sessions", create_directories=True)
    if not settings.redis_url:
        return None, RateLimiter(settings.rate_limit_per_second, settings.rate_limit_burst), MemoryStore()
    from litestar.stores.redis import RedisStore
    from redis.asyncio import Redis

    redis = Redis.from_url(settings.redis_url)
    limiter = RedisRateLimiter(redis, settings.rate_limit_per_second, settings.rate_limit_burst)
    return redis, limiter, RedisStore(redis, namespace="verbatim-console")


async def _reload_keys(services: Services) -> None:
    """Keys rotated by another process sharing the key directory (``signing-keys rotate``)."""
    while True:
        await asyncio.sleep(services.settings.key_reload_interval)
        try:
            if await asyncio.to_thread(services.keyring.reload_if_changed):
                log.info("signing keys reloaded", extra={"event": "keys_reloaded"})
        except Exception as exc:  # noqa: BLE001 - keep serving with the keys held; retried next interval
            log_failure(log, "reloading the signing keys failed", exc)


def attach_engine(services: Services, engine: ServingEngine) -> None:
    settings = services.settings
    services.engine = engine
    name = settings.served_model_name or str(engine.model_info.name)
    services.completions = CompletionService(engine, services.ledger, services.metrics, model_name=name,
                                             max_prompt_tokens=settings.max_prompt_tokens,
                                             max_tokens_limit=settings.max_tokens_limit, max_n=settings.max_n)
    if settings.workers > 1:  # /readyz on any worker waits for every worker (auditor/workers.py)
        ready = settings.run_dir / "ready"
        ready.mkdir(parents=True, exist_ok=True)
        (ready / str(os.getpid())).touch()
    services.engine_loaded.set()


async def _load_and_start(services: Services, loader: EngineLoader, on_error: EngineErrorHook | None) -> None:
    try:
        engine = await asyncio.to_thread(loader, services.settings)
        await engine.start()
    except Exception as exc:  # noqa: BLE001 - reported by /readyz and 503s, logged, and handed to on_error
        services.engine_error = f"{type(exc).__name__}: {exc}"
        log_failure(log, "engine failed to load", exc)
        services.engine_loaded.set()
        if on_error is not None:
            on_error(services.engine_error)
        return
    attach_engine(services, engine)
    log.info("engine ready, serving model %r", services.completions.model_name, extra={"event": "engine_ready"})


def create_app(
    settings: Settings,
    *,
    engine: ServingEngine | None = None,
    engine_loader: EngineLoader = load_engine,
    routes: Sequence[Any] = (),
    on_engine_error: EngineErrorHook | None = None,
) -> Litestar:
    """The app. ``engine``: a started engine owned by the caller; else ``engine_loader`` runs at startup
    and ``on_engine_error`` hears the error if it fails. ``routes``: extra route handlers / controllers /
    routers mounted beside the defaults."""
    services = build_services(settings)
    background: list[asyncio.Task[Any]] = []

    async def startup() -> None:
        # The log is checked before the server takes requests: nothing is signed over a log that fails.
        await services.ledger.start(settings.log_check_interval_seconds)
        if engine is not None:
            attach_engine(services, engine)
        else:
            background.append(asyncio.create_task(_load_and_start(services, engine_loader, on_engine_error)))
        ReplayService.for_app(app).start()
        background.append(asyncio.create_task(_reload_keys(services)))
        if services.witnesses is not None:
            services.witnesses.start()

    async def shutdown() -> None:
        await ReplayService.for_app(app).stop()
        if services.witnesses is not None:
            await services.witnesses.stop()
        for task in background:
            task.cancel()
        if services.completions is not None:
            await services.completions.drain()
        await services.ledger.stop()
        if engine is None and services.engine is not None:
            await services.engine.shutdown()
        await services.db.dispose()
        if services.redis is not None:
            await services.redis.aclose()

    app = Litestar(
        route_handlers=[*default_route_handlers(), *routes],
        dependencies={"services": Provide(lambda: services, sync_to_thread=False)},
        exception_handlers=exception_handlers(),
        on_startup=[startup],
        on_shutdown=[shutdown],
        middleware=[lambda app: observe(app, services)],
        before_request=check_request,
        request_max_body_size=settings.max_body_bytes,
        openapi_config=openapi_config(generator_version()),
        logging_config=None,  # logging is configured once at the edge (auditor.logs, by `serve`)
        debug=False,
    )
    app.state.services = services
    return app


def observe(app: ASGIApp, services: Services) -> ASGIApp:
    """Per request: one structured log line (no bodies) and the HTTP metrics."""

    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def capture(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await app(scope, receive, capture)
        finally:
            _observed(scope, services, status["code"], time.perf_counter() - started)

    return middleware


def _observed(scope: Scope, services: Services, status: int, seconds: float) -> None:
    route = scope.get("path_template") or "unmatched"
    services.metrics.requests.labels(scope["method"], route, str(status)).inc()
    services.metrics.latency.labels(route).observe(seconds)
    principal = scope.get("state", {}).get("principal")
    log.info("request", extra={
        "event": "http", "method": scope["method"], "path": scope["path"], "route": route, "status": status,
        "duration_ms": round(seconds * 1000, 1), "key_id": getattr(principal, "key_id", None),
        "tenant": getattr(principal, "tenant", None)})
