"""The witness's HTTP interface (C2SP tlog-witness): ``POST /add-checkpoint`` under the submission
prefix (the server root), plus ``GET /`` (name, vkey, logs) and ``GET /healthz``."""

from __future__ import annotations

import logging
from typing import Any

from litestar import Litestar, Request, Response, get, post

from auditor.witness.core import Refusal, Witness
from auditor.witness.protocol import NOTE_MEDIA_TYPE, SIZE_MEDIA_TYPE, size_body

MAX_BODY_BYTES = 65_536
log = logging.getLogger("auditor.witness")


def create_witness_app(witness: Witness) -> Litestar:
    @post("/add-checkpoint", status_code=200)
    async def add_checkpoint(request: Request[Any, Any, Any]) -> Response[str]:
        try:
            cosigned = await witness.add_checkpoint(await request.body())
        except Refusal as refusal:
            log.warning("refused (%d): %s", refusal.status, refusal.message,
                        extra={"event": "witness_refused", "status": refusal.status})
            if refusal.status == 409 and refusal.size is not None:
                return Response(size_body(refusal.size), status_code=409, media_type=SIZE_MEDIA_TYPE)
            return Response(refusal.message + "\n", status_code=refusal.status, media_type=NOTE_MEDIA_TYPE)
        log.info("cosigned tree size %d", cosigned.size, extra={"event": "witness_cosigned"})
        return Response(cosigned.line, media_type=NOTE_MEDIA_TYPE)

    @get("/")
    async def identity() -> dict[str, Any]:
        return {"name": witness.cosigner.key.name, "vkey": witness.cosigner.key.vkey(),
                "logs": sorted(witness.logs)}

    @get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    return Litestar(route_handlers=[add_checkpoint, identity, healthz], request_max_body_size=MAX_BODY_BYTES,
                    openapi_config=None, logging_config=None, debug=False)
