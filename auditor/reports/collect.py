"""Gather a report's inputs from the database and the ledger (async; no rendering here)."""

from __future__ import annotations

import base64
import datetime as dt
import json
from collections.abc import Callable
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from auditor import merkle
from auditor.checkpoint import Checkpoint, sign_checkpoint
from auditor.crypto import KeyRing, KeyRole
from auditor.db.models import ReplayJob, Transcript, TranscriptContent
from auditor.ledger import Ledger
from auditor.reports import store
from auditor.reports.scope import Scope, attested_at, in_period
from auditor.reports.inputs import (
    AccessEntry,
    BundleInputs,
    LogEvidence,
    ReplayEntry,
    ReportFilters,
    TranscriptContent as Content,
    TranscriptEntry,
)
from auditor.repository import TranscriptFilter, utc

Progress = Callable[[str, int, int], None]
"""``progress(stage, done, total)``; the CLI draws a bar with it."""


def _no_progress(stage: str, done: int, total: int) -> None:
    return None


async def _checkpoint_note(session: AsyncSession, ledger: Ledger, keyring: KeyRing, size: int) -> str:
    """The stored signed checkpoint for ``size``; a size without one (0, or never stored) is signed now."""
    stored = await ledger.checkpoint_at(session, size)
    if stored is not None:
        return stored.note
    root = merkle.EMPTY_ROOT if size == 0 else (await ledger.tree_for(session, size)).root(size)
    return sign_checkpoint(Checkpoint(ledger.origin, size, root), keyring.signer(KeyRole.CHECKPOINT))


def _content(row: TranscriptContent | None) -> Content | None:
    if row is None:
        return None
    return Content(bytes(row.salt), list(row.prompt_token_ids), list(row.output_token_ids),
                   list(row.token_logprobs), row.prompt_text, row.output_text)


def _attested_verdict(attestation: dict | None) -> str | None:
    """The verdict as signed in the attestation (the bundle verifier checks the signature)."""
    if attestation is None:
        return None
    try:
        return str(json.loads(base64.b64decode(attestation["payload"]))["predicate"]["result"])
    except (KeyError, TypeError, ValueError):
        return None


async def _replay(session: AsyncSession, ledger: Ledger, job: ReplayJob, end_size: int) -> ReplayEntry:
    attestation = _json(job.attestation)
    proof = None
    if attestation is not None and job.log_index is not None and job.log_index < end_size:
        proof = await ledger.inclusion_proof(session, job.log_index, end_size)
    verdict = _attested_verdict(attestation)
    return ReplayEntry(job.id, job.transcript_id, job.status, verdict, job.result, job.requested_by, utc(job.created_at),
                       utc(job.finished_at) if job.finished_at else None, attestation,
                       job.log_index if proof else None, proof)


async def collect(session: AsyncSession, ledger: Ledger, keyring: KeyRing, filters: ReportFilters, *,
                  report_id: str, generator_version: str, now: dt.datetime,
                  progress: Progress = _no_progress, end_size: int | None = None) -> BundleInputs:
    """Everything ``build_bundle`` needs for ``filters`` as of the ledger's latest checkpoint (or the
    stored one of ``end_size``: the latest a quorum of witnesses cosigned): the selected transcripts,
    the chain span around them, the replays of the selected ones and those attested in the period
    (``auditor.reports.scope`` says why each is there)."""
    end = await ledger.checkpoint(session) if end_size is None else await ledger.checkpoint_at(session, end_size)
    assert end is not None, end_size
    where = TranscriptFilter(filters.tenant, filters.model, True if filters.deterministic_only else None,
                             None, filters.since, filters.until)
    logged = [r for r in await store.transcripts(session, where) if r.log_index < end.tree_size]
    scoped = {r.id: (r, Scope.REPORT) for r in logged}
    await _chain_span(session, filters.tenant, logged, end.tree_size, scoped)
    jobs = await store.replay_jobs(session, filters.tenant, [r.id for r in logged])
    jobs += await _attested_in_period(session, filters, end.tree_size, {j.id for j in jobs}, scoped)
    rows = sorted(scoped.values(), key=lambda item: item[0].log_index)
    reported = [row.id for row, scope in rows if scope is Scope.REPORT]
    contents = await store.contents(session, reported) if filters.include_content else {}
    entries = []
    for i, (row, scope) in enumerate(rows):
        proof = await ledger.inclusion_proof(session, row.log_index, end.tree_size)
        entries.append(TranscriptEntry(stored_envelope(row.envelope), row.log_index, proof,
                                       _content(contents.get(row.id)), scope.value, row.id))
        progress("transcripts", i + 1, len(rows))
    start_size = await store.log_size_before(session, filters.since) if filters.since else 0
    start_size = min(start_size, end.tree_size)
    consistency = await ledger.consistency_proof(session, start_size, end.tree_size)
    replays = [await _replay(session, ledger, job, end.tree_size) for job in jobs]
    access = await store.access_rows(session, filters.tenant, filters.since, filters.until)
    return BundleInputs(
        report_id=report_id, filters=filters, transcripts=entries, replays=replays,
        access_log=[AccessEntry(utc(a.at), a.key_id, a.tenant, a.action, a.target) for a in access],
        log=LogEvidence(await _checkpoint_note(session, ledger, keyring, start_size), end.note, consistency),
        jwks=keyring.jwks(), generator_version=generator_version, created_at=now)


def stored_envelope(raw: bytes) -> dict[str, Any]:
    """The stored envelope as an object; bytes that are not a JSON object (damage) are carried as
    ``{"unreadable": <base64>}`` so the line still names them and every check on it fails."""
    try:
        envelope = json.loads(raw)
    except ValueError:
        envelope = None
    return envelope if isinstance(envelope, dict) else {"unreadable": base64.b64encode(bytes(raw)).decode("ascii")}


async def _chain_span(session: AsyncSession, tenant: str, selected: list[Transcript], tree_size: int,
                      scoped: dict[str, tuple[Transcript, Scope]]) -> None:
    """Add the tenant's unselected transcripts from just before the first selected sequence number to
    the last (``chain``), so that every link of the span can be checked."""
    if not selected:
        return
    sequences = [r.sequence for r in selected]
    for row in await store.chain_span(session, tenant, min(sequences) - 1, max(sequences)):
        if row.id not in scoped and row.log_index < tree_size:
            scoped[row.id] = (row, Scope.CHAIN)


async def _attested_in_period(session: AsyncSession, filters: ReportFilters, tree_size: int, known: set[str],
                              scoped: dict[str, tuple[Transcript, Scope]]) -> list[ReplayJob]:
    """Replays attested in the period (by their signed ``replayed_at``) of the tenant's transcripts
    that the filters select but for the period; their transcripts join as ``replayed``."""
    if filters.since is None and filters.until is None:
        return []
    margin = dt.timedelta(minutes=1)  # finished_at is stamped just after the signed replayed_at
    candidates = await store.replays_finished(session, filters.tenant, filters.since and filters.since - margin,
                                              filters.until and filters.until + margin)
    period = filters.to_json()
    candidates = [j for j in candidates if j.id not in known and j.log_index is not None and j.log_index < tree_size
                  and in_period(attested_at(_json(j.attestation)), period)]
    missing = [j.transcript_id for j in candidates if j.transcript_id not in scoped]
    for row in await store.transcripts_by_id(session, filters.tenant, missing):
        if (row.log_index < tree_size and (filters.model is None or row.model == filters.model)
                and (row.deterministic or not filters.deterministic_only)):
            scoped[row.id] = (row, Scope.REPLAYED)
    return [j for j in candidates if j.transcript_id in scoped]


def _json(raw: bytes | None) -> dict[str, Any] | None:
    try:
        value = json.loads(raw) if raw else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
