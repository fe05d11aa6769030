"""SQL the reports need beyond ``auditor.repository``: one function per question, caller's session."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

from sqlalchemy import delete, func, select
from sqlalchemy.ext.asyncio import AsyncSession

from auditor.db.models import AccessLogEntry, LogLeaf, ReplayJob, Transcript, TranscriptContent
from auditor.repository import TranscriptFilter, select_transcripts


async def transcripts(session: AsyncSession, where: TranscriptFilter) -> list[Transcript]:
    """Every transcript of the tenant matching ``where``, in log order."""
    query = select_transcripts(where).order_by(Transcript.log_index)
    return list((await session.scalars(query)).all())


async def chain_span(session: AsyncSession, tenant: str, first: int, last: int) -> list[Transcript]:
    """The tenant's transcripts with ``first <= sequence <= last``, in sequence order."""
    query = (select(Transcript).where(Transcript.tenant == tenant, Transcript.sequence >= first,
                                      Transcript.sequence <= last).order_by(Transcript.sequence))
    return list((await session.scalars(query)).all())


async def transcripts_by_id(session: AsyncSession, tenant: str, ids: Sequence[str]) -> list[Transcript]:
    if not ids:
        return []
    query = select(Transcript).where(Transcript.tenant == tenant, Transcript.id.in_(list(ids)))
    return list((await session.scalars(query)).all())


async def contents(session: AsyncSession, transcript_ids: Sequence[str]) -> dict[str, TranscriptContent]:
    if not transcript_ids:
        return {}
    rows = await session.scalars(select(TranscriptContent).where(TranscriptContent.transcript_id.in_(transcript_ids)))
    return {r.transcript_id: r for r in rows}


async def replay_jobs(session: AsyncSession, tenant: str, transcript_ids: Sequence[str]) -> list[ReplayJob]:
    if not transcript_ids:
        return []
    query = (select(ReplayJob).where(ReplayJob.tenant == tenant, ReplayJob.transcript_id.in_(transcript_ids))
             .order_by(ReplayJob.created_at, ReplayJob.id))
    return list((await session.scalars(query)).all())


async def replays_finished(session: AsyncSession, tenant: str, since: dt.datetime | None,
                           until: dt.datetime | None) -> list[ReplayJob]:
    """The tenant's replay jobs with an attestation that finished in ``[since, until)`` (either end open)."""
    query = select(ReplayJob).where(ReplayJob.tenant == tenant, ReplayJob.attestation.is_not(None))
    if since is not None:
        query = query.where(ReplayJob.finished_at >= since)
    if until is not None:
        query = query.where(ReplayJob.finished_at < until)
    return list((await session.scalars(query.order_by(ReplayJob.created_at, ReplayJob.id))).all())


async def access_rows(session: AsyncSession, tenant: str, since: dt.datetime | None,
                      until: dt.datetime | None) -> list[AccessLogEntry]:
    query = select(AccessLogEntry).where(AccessLogEntry.tenant == tenant)
    if since is not None:
        query = query.where(AccessLogEntry.at >= since)
    if until is not None:
        query = query.where(AccessLogEntry.at < until)
    return list((await session.scalars(query.order_by(AccessLogEntry.at, AccessLogEntry.id))).all())


async def log_size_before(session: AsyncSession, when: dt.datetime) -> int:
    """How many log leaves were appended before ``when`` (the log is append-only and dense)."""
    return int((await session.scalar(select(func.count()).select_from(LogLeaf).where(LogLeaf.created_at < when))) or 0)


async def purge_contents(session: AsyncSession, tenant: str, completed_before: dt.datetime) -> list[str]:
    """Delete the content rows (ids, salt, text) of the tenant's transcripts completed before the cut.

    Envelopes, log leaves and checkpoints are untouched, so every signature and proof still verifies.
    """
    ids = list((await session.scalars(
        select(TranscriptContent.transcript_id).join(Transcript, Transcript.id == TranscriptContent.transcript_id)
        .where(Transcript.tenant == tenant, Transcript.completed_at < completed_before))).all())
    if ids:
        await session.execute(delete(TranscriptContent).where(TranscriptContent.transcript_id.in_(ids)))
    return ids


async def tenants(session: AsyncSession) -> list[str]:
    return list((await session.scalars(select(Transcript.tenant).distinct().order_by(Transcript.tenant))).all())
