"""Strict request validation shared by every API route: query names, text values and JSON bodies.

* **Query**: a route accepts only the query parameters its handler declares (plus any it lists in
  ``opt["query"]`` and reads by hand), each at most once and never empty; anything else is a 400
  naming the parameters.
* **Text**: no query value or path parameter may hold NUL or text that is not Unicode; every string
  a client sends either reaches storage intact (see ``auditor.db.models.Utf8Text``) or is refused
  here, before any database or engine work, with the same answer on SQLite and PostgreSQL.
* **Body**: a route that takes a JSON body names its msgspec type in ``opt["body"]`` (also what the
  published OpenAPI schema documents); it requires ``Content-Type: application/json`` and decodes
  strictly (wrong types, unknown fields, lone surrogates are a 400 naming the field). Every other
  route refuses a request body.

``check_request`` runs as the app's ``before_request`` hook; handlers call ``json_body``. Routes with
``opt["strict"] = False`` (the HTML console, which validates its own forms) are left alone.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Mapping
from typing import Any, TypeVar
from urllib.parse import unquote_to_bytes

import msgspec
from litestar import Request
from litestar.constants import RESERVED_KWARGS
from litestar.handlers import HTTPRouteHandler
from litestar.params import ParameterKwarg

from auditor.errors import bad_request

T = TypeVar("T")

_AT = re.compile(r"at `\$\.?([^`]*)`")
_FIELD = re.compile(r"field `([^`]+)`")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


# --- text ------------------------------------------------------------------------------------------


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text (NUL, or a lone surrogate that is not Unicode), else None."""
    if "\x00" in value:
        return "contains NUL (U+0000)"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not Unicode text (lone surrogate U+{ord(value[exc.start]):04X} at offset {exc.start})"
    return None


def check_text(value: str | None, param: str) -> str | None:
    """``value`` unchanged, or a 400 naming ``param`` for a value no database column can hold."""
    if value is not None and (problem := text_problem(value)) is not None:
        raise bad_request(f"{param} {problem}", param=param, code="invalid_text")
    return value


def check_id(value: str | None, param: str) -> str | None:
    """A transcript or replay id (canonical lowercase UUID) or a 400 naming ``param``."""
    if value is not None and not _UUID.match(value):
        raise bad_request(f"{param} must be an id as the API returns it (a lowercase UUID such as "
                          f"01900000-0000-7000-8000-000000000000), got {value[:80]!r}", param=param)
    return value


def aware(value: dt.datetime | None, param: str) -> dt.datetime | None:
    """``value`` in UTC; a time without a zone, or one that leaves the calendar in UTC, is a 400."""
    if value is None:
        return None
    if value.tzinfo is None:
        raise bad_request(f"{param} must carry a time zone (e.g. 2026-01-01T00:00:00Z)", param=param)
    try:
        return value.astimezone(dt.UTC)
    except OverflowError:
        raise bad_request(f"{param} is outside the years 1-9999 in UTC", param=param) from None


# --- the before_request hook ---------------------------------------------------------------------------


def declared_query(handler: HTTPRouteHandler, path_params: Mapping[str, Any]) -> frozenset[str]:
    """The query parameter names ``handler`` reads: its signature's non-reserved, non-dependency,
    non-path parameters (``Parameter(query=...)`` aliases honoured, header/cookie ones skipped)
    plus ``opt["query"]``."""
    dependencies = handler.resolve_dependencies()
    names = set(handler.opt.get("query", ()))
    for name, field in handler.parsed_fn_signature.parameters.items():
        if name in RESERVED_KWARGS or name in dependencies or name in path_params:
            continue
        kwarg = field.kwarg_definition
        if isinstance(kwarg, ParameterKwarg):
            if kwarg.header or kwarg.cookie:
                continue
            name = kwarg.query or name
        names.add(name)
    return frozenset(names)


async def check_request(request: Request[Any, Any, Any]) -> None:
    """Refuse unknown, repeated or empty query parameters, NUL / non-Unicode query and path values,
    and a body on a route that takes none."""
    handler = request.route_handler
    if not isinstance(handler, HTTPRouteHandler) or handler.opt.get("strict", True) is False:
        return
    _check_utf8(request.scope)
    _check_query(request, declared_query(handler, request.path_params))
    for name, value in request.path_params.items():
        if isinstance(value, str):
            check_text(value, name)
    if "body" not in handler.opt and await request.body():
        raise bad_request(f"{request.method} {request.url.path} takes no request body (parameters go in the query)",
                          param="body", code="unexpected_body")


def _check_utf8(scope: Mapping[str, Any]) -> None:
    """Percent-escapes that are not UTF-8 are refused (decoders would turn them into U+FFFD)."""
    raw_path = scope.get("raw_path") or b""
    try:
        unquote_to_bytes(raw_path).decode("utf-8")
    except UnicodeDecodeError:
        raise bad_request("the URL path is not UTF-8 once percent-decoded", param="path", code="invalid_text") from None
    for part in (scope.get("query_string") or b"").split(b"&"):
        name, _, value = part.partition(b"=")
        try:
            unquote_to_bytes(value.replace(b"+", b" ")).decode("utf-8")
        except UnicodeDecodeError:
            param = unquote_to_bytes(name).decode("utf-8", "replace")
            raise bad_request(f"query parameter {param!r} is not UTF-8 once percent-decoded", param=param,
                              code="invalid_text") from None


def _check_query(request: Request[Any, Any, Any], allowed: frozenset[str]) -> None:
    items = list(request.query_params.multi_items())
    unknown = sorted({name for name, _ in items if name not in allowed})
    if unknown:
        known = ", ".join(sorted(allowed)) or "none"
        raise bad_request(f"unknown query parameter{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}"
                          f" (this route takes: {known})", param=",".join(unknown), code="unknown_parameter")
    seen: set[str] = set()
    for name, value in items:
        if name in seen:
            raise bad_request(f"query parameter {name!r} is given more than once", param=name, code="repeated_parameter")
        seen.add(name)
        if value == "":
            raise bad_request(f"query parameter {name!r} is empty; give a value or leave it out", param=name)
        check_text(value, name)


# --- JSON bodies --------------------------------------------------------------------------------------------


async def json_body(request: Request[Any, Any, Any], kind: type[T]) -> T:
    """The request body decoded strictly as ``kind``. An empty body is ``{}`` when ``kind`` has no
    required field, else a 400; a non-empty one must be sent as ``application/json``."""
    raw = await request.body()
    if not raw.strip():
        if not accepts_empty(kind):
            raise bad_request("request body is empty; expected a JSON object", code="invalid_json")
        return msgspec.convert({}, type=kind)
    media_type, options = request.content_type
    if media_type.lower() != "application/json" or options.get("charset", "utf-8").lower() not in ("utf-8", "utf8"):
        shown = request.headers.get("content-type") or "none"
        raise bad_request(f"the request body must be sent as Content-Type: application/json (got {shown[:80]!r})",
                          param="content-type", code="unsupported_media_type")
    return decode_json(raw, kind)


def accepts_empty(kind: type) -> bool:
    """Whether ``{}`` is a valid ``kind`` (no required field): then the body may be left out."""
    try:
        msgspec.convert({}, type=kind)
    except msgspec.ValidationError:
        return False
    return True


def decode_json(raw: bytes, kind: type[T]) -> T:
    """Decode ``raw`` as ``kind``; every failure is a 400 naming the offending field."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise bad_request(f"invalid request: {exc}", param=msgspec_param(str(exc)), code="invalid_type") from None
    except msgspec.DecodeError as exc:
        where = _lone_surrogate(raw)
        if where is not None:
            raise bad_request(f"{where or 'the body'} holds a lone UTF-16 surrogate escape, which is not Unicode "
                              "text; send valid UTF-8", param=where or None, code="invalid_text") from None
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None


def msgspec_param(message: str) -> str | None:
    """The field a msgspec validation message is about (``messages[0].content``), if it names one."""
    field = _FIELD.search(message)
    at = _AT.search(message)
    path = at.group(1) if at else ""
    if field:
        return f"{path}.{field.group(1)}" if path else field.group(1)
    return path or None


def _lone_surrogate(raw: bytes) -> str | None:
    """Where a body that msgspec refused holds a lone surrogate (``""`` for the top level), if that
    is why: Python's decoder accepts them, so decode with it and look."""
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return _surrogate_path(obj, "")


def _surrogate_path(obj: Any, path: str) -> str | None:
    if isinstance(obj, str):
        return path if text_problem(obj.replace("\x00", "")) else None
    if isinstance(obj, list):
        return next((p for i, v in enumerate(obj) if (p := _surrogate_path(v, f"{path}[{i}]")) is not None), None)
    if isinstance(obj, dict):
        for key, value in obj.items():
            child = f"{path}.{key}" if path else str(key)
            if text_problem(key.replace("\x00", "")):
                return path
            if (found := _surrogate_path(value, child)) is not None:
                return found
    return None
