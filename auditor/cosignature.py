"""C2SP tlog-cosignature/v1 with Ed25519 (signed-note signature type ``0x04``): witnesses cosign the log's
checkpoints, and anyone holding the witnesses' public keys checks the cosignatures offline.

A cosignature is a signed-note signature line on the checkpoint::

    — <cosigner name> base64(key id ‖ u64be timestamp ‖ Ed25519 signature)

    key id  = SHA-256(<name> ‖ 0x0A ‖ 0x04 ‖ 32-byte public key)[:4]
    message = "cosignature/v1\\n" ‖ "time <timestamp>\\n" ‖ <checkpoint note text>

Cosigners are configured as signed-note verifier keys (vkeys)::

    <name>+<hex key id>+base64(0x04 ‖ 32-byte public key)

A verifier ignores signature lines whose (name, key id) matches no configured cosigner and rejects the
note if a line that matches one does not verify (signed-note: a known key's bad signature is an error).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from auditor.checkpoint import SIG_PREFIX, CheckpointError, split_note, split_verifier_key
from auditor.crypto import KeyFileError, raw_public_bytes, read_private_key, write_private_pem

COSIGNATURE_ALG = b"\x04"
HEADER = "cosignature/v1\n"
MAX_TIMESTAMP = 2**63 - 1


class CosignatureError(Exception):
    """A cosigner key, a cosignature line or a cosigned note is malformed or does not verify."""


def _check_name(name: str) -> None:
    if not name or any(c.isspace() for c in name) or "+" in name:
        raise CosignatureError(f"cosigner name {name!r} must be non-empty without whitespace or '+'")


def cosigned_message(note_text: str, timestamp: int) -> bytes:
    """The bytes an Ed25519 cosigner signs for ``note_text`` (the checkpoint body, newline-terminated)."""
    if not 0 <= timestamp <= MAX_TIMESTAMP:
        raise CosignatureError(f"timestamp {timestamp} is outside [0, 2^63-1]")
    if not note_text.endswith("\n"):
        raise CosignatureError("the cosigned note text must end with a newline")
    return f"{HEADER}time {timestamp}\n{note_text}".encode("utf-8")


@dataclass(frozen=True)
class CosignerKey:
    """A witness's public identity: name and Ed25519 public key."""

    name: str
    public_raw: bytes

    def __post_init__(self) -> None:
        _check_name(self.name)
        if len(self.public_raw) != 32:
            raise CosignatureError(f"cosigner {self.name!r}: Ed25519 public key must be 32 bytes, "
                                   f"got {len(self.public_raw)}")

    @property
    def key_id(self) -> bytes:
        return hashlib.sha256(self.name.encode("utf-8") + b"\n" + COSIGNATURE_ALG + self.public_raw).digest()[:4]

    def vkey(self) -> str:
        encoded = base64.b64encode(COSIGNATURE_ALG + self.public_raw).decode("ascii")
        return f"{self.name}+{self.key_id.hex()}+{encoded}"

    @classmethod
    def parse(cls, vkey: str) -> CosignerKey:
        """Parse ``name+hexid+base64(0x04 ‖ key)``; the key id must match the name and key."""
        try:
            name, hex_id, blob = split_verifier_key(vkey)
            key_id = bytes.fromhex(hex_id)
        except (CheckpointError, ValueError) as exc:
            raise CosignatureError(f"cosigner vkey {vkey!r:.80}: {exc}") from None
        if blob[:1] != COSIGNATURE_ALG:
            raise CosignatureError(f"cosigner vkey {vkey!r:.80} has signature type {blob[:1].hex() or 'none'}, "
                                   "expected 04 (tlog-cosignature/v1 Ed25519)")
        key = cls(name, blob[1:])
        if key.key_id != key_id:
            raise CosignatureError(f"cosigner vkey {vkey!r:.80}: key id {hex_id} does not match the name and key "
                                   f"({key.key_id.hex()})")
        return key

    def verify(self, note_text: str, timestamp: int, signature: bytes) -> bool:
        try:
            Ed25519PublicKey.from_public_bytes(self.public_raw).verify(signature, cosigned_message(note_text, timestamp))
        except InvalidSignature:
            return False
        return True


class Cosigner:
    """A witness's private key and name. Never printed, never pickled."""

    __slots__ = ("_private", "key")

    def __init__(self, private: Ed25519PrivateKey, name: str) -> None:
        self._private = private
        self.key = CosignerKey(name, raw_public_bytes(private.public_key()))

    @classmethod
    def load_or_create(cls, path: Path, name: str) -> Cosigner:
        """The PKCS#8 key at ``path`` (0600), created on first use."""
        if not path.exists():
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            private = Ed25519PrivateKey.generate()
            pem = private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                        serialization.NoEncryption())
            write_private_pem(path, pem)
            return cls(private, name)
        try:
            return cls(read_private_key(path), name)
        except KeyFileError as exc:
            raise CosignatureError(f"witness key: {exc}") from None

    def cosign(self, note_text: str, timestamp: int) -> str:
        """One cosignature line (newline-terminated) over the checkpoint ``note_text``."""
        signature = self._private.sign(cosigned_message(note_text, timestamp))
        blob = self.key.key_id + struct.pack(">Q", timestamp) + signature
        return f"{SIG_PREFIX}{self.key.name} {base64.b64encode(blob).decode('ascii')}\n"

    def __repr__(self) -> str:
        return f"Cosigner(name={self.key.name!r})"

    def __reduce__(self) -> object:
        raise TypeError("Cosigner holds a private key and cannot be pickled")


@dataclass(frozen=True)
class Cosignature:
    """A verified cosignature: who, when (POSIX seconds), and its signature line."""

    name: str
    timestamp: int
    line: str


def _parse_line(line: str) -> tuple[str, bytes]:
    if not line.startswith(SIG_PREFIX) or not line.endswith("\n"):
        raise CosignatureError(f"signature line {line!r:.80} is not '— <name> <base64>\\n'")
    name, _, encoded = line[len(SIG_PREFIX):-1].rpartition(" ")
    try:
        return name, base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CosignatureError(f"signature line for {name!r} is not base64: {exc}") from None


def signature_lines(note: str) -> list[str]:
    """The signature lines of a signed note, each newline-terminated."""
    try:
        _, sigs = split_note(note)
    except CheckpointError as exc:
        raise CosignatureError(str(exc)) from None
    block = note.rpartition("\n\n")[2]
    lines = [line + "\n" for line in block[:-1].split("\n")]
    assert len(lines) == len(sigs), (len(lines), len(sigs))
    return lines


def verify_cosignatures(note: str, keys: Sequence[CosignerKey]) -> list[Cosignature]:
    """The valid cosignatures on ``note`` by the configured ``keys`` (one per cosigner at most).

    Lines by unknown cosigners are ignored; a line matching a known (name, key id) that does not verify
    raises ``CosignatureError`` naming the cosigner.
    """
    try:
        text, _ = split_note(note)
    except CheckpointError as exc:
        raise CosignatureError(str(exc)) from None
    by_id = {(k.name, k.key_id): k for k in keys}
    found: dict[str, Cosignature] = {}
    for line in signature_lines(note):
        name, blob = _parse_line(line)
        key = by_id.get((name, blob[:4]))
        if key is None:
            continue
        if len(blob) != 4 + 8 + 64:
            raise CosignatureError(f"cosignature by {name!r} is {len(blob)} bytes, expected 76")
        timestamp = struct.unpack(">Q", blob[4:12])[0]
        if timestamp > MAX_TIMESTAMP or not key.verify(text, timestamp, blob[12:]):
            raise CosignatureError(f"cosignature by {name!r} (key id {key.key_id.hex()}) does not verify")
        found.setdefault(name, Cosignature(name, timestamp, line))
    return list(found.values())


def with_signature_lines(note: str, lines: Iterable[str]) -> str:
    """``note`` with ``lines`` appended to its signature block (lines already present are skipped)."""
    present = set(signature_lines(note))
    extra = [line for line in lines if line not in present]
    for line in extra:
        _parse_line(line)
    return note + "".join(dict.fromkeys(extra))


def check_quorum(note: str, keys: Sequence[CosignerKey], quorum: int) -> list[Cosignature]:
    """The valid cosignatures; raises ``CosignatureError`` when fewer than ``quorum`` cosigners signed."""
    valid = verify_cosignatures(note, keys)
    if len(valid) < quorum:
        names = ", ".join(c.name for c in valid) or "none"
        raise CosignatureError(f"{len(valid)} of {len(keys)} configured witnesses cosigned (need {quorum}; "
                               f"valid: {names})")
    return valid
