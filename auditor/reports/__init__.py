"""Compliance report bundles (DESIGN §6): build a signed ZIP from plain inputs, verify one offline.

Bundle layout (every path below is listed with its SHA-256 in ``manifest.json``)::

    manifest.json              RFC 8785 JSON: report id, tenant, filters, generator version, period,
                               log checkpoints (start/end size + root), counts, transcript index
                               (id, log index, envelope digest) and every other file's SHA-256 + size
    manifest.dsse.json         DSSE envelope (payloadType MANIFEST_PAYLOAD_TYPE) whose payload is
                               exactly the bytes of manifest.json, signed with the ``report`` role key
    transcripts.jsonl          one transcript per line: {transcript_id, log_index, scope, envelope,
                               envelope_digest, inclusion_proof (at the end checkpoint's size)[, content]};
                               scope report / chain / replayed (``auditor.reports.scope``)
    checkpoints/start.txt      C2SP signed note: the log at the period's start
    checkpoints/end.txt        C2SP signed note: the log when the report was made
    checkpoints/consistency.json   consistency proof start -> end
    summary.csv                one row per transcripts.jsonl line (SUMMARY_COLUMNS), derived from the bundle
    replays.jsonl              replay jobs of the report's transcripts and those attested in the period,
                               with signed attestations when finished
    access_log.csv             who read, replayed, exported or listed what, and when
    jwks.json                  the public keys (every role, active and retired)
    report.html, report.pdf    the readable narrative with charts (content only when requested)

``manifest.json`` cannot list its own hash nor that of ``manifest.dsse.json``; those two are bound by
the signature instead. Content (token ids, salt, text) appears only when the filters ask for it, and
only on ``report`` lines. docs/reports.md describes the scope and the summary vocabulary.
"""

from auditor.reports.bundle import build_bundle
from auditor.reports.inputs import (
    AccessEntry,
    BundleInputs,
    LogEvidence,
    ReplayEntry,
    ReportFilters,
    TranscriptContent,
    TranscriptEntry,
)
from auditor.reports.verify_bundle import BundleVerification, Finding, verify_bundle

__all__ = [
    "AccessEntry", "BundleInputs", "BundleVerification", "Finding", "LogEvidence", "ReplayEntry",
    "ReportFilters", "TranscriptContent", "TranscriptEntry", "build_bundle", "verify_bundle",
]
