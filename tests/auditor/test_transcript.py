"""Transcript statements and replay attestations: layout, canonical bytes, signatures, tampering."""

import base64
import dataclasses
import hashlib
import json
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from auditor import attestation as at
from auditor import canonical as cn
from auditor import transcript as tr
from auditor.crypto import KeyRing, KeyRole, sign_envelope

SALT = bytes(range(100, 132))
BIG_SEED = 2**64 - 5


def make_inputs(**overrides: Any) -> tr.TranscriptInputs:
    fields: dict[str, Any] = dict(
        transcript_id=str(tr.uuid7()), tenant="acme", sequence=1, previous_digest=None,
        api=tr.Api.CHAT_COMPLETIONS, received_at="2026-11-29T13:00:00.123Z", completed_at="2026-11-29T13:00:01Z",
        status=tr.Status.COMPLETED,
        model=tr.ModelInfo("SmolLM2-135M", "a" * 64, "b" * 64, "c" * 64, "float32"),
        runtime={"engine_version": "0.1.0", "device": "cpu", "threads": 2, "W": 8, "G": 4},
        sampling_params={"temperature": 0.7, "top_p": 0.9, "top_k": 0, "max_tokens": 6, "seed": BIG_SEED},
        seed=BIG_SEED, deterministic=True, prompt_ids=[128000, 9906, 1917], output_ids=[11, 12, 13, 14, 15, 16],
        salt=SALT, finish_reason="length", windows=[(1, 4), (4, 6)], window_shape=(4, 8),
        logprobs=[-0.5, -1.25, -0.01, -3.0, -0.2, -0.7], dvr=tr.DvrStats(2, 1, 3),
    )
    fields.update(overrides)
    return tr.TranscriptInputs(**fields)


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    return KeyRing.open(tmp_path / "keys")


def test_uuid7_layout() -> None:
    u = tr.uuid7(unix_ms=0x0123456789AB, rand=bytes(range(10)))
    assert u.version == 7 and u.variant == uuid.RFC_4122
    assert u.hex.startswith("0123456789ab7")
    ids = [tr.uuid7() for _ in range(50)]
    assert len(set(ids)) == 50


def test_statement_layout(ring: KeyRing) -> None:
    x = make_inputs()
    st = tr.build_statement(x)
    assert st["_type"] == "https://in-toto.io/Statement/v1"
    assert st["predicateType"] == "https://verbatim.dev/transcript/v1"
    p = st["predicate"]
    assert set(p) == {"transcript", "request", "model", "runtime", "sampling", "tokens", "windows", "dvr"}
    assert p["sampling"]["seed"] == str(BIG_SEED) and "seed" not in p["sampling"]["params"]
    assert p["tokens"]["output_commitment"] == hashlib.sha256(SALT + struct.pack("<6I", 11, 12, 13, 14, 15, 16)).hexdigest()
    assert st["subject"][1] == {"name": f"transcript:{x.transcript_id}/output",
                                "digest": {"sha256": p["tokens"]["output_commitment"]}}
    assert (p["tokens"]["prompt_count"], p["tokens"]["output_count"]) == (3, 6)
    assert p["windows"]["spans"] == [[1, 4], [4, 6]] and p["windows"]["shape"] == {"G": 4, "W": 8}
    assert p["dvr"] == {"verify_passes": 2, "rollbacks": 1, "recomputed_tokens": 3}


def test_no_token_ids_or_salt_in_the_payload(ring: KeyRing) -> None:
    signed = tr.sign_transcript(make_inputs(), ring)
    text = signed.payload.decode()
    assert SALT.hex() not in text and base64.b64encode(SALT).decode() not in text
    assert "128000" not in text and "9906" not in text


def test_payload_is_canonical_and_big_seed_is_a_string(ring: KeyRing) -> None:
    signed = tr.sign_transcript(make_inputs(), ring)
    assert signed.payload == cn.canonical_json(json.loads(signed.payload))
    assert f'"seed":"{BIG_SEED}"'.encode() in signed.payload
    assert signed.payload_digest == hashlib.sha256(signed.payload).hexdigest()
    assert signed.envelope_digest == hashlib.sha256(cn.canonical_json(signed.envelope)).hexdigest()
    assert signed.leaf_data == bytes.fromhex(signed.envelope_digest)


def test_signature_checked_independently(ring: KeyRing) -> None:
    signed = tr.sign_transcript(make_inputs(), ring)
    env = json.loads(json.dumps(signed.envelope))
    payload = base64.b64decode(env["payload"])
    assert payload == signed.payload
    ptype = b"application/vnd.in-toto+json"
    pae = b"DSSEv1 " + str(len(ptype)).encode() + b" " + ptype + b" " + str(len(payload)).encode() + b" " + payload
    jwk = next(k for k in ring.jwks()["keys"] if k["kid"] == env["signatures"][0]["keyid"])
    assert jwk["role"] == "transcript"
    pub = Ed25519PublicKey.from_public_bytes(base64.urlsafe_b64decode(jwk["x"] + "=="))
    pub.verify(base64.b64decode(env["signatures"][0]["sig"]), pae)


def test_verify_transcript_with_content(ring: KeyRing) -> None:
    x = make_inputs()
    signed = tr.sign_transcript(x, ring)
    result = tr.verify_transcript(signed.envelope, ring.jwks(), prompt_ids=x.prompt_ids,
                                  output_ids=x.output_ids, salt=SALT, logprobs=x.logprobs)
    assert result.ok, result.failures()
    assert [c.name for c in result.checks] == ["signature", "hash_chain_fields", "prompt_commitment",
                                                "output_commitment", "window_chain", "logprob_digest"]
    assert result.payload_digest == signed.payload_digest


def _reencode(envelope: dict, payload: bytes) -> dict:
    return {**envelope, "payload": base64.b64encode(payload).decode()}


def test_tampered_payload_detected(ring: KeyRing) -> None:
    signed = tr.sign_transcript(make_inputs(), ring)
    forged = signed.payload.replace(b'"tenant":"acme"', b'"tenant":"evil"')
    result = tr.verify_transcript(_reencode(signed.envelope, forged), ring.jwks())
    assert not result.ok and "does not verify" in result.checks[0].detail


def test_reserialized_payload_is_not_accepted(ring: KeyRing) -> None:
    """Pretty-printed payload bytes, even with the same content, are not what was signed."""
    signed = tr.sign_transcript(make_inputs(), ring)
    pretty = json.dumps(json.loads(signed.payload), indent=1).encode()
    assert not tr.verify_transcript(_reencode(signed.envelope, pretty), ring.jwks()).ok
    validly_signed = sign_envelope(pretty, tr.PAYLOAD_TYPE, ring.signer(KeyRole.TRANSCRIPT))
    result = tr.verify_transcript(validly_signed, ring.jwks())
    assert not result.ok and "not in RFC 8785 canonical form" in result.checks[0].detail


def test_altered_token_ids_break_commitments(ring: KeyRing) -> None:
    x = make_inputs()
    signed = tr.sign_transcript(x, ring)
    altered = list(x.output_ids)
    altered[4] += 1
    result = tr.verify_transcript(signed.envelope, ring.jwks(), prompt_ids=x.prompt_ids, output_ids=altered, salt=SALT)
    failed = {c.name: c.detail for c in result.failures()}
    assert set(failed) == {"output_commitment", "window_chain"}
    assert "do not match the signed commitment" in failed["output_commitment"]
    wrong_salt = tr.verify_transcript(signed.envelope, ring.jwks(), prompt_ids=x.prompt_ids, salt=bytes(32))
    assert [c.name for c in wrong_salt.failures()] == ["prompt_commitment"]
    short = tr.verify_transcript(signed.envelope, ring.jwks(), output_ids=x.output_ids[:-1], salt=SALT)
    assert "5 output token ids supplied, signed count is 6" in short.failures()[0].detail


def test_wrong_role_key_rejected(ring: KeyRing) -> None:
    statement = tr.build_statement(make_inputs())
    _, envelope = tr.sign_statement(statement, ring, KeyRole.REPORT)
    result = tr.verify_transcript(envelope, ring.jwks())
    assert not result.ok and "expected 'transcript'" in result.checks[0].detail


def test_hash_chain_fields(ring: KeyRing) -> None:
    prev = tr.sign_transcript(make_inputs(), ring)
    nxt = tr.sign_transcript(make_inputs(sequence=2, previous_digest=prev.payload_digest), ring)
    result = tr.verify_transcript(nxt.envelope, ring.jwks())
    assert result.ok and prev.payload_digest in result.checks[1].detail


@pytest.mark.parametrize("overrides, match", [
    ({"sequence": 2}, "previous_digest must be None exactly when sequence == 1"),
    ({"previous_digest": "ab" * 32}, "previous_digest must be None exactly"),
    ({"sequence": 0}, "sequence must be an int >= 1"),
    ({"sequence": 2, "previous_digest": "XY" * 32}, "64 lower-case hex"),
    ({"transcript_id": str(uuid.uuid4())}, "not a canonical UUIDv7"),
    ({"received_at": "2026-11-29T13:00:00+01:00"}, "received_at must be RFC 3339 UTC"),
    ({"salt": bytes(16)}, "salt must be 32 bytes"),
    ({"seed": 2**64}, "seed must be an int"),
    ({"windows": [(1, 7)]}, r"window 0 = \(1, 7\)"),
    ({"logprobs": [0.0]}, "1 logprobs for 6 output tokens"),
    ({"sampling_params": {"seed": 3}}, "differs from seed"),
    ({"api": "embeddings"}, "embeddings"),
])
def test_inputs_validated(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_inputs(**overrides)


def test_salt_not_in_repr() -> None:
    assert SALT.hex() not in repr(make_inputs()) and repr(SALT) not in repr(make_inputs())


def _attestation(signed: tr.SignedTranscript, **overrides: Any) -> at.ReplayAttestationInputs:
    fields: dict[str, Any] = dict(
        replay_id=str(tr.uuid7()), transcript_id=signed.transcript_id,
        transcript_payload_digest=signed.payload_digest, result=at.ReplayVerdict.MATCH,
        replayed_at="2026-11-29T14:00:00Z", engine_fingerprint={"engine_version": "0.1.0"},
        system_fingerprint="fp_0123456789ab")
    fields.update(overrides)
    return at.ReplayAttestationInputs(**fields)


def test_replay_attestation_roundtrip(ring: KeyRing) -> None:
    signed = tr.sign_transcript(make_inputs(), ring)
    att = at.sign_replay_attestation(_attestation(signed), ring)
    st = at.verify_replay_attestation(att.envelope, ring.jwks(), signed.payload_digest)
    assert st["predicateType"] == "https://verbatim.dev/replay/v1"
    assert st["subject"][0]["digest"]["sha256"] == signed.payload_digest
    assert st["predicate"]["result"] == "match"
    kid = att.envelope["signatures"][0]["keyid"]
    assert kid == ring.signer(KeyRole.REPLAY).kid
    with pytest.raises(ValueError, match="not " + "0" * 64):
        at.verify_replay_attestation(att.envelope, ring.jwks(), "0" * 64)


def test_replay_attestation_requires_details(ring: KeyRing) -> None:
    signed = tr.sign_transcript(make_inputs(), ring)
    with pytest.raises(ValueError, match="needs details"):
        _attestation(signed, result=at.ReplayVerdict.MISMATCH, details={"position": 3})
    details = {"window_index": 1, "position": 4, "expected_token": 15, "replayed_token": 99}
    att = at.sign_replay_attestation(_attestation(signed, result=at.ReplayVerdict.MISMATCH, details=details), ring)
    assert at.verify_replay_attestation(att.envelope, ring.jwks())["predicate"]["details"] == details


def test_transcript_envelope_is_not_a_replay_attestation(ring: KeyRing) -> None:
    signed = tr.sign_transcript(make_inputs(), ring)
    with pytest.raises(Exception, match="role 'transcript', expected 'replay'"):
        at.verify_replay_attestation(signed.envelope, ring.jwks())


def test_frozen_inputs() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        make_inputs().seed = 1  # type: ignore[misc]


def test_signed_but_malformed_statement_reported(ring: KeyRing) -> None:
    bad = {"_type": tr.STATEMENT_TYPE, "predicateType": tr.TRANSCRIPT_PREDICATE, "subject": [], "predicate": {}}
    _, envelope = tr.sign_statement(bad, ring, KeyRole.TRANSCRIPT)
    result = tr.verify_transcript(envelope, ring.jwks(), output_ids=[1], salt=SALT)
    assert not result.ok and "lacks a predicate object or a subject" in result.checks[0].detail


def test_choice_and_extras_are_signed_only_when_present(ring: KeyRing) -> None:
    plain = tr.build_predicate(make_inputs())["request"]
    assert set(plain) == {"api", "received_at", "completed_at", "status"}
    x = make_inputs(choice=tr.Choice(1, 2, BIG_SEED), request_extras={"metadata": {"ticket": "T-1"}, "user": "u"})
    request = tr.build_predicate(x)["request"]
    assert request["choice"] == {"index": 1, "count": 2, "request_seed": str(BIG_SEED)}
    assert request["extras"] == {"metadata": {"ticket": "T-1"}, "user": "u"}
    signed = tr.sign_transcript(x, ring)
    assert tr.verify_transcript(signed.envelope, ring.jwks()).ok
    with pytest.raises(ValueError, match="choice index"):
        make_inputs(choice=tr.Choice(2, 2, 1))
