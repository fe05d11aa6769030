"""C2SP checkpoints and signed notes: the Go sumdb/note test vector and hand-built signatures."""

import base64
import hashlib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from auditor import checkpoint as ck
from auditor.crypto import KeyRing, KeyRole, KeyStatus, Signer, VerifierKey, jwk_thumbprint

# golang.org/x/mod/sumdb/note note_test.go
PETER_VKEY = "PeterNeumann+c74f20a3+ARpc2QcUPDhMQegwxbzhKqiBfsVkmqq/LDE4izWy10TW"
PETER_TEXT = "If you think cryptography is the answer to your problem,\nthen you don't know what your problem is.\n"
PETER_SIG = "\u2014 PeterNeumann x08go/ZJkuBS9UG/SffcvIAQxVBtiFupLLr8pAcElZInNIuGUgYN1FFYC2pZSNXgKvqfqdngotpRZb6KE6RyyBwJnAM=\n"
ORIGIN = "verbatim.test/log"


def test_go_note_vector() -> None:
    name, khash, key = PETER_VKEY.split("+")
    raw = base64.b64decode(key)
    assert raw[0] == 1
    assert ck.note_key_hash(name, raw[1:]).hex() == khash
    assert ck.verifier_key_string(name, raw[1:]) == PETER_VKEY
    text, sigs = ck.split_note(PETER_TEXT + "\n" + PETER_SIG)
    assert text == PETER_TEXT and sigs[0].key_name == name
    Ed25519PublicKey.from_public_bytes(raw[1:]).verify(sigs[0].signature, text.encode())


def test_c2sp_body_example_parses() -> None:
    body = "example.com/behind-the-sofa\n20852163\nCsUYapGGPo4dkMgIAUqom/Xajj7h2fB2MPA3j2jxq2I=\n"
    cp = ck.Checkpoint.parse(body)
    assert (cp.origin, cp.tree_size, cp.extensions) == ("example.com/behind-the-sofa", 20852163, ())
    assert cp.body() == body


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    return KeyRing.open(tmp_path / "keys")


def _note(ring: KeyRing, size: int = 5) -> str:
    cp = ck.Checkpoint(ORIGIN, size, hashlib.sha256(b"root").digest())
    return ck.sign_checkpoint(cp, ring.signer(KeyRole.CHECKPOINT))


def test_signed_note_checked_by_hand(ring: KeyRing) -> None:
    note = _note(ring)
    body, sig_line = note.split("\n\n")
    assert body.split("\n") == [ORIGIN, "5", base64.b64encode(hashlib.sha256(b"root").digest()).decode()]
    assert sig_line.startswith(f"\u2014 {ORIGIN} ") and sig_line.endswith("\n")
    blob = base64.b64decode(sig_line.split(" ")[-1])
    jwk = next(k for k in ring.jwks()["keys"] if k["role"] == "checkpoint")
    pub = base64.urlsafe_b64decode(jwk["x"] + "==")
    assert blob[:4] == hashlib.sha256(ORIGIN.encode() + b"\n\x01" + pub).digest()[:4]
    Ed25519PublicKey.from_public_bytes(pub).verify(blob[4:], (body + "\n").encode())


def test_verify_roundtrip(ring: KeyRing) -> None:
    cp = ck.verify_checkpoint(_note(ring, 42), ring.jwks(), origin=ORIGIN)
    assert cp.tree_size == 42 and cp.root_hash == hashlib.sha256(b"root").digest()


def test_tampered_notes_rejected(ring: KeyRing) -> None:
    note = _note(ring, 5)
    root_b64 = base64.b64encode(hashlib.sha256(b"root").digest()).decode()
    other_root = base64.b64encode(hashlib.sha256(b"other").digest()).decode()
    for bad in (note.replace("\n5\n", "\n6\n"), note.replace(root_b64, other_root),
                note.replace(ORIGIN, "evil.test/log", 1)):
        with pytest.raises(ck.CheckpointError):
            ck.verify_checkpoint(bad, ring.jwks())
    with pytest.raises(ck.CheckpointError, match="does not verify"):
        ck.verify_checkpoint(note.replace("\n5\n", "\n6\n"), ring.jwks())
    with pytest.raises(ck.CheckpointError, match="origin"):
        ck.verify_checkpoint(note, ring.jwks(), origin="other")


def test_unknown_and_wrong_role_keys_do_not_count(ring: KeyRing) -> None:
    stranger = Signer.generate(KeyRole.CHECKPOINT)
    cp = ck.Checkpoint(ORIGIN, 1, bytes(32))
    with pytest.raises(ck.CheckpointError, match="no signature by a known checkpoint key"):
        ck.verify_checkpoint(ck.sign_checkpoint(cp, stranger), ring.jwks())
    transcript_key = ring.signer(KeyRole.TRANSCRIPT)
    forged = cp.body() + "\n" + ck.signature_line(cp.body(), transcript_key, ORIGIN)
    with pytest.raises(ck.CheckpointError, match="no signature by a known checkpoint key"):
        ck.verify_checkpoint(forged, ring.jwks())
    with pytest.raises(ck.CheckpointError, match="role 'transcript'"):
        ck.sign_checkpoint(cp, transcript_key)


def test_extra_unknown_signature_is_ignored(ring: KeyRing) -> None:
    cp = ck.Checkpoint(ORIGIN, 3, bytes(32), ("ext line",))
    note = ck.sign_checkpoint(cp, ring.signer(KeyRole.CHECKPOINT))
    witness = Signer.generate(KeyRole.CHECKPOINT)
    cosigned = note + ck.signature_line(cp.body(), witness, "witness.test")
    assert ck.verify_checkpoint(cosigned, ring.jwks()) == cp
    keys = {witness.kid: VerifierKey(jwk_thumbprint(witness.public_raw), KeyRole.CHECKPOINT,
                                     KeyStatus.ACTIVE, witness.public_raw)}
    assert ck.verify_checkpoint(cosigned, keys) == cp


@pytest.mark.parametrize("text, match", [
    ("o\n5\n", "origin, size and root"),
    ("o\n05\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n", "canonical decimal"),
    ("o\n5\nAAAA\n", "3 bytes, expected 32"),
    ("o\n5\nAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "end with a newline"),
])
def test_malformed_bodies(text: str, match: str) -> None:
    with pytest.raises(ck.CheckpointError, match=match):
        ck.Checkpoint.parse(text)


def test_checkpoint_fields_validated() -> None:
    with pytest.raises(ck.CheckpointError, match="tree size must be"):
        ck.Checkpoint(ORIGIN, -1, bytes(32))
    with pytest.raises(ck.CheckpointError, match="root hash must be 32 bytes"):
        ck.Checkpoint(ORIGIN, 1, bytes(31))
    with pytest.raises(ck.CheckpointError, match="single line"):
        ck.Checkpoint("two\nlines", 1, bytes(32)).body()
