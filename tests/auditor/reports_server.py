"""A live server with the report routes and the console mounted (whether or not ``create_app``
already mounts them by default)."""

from __future__ import annotations

from typing import Any

from auditor.routes import default_route_handlers
from auditor.settings import Settings
from tests.auditor.conftest import LiveServer, start_server


def extra_routes() -> list[Any]:
    from auditor.routes.reports import ReportsController
    from auditor.ui import UI_ROUTES

    mounted = {getattr(h, "__name__", repr(h)) for h in default_route_handlers()}
    return [h for h in (ReportsController, *UI_ROUTES) if getattr(h, "__name__", repr(h)) not in mounted]


async def start_reports_server(settings: Settings, engine: Any, tenants: dict[str, str]) -> LiveServer:
    return await start_server(settings, engine, tenants, routes=extra_routes())
