"""Every table of the service, in one place (schema changes go through ``migrations/`` only).

Append-only tables (``transcripts``, ``log_leaves``, ``log_checkpoints``, ``access_log``) are
protected on PostgreSQL by triggers that reject UPDATE and DELETE. Content that may have to be
erased (token ids, salt, text) lives in ``transcript_contents``, which is deliberately *not*
append-only: erasing a row leaves every signature and log proof verifiable.
"""

from __future__ import annotations

import datetime as dt
import enum

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from auditor.roles import Role as Role  # the column type of api_keys.role
from auditor.transcript import Status as TranscriptStatus  # the signed statuses are the stored ones

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

APPEND_ONLY_TABLES = ("transcripts", "log_leaves", "log_checkpoints", "access_log", "checkpoint_cosignatures")


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Utf8Text(TypeDecorator[str]):
    """A string stored as its UTF-8 bytes (``bytea`` / BLOB). PostgreSQL ``text`` cannot hold NUL
    (U+0000), which a client may send in a prompt and a model may emit; bytes hold every Unicode
    string, so content is stored exactly as received on both databases."""

    impl = LargeBinary
    cache_ok = True

    def process_bind_param(self, value: str | None, dialect: Dialect) -> bytes | None:
        return None if value is None else value.encode("utf-8")

    def process_result_value(self, value: bytes | None, dialect: Dialect) -> str | None:
        return None if value is None else bytes(value).decode("utf-8")


class LeafKind(str, enum.Enum):
    TRANSCRIPT = "transcript"
    REPLAY_ATTESTATION = "replay_attestation"


class ReplayStatus(str, enum.Enum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class AccessAction(str, enum.Enum):
    READ = "read"
    REPLAY = "replay"
    EXPORT = "export"
    LIST = "list"


def _in(column: str, values: type[enum.Enum]) -> str:
    return f"{column} IN ({', '.join(repr(v.value) for v in values)})"


class ApiKey(Base):
    """An API key: only the SHA-256 of the secret is stored; the secret is shown once at creation."""

    __tablename__ = "api_keys"
    __table_args__ = (CheckConstraint(_in("role", Role), name="role"),)

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    """Public key id (``key_<hex>``), safe to log and to show in access logs."""
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    """Hex SHA-256 of the full secret key string."""
    tenant: Mapped[str] = mapped_column(String(64), index=True)
    role: Mapped[str] = mapped_column(String(16))
    name: Mapped[str | None] = mapped_column(String(128))
    """Free-form label given at creation."""
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    """Set once when revoked; a revoked key authenticates nothing."""


class Transcript(Base):
    """One signed transcript: the exact DSSE envelope bytes plus the clear fields needed to query it."""

    __tablename__ = "transcripts"
    __table_args__ = (
        UniqueConstraint("tenant", "sequence"),
        CheckConstraint(_in("status", TranscriptStatus), name="status"),
        Index("ix_transcripts_tenant_created_at", "tenant", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    """UUIDv7 string, also the Statement subject name."""
    tenant: Mapped[str] = mapped_column(String(64))
    sequence: Mapped[int] = mapped_column(BigInteger)
    """Per-tenant sequence number, starting at 1."""
    previous_digest: Mapped[str | None] = mapped_column(String(64))
    """``payload_digest`` of the tenant's previous transcript (None for the first)."""
    api: Mapped[str] = mapped_column(String(32))
    """``completions`` or ``chat.completions``."""
    model: Mapped[str] = mapped_column(String(128), index=True)
    deterministic: Mapped[bool] = mapped_column(Boolean)
    status: Mapped[str] = mapped_column(String(32))
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    seed: Mapped[str | None] = mapped_column(String(24))
    """Decimal seed (64-bit unsigned does not fit every database's signed BIGINT)."""
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    system_fingerprint: Mapped[str] = mapped_column(String(32))
    key_id: Mapped[str] = mapped_column(String(64))
    """Signing key id (RFC 7638 thumbprint)."""
    api_key_id: Mapped[str | None] = mapped_column(String(32))
    """API key that made the request."""
    envelope: Mapped[bytes] = mapped_column(LargeBinary)
    """The exact DSSE envelope bytes as signed and returned; never re-serialized."""
    payload_digest: Mapped[str] = mapped_column(String(64))
    """Hex SHA-256 of the signed payload bytes: the next transcript's ``previous_digest``."""
    envelope_digest: Mapped[str] = mapped_column(String(64), unique=True)
    """Hex SHA-256 of ``envelope`` (RFC 8785 bytes of the DSSE envelope): the log entry."""
    log_index: Mapped[int] = mapped_column(BigInteger, unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    """When the request was received (UTC)."""
    completed_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class TranscriptContent(Base):
    """What the envelope commits to but does not disclose; erasable."""

    __tablename__ = "transcript_contents"

    transcript_id: Mapped[str] = mapped_column(ForeignKey("transcripts.id"), primary_key=True)
    salt: Mapped[bytes] = mapped_column(LargeBinary)
    """32 random bytes; the commitments are SHA-256(salt || u32le ids)."""
    prompt_token_ids: Mapped[list[int]] = mapped_column(JSON)
    output_token_ids: Mapped[list[int]] = mapped_column(JSON)
    """Ground truth for replay; the text below is derived from these."""
    token_logprobs: Mapped[list[float]] = mapped_column(JSON)
    request_json: Mapped[dict] = mapped_column(JSON)
    """The validated request (prompt or messages and parameters), for replay and reports."""
    prompt_text: Mapped[str] = mapped_column(Utf8Text)
    output_text: Mapped[str] = mapped_column(Utf8Text)


class LogLeaf(Base):
    """One entry of the RFC 6962 log; ``index`` is dense from 0 and the tree is rebuilt from these."""

    __tablename__ = "log_leaves"
    __table_args__ = (CheckConstraint(_in("kind", LeafKind), name="kind"),)

    index: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    leaf_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    """SHA-256(0x00 || entry), RFC 6962 leaf hash."""
    entry: Mapped[bytes] = mapped_column(LargeBinary(32))
    """The logged data: the 32-byte envelope digest."""
    kind: Mapped[str] = mapped_column(String(24))
    transcript_id: Mapped[str | None] = mapped_column(ForeignKey("transcripts.id"), index=True)
    replay_job_id: Mapped[str | None] = mapped_column(ForeignKey("replay_jobs.id"), index=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class LogCheckpoint(Base):
    """A signed checkpoint (C2SP signed note) for one tree size."""

    __tablename__ = "log_checkpoints"

    tree_size: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=False)
    root_hash: Mapped[bytes] = mapped_column(LargeBinary(32))
    note: Mapped[str] = mapped_column(Text)
    """The full signed note text, exactly as served."""
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class CheckpointCosignature(Base):
    """A witness's cosignature (C2SP tlog-cosignature) on one stored checkpoint."""

    __tablename__ = "checkpoint_cosignatures"

    tree_size: Mapped[int] = mapped_column(ForeignKey("log_checkpoints.tree_size"), primary_key=True)
    witness: Mapped[str] = mapped_column(String(255), primary_key=True)
    """The cosigner name (as in its vkey and signature line)."""
    timestamp: Mapped[int] = mapped_column(BigInteger)
    """The signed POSIX time of the cosignature."""
    signature_line: Mapped[str] = mapped_column(Text)
    """The note signature line exactly as the witness returned it (newline-terminated)."""
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class ReplayJob(Base):
    """A replay of one transcript (replay issue); mutable while it runs, so not append-only."""

    __tablename__ = "replay_jobs"
    __table_args__ = (
        CheckConstraint(_in("status", ReplayStatus), name="status"),
        Index("ix_replay_jobs_tenant_created_at", "tenant", "created_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)
    tenant: Mapped[str] = mapped_column(String(64))
    transcript_id: Mapped[str] = mapped_column(ForeignKey("transcripts.id"), index=True)
    requested_by: Mapped[str | None] = mapped_column(String(32))
    """API key id that started the replay."""
    status: Mapped[str] = mapped_column(String(16))
    result: Mapped[dict | None] = mapped_column(JSON)
    """Verdict and details (match / mismatch / inconclusive_environment, divergence point)."""
    attestation: Mapped[bytes | None] = mapped_column(LargeBinary)
    """Signed replay attestation (DSSE envelope bytes), also logged."""
    log_index: Mapped[int | None] = mapped_column(BigInteger)
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    claimed_by: Mapped[str | None] = mapped_column(String(128))
    """The server process running the job (host:pid:random), while ``running``."""
    lease_expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True))
    """A running job whose lease has passed is taken back by any server (its runner died)."""


class AccessLogEntry(Base):
    """Who read, replayed, exported or listed what; append-only."""

    __tablename__ = "access_log"
    __table_args__ = (
        CheckConstraint(_in("action", AccessAction), name="action"),
        Index("ix_access_log_tenant_at", "tenant", "at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(32))
    tenant: Mapped[str] = mapped_column(String(64))
    action: Mapped[str] = mapped_column(String(16))
    target: Mapped[str] = mapped_column(String(256))
    """Transcript id, replay job id, export id, or the list query."""
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
