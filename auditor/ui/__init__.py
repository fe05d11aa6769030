"""The auditor's web console at ``/ui`` (server-rendered; see ``auditor.ui.controller``).

Mount with ``create_app(settings, routes=UI_ROUTES)`` or by adding ``UI_ROUTES`` to
``auditor.routes.default_route_handlers``.
"""

from auditor.ui.controller import ConsoleController

UI_ROUTES: list[type] = [ConsoleController]

__all__ = ["UI_ROUTES", "ConsoleController"]
