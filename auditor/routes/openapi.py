"""The published OpenAPI 3.1 document, ``GET /openapi.json``.

litestar derives paths, query and path parameters and their types from the handlers. JSON bodies
are read by the handlers themselves (strictly, see ``auditor.routes.validation``), so their schemas
come from the msgspec types the routes name in ``opt["body"]``, added to the document here; so do the
API-key security scheme and the error shape every 4xx / 5xx answer has.
"""

from __future__ import annotations

from typing import Any

import msgspec
from litestar import Request
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin
from litestar.openapi.spec import Components, SecurityScheme
from litestar.routes import HTTPRoute

from auditor.routes.openai_schemas import ChatBody, CompletionBody
from auditor.routes.validation import accepts_empty

PATH = "/openapi.json"
SECURITY_SCHEME = "api_key"
SECURITY = [{SECURITY_SCHEME: []}]
"""Put on controllers whose routes need an API key (``Authorization: Bearer vbk_...``)."""
_REF = "#/components/schemas/{name}"
_ERROR = {
    "type": "object", "required": ["error"],
    "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}},
}


def openapi_config(version: str) -> OpenAPIConfig:
    return OpenAPIConfig(
        title="Verbatim", version=version, path="/",
        description="Verifiable inference: OpenAI-compatible completions, signed transcripts, a Merkle log, "
                    "replay and compliance reports.",
        components=Components(security_schemes={SECURITY_SCHEME: SecurityScheme(
            type="http", scheme="bearer", description="An API key: vbk_...")}),
        render_plugins=[BodiesJsonPlugin(path=PATH)])


class BodiesJsonPlugin(JsonRenderPlugin):
    """litestar's JSON document plus the request bodies named in ``opt["body"]`` and the error schema."""

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        completions = request.app.state.services.completions
        served = completions.model_name if completions is not None else None
        return self.render_json(request, with_bodies(openapi_schema, request.app.routes, served))


def with_bodies(document: dict[str, Any], routes: list[Any], served_model: str | None = None) -> dict[str, Any]:
    """``document`` with the JSON request bodies, the error schema on every error answer and, once
    the engine is up, the one model name the generation routes accept."""
    document = msgspec.to_builtins(document)
    bodies = [(route.path_format, method.lower(), handler.opt["body"]) for route in routes
              if isinstance(route, HTTPRoute) for method, (handler, _) in route.route_handler_map.items()
              if "body" in handler.opt]
    refs, components = msgspec.json.schema_components([kind for _, _, kind in bodies], ref_template=_REF)
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    schemas.update(components)
    schemas["Error"] = _ERROR
    for kind in (CompletionBody, ChatBody):
        if served_model is not None and kind.__name__ in schemas:
            schemas[kind.__name__]["properties"]["model"] = {"type": "string", "enum": [served_model]}
    for (path, method, kind), ref in zip(bodies, refs):
        operation = document.get("paths", {}).get(path, {}).get(method)
        if operation is not None:
            operation["requestBody"] = {"required": not accepts_empty(kind),
                                        "content": {"application/json": {"schema": ref}}}
    for item in document.get("paths", {}).values():
        for operation in item.values():
            if isinstance(operation, dict) and "responses" in operation:
                _error_responses(operation["responses"])
    return document


def _error_responses(responses: dict[str, Any]) -> None:
    """Every error answer has the one error shape (litestar documents its own for parameter errors)."""
    for status, response in responses.items():
        if status[0] in "45":
            response["content"] = _error_response("")["content"]
    responses.setdefault("4XX", _error_response("Refused; ``error.param`` names the offending parameter"))
    responses.setdefault("5XX", _error_response("Server failure"))


def _error_response(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF.format(name="Error")}}}}

