"""A live server with the report routes and the console mounted (whether or not ``create_app``
already mounts them by default)."""

from __future__ import annotations

from typing import Any

from auditor.routes import default_route_handlers


def extra_routes() -> list[Any]:
    from auditor.routes.reports import ReportsController
    from auditor.ui import UI_ROUTES

    mounted = {getattr(h, "__name__", repr(h)) for h in default_route_handlers()}
    return [h for h in (ReportsController, *UI_ROUTES) if getattr(h, "__name__", repr(h)) not in mounted]
