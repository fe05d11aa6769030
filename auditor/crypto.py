"""Ed25519 keys, key roles, RFC 7638 key ids, JWKS, and DSSE envelopes (DESIGN §4).

Key files live in one directory managed by ``KeyRing``::

    <key_dir>/               0700
      manifest.json          public facts only: kid, role, status, x, created_at, retired_at
      <kid>.pem              PKCS#8 private key, 0600, one per key ever created

Rotation marks the role's active key ``retired`` and creates a new active one; retired public keys
stay in the JWKS forever so old signatures keep verifying. Private key material never appears in
any ``repr``, JWKS, manifest or exception text, and ``Signer`` objects refuse to be pickled.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import json
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from auditor.canonical import canonical_json, sha256_bytes

ALG = "EdDSA"
MANIFEST = "manifest.json"


class KeyRole(StrEnum):
    TRANSCRIPT = "transcript"
    CHECKPOINT = "checkpoint"
    REPLAY = "replay"
    REPORT = "report"


class KeyStatus(StrEnum):
    ACTIVE = "active"
    RETIRED = "retired"


class CryptoError(Exception):
    """Base class of every key / signature failure raised here."""


class KeyFileError(CryptoError):
    """A key file or manifest is missing, malformed or has unsafe permissions."""


class JwksError(CryptoError):
    """A JWKS document is malformed."""


class EnvelopeError(CryptoError):
    """A DSSE envelope is malformed (missing fields, bad base64, wrong payload type)."""


class SignatureError(CryptoError):
    """No signature on the envelope verifies with a known key of the required role."""


def b64url(data: bytes) -> str:
    """Base64url without padding (JOSE style)."""
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def b64url_decode(text: str) -> bytes:
    """Inverse of ``b64url``; raises ``ValueError`` on bad input."""
    if not isinstance(text, str):
        raise ValueError(f"expected a base64url string, got {type(text).__name__}")
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"invalid base64url {text[:16]!r}…: {exc}") from exc


def b64std_decode(text: str) -> bytes:
    """Strict standard base64 decode; raises ``ValueError`` on bad input."""
    if not isinstance(text, str):
        raise ValueError(f"expected a base64 string, got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"invalid base64 {text[:16]!r}…: {exc}") from exc


def raw_public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def jwk_thumbprint(public_raw: bytes) -> str:
    """RFC 7638 thumbprint of an Ed25519 OKP key: b64url(SHA-256(JCS({crv, kty, x})))."""
    if len(public_raw) != 32:
        raise ValueError(f"Ed25519 public key must be 32 bytes, got {len(public_raw)}")
    members = {"crv": "Ed25519", "kty": "OKP", "x": b64url(public_raw)}
    return b64url(sha256_bytes(canonical_json(members)))


@dataclass(frozen=True)
class VerifierKey:
    """A public key as published in the JWKS."""

    kid: str
    role: KeyRole
    status: KeyStatus
    public_raw: bytes

    def verify(self, signature: bytes, message: bytes) -> bool:
        """True iff ``signature`` is a valid Ed25519 signature of ``message`` by this key."""
        try:
            Ed25519PublicKey.from_public_bytes(self.public_raw).verify(signature, message)
        except InvalidSignature:
            return False
        return True

    def to_jwk(self) -> dict[str, str]:
        """The JWKS entry: OKP members plus kid, use, alg, role and status."""
        return {
            "kty": "OKP", "crv": "Ed25519", "x": b64url(self.public_raw), "kid": self.kid,
            "use": "sig", "alg": ALG, "role": self.role.value, "status": self.status.value,
        }


class Signer:
    """An Ed25519 private key with its role and key id. Never printed, never pickled."""

    __slots__ = ("_private", "kid", "role")

    def __init__(self, private: Ed25519PrivateKey, role: KeyRole) -> None:
        self._private = private
        self.role = KeyRole(role)
        self.kid = jwk_thumbprint(self.public_raw)

    @classmethod
    def generate(cls, role: KeyRole) -> Signer:
        return cls(Ed25519PrivateKey.generate(), role)

    @property
    def public_raw(self) -> bytes:
        return raw_public_bytes(self._private.public_key())

    def verifier(self, status: KeyStatus = KeyStatus.ACTIVE) -> VerifierKey:
        return VerifierKey(self.kid, self.role, status, self.public_raw)

    def sign(self, message: bytes) -> bytes:
        return self._private.sign(message)

    def private_pem(self) -> bytes:
        """PKCS#8 PEM of the private key; only ``save_private_key`` should call this."""
        return self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def __repr__(self) -> str:
        return f"Signer(kid={self.kid!r}, role={self.role.value!r})"

    def __reduce__(self) -> Any:
        raise TypeError("Signer holds a private key and cannot be pickled")


def write_private_pem(path: Path, pem: bytes) -> None:
    """Write a private key's PEM to a new file created with mode 0600 (refuses to overwrite)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, pem)
    finally:
        os.close(fd)


def read_private_key(path: Path) -> Ed25519PrivateKey:
    """Read a PEM Ed25519 private key; refuses files readable by group or others."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise KeyFileError(f"{path} has mode {mode:o}; private keys must be 0600")
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} is not an Ed25519 private key")
    return key


def save_private_key(path: Path, signer: Signer) -> None:
    """Write ``signer``'s PEM to a new file created with mode 0600 (refuses to overwrite)."""
    write_private_pem(path, signer.private_pem())


def load_private_key(path: Path, role: KeyRole) -> Signer:
    """Read a PEM private key; refuses files readable by group or others."""
    return Signer(read_private_key(path), role)


def jwks_document(keys: Iterable[VerifierKey]) -> dict[str, Any]:
    """A JWKS ``{"keys": [...]}`` of public keys, sorted by role then kid."""
    ordered = sorted(keys, key=lambda k: (k.role.value, k.kid))
    return {"keys": [k.to_jwk() for k in ordered]}


def _parse_jwk(jwk: Mapping[str, Any], i: int) -> VerifierKey:
    if jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        raise JwksError(f"key {i}: expected kty OKP / crv Ed25519, got {jwk.get('kty')!r}/{jwk.get('crv')!r}")
    try:
        raw = b64url_decode(jwk["x"])
        role, status = KeyRole(jwk["role"]), KeyStatus(jwk.get("status", "active"))
    except (KeyError, ValueError) as exc:
        raise JwksError(f"key {i}: {exc!r}") from exc
    kid = jwk_thumbprint(raw)
    if jwk.get("kid") != kid:
        raise JwksError(f"key {i}: kid {jwk.get('kid')!r} is not the RFC 7638 thumbprint {kid!r}")
    return VerifierKey(kid, role, status, raw)


def parse_jwks(doc: Mapping[str, Any]) -> dict[str, VerifierKey]:
    """Parse a JWKS document into ``{kid: VerifierKey}``; every kid must equal its thumbprint."""
    entries = doc.get("keys") if isinstance(doc, Mapping) else None
    if not isinstance(entries, list):
        raise JwksError("JWKS document has no 'keys' list")
    return {k.kid: k for k in (_parse_jwk(jwk, i) for i, jwk in enumerate(entries))}


def as_verifier_keys(jwks: Mapping[str, Any]) -> dict[str, VerifierKey]:
    """Accept a JWKS document or an already parsed ``{kid: VerifierKey}`` mapping."""
    if "keys" in jwks and isinstance(jwks["keys"], list):
        return parse_jwks(jwks)
    if all(isinstance(v, VerifierKey) for v in jwks.values()):
        return dict(jwks)
    raise JwksError("expected a JWKS document or a {kid: VerifierKey} mapping")


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSEv1 pre-authentication encoding: ``"DSSEv1" SP len(type) SP type SP len(body) SP body``."""
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %b %d %b" % (len(t), t, len(payload), payload)


def sign_envelope(payload: bytes, payload_type: str, signer: Signer) -> dict[str, Any]:
    """A DSSE envelope ``{payload, payloadType, signatures: [{keyid, sig}]}`` (standard base64)."""
    sig = signer.sign(pae(payload_type, payload))
    return {
        "payload": base64.b64encode(payload).decode("ascii"),
        "payloadType": payload_type,
        "signatures": [{"keyid": signer.kid, "sig": base64.b64encode(sig).decode("ascii")}],
    }


def _envelope_parts(envelope: Mapping[str, Any]) -> tuple[bytes, str, list[Mapping[str, Any]]]:
    if not isinstance(envelope, Mapping):
        raise EnvelopeError(f"envelope must be a JSON object, got {type(envelope).__name__}")
    missing = [f for f in ("payload", "payloadType", "signatures") if f not in envelope]
    if missing:
        raise EnvelopeError(f"envelope lacks {missing}")
    if not isinstance(envelope["payloadType"], str):
        raise EnvelopeError(f"payloadType must be a string, got {type(envelope['payloadType']).__name__}")
    sigs = envelope["signatures"]
    if not isinstance(sigs, list) or not sigs:
        raise EnvelopeError("envelope has no signatures")
    try:
        payload = b64std_decode(envelope["payload"])
    except ValueError as exc:
        raise EnvelopeError(f"payload: {exc}") from exc
    return payload, envelope["payloadType"], sigs


def verify_envelope(
    envelope: Mapping[str, Any],
    keys: Mapping[str, VerifierKey],
    *,
    payload_type: str | None = None,
    role: KeyRole | None = None,
) -> bytes:
    """Return the exact payload bytes if any signature verifies with a key in ``keys``.

    ``keys`` is a parsed ``{kid: VerifierKey}`` mapping or a JWKS document.
    The key must have ``role`` when given (retired keys still verify). Raises ``EnvelopeError`` for
    a malformed envelope or unexpected payload type, ``SignatureError`` naming every keyid tried.
    """
    keys = as_verifier_keys(keys)
    payload, ptype, sigs = _envelope_parts(envelope)
    if payload_type is not None and ptype != payload_type:
        raise EnvelopeError(f"payloadType is {ptype!r}, expected {payload_type!r}")
    message = pae(ptype, payload)
    problems = [_check_sig(s, keys, role, message) for s in sigs]
    if None in problems:
        return payload
    raise SignatureError("no valid signature: " + "; ".join(p for p in problems if p))


def _check_sig(sig: Mapping[str, Any], keys: Mapping[str, VerifierKey], role: KeyRole | None, message: bytes) -> str | None:
    kid = sig.get("keyid") if isinstance(sig, Mapping) else None
    key = keys.get(kid) if isinstance(kid, str) else None
    if key is None:
        return f"keyid {kid!r} is not in the JWKS"
    if role is not None and key.role != role:
        return f"keyid {kid!r} has role {key.role.value!r}, expected {role.value!r}"
    try:
        raw = b64std_decode(sig.get("sig"))
    except ValueError as exc:
        return f"keyid {kid!r}: {exc}"
    return None if key.verify(raw, message) else f"keyid {kid!r}: Ed25519 signature does not verify"


@dataclass
class _KeyEntry:
    kid: str
    role: KeyRole
    status: KeyStatus
    x: str
    created_at: str
    retired_at: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"kid": self.kid, "role": self.role.value, "status": self.status.value, "x": self.x,
                "created_at": self.created_at, "retired_at": self.retired_at}

    def verifier(self) -> VerifierKey:
        return VerifierKey(self.kid, self.role, self.status, b64url_decode(self.x))


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


class KeyRing:
    """The server's keys: one active signer per role plus every retired public key.

    ``KeyRing.open(key_dir)`` creates the directory (0700) and a key for any role that has none.
    """

    def __init__(self, key_dir: Path, entries: list[_KeyEntry], signers: dict[KeyRole, Signer]) -> None:
        self.key_dir = key_dir
        self._entries = entries
        self._signers = signers
        self._stamp = _manifest_stamp(key_dir)

    @classmethod
    def open(cls, key_dir: Path | str) -> KeyRing:
        key_dir = Path(key_dir)
        key_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        with _locked(key_dir):
            ring = cls(key_dir, _read_manifest(key_dir), {})
            for entry in ring._entries:
                if entry.status is KeyStatus.ACTIVE:
                    ring._signers[entry.role] = ring._load(entry)
            for role in KeyRole:
                if role not in ring._signers:
                    ring._add(Signer.generate(role))
        return ring

    def _load(self, entry: _KeyEntry) -> Signer:
        signer = load_private_key(self.key_dir / f"{entry.kid}.pem", entry.role)
        if signer.kid != entry.kid:
            raise KeyFileError(f"{entry.kid}.pem holds key {signer.kid}, not the manifest's {entry.kid}")
        return signer

    def _add(self, signer: Signer) -> None:
        save_private_key(self.key_dir / f"{signer.kid}.pem", signer)
        self._entries.append(_KeyEntry(signer.kid, signer.role, KeyStatus.ACTIVE, b64url(signer.public_raw), _now()))
        self._signers[signer.role] = signer
        _write_manifest(self.key_dir, self._entries)
        self._stamp = _manifest_stamp(self.key_dir)

    def reload_if_changed(self) -> bool:
        """Pick up keys another process rotated in the same (shared) directory; True if anything changed.

        Several server processes sharing one key directory converge on the new active key within one
        reload interval; until then the others sign with the retired key, which stays verifiable.
        """
        if _manifest_stamp(self.key_dir) == self._stamp:
            return False
        with _locked(self.key_dir):
            stamp = _manifest_stamp(self.key_dir)
            entries = _read_manifest(self.key_dir)
            signers = dict(self._signers)
            for entry in entries:
                current = signers.get(entry.role)
                if entry.status is KeyStatus.ACTIVE and (current is None or current.kid != entry.kid):
                    signers[entry.role] = self._load(entry)
        self._entries, self._signers, self._stamp = entries, signers, stamp
        return True

    def signer(self, role: KeyRole) -> Signer:
        """The active signer of ``role``."""
        return self._signers[KeyRole(role)]

    def rotate(self, role: KeyRole) -> Signer:
        """Retire the active key of ``role`` (its public key stays published) and make a new one.

        Other processes holding an open ``KeyRing`` keep signing with the retired key until they
        reopen it or ``reload_if_changed`` sees the change; their signatures stay verifiable because
        retired keys remain in the JWKS.
        """
        role = KeyRole(role)
        with _locked(self.key_dir):
            self._entries = _read_manifest(self.key_dir)
            for entry in self._entries:
                if entry.role is role and entry.status is KeyStatus.ACTIVE:
                    entry.status, entry.retired_at = KeyStatus.RETIRED, _now()
            self._add(Signer.generate(role))
        return self._signers[role]

    def verifier_keys(self) -> dict[str, VerifierKey]:
        """Every key ever created (active and retired), ``{kid: VerifierKey}``."""
        return {e.kid: e.verifier() for e in self._entries}

    def jwks(self) -> dict[str, Any]:
        """The public JWKS document served at ``/.well-known/jwks.json``."""
        return jwks_document(self.verifier_keys().values())

    def __repr__(self) -> str:
        return f"KeyRing(key_dir={str(self.key_dir)!r}, keys={len(self._entries)})"

    def __reduce__(self) -> Any:
        raise TypeError("KeyRing holds private keys and cannot be pickled")


@contextmanager
def _locked(key_dir: Path) -> Iterator[None]:
    """An exclusive advisory lock on the key directory (two processes starting at once)."""
    fd = os.open(key_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _manifest_stamp(key_dir: Path) -> tuple[int, int] | None:
    try:
        st = (key_dir / MANIFEST).stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, st.st_size


def _read_manifest(key_dir: Path) -> list[_KeyEntry]:
    path = key_dir / MANIFEST
    if not path.exists():
        return []
    try:
        rows = json.loads(path.read_text())["keys"]
        return [_KeyEntry(r["kid"], KeyRole(r["role"]), KeyStatus(r["status"]), r["x"], r["created_at"],
                          r.get("retired_at")) for r in rows]
    except (KeyError, ValueError, TypeError) as exc:
        raise KeyFileError(f"{path} is malformed: {exc!r}") from exc


def _write_manifest(key_dir: Path, entries: list[_KeyEntry]) -> None:
    tmp = key_dir / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"keys": [e.to_json() for e in entries]}, indent=2) + "\n")
    os.replace(tmp, key_dir / MANIFEST)


# --- sealed values (secrets kept in a shared store) ---------------------------------------------------


def derive_key(secret: bytes, info: bytes) -> bytes:
    """A 32-byte key from a high-entropy ``secret`` (HKDF-SHA256, no salt), domain-separated by ``info``."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """AES-256-GCM: ``nonce (12 bytes) ‖ ciphertext ‖ tag``."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    nonce = os.urandom(12)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, aad)


def unseal(key: bytes, sealed: bytes, aad: bytes) -> bytes | None:
    """Inverse of ``seal``; ``None`` if the value was not sealed with ``key`` and ``aad`` or was altered."""
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    if len(sealed) < 12 + 16:
        return None
    try:
        return AESGCM(key).decrypt(sealed[:12], sealed[12:], aad)
    except InvalidTag:
        return None
