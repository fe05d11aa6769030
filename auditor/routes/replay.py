"""``POST /v1/transcripts/{id}/replay`` (202 + job; ``?wait=true``: 200 with the finished job) and
``GET /v1/replays/{id}``. Any key of the transcript's tenant (its clients, auditors, admins) may
replay it; other tenants get 404. Refusals: 409 (not replayable, other model, invalid signature),
429 (the tenant's replay queue is full), 503 (engine not ready)."""

from __future__ import annotations

from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.di import Provide

from auditor.auth import Principal
from auditor.replay import ReplayService
from auditor.routes.deps import provide_principal
from auditor.routes.openapi import SECURITY

_FINAL = ("done", "failed")


def provide_replays(request: Request[Any, Any, Any]) -> ReplayService:
    return ReplayService.for_app(request.app)


class ReplayController(Controller):
    path = "/v1"
    security = SECURITY
    dependencies = {"principal": Provide(provide_principal),
                    "replays": Provide(provide_replays, sync_to_thread=False)}

    @post("/transcripts/{transcript_id:str}/replay", status_code=202)
    async def start(self, transcript_id: str, principal: Principal, replays: ReplayService,
                    wait: bool = False) -> Response[dict[str, Any]]:
        job = await replays.submit(principal, transcript_id)
        if wait:
            job = await replays.wait(principal, job["id"])
        return Response(job, status_code=200 if job["status"] in _FINAL else 202,
                        headers={"Location": f"/v1/replays/{job['id']}"})

    @get("/replays/{replay_id:str}")
    async def fetch(self, replay_id: str, principal: Principal, replays: ReplayService) -> dict[str, Any]:
        return await replays.get(principal, replay_id)
