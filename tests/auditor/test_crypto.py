"""Keys, JWKS, DSSE: RFC test vectors and independent re-checks with raw ``cryptography`` calls."""

import base64
import json
import pickle
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from auditor import crypto as cr
from auditor.crypto import KeyRing, KeyRole, KeyStatus, Signer
from tests.auditor import independent

# RFC 8032 §7.1 TEST 1 key; RFC 8037 §A.3 gives its JWK thumbprint.
RFC8032_SK = bytes.fromhex("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60")
RFC8032_PK = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
RFC8032_SIG_EMPTY = bytes.fromhex(
    "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b")


def rfc_signer(role: KeyRole = KeyRole.TRANSCRIPT) -> Signer:
    return Signer(Ed25519PrivateKey.from_private_bytes(RFC8032_SK), role)


def test_rfc8037_thumbprint_and_rfc8032_signature() -> None:
    s = rfc_signer()
    assert s.public_raw == RFC8032_PK
    assert s.kid == "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"
    assert s.verifier().to_jwk()["x"] == "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
    assert s.sign(b"") == RFC8032_SIG_EMPTY


def test_pae_dsse_spec_example() -> None:
    assert cr.pae("http://example.com/HelloWorld", b"hello world") == \
        b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
    assert cr.pae("t", "é".encode()) == b"DSSEv1 1 t 2 \xc3\xa9"


@pytest.fixture
def ring(tmp_path: Path) -> KeyRing:
    return KeyRing.open(tmp_path / "keys")


def test_sign_envelope_verifies_independently(ring: KeyRing) -> None:
    env = cr.sign_envelope(b'{"a":1}', "application/vnd.in-toto+json", ring.signer(KeyRole.TRANSCRIPT))
    assert independent.verify_dsse(env, ring.jwks()) == b'{"a":1}'
    keys = cr.parse_jwks(ring.jwks())
    assert cr.verify_envelope(env, keys, role=KeyRole.TRANSCRIPT) == b'{"a":1}'
    assert cr.verify_envelope(env, ring.jwks(), role=KeyRole.TRANSCRIPT) == b'{"a":1}'


def _tampered(env: dict, **changes: object) -> dict:
    out = json.loads(json.dumps(env))
    out.update(changes)
    return out


def test_verify_envelope_detects_tampering(ring: KeyRing) -> None:
    signer = ring.signer(KeyRole.TRANSCRIPT)
    env = cr.sign_envelope(b"payload", "t", signer)
    keys = cr.parse_jwks(ring.jwks())
    bad_sig = bytearray(base64.b64decode(env["signatures"][0]["sig"]))
    bad_sig[5] ^= 1
    cases = [
        _tampered(env, payload=base64.b64encode(b"paylOad").decode()),
        _tampered(env, payloadType="u"),
        _tampered(env, signatures=[{"keyid": signer.kid, "sig": base64.b64encode(bytes(bad_sig)).decode()}]),
    ]
    for case in cases:
        with pytest.raises(cr.SignatureError, match="does not verify"):
            cr.verify_envelope(case, keys)
    with pytest.raises(cr.SignatureError, match="not in the JWKS"):
        cr.verify_envelope(_tampered(env, signatures=[{"keyid": "nope", "sig": env["signatures"][0]["sig"]}]), keys)
    with pytest.raises(cr.SignatureError, match="role 'transcript', expected 'replay'"):
        cr.verify_envelope(env, keys, role=KeyRole.REPLAY)
    with pytest.raises(cr.EnvelopeError, match="payloadType"):
        cr.verify_envelope(env, keys, payload_type="other")
    with pytest.raises(cr.EnvelopeError, match="no signatures"):
        cr.verify_envelope(_tampered(env, signatures=[]), keys)


def test_key_files_are_owner_only(ring: KeyRing) -> None:
    pems = sorted(ring.key_dir.glob("*.pem"))
    assert len(pems) == len(KeyRole)
    assert stat.S_IMODE(ring.key_dir.stat().st_mode) == 0o700
    for pem in pems:
        assert stat.S_IMODE(pem.stat().st_mode) == 0o600


def test_load_refuses_group_readable_key(ring: KeyRing) -> None:
    pem = next(ring.key_dir.glob("*.pem"))
    pem.chmod(0o644)
    with pytest.raises(cr.KeyFileError, match="mode 644"):
        KeyRing.open(ring.key_dir)


def test_private_key_never_exported(ring: KeyRing) -> None:
    signer = ring.signer(KeyRole.TRANSCRIPT)
    raw = signer._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                        serialization.NoEncryption())
    exports = [json.dumps(ring.jwks()), repr(ring), repr(signer), str(signer),
               (ring.key_dir / "manifest.json").read_text()]
    for text in exports:
        for form in (raw.hex(), base64.b64encode(raw).decode(), cr.b64url(raw), "PRIVATE KEY"):
            assert form not in text
    for obj in (signer, ring):
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(obj)


def test_jwks_shape(ring: KeyRing) -> None:
    keys = ring.jwks()["keys"]
    assert {k["role"] for k in keys} == {r.value for r in KeyRole}
    for k in keys:
        assert set(k) == {"kty", "crv", "x", "kid", "use", "alg", "role", "status"}
        assert (k["kty"], k["crv"], k["alg"], k["use"], k["status"]) == ("OKP", "Ed25519", "EdDSA", "sig", "active")
        assert k["kid"] == cr.jwk_thumbprint(cr.b64url_decode(k["x"]))


def test_rotation_keeps_old_keys_verifiable(ring: KeyRing) -> None:
    old = ring.signer(KeyRole.TRANSCRIPT)
    env = cr.sign_envelope(b"old", "t", old)
    new = ring.rotate(KeyRole.TRANSCRIPT)
    assert new.kid != old.kid and ring.signer(KeyRole.TRANSCRIPT).kid == new.kid
    reopened = KeyRing.open(ring.key_dir)
    assert reopened.signer(KeyRole.TRANSCRIPT).kid == new.kid
    keys = cr.parse_jwks(reopened.jwks())
    assert keys[old.kid].status is KeyStatus.RETIRED and keys[new.kid].status is KeyStatus.ACTIVE
    assert cr.verify_envelope(env, keys, role=KeyRole.TRANSCRIPT) == b"old"
    assert len(keys) == len(KeyRole) + 1


def test_reopen_keeps_the_same_keys(ring: KeyRing) -> None:
    again = KeyRing.open(ring.key_dir)
    assert again.jwks() == ring.jwks()


def test_parse_jwks_rejects_wrong_kid(ring: KeyRing) -> None:
    doc = ring.jwks()
    doc["keys"][0]["kid"] = "forged"
    with pytest.raises(cr.JwksError, match="not the RFC 7638 thumbprint"):
        cr.parse_jwks(doc)
    with pytest.raises(cr.JwksError, match="no 'keys' list"):
        cr.parse_jwks({})


def _open_and_list(key_dir: str) -> list[str]:
    return sorted(KeyRing.open(key_dir).verifier_keys())


def test_concurrent_first_open_creates_one_key_per_role(tmp_path: Path) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(2) as pool:
        results = pool.map(_open_and_list, [str(tmp_path / "k")] * 4)
    assert all(r == results[0] for r in results) and len(results[0]) == len(KeyRole)


def test_envelope_payload_type_must_be_string(ring: KeyRing) -> None:
    env = cr.sign_envelope(b"x", "t", ring.signer(KeyRole.TRANSCRIPT))
    with pytest.raises(cr.EnvelopeError, match="payloadType must be a string"):
        cr.verify_envelope(_tampered(env, payloadType=5), cr.parse_jwks(ring.jwks()))
