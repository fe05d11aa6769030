"""SQL queries, one function per question, each taking the caller's session (the caller owns the
transaction). No crypto and no HTTP here."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Select, and_, func, insert, select, text
from sqlalchemy.ext.asyncio import AsyncSession

from auditor.db.models import (
    AccessLogEntry,
    ApiKey,
    CheckpointCosignature,
    LeafKind,
    LogCheckpoint,
    LogLeaf,
    ReplayJob,
    Transcript,
    TranscriptContent,
)


def utc(value: dt.datetime) -> dt.datetime:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


def iso_utc(value: dt.datetime) -> str:
    """A stored time as RFC 3339 UTC with a ``Z`` (microseconds kept when present)."""
    return utc(value).astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


# --- cross-process locks ------------------------------------------------------------------------


async def lock_log(session: AsyncSession) -> None:
    """Serialize log appends across processes, held until the transaction ends: the advisory lock on
    PostgreSQL, the database's write lock on SQLite (``lock_writes``). Call it first in the transaction."""
    if session.bind.dialect.name == "postgresql":
        await session.execute(text("SELECT pg_advisory_xact_lock(7262010301)"))
    else:
        await lock_writes(session)


async def lock_writes(session: AsyncSession) -> None:
    """On SQLite, take the database's write lock as the transaction's FIRST statement, waiting for it
    (busy_timeout): every later read of the transaction then sees every commit of every process, and
    no other connection writes until this transaction ends. A no-op on PostgreSQL, where callers take
    advisory or row locks instead.

    Why ``BEGIN IMMEDIATE`` issued here, rather than SQLAlchemy's recipe of emitting BEGIN in a
    "begin" event, or a write to a one-row lock table: the driver (Python's sqlite3 in its default,
    legacy transaction control, kept by aiosqlite and SQLAlchemy's dialect) opens a transaction
    implicitly only before INSERT / UPDATE / DELETE / REPLACE, so until then this connection holds no
    transaction and no snapshot; this statement opens one with the write lock, and the driver's
    commit() and rollback() end it (they ask SQLite whether one is open). The recipe changes how every
    transaction of an engine begins (these locks are taken on the shared request engine too): a
    deferred BEGIN before a request's reads makes its access-log INSERT fail with SQLITE_BUSY_SNAPSHOT,
    without waiting, whenever another process commits in between. A lock table needs a migration and
    a row write per append for what SQLite does with one statement. A caller that already wrote in
    the transaction gets SQLite's "cannot start a transaction within a transaction"."""
    if session.bind.dialect.name == "sqlite":
        await session.execute(text("BEGIN IMMEDIATE"))


# --- transcripts and the per-tenant chain -------------------------------------------------------


@dataclass(frozen=True)
class ChainHead:
    sequence: int
    """The sequence number the next transcript of the tenant gets."""
    previous_digest: str | None


async def chain_heads(session: AsyncSession, tenants: Iterable[str]) -> dict[str, ChainHead]:
    """The chain head of each tenant in ``tenants`` (one query; the (tenant, sequence) index serves it)."""
    wanted = sorted(set(tenants))
    last = (select(Transcript.tenant, func.max(Transcript.sequence).label("sequence"))
            .where(Transcript.tenant.in_(wanted)).group_by(Transcript.tenant).subquery())
    rows = (await session.execute(
        select(Transcript.tenant, Transcript.sequence, Transcript.payload_digest)
        .join(last, and_(Transcript.tenant == last.c.tenant, Transcript.sequence == last.c.sequence)))).all()
    heads = {tenant: ChainHead(1, None) for tenant in wanted}
    heads.update({row.tenant: ChainHead(row.sequence + 1, row.payload_digest) for row in rows})
    return heads


async def get_transcript(session: AsyncSession, transcript_id: str) -> Transcript | None:
    return await session.get(Transcript, transcript_id)


async def get_content(session: AsyncSession, transcript_id: str) -> TranscriptContent | None:
    return await session.get(TranscriptContent, transcript_id)


@dataclass(frozen=True)
class TranscriptFilter:
    tenant: str
    model: str | None = None
    deterministic: bool | None = None
    status: str | None = None
    since: dt.datetime | None = None
    until: dt.datetime | None = None


def select_transcripts(where: TranscriptFilter) -> Select[tuple[Transcript]]:
    """The tenant's transcripts matching ``where``, unordered: callers add order and paging."""
    query = select(Transcript).where(Transcript.tenant == where.tenant)
    if where.model is not None:
        query = query.where(Transcript.model == where.model)
    if where.deterministic is not None:
        query = query.where(Transcript.deterministic == where.deterministic)
    if where.status is not None:
        query = query.where(Transcript.status == where.status)
    if where.since is not None:
        query = query.where(Transcript.created_at >= where.since)
    if where.until is not None:
        query = query.where(Transcript.created_at < where.until)
    return query


async def list_transcripts(
    session: AsyncSession, where: TranscriptFilter, *, after: str | None, limit: int, descending: bool
) -> list[Transcript]:
    """One page of a tenant's transcripts ordered by id (UUIDv7: request time); ``limit + 1`` rows
    are fetched by the caller to learn whether there is more."""
    query = select_transcripts(where)
    if after is not None:
        query = query.where(Transcript.id < after if descending else Transcript.id > after)
    order = Transcript.id.desc() if descending else Transcript.id.asc()
    return list((await session.scalars(query.order_by(order).limit(limit))).all())


# --- the log ---------------------------------------------------------------------------------------


async def leaf_hashes(session: AsyncSession, start: int, end: int | None = None) -> list[bytes]:
    """Leaf hashes with ``start <= index < end``, in index order."""
    query = select(LogLeaf.index, LogLeaf.leaf_hash).where(LogLeaf.index >= start)
    if end is not None:
        query = query.where(LogLeaf.index < end)
    rows = (await session.execute(query.order_by(LogLeaf.index))).all()
    for offset, row in enumerate(rows):
        if row.index != start + offset:
            raise RuntimeError(f"log leaves are not dense: expected index {start + offset}, found {row.index}")
    return [bytes(row.leaf_hash) for row in rows]


@dataclass
class LogRows:
    """What one append transaction writes, as dicts of model attribute names to values."""

    transcripts: list[dict[str, Any]] = field(default_factory=list)
    contents: list[dict[str, Any]] = field(default_factory=list)
    leaves: list[dict[str, Any]] = field(default_factory=list)


async def add_log_rows(session: AsyncSession, rows: LogRows, checkpoint: dict[str, Any]) -> None:
    """Insert a transaction's transcripts, contents, leaves and its checkpoint: one executemany INSERT
    per table, parents first. (One multi-table statement would save round trips on PostgreSQL, but
    compiling it anew for every batch size cost three times the CPU of the append it saved.)"""
    for model, values in ((Transcript, rows.transcripts), (TranscriptContent, rows.contents), (LogLeaf, rows.leaves)):
        if values:
            await session.execute(insert(model), values)
    await session.execute(insert(LogCheckpoint), [checkpoint])


async def latest_checkpoint(session: AsyncSession) -> LogCheckpoint | None:
    return await session.scalar(select(LogCheckpoint).order_by(LogCheckpoint.tree_size.desc()).limit(1))


async def checkpoint_at(session: AsyncSession, tree_size: int) -> LogCheckpoint | None:
    return await session.get(LogCheckpoint, tree_size)


async def cosignature_lines(session: AsyncSession, tree_size: int) -> list[str]:
    """The witnesses' signature lines stored for the checkpoint of ``tree_size``, by witness name."""
    rows = await session.scalars(select(CheckpointCosignature.signature_line)
                                 .where(CheckpointCosignature.tree_size == tree_size)
                                 .order_by(CheckpointCosignature.witness))
    return list(rows.all())


async def has_cosignature(session: AsyncSession, tree_size: int, witness: str) -> bool:
    return await session.get(CheckpointCosignature, (tree_size, witness)) is not None


async def latest_cosigned_size(session: AsyncSession, witness: str) -> int | None:
    return await session.scalar(select(func.max(CheckpointCosignature.tree_size))
                                .where(CheckpointCosignature.witness == witness))


async def latest_witnessed_size(session: AsyncSession, witnesses: Sequence[str], quorum: int) -> int | None:
    """The largest checkpoint size cosigned by at least ``quorum`` of ``witnesses``."""
    query = (select(CheckpointCosignature.tree_size).where(CheckpointCosignature.witness.in_(list(witnesses)))
             .group_by(CheckpointCosignature.tree_size).having(func.count() >= quorum)
             .order_by(CheckpointCosignature.tree_size.desc()).limit(1))
    return await session.scalar(query)


async def add_cosignature(session: AsyncSession, row: CheckpointCosignature) -> None:
    session.add(row)
    await session.flush()


async def lock(session: AsyncSession, name: str) -> None:
    """Wait for the lock named ``name``, held to the end of the transaction (server processes starting
    together do one-time set-up one at a time): a PostgreSQL advisory lock; on SQLite, the database's
    write lock (``lock_writes``: every writer, not only this name). Call it first in the transaction."""
    if session.bind.dialect.name == "postgresql":
        await session.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": name})
    else:
        await lock_writes(session)


async def try_lock(session: AsyncSession, name: str) -> bool:
    """The PostgreSQL advisory lock named ``name`` for the rest of the transaction, if free (one server
    process at a time does the named work). SQLite has no named locks: see ``auditor.db.filelock``."""
    assert session.bind.dialect.name == "postgresql", session.bind.dialect.name
    return bool(await session.scalar(text("SELECT pg_try_advisory_xact_lock(hashtext(:name))"), {"name": name}))


async def checkpoint_roots(session: AsyncSession, max_size: int) -> list[tuple[int, bytes]]:
    """(tree size, root hash) of every stored checkpoint up to ``max_size``, by size."""
    rows = (await session.execute(select(LogCheckpoint.tree_size, LogCheckpoint.root_hash)
                                  .where(LogCheckpoint.tree_size <= max_size).order_by(LogCheckpoint.tree_size))).all()
    return [(row.tree_size, bytes(row.root_hash)) for row in rows]


async def leaf_for_entry(session: AsyncSession, entry: bytes) -> LogLeaf | None:
    return await session.scalar(select(LogLeaf).where(LogLeaf.entry == entry))


@dataclass(frozen=True)
class LeafRecord:
    """A log leaf beside the record it logs (a transcript or a replay job), for the log's self-check."""

    index: int
    leaf_hash: bytes
    entry: bytes
    kind: str
    transcript_id: str | None
    replay_job_id: str | None
    logged: bytes | None
    """The logged record's stored envelope bytes (``transcripts.envelope`` / ``replay_jobs.attestation``);
    None when the row it names is missing."""
    logged_index: int | None
    """The log index the logged record says it has."""
    envelope_digest: str | None
    """``transcripts.envelope_digest`` for a transcript leaf."""


async def leaf_records(session: AsyncSession, start: int, end: int | None = None) -> list[LeafRecord]:
    """Leaves with ``start <= index < end`` joined with what they log, in index order (one statement, so
    one snapshot: a leaf and its record commit together)."""
    query = (select(LogLeaf.index, LogLeaf.leaf_hash, LogLeaf.entry, LogLeaf.kind, LogLeaf.transcript_id,
                    LogLeaf.replay_job_id, Transcript.envelope, Transcript.log_index, Transcript.envelope_digest,
                    ReplayJob.attestation, ReplayJob.log_index.label("job_log_index"))
             .outerjoin(Transcript, Transcript.id == LogLeaf.transcript_id)
             .outerjoin(ReplayJob, ReplayJob.id == LogLeaf.replay_job_id)
             .where(LogLeaf.index >= start))
    if end is not None:
        query = query.where(LogLeaf.index < end)
    rows = (await session.execute(query.order_by(LogLeaf.index))).all()
    return [_leaf_record(row, row.kind == LeafKind.TRANSCRIPT.value) for row in rows]


def _leaf_record(row: Any, transcript: bool) -> LeafRecord:
    return LeafRecord(row.index, bytes(row.leaf_hash), bytes(row.entry), row.kind, row.transcript_id,
                      row.replay_job_id, _bytes(row.envelope if transcript else row.attestation),
                      row.log_index if transcript else row.job_log_index, row.envelope_digest)


def _bytes(value: Any) -> bytes | None:
    return None if value is None else bytes(value)


async def transcripts_without_leaf(session: AsyncSession, limit: int = 1) -> list[tuple[str, int]]:
    """(id, log index) of transcripts whose log index holds no leaf naming them, lowest index first."""
    query = (select(Transcript.id, Transcript.log_index)
             .outerjoin(LogLeaf, and_(LogLeaf.index == Transcript.log_index, LogLeaf.transcript_id == Transcript.id))
             .where(LogLeaf.index.is_(None)).order_by(Transcript.log_index).limit(limit))
    return [(row.id, row.log_index) for row in (await session.execute(query)).all()]


async def replays_without_leaf(session: AsyncSession, limit: int = 1) -> list[tuple[str, int]]:
    """(id, log index) of logged replay jobs whose log index holds no leaf naming them."""
    query = (select(ReplayJob.id, ReplayJob.log_index)
             .outerjoin(LogLeaf, and_(LogLeaf.index == ReplayJob.log_index, LogLeaf.replay_job_id == ReplayJob.id))
             .where(ReplayJob.log_index.is_not(None), LogLeaf.index.is_(None))
             .order_by(ReplayJob.log_index).limit(limit))
    return [(row.id, row.log_index) for row in (await session.execute(query)).all()]


# --- API keys ----------------------------------------------------------------------------------------


async def add_api_key(session: AsyncSession, key: ApiKey) -> None:
    session.add(key)
    await session.flush()


async def api_key_by_hash(session: AsyncSession, key_hash: str) -> ApiKey | None:
    return await session.scalar(select(ApiKey).where(ApiKey.key_hash == key_hash))


async def list_api_keys(session: AsyncSession, tenant: str | None = None) -> Sequence[ApiKey]:
    query = select(ApiKey).order_by(ApiKey.created_at, ApiKey.id)
    if tenant is not None:
        query = query.where(ApiKey.tenant == tenant)
    return (await session.scalars(query)).all()


async def get_api_key(session: AsyncSession, key_id: str) -> ApiKey | None:
    return await session.get(ApiKey, key_id)


async def count_admin_keys(session: AsyncSession) -> int:
    query = select(func.count()).select_from(ApiKey).where(ApiKey.role == "admin", ApiKey.revoked_at.is_(None))
    return int((await session.scalar(query)) or 0)


# --- access log ---------------------------------------------------------------------------------------


async def add_access(session: AsyncSession, entry: AccessLogEntry) -> None:
    session.add(entry)
    await session.flush()
