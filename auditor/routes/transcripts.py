"""``GET /v1/transcripts`` (tenant-scoped, filtered, paginated) and ``GET /v1/transcripts/{id}``."""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from litestar import Controller, get
from litestar.di import Provide
from litestar.params import Parameter
from sqlalchemy.ext.asyncio import AsyncSession

from auditor import queries, repository
from auditor.auth import Principal
from auditor.repository import TranscriptFilter
from auditor.routes.deps import Services, provide_db_session, provide_principal, witnessed_size
from auditor.routes.openapi import SECURITY
from auditor.routes.validation import aware, check_id
from auditor.transcript import Status


class TranscriptsController(Controller):
    path = "/v1/transcripts"
    security = SECURITY
    dependencies = {"principal": Provide(provide_principal), "db_session": Provide(provide_db_session)}

    @get("/")
    async def list_transcripts(
        self,
        db_session: AsyncSession,
        principal: Principal,
        limit: int = Parameter(default=20, ge=1, le=queries.MAX_PAGE),
        after: str | None = None,
        order: Literal["asc", "desc"] = "desc",
        model: str | None = None,
        deterministic: bool | None = None,
        status: Status | None = None,
        since: dt.datetime | None = None,
        until: dt.datetime | None = None,
    ) -> dict[str, Any]:
        """``after``: the ``last_id`` of the previous page (a transcript id)."""
        where = TranscriptFilter(principal.tenant, model, deterministic, status.value if status else None,
                                 aware(since, "since"), aware(until, "until"))
        page = await queries.transcript_page(db_session, principal, where, after=check_id(after, "after"),
                                             limit=limit, descending=order == "desc")
        return page.to_json()

    @get("/{transcript_id:str}")
    async def get_transcript(
        self,
        transcript_id: str,
        services: Services,
        db_session: AsyncSession,
        principal: Principal,
        include_content: bool = False,
        verify: bool = False,
        witnessed: bool = False,
    ) -> dict[str, Any]:
        """The transcript as a ``verify`` file: envelope, inclusion proof and the latest signed
        checkpoint (which covers it as soon as the completion's response has arrived: no waiting), or
        with ``witnessed=true`` the latest one a quorum of witnesses cosigned that covers it.
        ``include_content``: token ids, salt, windows, logprobs and text. ``verify``: ``verification``,
        every check the offline verifier runs, on the stored content too (token ids and salt against
        the signed commitments) whether or not it is included, plus the log's own self-check."""
        at_size = None
        if witnessed:  # a checkpoint that covers the transcript (an unknown id is a 404 below)
            row = await repository.get_transcript(db_session, transcript_id)
            at_size = await witnessed_size(services, row.log_index + 1 if row is not None else 0)
        return await queries.transcript_document(db_session, services.ledger, services.keyring, principal,
                                                 transcript_id, include_content=include_content, verify=verify,
                                                 at_size=at_size)

