"""Build a signed report bundle (ZIP bytes) from plain inputs; layout in ``auditor.reports``."""

from __future__ import annotations

import datetime as dt
import io
import json
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from auditor import canonical as cn
from auditor.checkpoint import Checkpoint, verify_checkpoint
from auditor.crypto import Signer, as_verifier_keys
from auditor.merkle import ProofError, leaf_hash, verify_consistency, verify_inclusion
from auditor.reports.inputs import BundleInputs, TranscriptEntry, iso_utc
from auditor.reports.manifest import (
    MANIFEST_ENVELOPE_PATH,
    MANIFEST_PATH,
    TranscriptIndexEntry,
    build_manifest,
    sign_manifest,
)
from auditor.reports.narrative import ContentItem, Narrative, render_html
from auditor.reports.stats import compute_stats
from auditor.reports.scope import ChainLink, Scope, chain_findings
from auditor.reports.summary import (
    SUMMARY_COLUMNS,
    readable_statement,
    replay_status,
    summary_row,
    write_csv,
)
from auditor.transcript import verify_transcript

TRANSCRIPTS_PATH = "transcripts.jsonl"
REPLAYS_PATH = "replays.jsonl"
SUMMARY_PATH = "summary.csv"
ACCESS_LOG_PATH = "access_log.csv"
JWKS_PATH = "jwks.json"
START_CHECKPOINT_PATH = "checkpoints/start.txt"
END_CHECKPOINT_PATH = "checkpoints/end.txt"
CONSISTENCY_PATH = "checkpoints/consistency.json"
HTML_PATH = "report.html"
PDF_PATH = "report.pdf"
ACCESS_LOG_COLUMNS: tuple[str, ...] = ("at", "key_id", "tenant", "action", "target")


def jsonl(objs: Sequence[Mapping[str, Any]]) -> bytes:
    """One RFC 8785 JSON object per ``\\n``-terminated line."""
    return b"".join(cn.canonical_json(dict(o)) + b"\n" for o in objs)


@dataclass(frozen=True)
class _Transcript:
    line: dict[str, Any]
    shown: dict[str, Any] | None
    """The payload as read without checking the signature (the summary's cells); None if unreadable."""
    link: ChainLink
    """Chain fields from the signature-checked statement (None fields when it does not verify)."""
    signature_ok: bool
    inclusion_ok: bool
    signer_kids: list[str]

    @property
    def in_report(self) -> bool:
        return self.line["scope"] == Scope.REPORT


def _transcript(entry: TranscriptEntry, include_content: bool, keys: Mapping[str, Any], end: Checkpoint) -> _Transcript:
    """One line; a damaged envelope (unreadable, altered, unsigned) is kept and reported, never fatal."""
    proof = entry.inclusion_proof
    if proof.tree_size != end.tree_size or proof.log_index != entry.log_index:
        raise ValueError(f"transcript {entry.transcript_id}: inclusion proof is for index {proof.log_index} in size "
                         f"{proof.tree_size}, expected {entry.log_index} in {end.tree_size}")
    shown = readable_statement(entry.envelope)
    verification = verify_transcript(entry.envelope, keys)
    signed = verification.statement
    transcript = (signed or shown or {}).get("predicate", {}).get("transcript", {})
    tid = entry.transcript_id or str(transcript.get("id"))
    digest = envelope_digest_or_empty(entry.envelope)
    line: dict[str, Any] = {
        "transcript_id": tid, "log_index": entry.log_index, "scope": entry.scope,
        "envelope_digest": digest, "envelope": dict(entry.envelope), "inclusion_proof": proof.to_json(),
    }
    if include_content and entry.content is not None and entry.scope == Scope.REPORT:
        line["content"] = entry.content.to_json()
    link = ChainLink(tid, entry.scope, transcript.get("sequence") if signed else None,
                     transcript.get("previous_digest") if signed else None, verification.payload_digest)
    return _Transcript(line, shown, link, verification.ok, _included(digest, proof, end), _kids(entry.envelope))


def envelope_digest_or_empty(envelope: Mapping[str, Any]) -> str:
    """The envelope's digest (its log entry), or ``""`` when a damaged envelope cannot be hashed."""
    try:
        return cn.envelope_digest(dict(envelope))
    except (TypeError, ValueError):
        return ""


def _included(digest: str, proof: Any, end: Checkpoint) -> bool:
    if not digest:
        return False
    try:
        verify_inclusion(leaf_hash(bytes.fromhex(digest)), proof.log_index, proof.tree_size, proof.hashes, end.root_hash)
    except ProofError:
        return False
    return True


def _kids(envelope: Mapping[str, Any]) -> list[str]:
    signatures = envelope.get("signatures")
    return [str(s.get("keyid")) for s in signatures if isinstance(s, Mapping)] if isinstance(signatures, list) else []


def _row(t: _Transcript, replays: Sequence[Mapping[str, Any]], chain_status: str) -> dict[str, str]:
    deterministic = bool(t.shown and t.shown["predicate"].get("sampling", {}).get("deterministic"))
    return summary_row(t.shown, t.line["log_index"], t.signature_ok, replay_status(deterministic, replays),
                       t.line["envelope_digest"], transcript_id=t.link.transcript_id, scope=t.line["scope"],
                       chain_status=chain_status)


def _attestation_kids(replays: Sequence[Mapping[str, Any]]) -> list[str]:
    return [str(sig.get("keyid")) for r in replays if isinstance(r.get("attestation"), Mapping)
            for sig in r["attestation"].get("signatures", [])]


def _zip(files: Mapping[str, bytes], when: dt.datetime) -> bytes:
    stamp = when.astimezone(dt.UTC).timetuple()[:6]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for path in [MANIFEST_PATH, MANIFEST_ENVELOPE_PATH, *sorted(p for p in files if p not in
                                                                     (MANIFEST_PATH, MANIFEST_ENVELOPE_PATH))]:
            info = zipfile.ZipInfo(path, date_time=stamp)
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            zf.writestr(info, files[path])
    return buf.getvalue()


def _checkpoints(inputs: BundleInputs, keys: Mapping[str, Any]) -> tuple[Checkpoint, Checkpoint]:
    start = verify_checkpoint(inputs.log.start_checkpoint, keys)
    end = verify_checkpoint(inputs.log.end_checkpoint, keys)
    c = inputs.log.consistency
    if (c.old_size, c.new_size) != (start.tree_size, end.tree_size):
        raise ValueError(f"consistency proof is {c.old_size} -> {c.new_size}, checkpoints are "
                         f"{start.tree_size} -> {end.tree_size}")
    verify_consistency(c.old_size, c.new_size, start.root_hash, end.root_hash, c.hashes)
    return start, end


def _renderers() -> tuple[Any, Any]:
    """(charts module, render_pdf): matplotlib and reportlab are the `reports` extra, imported only when a
    report is built, so verifying a bundle or serving needs neither."""
    try:
        from auditor.reports import charts
        from auditor.reports.pdf import render_pdf
    except ImportError as exc:
        raise RuntimeError(f"building a report needs matplotlib and reportlab: pip install 'verbatim[reports]' "
                           f"({exc})") from exc
    return charts, render_pdf


def build_bundle(inputs: BundleInputs, signer: Signer) -> bytes:
    """The ZIP bytes of a report bundle, its manifest signed by ``signer`` (``report`` role).

    Raises if the log evidence itself is inconsistent (bad checkpoint signature, consistency proof,
    or an inclusion proof for the wrong size): a report must not be built on a broken log view.
    A transcript whose signature or inclusion proof fails is kept and reported as such.
    """
    charts, render_pdf = _renderers()
    keys = as_verifier_keys(inputs.jwks)
    start, end = _checkpoints(inputs, keys)
    include = inputs.filters.include_content
    made = [_transcript(e, include, keys, end) for e in sorted(inputs.transcripts, key=lambda e: e.log_index)]
    replays = [r.to_json() for r in sorted(inputs.replays, key=lambda r: (iso_utc(r.created_at), r.replay_id))]
    by_transcript: dict[str, list[dict[str, Any]]] = {}
    for r in replays:
        by_transcript.setdefault(r["transcript_id"], []).append(r)
    chain = chain_findings([t.link for t in made])
    rows = [_row(t, by_transcript.get(t.link.transcript_id, []), chain[t.link.transcript_id][0]) for t in made]
    report = [t for t in made if t.in_report]
    access = [{"at": iso_utc(a.at), "key_id": a.key_id, "tenant": a.tenant, "action": a.action, "target": a.target}
              for a in sorted(inputs.access_log, key=lambda a: a.at)]
    filters = inputs.filters.to_json()
    created_at = iso_utc(inputs.created_at)
    reported_ids = {t.link.transcript_id for t in report}
    stats = compute_stats([t.shown for t in report if t.shown is not None],
                          [r for r in replays if r["transcript_id"] in reported_ids], inputs.jwks,
                          [*(k for t in made for k in t.signer_kids), *_attestation_kids(replays), signer.kid],
                          sum(t.signature_ok for t in report), sum(t.inclusion_ok for t in report),
                          transcripts=len(report))
    content = [ContentItem(t.line["transcript_id"], t.line["content"]["prompt_text"], t.line["content"]["output_text"])
               for t in made if "content" in t.line] if include else None
    narrative = Narrative(inputs.report_id, created_at, f"verbatim {inputs.generator_version}", filters, stats,
                          start, end, len(inputs.log.consistency.hashes), rows, charts.all_charts(stats), content)
    files: dict[str, bytes] = {
        TRANSCRIPTS_PATH: jsonl([t.line for t in made]),
        REPLAYS_PATH: jsonl(replays),
        SUMMARY_PATH: write_csv(SUMMARY_COLUMNS, rows),
        ACCESS_LOG_PATH: write_csv(ACCESS_LOG_COLUMNS, access),
        JWKS_PATH: json.dumps(dict(inputs.jwks), indent=2).encode("utf-8") + b"\n",
        START_CHECKPOINT_PATH: inputs.log.start_checkpoint.encode("utf-8"),
        END_CHECKPOINT_PATH: inputs.log.end_checkpoint.encode("utf-8"),
        CONSISTENCY_PATH: cn.canonical_json(inputs.log.consistency.to_json()) + b"\n",
        HTML_PATH: render_html(narrative),
        PDF_PATH: render_pdf(narrative),
    }
    index = [TranscriptIndexEntry(t.line["transcript_id"], t.line["log_index"], t.line["envelope_digest"],
                                  t.line["scope"]) for t in made]
    manifest = build_manifest(report_id=inputs.report_id, created_at=created_at,
                              generator_version=inputs.generator_version, filters=filters, start=start, end=end,
                              consistency_hashes=len(inputs.log.consistency.hashes), transcripts=index,
                              replays=len(replays), access_log=len(access), files=files)
    files[MANIFEST_PATH], files[MANIFEST_ENVELOPE_PATH] = sign_manifest(manifest, signer)
    return _zip(files, inputs.created_at)
