"""A live server with the report routes and the console mounted (whether or not ``create_app``
already mounts them by default)."""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn

from auditor.app import create_app
from auditor.routes import default_route_handlers
from auditor.settings import Settings
from tests.auditor.conftest import LiveServer, make_key


def extra_routes() -> list[Any]:
    from auditor.routes.reports import ReportsController
    from auditor.ui import UI_ROUTES

    mounted = {getattr(h, "__name__", repr(h)) for h in default_route_handlers()}
    return [h for h in (ReportsController, *UI_ROUTES) if getattr(h, "__name__", repr(h)) not in mounted]


class ReportsLiveServer(LiveServer):
    def _make_server(self) -> uvicorn.Server:
        self.app = create_app(self.settings, engine=self.engine, routes=extra_routes())
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.settings.port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        return self._server


async def add_keys(server: LiveServer, tenants: dict[str, str]) -> None:
    for name, spec in tenants.items():
        tenant, role = spec.split(":")
        server.keys[name] = await make_key(server.settings, tenant, role)


async def start_reports_server(settings: Settings, engine: Any, tenants: dict[str, str]) -> ReportsLiveServer:
    server = ReportsLiveServer(settings, engine)
    await add_keys(server, tenants)
    await asyncio.to_thread(server.start)
    return server
