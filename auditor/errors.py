"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``ApiError`` (or a subclass); ``exception_handlers`` turns it, every litestar
``HTTPException`` (413 from the body limit, 404 on unknown routes, 405, ...) and any unexpected
exception into that shape, so a client never sees another error format.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from litestar import Request, Response
from litestar.exceptions import HTTPException, ValidationException

from auditor.logs import log_failure

log = logging.getLogger("auditor.errors")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class ApiError(Exception):
    """An error meant for the client; ``message`` must not contain prompt content or secrets."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


def not_found(message: str) -> ApiError:
    return ApiError(404, message, code="not_found")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def _api_error(_: Request, exc: ApiError) -> Response:
    return Response(error_body(exc.status, exc.message, exc.param, exc.code), status_code=exc.status, headers=exc.headers)


def _validation_exception(_: Request, exc: ValidationException) -> Response:
    """litestar's own parameter checks (types, ``ge``/``le``, literals): name the first parameter,
    and never echo the request URL (its query may hold anything)."""
    problems = [e for e in exc.extra if isinstance(e, dict)] if isinstance(exc.extra, list) else []
    keyed = [e for e in problems if e.get("key")]
    if not keyed:
        return Response(error_body(400, "invalid request parameters", None, "invalid_value"), status_code=400)
    message = "; ".join(f"{e['key']}: {e.get('message', 'invalid value')}" for e in keyed)
    return Response(error_body(400, message, str(keyed[0]["key"]), "invalid_value"), status_code=400)


def _http_exception(_: Request, exc: HTTPException) -> Response:
    status = exc.status_code
    code = {413: "request_too_large", 404: "not_found", 405: "method_not_allowed"}.get(status)
    message = exc.detail if isinstance(exc.detail, str) and exc.detail else "request failed"
    if status == 413:
        message = "request body too large"
    return Response(error_body(status, message, None, code), status_code=status, headers=exc.headers or None)


def _unexpected(request: Request, exc: Exception) -> Response:
    log_failure(log, "unhandled error", exc, path=request.url.path)
    return Response(error_body(500, "internal server error", None, "internal_error"), status_code=500)


def exception_handlers() -> dict[type[Exception] | int, Callable[..., Response]]:
    return {ApiError: _api_error, ValidationException: _validation_exception, HTTPException: _http_exception,
            Exception: _unexpected}
