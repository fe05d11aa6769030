"""Independent re-implementations used to check the service's outputs (nothing from ``auditor``):
a naive RFC 6962 Merkle tree (the recursive definitions of §2.1), DSSE PAE, RFC 7638 thumbprints,
Ed25519 verification with the key taken from the JWKS, and a C2SP checkpoint parser."""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey


# --- RFC 6962 §2.1 ---------------------------------------------------------------------------------


def _h(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def leaf(entry: bytes) -> bytes:
    return _h(b"\x00" + entry)


def _k(n: int) -> int:
    """The largest power of two smaller than n."""
    k = 1
    while k * 2 < n:
        k *= 2
    return k


def mth(leaves: list[bytes]) -> bytes:
    """Merkle Tree Hash over leaf hashes."""
    n = len(leaves)
    if n == 0:
        return _h(b"")
    if n == 1:
        return leaves[0]
    k = _k(n)
    return _h(b"\x01" + mth(leaves[:k]) + mth(leaves[k:]))


def path(m: int, leaves: list[bytes]) -> list[bytes]:
    """PATH(m, D[n]): the audit path of leaf m."""
    n = len(leaves)
    if n <= 1:
        return []
    k = _k(n)
    if m < k:
        return path(m, leaves[:k]) + [mth(leaves[k:])]
    return path(m - k, leaves[k:]) + [mth(leaves[:k])]


def proof(m: int, leaves: list[bytes]) -> list[bytes]:
    """PROOF(m, D[n]): the consistency proof from size m."""
    return _subproof(m, leaves, True)


def _subproof(m: int, leaves: list[bytes], b: bool) -> list[bytes]:
    n = len(leaves)
    if m == n:
        return [] if b else [mth(leaves)]
    k = _k(n)
    if m <= k:
        return _subproof(m, leaves[:k], b) + [mth(leaves[k:])]
    return _subproof(m - k, leaves[k:], False) + [mth(leaves[:k])]


# --- DSSE / JWK / Ed25519 ----------------------------------------------------------------------------


def pae(payload_type: str, payload: bytes) -> bytes:
    t = payload_type.encode()
    return b"DSSEv1 " + str(len(t)).encode() + b" " + t + b" " + str(len(payload)).encode() + b" " + payload


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def thumbprint(jwk: dict[str, Any]) -> str:
    """RFC 7638 for an OKP key: required members in lexicographic order, no whitespace."""
    members = '{"crv":"%s","kty":"%s","x":"%s"}' % (jwk["crv"], jwk["kty"], jwk["x"])
    return base64.urlsafe_b64encode(hashlib.sha256(members.encode()).digest()).rstrip(b"=").decode()


def verify_dsse(envelope: dict[str, Any], jwks: dict[str, Any]) -> bytes:
    """Return the payload if a signature verifies with a JWKS key whose kid is its thumbprint."""
    payload = base64.b64decode(envelope["payload"], validate=True)
    message = pae(envelope["payloadType"], payload)
    keys = {k["kid"]: k for k in jwks["keys"]}
    for sig in envelope["signatures"]:
        jwk = keys[sig["keyid"]]
        assert thumbprint(jwk) == jwk["kid"], "kid is not the RFC 7638 thumbprint"
        public = Ed25519PublicKey.from_public_bytes(b64url_decode(jwk["x"]))
        public.verify(base64.b64decode(sig["sig"]), message)  # raises InvalidSignature
        return payload
    raise AssertionError("no signatures")


def envelope_digest(envelope: dict[str, Any]) -> bytes:
    """SHA-256 of the RFC 8785 form; the envelope holds only strings, so sorted compact JSON is JCS."""
    return _h(json.dumps(envelope, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode())


def parse_checkpoint(note: str) -> tuple[str, int, bytes]:
    body = note.split("\n\n", 1)[0]
    origin, size, root = body.split("\n")[:3]
    return origin, int(size), base64.b64decode(root)


# --- C2SP tlog-cosignature/v1 (Ed25519) ---------------------------------------------------------------


def cosignatures(note: str, vkey: str) -> list[int]:
    """Timestamps of the valid cosignatures on ``note`` by the cosigner ``vkey`` (name+hexid+b64(0x04‖key)),
    from the spec's wording alone; raises ``ValueError`` on a bad signature by that key."""
    name, hex_id, encoded = vkey.split("+", 2)
    blob = base64.b64decode(encoded)
    assert blob[0] == 4 and len(blob) == 33, "not a tlog-cosignature/v1 Ed25519 vkey"
    key_id = hashlib.sha256(name.encode() + b"\n" + b"\x04" + blob[1:]).digest()[:4]
    assert key_id.hex() == hex_id
    text, _, block = note.rpartition("\n\n")
    out = []
    for line in block.rstrip("\n").split("\n"):
        signer, _, sig64 = line.removeprefix("\u2014 ").rpartition(" ")
        sig = base64.b64decode(sig64)
        if signer != name or sig[:4] != key_id:
            continue
        timestamp = int.from_bytes(sig[4:12], "big")
        message = b"cosignature/v1\n" + f"time {timestamp}\n".encode() + (text + "\n").encode()
        try:
            Ed25519PublicKey.from_public_bytes(blob[1:]).verify(sig[12:], message)
        except Exception as exc:  # noqa: BLE001
            raise ValueError(f"cosignature by {name} does not verify") from exc
        out.append(timestamp)
    return out
