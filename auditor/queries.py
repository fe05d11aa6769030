"""Read side: transcript documents (envelope + inclusion proof + checkpoint, the ``verify`` file
format), tenant-scoped listing, and the access log entry every read leaves behind.

Functions take the request's session (one transaction per request), so the access log row commits
with the read that caused it.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from auditor import repository
from auditor.auth import Principal
from auditor.crypto import KeyRing
from auditor.db.models import AccessAction, AccessLogEntry, Transcript, TranscriptContent
from auditor.errors import not_found
from auditor.ledger import Integrity, Ledger
from auditor.repository import TranscriptFilter, iso_utc
from auditor.verify import bundle_entry, content_fields, verify_document

MAX_PAGE = 100


def summary(row: Transcript) -> dict[str, Any]:
    """The clear (non-content) fields of a stored transcript."""
    return {
        "id": row.id, "tenant": row.tenant, "sequence": row.sequence, "previous_digest": row.previous_digest,
        "api": row.api, "model": row.model, "deterministic": row.deterministic, "status": row.status,
        "finish_reason": row.finish_reason, "seed": row.seed, "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens, "system_fingerprint": row.system_fingerprint,
        "created_at": iso_utc(row.created_at), "completed_at": iso_utc(row.completed_at), "log_index": row.log_index,
        "payload_digest": row.payload_digest, "envelope_digest": row.envelope_digest,
        "replayable": row.deterministic,
    }


async def record_access(session: AsyncSession, principal: Principal, action: AccessAction, target: str) -> None:
    await repository.add_access(session, AccessLogEntry(
        key_id=principal.key_id, tenant=principal.tenant, action=action.value, target=target[:256],
        at=dt.datetime.now(dt.UTC)))


async def transcript_document(session: AsyncSession, ledger: Ledger, keyring: KeyRing, principal: Principal,
                              transcript_id: str, *, include_content: bool, verify: bool,
                              at_size: int | None = None) -> dict[str, Any]:
    """The transcript in the ``verify`` file format, proved against the latest checkpoint or the stored
    one of ``at_size``. ``verify``: the server runs every check the offline verifier runs on that file
    with the stored content (token ids and salt against the signed commitments, the window chain, the
    logprob digest) whether or not the content is returned, plus ``log_self_check``: the state of the
    log's own check (``auditor.logcheck``)."""
    row = await repository.get_transcript(session, transcript_id)
    if row is None or row.tenant != principal.tenant:
        raise not_found(f"transcript {transcript_id!r} not found")
    checkpoint = await ledger.checkpoint(session) if at_size is None else await ledger.checkpoint_at(session, at_size)
    assert checkpoint is not None and row.log_index < checkpoint.tree_size, (at_size, row.log_index)
    proof = await ledger.inclusion_proof(session, row.log_index, checkpoint.tree_size)
    envelope = json.loads(row.envelope)
    content = await repository.get_content(session, row.id) if include_content or verify else None
    fields = None
    if content is not None:
        fields = content_fields(content.prompt_token_ids, content.output_token_ids, bytes(content.salt),
                                _signed_spans(envelope), content.token_logprobs)
        fields.update(prompt_text=content.prompt_text, output_text=content.output_text)
    doc = bundle_entry(envelope, proof, checkpoint.note, fields if include_content else None)
    doc["transcript"] = summary(row)
    if verify:
        checked = bundle_entry(envelope, proof, checkpoint.note, fields)
        report = verify_document(checked, keyring.jwks(), source=f"transcript {row.id}").to_json()
        report["checks"] += [*_erased(content), _self_check(ledger)]
        report["ok"] = all(c["ok"] for c in report["checks"])
        doc["verification"] = report
    await record_access(session, principal, AccessAction.READ, row.id)
    return doc


def _erased(content: TranscriptContent | None) -> list[dict[str, Any]]:
    if content is not None:
        return []  # its checks are the verifier's: prompt/output commitments, window chain, logprob digest
    return [{"name": "content", "ok": True,
             "detail": "the content (token ids, salt, text) was erased: envelope and log checks only"}]


def _self_check(ledger: Ledger) -> dict[str, Any]:
    """The log this transcript is in passed the server's own check (``auditor.logcheck``)."""
    fault = ledger.fault
    if fault is not None:
        return {"name": "log_self_check", "ok": False,
                "detail": f"the server's log failed its self-check: {fault.describe()}"}
    if ledger.stats.integrity is not Integrity.OK:
        return {"name": "log_self_check", "ok": False, "detail": "the server's log self-check has not finished"}
    return {"name": "log_self_check", "ok": True, "detail": "the server's log passed its self-check"}


def _signed_spans(envelope: dict[str, Any]) -> list[tuple[int, int]]:
    """The window spans as signed (read from the stored payload, which the verifier checks)."""
    try:
        payload = json.loads(base64.b64decode(envelope["payload"]))
        return [(int(s), int(e)) for s, e in payload["predicate"]["windows"]["spans"]]
    except (KeyError, TypeError, ValueError):
        return []  # a damaged envelope: the verification reports it


@dataclass(frozen=True)
class Page:
    data: list[dict[str, Any]]
    has_more: bool

    def to_json(self) -> dict[str, Any]:
        return {"object": "list", "data": self.data, "has_more": self.has_more,
                "first_id": self.data[0]["id"] if self.data else None,
                "last_id": self.data[-1]["id"] if self.data else None}


async def transcript_page(session: AsyncSession, principal: Principal, where: TranscriptFilter, *,
                          after: str | None, limit: int, descending: bool) -> Page:
    rows = await repository.list_transcripts(session, where, after=after, limit=limit + 1, descending=descending)
    await record_access(session, principal, AccessAction.LIST, _describe(where, after))
    return Page([summary(r) for r in rows[:limit]], len(rows) > limit)


def _describe(where: TranscriptFilter, after: str | None) -> str:
    parts = [f"{k}={v}" for k, v in (("model", where.model), ("deterministic", where.deterministic),
                                      ("status", where.status), ("since", where.since), ("until", where.until),
                                      ("after", after)) if v is not None]
    return "transcripts?" + "&".join(parts)
