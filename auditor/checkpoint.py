"""Log checkpoints: C2SP tlog-checkpoint bodies signed as C2SP signed notes with Ed25519.

Checkpoint body (note text)::

    <origin>\\n
    <tree size, decimal>\\n
    <root hash, standard base64>\\n
    [<extension line>\\n …]

Signed note = note text + ``\\n`` + one line per signature: ``— <key name> <base64(key hash ‖ sig)>\\n``
(U+2014 EM DASH, space). For Ed25519 the 4-byte key hash is
``SHA-256(key name ‖ 0x0A ‖ 0x01 ‖ 32-byte public key)[:4]`` and the signature covers the note text.
The key name defaults to the origin; verifiers find the key among the JWKS ``checkpoint`` role keys
by key hash, ignore signatures by unknown keys, and require at least one valid known signature.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from auditor.crypto import KeyRole, Signer, VerifierKey, as_verifier_keys

ED25519_ALG = b"\x01"
SIG_PREFIX = "\u2014 "


class CheckpointError(Exception):
    """A checkpoint or signed note is malformed or its signature does not verify."""


@dataclass(frozen=True)
class Checkpoint:
    origin: str
    tree_size: int
    root_hash: bytes
    extensions: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.tree_size, int) or self.tree_size < 0:
            raise CheckpointError(f"tree size must be an int >= 0, got {self.tree_size!r}")
        if not isinstance(self.root_hash, bytes) or len(self.root_hash) != 32:
            raise CheckpointError(f"root hash must be 32 bytes, got {self.root_hash!r:.40}")

    def body(self) -> str:
        """The note text (every line newline-terminated)."""
        _check_line(self.origin, "origin")
        for ext in self.extensions:
            _check_line(ext, "extension line")
        lines = [self.origin, str(self.tree_size), base64.b64encode(self.root_hash).decode("ascii"),
                 *self.extensions]
        return "".join(line + "\n" for line in lines)

    @classmethod
    def parse(cls, text: str) -> Checkpoint:
        """Parse a note text into a Checkpoint; raises ``CheckpointError`` with the bad line."""
        if not text.endswith("\n"):
            raise CheckpointError("checkpoint body must end with a newline")
        lines = text[:-1].split("\n")
        if len(lines) < 3 or not lines[0]:
            raise CheckpointError(f"checkpoint body needs origin, size and root lines, got {len(lines)} lines")
        if not lines[1].isdigit() or (lines[1] != "0" and lines[1].startswith("0")):
            raise CheckpointError(f"tree size line {lines[1]!r} is not a canonical decimal")
        try:
            root = base64.b64decode(lines[2], validate=True)
        except (binascii.Error, ValueError) as exc:
            raise CheckpointError(f"root hash line {lines[2]!r} is not base64") from exc
        if len(root) != 32:
            raise CheckpointError(f"root hash is {len(root)} bytes, expected 32")
        return cls(lines[0], int(lines[1]), root, tuple(lines[3:]))


@dataclass(frozen=True)
class NoteSignature:
    key_name: str
    key_hash: bytes
    signature: bytes


def _check_line(text: str, what: str) -> None:
    if not text or "\n" in text:
        raise CheckpointError(f"{what} {text!r} must be a non-empty single line")


def _check_key_name(name: str) -> None:
    if not name or any(c.isspace() for c in name) or "+" in name:
        raise CheckpointError(f"key name {name!r} must be non-empty without whitespace or '+'")


def note_key_hash(key_name: str, public_raw: bytes) -> bytes:
    """C2SP signed-note Ed25519 key hash: SHA-256(name ‖ "\\n" ‖ 0x01 ‖ public key)[:4]."""
    _check_key_name(key_name)
    return hashlib.sha256(key_name.encode() + b"\n" + ED25519_ALG + public_raw).digest()[:4]


def verifier_key_string(key_name: str, public_raw: bytes) -> str:
    """The note verifier key ``<name>+<hex key hash>+<base64(0x01 ‖ public key)>``."""
    key_hash = note_key_hash(key_name, public_raw).hex()
    return f"{key_name}+{key_hash}+{base64.b64encode(ED25519_ALG + public_raw).decode('ascii')}"


def signature_line(text: str, signer: Signer, key_name: str) -> str:
    """One signed-note signature line for ``text`` by ``signer`` under ``key_name``."""
    blob = note_key_hash(key_name, signer.public_raw) + signer.sign(text.encode("utf-8"))
    return f"{SIG_PREFIX}{key_name} {base64.b64encode(blob).decode('ascii')}\n"


def sign_checkpoint(checkpoint: Checkpoint, signer: Signer, key_name: str | None = None) -> str:
    """The signed note for ``checkpoint`` (``signer`` should hold the ``checkpoint`` role)."""
    if signer.role is not KeyRole.CHECKPOINT:
        raise CheckpointError(f"checkpoint signer has role {signer.role.value!r}, expected 'checkpoint'")
    text = checkpoint.body()
    return text + "\n" + signature_line(text, signer, key_name or checkpoint.origin)


def split_note(note: str) -> tuple[str, list[NoteSignature]]:
    """Split a signed note into its text and parsed signature lines."""
    text, sep, sig_block = note.rpartition("\n\n")
    if not sep or not sig_block.endswith("\n"):
        raise CheckpointError("signed note must be text, a blank line, and newline-terminated signature lines")
    return text + "\n", [_parse_sig_line(line) for line in sig_block[:-1].split("\n")]


def _parse_sig_line(line: str) -> NoteSignature:
    if not line.startswith(SIG_PREFIX):
        raise CheckpointError(f"signature line {line!r} does not start with '— '")
    name, _, b64 = line[len(SIG_PREFIX):].rpartition(" ")
    try:
        blob = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CheckpointError(f"signature line for {name!r} is not base64") from exc
    if len(blob) < 5:
        raise CheckpointError(f"signature line for {name!r} is too short ({len(blob)} bytes)")
    return NoteSignature(name, blob[:4], blob[4:])


def verify_checkpoint(note: str, jwks: Mapping[str, Any], *, origin: str | None = None) -> Checkpoint:
    """Verify a signed checkpoint note with the JWKS ``checkpoint`` keys; returns the checkpoint.

    Raises ``CheckpointError`` if it is malformed, the origin differs from ``origin`` (when given),
    or no signature by a known checkpoint key verifies.
    """
    text, sigs = split_note(note)
    checkpoint = Checkpoint.parse(text)
    if origin is not None and checkpoint.origin != origin:
        raise CheckpointError(f"checkpoint origin {checkpoint.origin!r}, expected {origin!r}")
    keys = [k for k in as_verifier_keys(jwks).values() if k.role is KeyRole.CHECKPOINT]
    tried = [_try_signature(sig, keys, text) for sig in sigs]
    if any(t is True for t in tried):
        return checkpoint
    reasons = [t for t in tried if isinstance(t, str)] or ["no signature by a known checkpoint key"]
    raise CheckpointError("checkpoint signature invalid: " + "; ".join(reasons))


def _try_signature(sig: NoteSignature, keys: list[VerifierKey], text: str) -> bool | str | None:
    """True if valid, a reason string if a known key's signature fails, None if the key is unknown."""
    try:
        match = [k for k in keys if note_key_hash(sig.key_name, k.public_raw) == sig.key_hash]
    except CheckpointError as exc:
        return str(exc)
    if not match:
        return None
    if any(k.verify(sig.signature, text.encode("utf-8")) for k in match):
        return True
    return f"signature by {sig.key_name!r} (kid {match[0].kid}) does not verify"


def split_verifier_key(vkey: str) -> tuple[str, str, bytes]:
    """``(name, hex key id, decoded key blob)`` of a signed-note verifier key ``<name>+<hex id>+<base64>``: the
    shape shared by checkpoint keys (type 0x01) and witness cosigner keys (type 0x04)."""
    parts = vkey.strip().split("+", 2)  # base64 may hold '+'; the name may not
    if len(parts) != 3:
        raise CheckpointError(f"verifier key {vkey!r:.80} is not <name>+<hex key id>+<base64 key>")
    name, hex_id, encoded = parts
    try:
        return name, hex_id, base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CheckpointError(f"verifier key {vkey!r:.80}: {exc}") from None


def parse_verifier_key(vkey: str) -> tuple[str, bytes]:
    """``(key name, Ed25519 public key)`` of a signed-note verifier key ``<name>+<hex id>+base64(0x01 ‖ key)``
    (the form ``verifier_key_string`` writes); the key id must match."""
    name, hex_id, blob = split_verifier_key(vkey)
    if blob[:1] != ED25519_ALG or len(blob) != 33:
        raise CheckpointError(f"verifier key {vkey!r:.80} is not an Ed25519 (type 01) key")
    if note_key_hash(name, blob[1:]).hex() != hex_id.lower():
        raise CheckpointError(f"verifier key {vkey!r:.80}: key id {hex_id} does not match the name and key")
    return name, blob[1:]
