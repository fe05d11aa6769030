"""The add-checkpoint request body of C2SP tlog-witness::

    old <previous size, canonical decimal>\\n
    <consistency proof hash, base64>\\n        (0 to 63 lines; none when the old size is 0)
    \\n
    <signed checkpoint note>

A 409 answer carries the witness's latest size as ``<decimal>\\n`` with ``Content-Type: text/x.tlog.size``.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass

MAX_PROOF_LINES = 63
SIZE_MEDIA_TYPE = "text/x.tlog.size"
NOTE_MEDIA_TYPE = "text/plain; charset=utf-8"


class ProtocolError(ValueError):
    """The request body is not a well-formed add-checkpoint request (HTTP 400)."""


def _decimal(text: str, what: str) -> int:
    if not text.isascii() or not text.isdigit() or (text != "0" and text.startswith("0")):
        raise ProtocolError(f"{what} {text!r:.40} is not a canonical decimal")
    return int(text)


@dataclass(frozen=True)
class AddCheckpoint:
    old_size: int
    proof: tuple[bytes, ...]
    note: str
    """The signed checkpoint (note text, blank line, signature lines)."""

    def encode(self) -> bytes:
        lines = [f"old {self.old_size}", *(base64.b64encode(h).decode("ascii") for h in self.proof)]
        return ("".join(line + "\n" for line in lines) + "\n" + self.note).encode("utf-8")

    @classmethod
    def parse(cls, body: bytes) -> AddCheckpoint:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"request body is not UTF-8: {exc}") from None
        head, sep, note = text.partition("\n\n")
        if not sep:
            raise ProtocolError("request body needs an 'old' line, proof lines, a blank line and the checkpoint")
        lines = head.split("\n")
        if not lines[0].startswith("old "):
            raise ProtocolError(f"first line {lines[0]!r:.40} is not 'old <size>'")
        old_size = _decimal(lines[0][4:], "old size")
        if len(lines) - 1 > MAX_PROOF_LINES:
            raise ProtocolError(f"{len(lines) - 1} consistency proof lines; at most {MAX_PROOF_LINES} are allowed")
        return cls(old_size, tuple(_hash(line, i) for i, line in enumerate(lines[1:])), note)


def _hash(line: str, index: int) -> bytes:
    try:
        value = base64.b64decode(line, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ProtocolError(f"proof line {index} is not base64: {exc}") from None
    if len(value) != 32:
        raise ProtocolError(f"proof line {index} decodes to {len(value)} bytes, expected 32")
    return value


def size_body(size: int) -> str:
    return f"{size}\n"


def parse_size_body(body: str) -> int:
    return _decimal(body.rstrip("\n"), "conflict size")


def encode_request(old_size: int, proof: Sequence[bytes], note: str) -> bytes:
    return AddCheckpoint(old_size, tuple(proof), note).encode()
