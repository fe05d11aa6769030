"""The plain inputs a report bundle is built from (no SQL, no HTTP: the service fills these in)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from auditor.merkle import ConsistencyProof, InclusionProof


def iso_utc(t: dt.datetime) -> str:
    """RFC 3339 UTC with a ``Z`` (microseconds kept when present); naive times are taken as UTC."""
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return t.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class ReportFilters:
    """What a report covers. ``since`` is inclusive, ``until`` exclusive; ``None`` means unbounded."""

    tenant: str
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    model: str | None = None
    deterministic_only: bool = False
    include_content: bool = False

    def __post_init__(self) -> None:
        if not self.tenant:
            raise ValueError("report filters need a tenant")
        if self.since and self.until and self.since >= self.until:
            raise ValueError(f"since {iso_utc(self.since)} must be before until {iso_utc(self.until)}")

    def to_json(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "since": iso_utc(self.since) if self.since else None,
            "until": iso_utc(self.until) if self.until else None,
            "model": self.model,
            "deterministic_only": self.deterministic_only,
            "include_content": self.include_content,
        }


@dataclass(frozen=True)
class TranscriptContent:
    """What the envelope commits to but does not disclose (only exported when asked for)."""

    salt: bytes = field(repr=False)
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    token_logprobs: Sequence[float]
    prompt_text: str
    output_text: str

    def to_json(self) -> dict[str, Any]:
        return {
            "salt": self.salt.hex(),
            "prompt_token_ids": list(self.prompt_token_ids),
            "output_token_ids": list(self.output_token_ids),
            "token_logprobs": list(self.token_logprobs),
            "prompt_text": self.prompt_text,
            "output_text": self.output_text,
        }


@dataclass(frozen=True)
class TranscriptEntry:
    """One logged transcript: its DSSE envelope, log index and inclusion proof at the end checkpoint.

    ``scope`` says why the bundle carries it (``auditor.reports.scope.Scope``); ``transcript_id`` is
    the stored row's id, which names the line when the envelope is damaged beyond reading.
    """

    envelope: Mapping[str, Any]
    log_index: int
    inclusion_proof: InclusionProof
    content: TranscriptContent | None = None
    scope: str = "report"
    transcript_id: str | None = None


@dataclass(frozen=True)
class ReplayEntry:
    """One replay job of a transcript in the report."""

    replay_id: str
    transcript_id: str
    status: str
    """Job status: queued / running / done / failed."""
    verdict: str | None
    """match / mismatch / inconclusive_environment once done."""
    result: Mapping[str, Any] | None
    requested_by: str | None
    created_at: dt.datetime
    finished_at: dt.datetime | None
    attestation: Mapping[str, Any] | None = None
    """Signed replay attestation (DSSE envelope), when the replay finished."""
    log_index: int | None = None
    inclusion_proof: InclusionProof | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "replay_id": self.replay_id, "transcript_id": self.transcript_id, "status": self.status,
            "verdict": self.verdict, "result": dict(self.result) if self.result is not None else None,
            "requested_by": self.requested_by, "created_at": iso_utc(self.created_at),
            "finished_at": iso_utc(self.finished_at) if self.finished_at else None,
            "attestation": dict(self.attestation) if self.attestation is not None else None,
            "log_index": self.log_index,
            "inclusion_proof": self.inclusion_proof.to_json() if self.inclusion_proof else None,
        }


@dataclass(frozen=True)
class AccessEntry:
    """One access-log row: ``key_id`` did ``action`` on ``target`` at ``at``."""

    at: dt.datetime
    key_id: str
    tenant: str
    action: str
    target: str


@dataclass(frozen=True)
class LogEvidence:
    """Signed checkpoints at the period's start and at export time, and the proof linking them."""

    start_checkpoint: str
    end_checkpoint: str
    consistency: ConsistencyProof


@dataclass(frozen=True)
class BundleInputs:
    report_id: str
    filters: ReportFilters
    transcripts: Sequence[TranscriptEntry]
    replays: Sequence[ReplayEntry]
    access_log: Sequence[AccessEntry]
    log: LogEvidence
    jwks: Mapping[str, Any]
    generator_version: str
    created_at: dt.datetime
