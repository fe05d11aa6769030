"""``POST /v1/completions``, ``POST /v1/chat/completions`` (streaming and not) and ``GET /v1/models``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.di import Provide
from litestar.response import Stream

from auditor.auth import Principal, require_role
from auditor.db.models import Role
from auditor.errors import ApiError, error_body
from auditor.logs import log_failure
from auditor.routes import openai_schemas as schemas
from auditor.routes.deps import Services, provide_principal
from auditor.routes.openai_format import ChunkWriter, Done, final_body
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
        return {"object": "list", "data": [_model(service.model_name)]}

    @get("/models/{model_id:str}")
    async def model(self, services: Services, principal: Principal, model_id: str) -> dict[str, Any]:
        service = services.require_completions()
        schemas.check_model(model_id, service.model_name)
        return _model(service.model_name)


def _model(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "verbatim"}


async def _serve(services: Services, principal: Principal, request: GenerationRequest) -> Response[Any]:
    service = services.require_completions()
    schemas.check_model(request.model, service.model_name)
    choices = await service.prepare(request, principal.tenant, principal.key_id)
    headers = {TRANSCRIPT_HEADER: ", ".join(p.transcript_id for p in choices)}
    fingerprint = service.engine.system_fingerprint()
    if request.stream:
        return Stream(_sse(service, choices, fingerprint), media_type="text/event-stream",
                      headers={**headers, "Cache-Control": "no-cache"})
    results = await asyncio.gather(*(service.complete(p) for p in choices))
    done = [Done(p, output, recorded) for p, (output, recorded) in zip(choices, results)]
    return Response(final_body(done, service.model_name, fingerprint, service.engine.tokenizer), headers=headers)


_NOT_RECORDED = error_body(500, "the transcript could not be recorded; nothing was kept", None, "recording_failed")


async def _record_error(service: CompletionService, prepared: Prepared, last: Any) -> bool:
    """Record what was committed before the engine failed, as status ``error``; False if that failed."""
    try:
        await service.record_shielded(prepared, last, Status.ERROR)
    except Exception as exc:  # noqa: BLE001 - logged; the client is told nothing was kept
        log_failure(log, "recording a failed generation failed", exc, transcript_id=prepared.transcript_id)
        return False
    return True


_JSON = msgspec.json.Encoder()


def _event(payload: dict[str, Any]) -> bytes:
    """One server-sent event: compact UTF-8 JSON, as litestar encodes the non-streamed bodies."""
    return b"data: " + _JSON.encode(payload) + b"\n\n"


async def _merged(service: CompletionService, choices: list[Prepared]) -> AsyncIterator[tuple[int, Any]]:
    """``(choice index, cumulative output)`` of every choice as its tokens are committed. A failure of one
    choice is raised here; the others' generators are closed (which aborts them in the engine)."""
    if len(choices) == 1:
        async for output in service.outputs(choices[0]):
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()

    async def pump(index: int, prepared: Prepared) -> None:
        try:
            async for output in service.outputs(prepared):
                await queue.put((index, output, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(choices)]
    try:
        running = len(tasks)
        while running:
            index, output, error = await queue.get()
            if error is not None:
                raise error
            if output is None:
                running -= 1
                continue
            yield index, output
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sse(service: CompletionService, choices: list[Prepared], fingerprint: str) -> AsyncIterator[bytes]:
    """Committed text of every choice as it arrives, each choice's finish chunk, a chunk with the usage
    and the transcripts, ``[DONE]``.

    If the client goes away (the generator is cancelled or closed) before generation ends, the unfinished
    choices are aborted and their committed tokens are recorded as ``client_disconnected``. If the engine
    fails, every choice's committed tokens are recorded as ``error``. If recording fails, nothing was
    kept: the stream ends with an error event and without ``[DONE]``.
    """
    writer = ChunkWriter(choices, service.model_name, fingerprint, service.engine.tokenizer)
    last: list[Any] = [None] * len(choices)
    generating = True
    try:
        for chunk in writer.first():
            yield _event(chunk)
        async for index, output in _merged(service, choices):
            last[index] = output
            chunk = writer.delta(index, output)
            if chunk is not None:
                yield _event(chunk)
        generating = False
        if any(output is None for output in last):
            raise RuntimeError("the engine produced no output")
        recorded = await asyncio.gather(*(service.record_shielded(p, o, Status.COMPLETED)
                                          for p, o in zip(choices, last)))
        yield _event(writer.last([Done(p, o, r) for p, o, r in zip(choices, last, recorded)]))
    except ApiError as exc:
        generating = False
        yield _event(error_body(exc.status, exc.message, exc.param, exc.code))
    except Exception as exc:
        if not generating:
            log_failure(log, "recording a streamed completion failed", exc, transcript_id=choices[0].transcript_id)
            yield _event(_NOT_RECORDED)
            return
        generating = False
        log_failure(log, "generation failed mid-stream", exc, transcript_id=choices[0].transcript_id)
        kept = [await _record_error(service, p, o) for p, o in zip(choices, last) if o is not None]
        if not all(kept):
            yield _event(_NOT_RECORDED)
            return
        yield _event(error_body(500, "generation failed; the committed tokens were recorded", None, "engine_error"))
    finally:
        if generating:
            for prepared, output in zip(choices, last):
                if output is not None and output.finished:
                    service.record_finished(prepared, output)
                else:
                    service.record_disconnect(prepared, output)
    yield b"data: [DONE]\n\n"
