"""The bundle manifest: what is in the ZIP, and the DSSE signature that binds it to the report key.

``manifest.json`` holds exactly the DSSE payload bytes (RFC 8785 JSON), so a reader can hash or diff
it directly; ``manifest.dsse.json`` is the envelope. Fields::

    type              MANIFEST_TYPE
    report_id, created_at, generator {name, version}, tenant, filters, content_included
    log               {start: {origin, tree_size, root_hash}, end: {…}, consistency_hashes}
    counts            {transcripts (scope ``report``), context_transcripts (scopes ``chain``, ``replayed``),
                       replays, access_log}
    transcripts       [{id, log_index, envelope_digest, scope}, …] in transcripts.jsonl order
    files             [{path, sha256, size}, …] sorted by path (every file but the two manifest files)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from auditor import canonical as cn
from auditor.checkpoint import Checkpoint
from auditor.crypto import KeyRole, Signer, VerifierKey, sign_envelope, verify_envelope

MANIFEST_TYPE = "https://verbatim.dev/report-manifest/v1"
MANIFEST_PAYLOAD_TYPE = "application/vnd.verbatim.report-manifest+json"
MANIFEST_PATH = "manifest.json"
MANIFEST_ENVELOPE_PATH = "manifest.dsse.json"
GENERATOR_NAME = "verbatim"


@dataclass(frozen=True)
class TranscriptIndexEntry:
    transcript_id: str
    log_index: int
    envelope_digest: str
    scope: str = "report"

    def to_json(self) -> dict[str, Any]:
        return {"id": self.transcript_id, "log_index": self.log_index, "envelope_digest": self.envelope_digest,
                "scope": self.scope}


def file_entry(path: str, data: bytes) -> dict[str, Any]:
    return {"path": path, "sha256": cn.sha256_hex(data), "size": len(data)}


def checkpoint_json(cp: Checkpoint) -> dict[str, Any]:
    return {"origin": cp.origin, "tree_size": cp.tree_size, "root_hash": cp.root_hash.hex()}


def build_manifest(*, report_id: str, created_at: str, generator_version: str, filters: Mapping[str, Any],
                   start: Checkpoint, end: Checkpoint, consistency_hashes: int,
                   transcripts: Sequence[TranscriptIndexEntry], replays: int, access_log: int,
                   files: Mapping[str, bytes]) -> dict[str, Any]:
    """The manifest object (layout in the module docstring)."""
    return {
        "type": MANIFEST_TYPE,
        "report_id": report_id,
        "created_at": created_at,
        "generator": {"name": GENERATOR_NAME, "version": generator_version},
        "tenant": filters["tenant"],
        "filters": dict(filters),
        "content_included": bool(filters.get("include_content")),
        "log": {"start": checkpoint_json(start), "end": checkpoint_json(end),
                "consistency_hashes": consistency_hashes},
        "counts": {"transcripts": sum(t.scope == "report" for t in transcripts),
                   "context_transcripts": sum(t.scope != "report" for t in transcripts),
                   "replays": replays, "access_log": access_log},
        "transcripts": [t.to_json() for t in transcripts],
        "files": [file_entry(p, files[p]) for p in sorted(files)],
    }


def sign_manifest(manifest: Mapping[str, Any], signer: Signer) -> tuple[bytes, bytes]:
    """``(manifest.json bytes, manifest.dsse.json bytes)``; ``signer`` must hold the report role."""
    if signer.role is not KeyRole.REPORT:
        raise ValueError(f"manifest signer has role {signer.role.value!r}, expected 'report'")
    payload = cn.canonical_json(dict(manifest))
    envelope = sign_envelope(payload, MANIFEST_PAYLOAD_TYPE, signer)
    return payload, json.dumps(envelope, indent=2).encode("utf-8") + b"\n"


def open_manifest(manifest_bytes: bytes, envelope_bytes: bytes, keys: Mapping[str, VerifierKey]) -> dict[str, Any]:
    """Verify the envelope with a ``report`` key and that its payload is exactly ``manifest_bytes``.

    Raises ``ValueError`` / ``CryptoError`` with the reason.
    """
    envelope = json.loads(envelope_bytes)
    payload = verify_envelope(envelope, keys, payload_type=MANIFEST_PAYLOAD_TYPE, role=KeyRole.REPORT)
    if payload != manifest_bytes:
        raise ValueError(f"{MANIFEST_PATH} ({cn.sha256_hex(manifest_bytes)}) is not the signed payload "
                         f"({cn.sha256_hex(payload)})")
    manifest = json.loads(payload)
    if not isinstance(manifest, dict) or manifest.get("type") != MANIFEST_TYPE:
        raise ValueError(f"signed manifest type is {manifest.get('type') if isinstance(manifest, dict) else None!r}, "
                         f"expected {MANIFEST_TYPE!r}")
    return manifest
