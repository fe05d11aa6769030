"""Route modules. ``default_route_handlers()`` is what ``create_app`` mounts (the API, replay, reports and
the console); extensions pass extra controllers to ``create_app(routes=...)``."""

from __future__ import annotations

from typing import Any


def default_route_handlers() -> list[Any]:
    from auditor.routes.completions import CompletionsController
    from auditor.routes.health import ROUTES
    from auditor.routes.keys import KeysController
    from auditor.routes.log import LogController
    from auditor.routes.replay import ReplayController
    from auditor.routes.reports import ReportsController
    from auditor.routes.transcripts import TranscriptsController
    from auditor.ui import UI_ROUTES

    return [*ROUTES, CompletionsController, TranscriptsController, LogController, KeysController, ReplayController,
            ReportsController, *UI_ROUTES]
