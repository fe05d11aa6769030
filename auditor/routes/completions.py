"""``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and not) and ``GET /v1/models``."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.di import Provide
from litestar.response import Stream

from auditor.auth import Principal, require_role
from auditor.db.models import Role
from auditor.errors import ApiError, error_body
from auditor.logs import log_failure
from auditor.routes import openai_schemas as schemas
from auditor.routes.deps import Services, provide_principal
from auditor.routes.openai_format import ChunkWriter, final_body
from auditor.routes.openapi import SECURITY
from auditor.routes.validation import json_body
from auditor.service import CompletionService, GenerationRequest, Prepared
from auditor.transcript import Status

log = logging.getLogger("auditor.completions")

TRANSCRIPT_HEADER = "Verbatim-Transcript-Id"
GENERATE_ROLES = (Role.CLIENT, Role.ADMIN)


class CompletionsController(Controller):
    path = "/v1"
    security = SECURITY
    dependencies = {"principal": Provide(provide_principal)}

    @post("/completions", status_code=200, opt={"body": schemas.CompletionBody})
    async def completions(self, request: Request[Any, Any, Any], services: Services, principal: Principal) -> Response[Any]:
        require_role(principal, GENERATE_ROLES)
        body = await json_body(request, schemas.CompletionBody)
        return await _serve(services, principal, schemas.completion_request(body, services.settings.deterministic_default))

    @post("/chat/completions", status_code=200, opt={"body": schemas.ChatBody})
    async def chat_completions(self, request: Request[Any, Any, Any], services: Services, principal: Principal) -> Response[Any]:
        require_role(principal, GENERATE_ROLES)
        body = await json_body(request, schemas.ChatBody)
        return await _serve(services, principal, schemas.chat_request(body, services.settings.deterministic_default))

    @get("/models")
    async def models(self, services: Services, principal: Principal) -> dict[str, Any]:
        service = services.require_completions()
        return {"object": "list", "data": [{"id": service.model_name, "object": "model", "created": 0,
                                            "owned_by": "verbatim"}]}


async def _serve(services: Services, principal: Principal, request: GenerationRequest) -> Response[Any]:
    service = services.require_completions()
    schemas.check_model(request.model, service.model_name)
    prepared = await service.prepare(request, principal.tenant, principal.key_id)
    headers = {TRANSCRIPT_HEADER: prepared.transcript_id}
    fingerprint = service.engine.system_fingerprint()
    if request.stream:
        return Stream(_sse(service, prepared, fingerprint), media_type="text/event-stream",
                      headers={**headers, "Cache-Control": "no-cache"})
    output, recorded = await service.complete(prepared)
    body = final_body(prepared, output, recorded, service.model_name, fingerprint, service.engine.tokenizer)
    return Response(body, headers=headers)


_NOT_RECORDED = error_body(500, "the transcript could not be recorded; nothing was kept", None, "recording_failed")


async def _record_error(service: CompletionService, prepared: Prepared, last: Any) -> bool:
    """Record what was committed before the engine failed, as status ``error``; False if that failed."""
    try:
        await service.record_shielded(prepared, last, Status.ERROR)
    except Exception as exc:  # noqa: BLE001 - logged; the client is told nothing was kept
        log_failure(log, "recording a failed generation failed", exc, transcript_id=prepared.transcript_id)
        return False
    return True


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _sse(service: CompletionService, prepared: Prepared, fingerprint: str) -> AsyncIterator[bytes]:
    """Committed text as it arrives, the finish chunk, a chunk with the transcript, ``[DONE]``.

    If the client goes away (the generator is cancelled or closed) before generation ends, the
    request is aborted and its committed tokens are recorded as ``client_disconnected``. If recording
    fails, nothing was kept: the stream ends with an error event and without ``[DONE]``.
    """
    writer = ChunkWriter(prepared, service.model_name, fingerprint, service.engine.tokenizer)
    last = None
    generating = True
    try:
        first = writer.first()
        if first is not None:
            yield _event(first)
        async for output in service.outputs(prepared):
            last = output
            chunk = writer.delta(output)
            if chunk is not None:
                yield _event(chunk)
        generating = False
        if last is None:
            raise RuntimeError("the engine produced no output")
        recorded = await service.record_shielded(prepared, last, Status.COMPLETED)
        yield _event(writer.last(last, recorded))
    except ApiError as exc:
        generating = False
        yield _event(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception as exc:
        if not generating:
            log_failure(log, "recording a streamed completion failed", exc, transcript_id=prepared.transcript_id)
            yield _event(_NOT_RECORDED)
            return
        generating = False
        log_failure(log, "generation failed mid-stream", exc, transcript_id=prepared.transcript_id)
        if last is not None and not await _record_error(service, prepared, last):
            yield _event(_NOT_RECORDED)
            return
        yield _event(error_body(500, "generation failed; the committed tokens were recorded", None, "engine_error"))
    finally:
        if generating:
            service.record_disconnect(prepared, last)
    yield b"data: [DONE]\n\n"
