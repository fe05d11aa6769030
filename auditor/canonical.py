"""The one canonical byte encoding of everything Verbatim signs or hashes (DESIGN §4).

* JSON: RFC 8785 (JCS) via the ``rfc8785`` package. Integers beyond ±(2^53 - 1) are refused by JCS,
  so 64-bit values such as seeds travel as decimal strings (``seed_to_str``).
* Token ids: unsigned 32-bit little-endian, concatenated (``pack_u32le``).
* Commitments: ``SHA-256(salt ‖ u32le ids)`` with a per-transcript random 32-byte salt.
* Window chain: ``h_-1 = SHA-256(b"verbatim-windows-v1" ‖ salt)``,
  ``h_k = SHA-256(h_k-1 ‖ u32le start ‖ u32le end ‖ u32le tokens[start:end])`` over output ids.
* Logprob digest: SHA-256 of the float32 little-endian bytes of the logprobs, in order.
* Timestamps: RFC 3339 UTC with microseconds and a ``Z`` suffix (``timestamp``).
* Envelope digest: SHA-256 of the JCS bytes of a DSSE envelope dict (the Merkle log's leaf data).

Digests are lower-case hex strings unless a name says ``_bytes``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import struct
from collections.abc import Sequence
from typing import Any

import rfc8785

SALT_BYTES = 32
WINDOW_CHAIN_DOMAIN = b"verbatim-windows-v1"
U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1


def canonical_json(obj: Any) -> bytes:
    """RFC 8785 canonical JSON bytes of ``obj`` (raises on ints outside the JSON-safe range)."""
    return rfc8785.dumps(obj)


def sha256_bytes(data: bytes) -> bytes:
    """Raw 32-byte SHA-256 digest."""
    return hashlib.sha256(data).digest()


def sha256_hex(data: bytes) -> str:
    """Lower-case hex SHA-256 digest."""
    return hashlib.sha256(data).hexdigest()


def pack_u32le(ids: Sequence[int]) -> bytes:
    """Token ids as concatenated unsigned 32-bit little-endian integers."""
    for i, tok in enumerate(ids):
        if not isinstance(tok, int) or isinstance(tok, bool) or not 0 <= tok <= U32_MAX:
            raise ValueError(f"token id at index {i} is {tok!r}; must be an int in [0, {U32_MAX}]")
    return struct.pack(f"<{len(ids)}I", *ids)


def check_salt(salt: bytes) -> None:
    """Raise unless ``salt`` is exactly ``SALT_BYTES`` bytes."""
    if not isinstance(salt, bytes) or len(salt) != SALT_BYTES:
        got = len(salt) if isinstance(salt, bytes) else type(salt).__name__
        raise ValueError(f"salt must be {SALT_BYTES} bytes, got {got}")


def token_commitment(salt: bytes, ids: Sequence[int]) -> str:
    """``SHA-256(salt ‖ u32le ids)`` as hex."""
    check_salt(salt)
    return sha256_hex(salt + pack_u32le(ids))


def prompt_commitment(salt: bytes, ids: Sequence[int]) -> str:
    """Salted commitment to the prompt token ids."""
    return token_commitment(salt, ids)


def output_commitment(salt: bytes, ids: Sequence[int]) -> str:
    """Salted commitment to the output token ids."""
    return token_commitment(salt, ids)


def check_windows(windows: Sequence[tuple[int, int]], n_output: int) -> None:
    """Raise unless every span is a valid ``start <= end <= n_output`` slice of the output."""
    for k, (start, end) in enumerate(windows):
        if not 0 <= start <= end <= n_output:
            raise ValueError(f"window {k} = ({start}, {end}) is not a slice of {n_output} output tokens")


def window_chain(salt: bytes, windows: Sequence[tuple[int, int]], output_ids: Sequence[int]) -> list[str]:
    """The chain values ``[h_0, …, h_{n-1}]`` (hex), one per window, in order."""
    check_salt(salt)
    check_windows(windows, len(output_ids))
    h = sha256_bytes(WINDOW_CHAIN_DOMAIN + salt)
    chain: list[str] = []
    for start, end in windows:
        h = sha256_bytes(h + pack_u32le([start, end]) + pack_u32le(output_ids[start:end]))
        chain.append(h.hex())
    return chain


def window_chain_head(salt: bytes, windows: Sequence[tuple[int, int]], output_ids: Sequence[int]) -> str:
    """The last chain value ``h_{n-1}`` (hex); ``h_-1`` when there are no windows."""
    chain = window_chain(salt, windows, output_ids)
    return chain[-1] if chain else sha256_hex(WINDOW_CHAIN_DOMAIN + salt)


def logprob_digest(logprobs: Sequence[float]) -> str:
    """SHA-256 (hex) of the float32 little-endian bytes of ``logprobs`` in order."""
    return sha256_hex(struct.pack(f"<{len(logprobs)}f", *logprobs))


def seed_to_str(seed: int) -> str:
    """A 64-bit unsigned seed as its decimal string (JCS numbers stop at 2^53)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= U64_MAX:
        raise ValueError(f"seed must be an int in [0, 2^64 - 1], got {seed!r}")
    return str(seed)


def timestamp(value: dt.datetime) -> str:
    """A time as signed: RFC 3339 in UTC with microseconds, ``Z``-suffixed."""
    return value.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_timestamp(text: str) -> dt.datetime:
    """The aware UTC datetime of a ``timestamp`` string."""
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def envelope_digest(envelope: dict[str, Any]) -> str:
    """SHA-256 (hex) of ``canonical_json(envelope)``: the leaf data of the Merkle log."""
    return sha256_hex(canonical_json(envelope))
