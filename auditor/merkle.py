"""RFC 6962 / RFC 9162 Merkle tree hashing, proofs and proof verification.

Leaves are hashed ``SHA-256(0x00 ‖ data)``, interior nodes ``SHA-256(0x01 ‖ left ‖ right)``; the
empty tree's root is ``SHA-256("")``. The log's leaf data is the 32-byte envelope digest
(``canonical.envelope_digest``) of a transcript or replay attestation.

``MerkleTree`` holds the ordered list of leaf hashes, which is all that needs persisting (one row
per leaf in SQL); build it from the stored list and call ``append_leaf_hash`` as rows are added.
Hashes of complete (power-of-two) subtrees are cached, since they never change once full.

Proof generation follows RFC 9162 §2.1.3.1 / §2.1.4.1 (PATH, SUBPROOF); verification follows the
iterative algorithms of §2.1.3.2 / §2.1.4.2 and raises ``ProofError`` with the reason.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

HASH_SIZE = 32
EMPTY_ROOT = hashlib.sha256(b"").digest()


class ProofError(Exception):
    """A proof does not verify, or was requested for impossible indices or sizes."""


def leaf_hash(data: bytes) -> bytes:
    """RFC 6962 leaf hash ``SHA-256(0x00 ‖ data)``."""
    return hashlib.sha256(b"\x00" + data).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """RFC 6962 interior node hash ``SHA-256(0x01 ‖ left ‖ right)``."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two strictly smaller than ``n`` (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class MerkleTree:
    """An append-only Merkle tree over a list of leaf hashes."""

    def __init__(self, leaf_hashes: Iterable[bytes] = ()) -> None:
        self._leaves: list[bytes] = []
        self._cache: dict[tuple[int, int], bytes] = {}
        for h in leaf_hashes:
            self.append_leaf_hash(h)

    @property
    def size(self) -> int:
        return len(self._leaves)

    def leaf_hashes(self) -> list[bytes]:
        """A copy of the leaf hashes (what to persist)."""
        return list(self._leaves)

    def append(self, data: bytes) -> int:
        """Append a leaf by its data; returns its index."""
        return self.append_leaf_hash(leaf_hash(data))

    def append_leaf_hash(self, h: bytes) -> int:
        """Append an already hashed leaf; returns its index."""
        if not isinstance(h, bytes) or len(h) != HASH_SIZE:
            raise ValueError(f"leaf hash must be {HASH_SIZE} bytes, got {h!r:.40}")
        self._leaves.append(h)
        return len(self._leaves) - 1

    def leaf_hash(self, index: int) -> bytes:
        return self._leaves[index]

    def truncate(self, size: int) -> None:
        """Drop the leaves from ``size`` on (an append rolled back), and the subtree hashes over them."""
        self._check_size(size)
        del self._leaves[size:]
        self._cache = {span: h for span, h in self._cache.items() if span[1] <= size}

    def root(self, size: int | None = None) -> bytes:
        """MTH of the first ``size`` leaves (default: all)."""
        size = self.size if size is None else size
        self._check_size(size)
        return EMPTY_ROOT if size == 0 else self._subtree(0, size)

    def inclusion_proof(self, index: int, size: int | None = None) -> list[bytes]:
        """PATH(index, D[0:size]) — the audit path of leaf ``index`` in the tree of ``size``."""
        size = self.size if size is None else size
        self._check_size(size)
        if not 0 <= index < size:
            raise ProofError(f"leaf index {index} is outside a tree of size {size}")
        return self._path(index, 0, size)

    def consistency_proof(self, old_size: int, new_size: int | None = None) -> list[bytes]:
        """PROOF(old_size, D[0:new_size]); empty when ``old_size`` is 0 or equals ``new_size``."""
        new_size = self.size if new_size is None else new_size
        self._check_size(new_size)
        if not 0 <= old_size <= new_size:
            raise ProofError(f"old size {old_size} is not within [0, {new_size}]")
        if old_size in (0, new_size):
            return []
        return self._subproof(old_size, 0, new_size, True)

    def _check_size(self, size: int) -> None:
        if not 0 <= size <= self.size:
            raise ProofError(f"tree size {size} is outside [0, {self.size}] (leaves held)")

    def _subtree(self, start: int, end: int) -> bytes:
        n = end - start
        if n == 1:
            return self._leaves[start]
        cached = self._cache.get((start, end))
        if cached is not None:
            return cached
        k = _split(n)
        h = node_hash(self._subtree(start, start + k), self._subtree(start + k, end))
        if _is_pow2(n):
            self._cache[(start, end)] = h
        return h

    def _path(self, m: int, start: int, end: int) -> list[bytes]:
        n = end - start
        if n == 1:
            return []
        k = _split(n)
        if m < k:
            return self._path(m, start, start + k) + [self._subtree(start + k, end)]
        return self._path(m - k, start + k, end) + [self._subtree(start, start + k)]

    def _subproof(self, m: int, start: int, end: int, b: bool) -> list[bytes]:
        n = end - start
        if m == n:
            return [] if b else [self._subtree(start, end)]
        k = _split(n)
        if m <= k:
            return self._subproof(m, start, start + k, b) + [self._subtree(start + k, end)]
        return self._subproof(m - k, start + k, end, False) + [self._subtree(start, start + k)]


def _check_hash(h: bytes, what: str) -> None:
    if not isinstance(h, bytes) or len(h) != HASH_SIZE:
        raise ProofError(f"{what} must be {HASH_SIZE} bytes, got {h!r:.40}")


def root_from_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes]) -> bytes:
    """The root implied by an inclusion proof (RFC 9162 §2.1.3.2 steps 1–5)."""
    _check_hash(leaf, "leaf hash")
    if not 0 <= index < size:
        raise ProofError(f"leaf index {index} is outside a tree of size {size}")
    fn, sn, r = index, size - 1, leaf
    for i, p in enumerate(proof):
        _check_hash(p, f"proof hash {i}")
        if sn == 0:
            raise ProofError(f"inclusion proof has {len(proof)} hashes, more than size {size} allows")
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ProofError(f"inclusion proof has {len(proof)} hashes, too few for index {index} in size {size}")
    return r


def verify_inclusion(leaf: bytes, index: int, size: int, proof: Sequence[bytes], root: bytes) -> None:
    """Raise ``ProofError`` unless ``proof`` shows leaf hash ``leaf`` at ``index`` under ``root``."""
    _check_hash(root, "root hash")
    got = root_from_inclusion(leaf, index, size, proof)
    if got != root:
        raise ProofError(f"inclusion proof for index {index} in size {size} gives root {got.hex()}, expected {root.hex()}")


def verify_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]) -> None:
    """Raise ``ProofError`` unless ``proof`` shows tree ``old_size`` is a prefix of ``new_size`` (§2.1.4.2)."""
    _check_hash(old_root, "old root")
    _check_hash(new_root, "new root")
    if not 0 <= old_size <= new_size:
        raise ProofError(f"old size {old_size} is not within [0, {new_size}]")
    if old_size == 0 or old_size == new_size:
        _check_trivial_consistency(old_size, new_size, old_root, new_root, proof)
        return
    if not proof:
        raise ProofError(f"empty consistency proof for sizes {old_size} -> {new_size}")
    fr, sr = _consistency_roots(old_size, new_size, old_root, proof)
    if fr != old_root:
        raise ProofError(f"consistency proof {old_size} -> {new_size} gives old root {fr.hex()}, expected {old_root.hex()}")
    if sr != new_root:
        raise ProofError(f"consistency proof {old_size} -> {new_size} gives new root {sr.hex()}, expected {new_root.hex()}")


def _check_trivial_consistency(old_size: int, new_size: int, old_root: bytes, new_root: bytes, proof: Sequence[bytes]) -> None:
    if proof:
        raise ProofError(f"consistency proof {old_size} -> {new_size} must be empty, has {len(proof)} hashes")
    if old_size == 0 and old_root != EMPTY_ROOT:
        raise ProofError(f"old root of the empty tree must be {EMPTY_ROOT.hex()}, got {old_root.hex()}")
    if old_size == new_size and old_root != new_root:
        raise ProofError(f"equal sizes {old_size} but roots differ: {old_root.hex()} != {new_root.hex()}")


def _consistency_roots(old_size: int, new_size: int, old_root: bytes, proof: Sequence[bytes]) -> tuple[bytes, bytes]:
    for i, p in enumerate(proof):
        _check_hash(p, f"proof hash {i}")
    path = [old_root, *proof] if _is_pow2(old_size) else list(proof)
    fn, sn = old_size - 1, new_size - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            raise ProofError(f"consistency proof {old_size} -> {new_size} has too many hashes ({len(proof)})")
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while not fn & 1 and fn != 0:
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    if sn != 0:
        raise ProofError(f"consistency proof {old_size} -> {new_size} has too few hashes ({len(proof)})")
    return fr, sr


def encode_hashes(hashes: Sequence[bytes]) -> list[str]:
    """Proof hashes as standard base64 strings (the JSON / HTTP form)."""
    return [base64.b64encode(h).decode("ascii") for h in hashes]


def decode_hashes(items: Any) -> list[bytes]:
    """Inverse of ``encode_hashes``; raises ``ProofError`` naming the bad item."""
    if not isinstance(items, list):
        raise ProofError(f"proof hashes must be a list, got {type(items).__name__}")
    out = []
    for i, s in enumerate(items):
        try:
            h = base64.b64decode(s, validate=True)
        except (ValueError, TypeError) as exc:
            raise ProofError(f"proof hash {i} is not base64: {exc}") from exc
        _check_hash(h, f"proof hash {i}")
        out.append(h)
    return out


@dataclass(frozen=True)
class InclusionProof:
    """JSON form ``{"log_index", "tree_size", "hashes": [base64…]}``."""

    log_index: int
    tree_size: int
    hashes: tuple[bytes, ...]

    def to_json(self) -> dict[str, Any]:
        return {"log_index": self.log_index, "tree_size": self.tree_size, "hashes": encode_hashes(self.hashes)}

    @classmethod
    def from_json(cls, obj: Any) -> InclusionProof:
        if not isinstance(obj, dict):
            raise ProofError(f"inclusion proof must be an object, got {type(obj).__name__}")
        index, size = obj.get("log_index"), obj.get("tree_size")
        if not (_is_int(index) and _is_int(size)):
            raise ProofError(f"inclusion proof needs integer log_index and tree_size, got {index!r}, {size!r}")
        return cls(index, size, tuple(decode_hashes(obj.get("hashes"))))


@dataclass(frozen=True)
class ConsistencyProof:
    """JSON form ``{"old_size", "new_size", "hashes": [base64…]}``."""

    old_size: int
    new_size: int
    hashes: tuple[bytes, ...]

    def to_json(self) -> dict[str, Any]:
        return {"old_size": self.old_size, "new_size": self.new_size, "hashes": encode_hashes(self.hashes)}

    @classmethod
    def from_json(cls, obj: Any) -> ConsistencyProof:
        if not isinstance(obj, dict):
            raise ProofError(f"consistency proof must be an object, got {type(obj).__name__}")
        old, new = obj.get("old_size"), obj.get("new_size")
        if not (_is_int(old) and _is_int(new)):
            raise ProofError(f"consistency proof needs integer old_size and new_size, got {old!r}, {new!r}")
        return cls(old, new, tuple(decode_hashes(obj.get("hashes"))))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
