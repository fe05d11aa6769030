"""Offline verification of a transcript (or replay attestation) file with only the public JWKS.

File format (JSON object)::

    envelope          the DSSE envelope, exactly as served
    inclusion_proof   {"log_index", "tree_size", "hashes": [base64…]}   (merkle.InclusionProof)
    checkpoint        the signed checkpoint note text (checkpoint.sign_checkpoint)
    optional content: prompt_token_ids [int], token_ids [int], salt (64 hex chars),
                      windows [[start, end], …], token_logprobs [float]

Checks, in order: ``signature``, ``hash_chain_fields`` (transcripts), ``checkpoint_signature``,
``inclusion`` (leaf = the envelope digest, against the checkpoint's root; the proof's tree size must
equal the checkpoint's), ``cosignatures`` when witness keys are given (at least ``quorum`` of them
cosigned the checkpoint, C2SP tlog-cosignature), then with content: ``prompt_commitment``,
``output_commitment``, ``window_chain``, ``windows`` (spans equal the signed spans), ``logprob_digest``.
Without content the envelope still verifies: integrity without disclosure.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from auditor import canonical as cn
from auditor.attestation import REPLAY_PREDICATE, verify_replay_attestation
from auditor.checkpoint import Checkpoint, CheckpointError, verify_checkpoint
from auditor.cosignature import CosignatureError, CosignerKey, check_quorum
from auditor.merkle import InclusionProof, ProofError, leaf_hash, verify_inclusion
from auditor.transcript import Check, verify_transcript


@dataclass(frozen=True)
class VerifyReport:
    source: str
    kind: str
    checks: list[Check]

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "kind": self.kind, "ok": self.ok,
                "checks": [{"name": c.name, "ok": c.ok, "detail": c.detail} for c in self.checks]}

    def render(self) -> str:
        """Human-readable lines: one per check, then the verdict."""
        lines = [f"{'PASS' if c.ok else 'FAIL'}  {c.name}: {c.detail}" for c in self.checks]
        return "\n".join([*lines, f"{'VALID' if self.ok else 'INVALID'} {self.kind} {self.source}"])


def verify_file(path: Path | str, jwks: Mapping[str, Any], *, origin: str | None = None,
                witnesses: Sequence[CosignerKey] = (), quorum: int | None = None) -> VerifyReport:
    """Verify the JSON file at ``path`` (format in the module docstring)."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        return VerifyReport(str(path), "unknown", [Check("file", False, f"cannot read JSON: {exc}")])
    return verify_document(doc, jwks, source=str(path), origin=origin, witnesses=witnesses, quorum=quorum)


def verify_document(doc: Any, jwks: Mapping[str, Any], *, source: str = "<document>",
                    origin: str | None = None, witnesses: Sequence[CosignerKey] = (),
                    quorum: int | None = None) -> VerifyReport:
    """Verify an already parsed file document; with ``witnesses``, the checkpoint must carry valid
    cosignatures from ``quorum`` of them (default: all)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("envelope"), dict):
        return VerifyReport(source, "unknown", [Check("file", False, "no 'envelope' object in the document")])
    envelope = doc["envelope"]
    kind = _peek_kind(envelope)
    checks = _envelope_checks(kind, envelope, doc, jwks)
    checks += _log_checks(envelope, doc, jwks, origin)
    if witnesses:
        checks.append(cosignature_check(doc.get("checkpoint"), witnesses, quorum or len(witnesses)))
    return VerifyReport(source, kind, checks)


def cosignature_check(note: Any, witnesses: Sequence[CosignerKey], quorum: int) -> Check:
    """``cosignatures``: at least ``quorum`` of ``witnesses`` cosigned the checkpoint ``note``."""
    if not isinstance(note, str):
        return Check("cosignatures", False, "no checkpoint note to check cosignatures on")
    try:
        valid = check_quorum(note, witnesses, quorum)
    except CosignatureError as exc:
        return Check("cosignatures", False, str(exc))
    names = ", ".join(f"{c.name} at {c.timestamp}" for c in valid)
    return Check("cosignatures", True, f"{len(valid)} of {len(witnesses)} witnesses cosigned (need {quorum}): {names}")


def _peek_kind(envelope: Mapping[str, Any]) -> str:
    """Unverified look at the predicate type, only to choose which verification to run."""
    try:
        statement = json.loads(base64.b64decode(envelope["payload"], validate=True))
        return "replay_attestation" if statement.get("predicateType") == REPLAY_PREDICATE else "transcript"
    except (KeyError, ValueError, TypeError, AttributeError):
        return "transcript"


def _envelope_checks(kind: str, envelope: dict[str, Any], doc: dict[str, Any], jwks: Mapping[str, Any]) -> list[Check]:
    if kind == "replay_attestation":
        try:
            st = verify_replay_attestation(envelope, jwks)
        except Exception as exc:  # noqa: BLE001 - reported as a failed check
            return [Check("signature", False, f"{type(exc).__name__}: {exc}")]
        return [Check("signature", True, f"replay attestation, result {st['predicate']['result']!r}")]
    content = _content(doc)
    bad_content = [content] if isinstance(content, Check) else []
    result = verify_transcript(envelope, jwks, **({} if bad_content else content))
    checks = list(result.checks) + bad_content
    if result.statement is not None and doc.get("windows") is not None:
        checks.append(_windows_check(doc["windows"], result.statement))
    return checks


def _content(doc: Mapping[str, Any]) -> dict[str, Any] | Check:
    try:
        salt = bytes.fromhex(doc["salt"]) if doc.get("salt") is not None else None
        prompt_ids, output_ids = _ids(doc.get("prompt_token_ids")), _ids(doc.get("token_ids"))
    except (TypeError, ValueError) as exc:
        return Check("content", False, f"salt must be 64 hex chars and token ids int lists: {exc}")
    return {"prompt_ids": prompt_ids, "output_ids": output_ids, "salt": salt, "logprobs": doc.get("token_logprobs")}


def _ids(value: Any) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise ValueError(f"token ids must be a list of ints, got {value!r:.80}")
    return value


def _windows_check(windows: Any, statement: Mapping[str, Any]) -> Check:
    signed = statement["predicate"]["windows"]["spans"]
    given = [list(w) for w in windows] if isinstance(windows, list) else windows
    if given != signed:
        return Check("windows", False, f"file windows {given!r:.200} differ from signed spans {signed!r:.200}")
    return Check("windows", True, f"{len(signed)} windows equal the signed spans")


def _log_checks(envelope: Mapping[str, Any], doc: Mapping[str, Any], jwks: Mapping[str, Any],
                origin: str | None) -> list[Check]:
    try:
        checkpoint = verify_checkpoint(_require_str(doc, "checkpoint"), jwks, origin=origin)
    except (CheckpointError, ValueError) as exc:
        return [Check("checkpoint_signature", False, str(exc)),
                Check("inclusion", False, "not checked: no valid checkpoint")]
    cp_check = Check("checkpoint_signature", True,
                     f"origin {checkpoint.origin!r} size {checkpoint.tree_size} root {checkpoint.root_hash.hex()}")
    return [cp_check, _inclusion_check(envelope, doc.get("inclusion_proof"), checkpoint)]


def _require_str(doc: Mapping[str, Any], key: str) -> str:
    value = doc.get(key)
    if not isinstance(value, str):
        raise ValueError(f"'{key}' must be the signed note text, got {type(value).__name__}")
    return value


def _inclusion_check(envelope: Mapping[str, Any], raw_proof: Any, checkpoint: Checkpoint) -> Check:
    try:
        proof = InclusionProof.from_json(raw_proof)
        if proof.tree_size != checkpoint.tree_size:
            raise ProofError(f"proof is for tree size {proof.tree_size}, checkpoint has {checkpoint.tree_size}")
        leaf = leaf_hash(bytes.fromhex(cn.envelope_digest(dict(envelope))))
        verify_inclusion(leaf, proof.log_index, proof.tree_size, list(proof.hashes), checkpoint.root_hash)
    except (ProofError, ValueError, TypeError) as exc:
        return Check("inclusion", False, str(exc))
    return Check("inclusion", True, f"leaf {proof.log_index} of {proof.tree_size} under the checkpoint root")


def bundle_entry(envelope: Mapping[str, Any], proof: InclusionProof, checkpoint_note: str,
                 content: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Assemble a verifiable document in this module's file format (content keys as documented)."""
    doc: dict[str, Any] = {"envelope": dict(envelope), "inclusion_proof": proof.to_json(),
                           "checkpoint": checkpoint_note}
    doc.update(content or {})
    return doc


def content_fields(prompt_ids: Sequence[int], output_ids: Sequence[int], salt: bytes,
                   windows: Sequence[tuple[int, int]], logprobs: Sequence[float] | None = None) -> dict[str, Any]:
    """The optional content keys of the file format, encoded as ``verify_file`` expects."""
    out: dict[str, Any] = {"prompt_token_ids": list(prompt_ids), "token_ids": list(output_ids),
                           "salt": salt.hex(), "windows": [[s, e] for s, e in windows]}
    if logprobs is not None:
        out["token_logprobs"] = list(logprobs)
    return out
