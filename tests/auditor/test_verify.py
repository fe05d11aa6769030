"""Offline verification of transcript files with only the JWKS."""

import base64
import json
from pathlib import Path
from typing import Any

import pytest

from auditor import attestation as at
from auditor import transcript as tr
from auditor.checkpoint import Checkpoint, sign_checkpoint
from auditor.crypto import KeyRing, KeyRole
from auditor.merkle import InclusionProof, MerkleTree
from auditor.verify import bundle_entry, content_fields, verify_document, verify_file
from tests.auditor.test_transcript import SALT, make_inputs

ORIGIN = "verbatim.test/log"


class Log:
    """A tiny in-memory log: transcripts appended, one checkpoint per document."""

    def __init__(self, ring: KeyRing) -> None:
        self.ring, self.tree = ring, MerkleTree()

    def add(self, leaf_data: bytes) -> int:
        return self.tree.append(leaf_data)

    def document(self, envelope: dict, index: int, content: dict | None = None) -> dict[str, Any]:
        proof = InclusionProof(index, self.tree.size, tuple(self.tree.inclusion_proof(index)))
        note = sign_checkpoint(Checkpoint(ORIGIN, self.tree.size, self.tree.root()),
                               self.ring.signer(KeyRole.CHECKPOINT))
        return json.loads(json.dumps(bundle_entry(envelope, proof, note, content)))


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    return KeyRing.open(tmp_path / "keys")


@pytest.fixture
def doc(ring: KeyRing) -> dict[str, Any]:
    log = Log(ring)
    x = make_inputs()
    for i in range(6):
        log.add(bytes([i]) * 32)
    signed = tr.sign_transcript(x, ring)
    index = log.add(signed.leaf_data)
    log.add(b"\xff" * 32)
    content = content_fields(x.prompt_ids, x.output_ids, SALT, x.windows, x.logprobs)
    return log.document(signed.envelope, index, content)


def _names(report: Any, ok: bool) -> list[str]:
    return [c.name for c in report.checks if c.ok is ok]


def test_valid_file(tmp_path: Path, ring: KeyRing, doc: dict) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc))
    public_only = json.loads(json.dumps(ring.jwks()))
    report = verify_file(path, public_only, origin=ORIGIN)
    assert report.ok, report.render()
    assert _names(report, True) == ["signature", "hash_chain_fields", "prompt_commitment", "output_commitment",
                                    "window_chain", "logprob_digest", "windows", "checkpoint_signature", "inclusion"]
    assert report.render().endswith(f"VALID transcript {path}")
    assert report.to_json()["ok"] is True


def test_without_content_still_verifies(ring: KeyRing, doc: dict) -> None:
    for key in ("prompt_token_ids", "token_ids", "salt", "windows", "token_logprobs"):
        del doc[key]
    report = verify_document(doc, ring.jwks())
    assert report.ok and _names(report, True) == ["signature", "hash_chain_fields", "checkpoint_signature", "inclusion"]


def test_altered_token_ids(ring: KeyRing, doc: dict) -> None:
    doc["token_ids"][3] += 1
    report = verify_document(doc, ring.jwks())
    assert not report.ok and _names(report, False) == ["output_commitment", "window_chain"]
    assert "do not match the signed commitment" in report.failures()[0].detail


def test_altered_windows(ring: KeyRing, doc: dict) -> None:
    doc["windows"] = [[1, 3], [3, 6]]
    assert _names(verify_document(doc, ring.jwks()), False) == ["windows"]


def test_tampered_envelope_fails_signature_and_inclusion(ring: KeyRing, doc: dict) -> None:
    payload = base64.b64decode(doc["envelope"]["payload"]).replace(b'"status":"completed"', b'"status":"error"')
    doc["envelope"]["payload"] = base64.b64encode(payload).decode()
    report = verify_document(doc, ring.jwks())
    assert {"signature", "inclusion"} <= set(_names(report, False))
    assert "does not verify" in report.failures()[0].detail


def test_wrong_inclusion_proof(ring: KeyRing, doc: dict) -> None:
    doc["inclusion_proof"]["log_index"] -= 1
    report = verify_document(doc, ring.jwks())
    assert _names(report, False) == ["inclusion"]
    assert "gives root" in report.failures()[0].detail
    doc["inclusion_proof"]["log_index"] += 1
    doc["inclusion_proof"]["tree_size"] -= 1
    assert "checkpoint has 8" in verify_document(doc, ring.jwks()).failures()[0].detail


def test_tampered_checkpoint(ring: KeyRing, doc: dict) -> None:
    doc["checkpoint"] = doc["checkpoint"].replace("\n8\n", "\n9\n")
    report = verify_document(doc, ring.jwks())
    assert _names(report, False) == ["checkpoint_signature", "inclusion"]


def test_unknown_keys(tmp_path: Path, doc: dict) -> None:
    other = KeyRing.open(tmp_path / "other")
    report = verify_document(doc, other.jwks())
    assert set(_names(report, False)) == {"signature", "checkpoint_signature", "inclusion"}
    assert "not in the JWKS" in report.failures()[0].detail


def test_replay_attestation_file(ring: KeyRing) -> None:
    log = Log(ring)
    signed = tr.sign_transcript(make_inputs(), ring)
    log.add(signed.leaf_data)
    att = at.sign_replay_attestation(at.ReplayAttestationInputs(
        str(tr.uuid7()), signed.transcript_id, signed.payload_digest, at.ReplayVerdict.MATCH,
        "2026-11-29T14:00:00Z", {"engine_version": "0.1.0"}, "fp_0123456789ab"), ring)
    index = log.add(att.leaf_data)
    report = verify_document(log.document(att.envelope, index), ring.jwks())
    assert report.ok and report.kind == "replay_attestation", report.render()


@pytest.mark.parametrize("text, match", [("not json", "cannot read JSON"), ("[]", "no 'envelope'")])
def test_malformed_files(tmp_path: Path, ring: KeyRing, text: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    report = verify_file(path, ring.jwks())
    assert not report.ok and match in report.checks[0].detail


def test_bad_salt_reported(ring: KeyRing, doc: dict) -> None:
    doc["salt"] = "zz"
    report = verify_document(doc, ring.jwks())
    assert _names(report, False) == ["content"] and "salt must be 64 hex chars" in report.failures()[0].detail
    assert _names(report, True) == ["signature", "hash_chain_fields", "windows", "checkpoint_signature", "inclusion"]
    doc["salt"], doc["token_logprobs"] = SALT.hex(), ["x"]
    assert "not a list of floats" in verify_document(doc, ring.jwks()).failures()[-1].detail
    doc["token_logprobs"] = [-0.5] * 6
    assert "differs from signed" in verify_document(doc, ring.jwks()).failures()[-1].detail
    doc["token_ids"] = ["1"]
    assert _names(verify_document(doc, ring.jwks()), False) == ["content"]
