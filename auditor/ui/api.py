"""The console is a client of the public API: it calls the app's own routes in process (httpx over
ASGI) with the signed-in key, so auth, tenant scoping, roles and access logging are the API's."""

from __future__ import annotations

from typing import Any

import httpx


class ApiFailure(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


def _message(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:300] or response.reason_phrase


class ApiClient:
    def __init__(self, app: Any, api_key: str) -> None:
        self._app = app
        self._headers = {"Authorization": f"Bearer {api_key}"}

    async def request(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                      json: Any = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=self._app)
        async with httpx.AsyncClient(transport=transport, base_url="http://console.internal",
                                     headers=self._headers, timeout=120) as client:
            clean = {k: v for k, v in (params or {}).items() if v not in (None, "")}
            return await client.request(method, path, params=clean, json=json)

    async def json(self, method: str, path: str, *, params: dict[str, Any] | None = None,
                   json: Any = None, ok: tuple[int, ...] = (200, 201, 202)) -> dict[str, Any]:
        response = await self.request(method, path, params=params, json=json)
        if response.status_code not in ok:
            raise ApiFailure(response.status_code, _message(response))
        return response.json()


def has_route(app: Any, path: str) -> bool:
    """Whether the app serves ``path`` (a litestar path template such as ``/v1/replays/{replay_id:str}``)."""
    return any(_normalise(r.path) == _normalise(path) for r in app.routes)


def _normalise(path: str) -> str:
    import re

    return re.sub(r"\{[^}]*\}", "{}", path.rstrip("/"))
