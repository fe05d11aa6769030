"""``summary.csv``: one row per ``transcripts.jsonl`` line, every cell derived from the bundle.

Because each cell is a function of (signed statement, log index, signature check, replay jobs, the
line's scope and its place in the chain), an offline verifier recomputes the rows and names any row
that differs. Vocabulary (docs/reports.md):

* ``signature_status``: ``valid`` / ``invalid`` (does not verify, or the payload cannot be read:
  then only ``transcript_id``, ``log_index``, ``envelope_digest`` and the last four cells are filled);
* ``replay_status``: the verdict of the latest finished replay (``match`` / ``mismatch`` /
  ``inconclusive_environment``), else the latest job's status (``queued`` / ``running`` /
  ``failed``), else ``not_replayed`` (deterministic) or ``not_replayable``;
* ``scope``: ``report`` / ``chain`` / ``replayed`` and ``chain_status``: ``first`` / ``linked`` /
  ``unchecked`` / ``broken`` (``auditor.reports.scope``).
"""

from __future__ import annotations

import base64
import csv
import io
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from auditor import canonical as cn

SUMMARY_COLUMNS: tuple[str, ...] = (
    "transcript_id", "log_index", "tenant", "sequence", "api", "received_at", "completed_at", "status",
    "model", "model_weights_digest", "model_dtype", "system_fingerprint", "deterministic", "seed",
    "parameters", "prompt_tokens", "completion_tokens", "finish_reason", "verify_passes", "rollbacks",
    "recomputed_tokens", "signature_status", "replay_status", "envelope_digest", "scope", "chain_status",
)


class SummaryError(ValueError):
    """An envelope payload cannot be read as a transcript statement."""


def unverified_statement(envelope: Mapping[str, Any]) -> dict[str, Any]:
    """Decode the envelope payload as JSON without checking the signature (for reporting only)."""
    try:
        obj = json.loads(base64.b64decode(envelope["payload"], validate=True))
    except (KeyError, TypeError, ValueError) as exc:
        raise SummaryError(f"envelope payload is not base64 JSON: {exc}") from exc
    if not isinstance(obj, dict) or not isinstance(obj.get("predicate"), dict):
        raise SummaryError("envelope payload has no predicate object")
    for part in ("transcript", "request", "model", "sampling", "tokens", "dvr", "runtime"):
        if not isinstance(obj["predicate"].get(part, {}), dict):
            raise SummaryError(f"predicate.{part} is not an object")
    return obj


def readable_statement(envelope: Mapping[str, Any]) -> dict[str, Any] | None:
    """``unverified_statement``, or None for a damaged envelope (reported, never fatal)."""
    try:
        return unverified_statement(envelope)
    except SummaryError:
        return None


def system_fingerprint(runtime: Mapping[str, Any]) -> str:
    """``fp_`` + the first 12 hex of SHA-256(JCS(runtime fingerprint)), as served to clients."""
    return "fp_" + cn.sha256_hex(cn.canonical_json(dict(runtime)))[:12]


def replay_status(deterministic: bool, replays: Sequence[Mapping[str, Any]]) -> str:
    """Status column for a transcript given its replay jobs (``replays.jsonl`` objects)."""
    done = [r for r in replays if r.get("verdict")]
    if done:
        return str(max(done, key=lambda r: (r.get("finished_at") or "", r["replay_id"]))["verdict"])
    if replays:
        return str(max(replays, key=lambda r: (r.get("created_at") or "", r["replay_id"]))["status"])
    return "not_replayed" if deterministic else "not_replayable"


def summary_row(statement: Mapping[str, Any] | None, log_index: int, signature_ok: bool, replay: str,
                envelope_digest: str, *, transcript_id: str, scope: str, chain_status: str) -> dict[str, str]:
    """The row for one line (all cells as strings, as they appear in the CSV). A payload that cannot
    be read (``statement`` None, or cells that cannot be derived) is ``invalid`` with only the cells
    known without it."""
    tail = {"signature_status": "valid" if signature_ok and statement is not None else "invalid",
            "replay_status": replay, "envelope_digest": envelope_digest, "scope": scope,
            "chain_status": chain_status}
    if statement is not None:
        try:
            return {k: "" if v is None else str(v) for k, v in {**_cells(statement, log_index), **tail}.items()}
        except (TypeError, ValueError, AttributeError):
            tail["signature_status"] = "invalid"
    row = {k: "" for k in SUMMARY_COLUMNS}
    row.update(transcript_id=transcript_id, log_index=str(log_index), **tail)
    return row


def _cells(statement: Mapping[str, Any], log_index: int) -> dict[str, Any]:
    p = statement["predicate"]
    t, req, model, sampling = p.get("transcript", {}), p.get("request", {}), p.get("model", {}), p.get("sampling", {})
    tokens, dvr = p.get("tokens", {}), p.get("dvr", {})
    return {
        "transcript_id": t.get("id"), "log_index": log_index, "tenant": t.get("tenant"),
        "sequence": t.get("sequence"), "api": req.get("api"), "received_at": req.get("received_at"),
        "completed_at": req.get("completed_at"), "status": req.get("status"), "model": model.get("name"),
        "model_weights_digest": model.get("weights_digest"), "model_dtype": model.get("dtype"),
        "system_fingerprint": system_fingerprint(p.get("runtime", {})),
        "deterministic": "true" if sampling.get("deterministic") else "false", "seed": sampling.get("seed"),
        "parameters": cn.canonical_json(sampling.get("params", {})).decode(),
        "prompt_tokens": tokens.get("prompt_count"), "completion_tokens": tokens.get("output_count"),
        "finish_reason": tokens.get("finish_reason"), "verify_passes": dvr.get("verify_passes"),
        "rollbacks": dvr.get("rollbacks"), "recomputed_tokens": dvr.get("recomputed_tokens"),
    }


def write_csv(columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> bytes:
    """CSV bytes with a header row; ``\\n`` line endings so line numbers are stable."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n", extrasaction="raise")
    writer.writeheader()
    for row in rows:
        writer.writerow(row)
    return buf.getvalue().encode("utf-8")


def read_csv(data: bytes) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """Header and ``(line number, row)`` pairs; line 1 is the header."""
    reader = csv.DictReader(io.StringIO(data.decode("utf-8"), newline=""))
    rows = [(reader.line_num, dict(row)) for row in reader]
    return list(reader.fieldnames or []), rows
