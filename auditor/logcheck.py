"""The log's self-check: the server verifies its own log before it signs a checkpoint over it.

**Full check** (``check_log``; at start and every ``log_check_interval_seconds``), over what the
database holds:

1. the leaves are dense from index 0 and every ``leaf_hash`` is ``SHA-256(0x00 ‖ entry)``;
2. every transcript leaf names a transcript row that says it sits at this index and whose stored
   envelope bytes hash to the leaf's entry (so does its ``envelope_digest`` column); every
   replay-attestation leaf the same with its replay job's stored attestation;
3. the reverse: every transcript, and every replay job with a log index, has a leaf at that index
   naming it;
4. the latest stored checkpoint is a signed note by one of this server's checkpoint keys, states the
   size and root of its row, covers every stored leaf, and the tree rebuilt from the stored leaves has
   its root at its size.

**Incremental check** (``check_extension``; in the append transaction, before each new checkpoint is
signed): the tree the new checkpoint is signed over extends the latest stored checkpoint (its
consistency proof verifies against both roots), that checkpoint is signed and covers every leaf, and
leaves another process appended since (``check_leaf``) pass 1–2. It costs O(log n) hashes and one
signature check at most, so it runs on every checkpoint; the O(n) rebuild is left to the full check.

A mismatch is a ``LogFault``: the check that failed, the first bad log index and a detail made of
indices, ids and hashes only (never content). ``Ledger`` keeps the first fault it meets: from then on
it signs nothing and refuses appends (``LogIntegrityError``) until an operator repairs the database
and restarts the server.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from auditor import merkle, repository
from auditor.checkpoint import CheckpointError, verify_checkpoint
from auditor.db.models import LeafKind, LogCheckpoint
from auditor.repository import LeafRecord

CHUNK = 2000
"""Leaves read per query by the full check."""


@dataclass(frozen=True)
class LogFault:
    """A mismatch between the log and what it logs. ``first_bad_index`` is the lowest log index whose
    leaf, logged record or covering checkpoint is wrong (for a root mismatch with every leaf matching its
    record: the size of the last stored checkpoint that still matches, i.e. the first index that may
    have changed)."""

    check: str
    first_bad_index: int
    detail: str

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "first_bad_index": self.first_bad_index, "detail": self.detail}

    def describe(self) -> str:
        return f"{self.check} at log index {self.first_bad_index}: {self.detail}"


class LogIntegrityError(Exception):
    """The log failed its self-check: nothing is signed or appended until it is repaired."""

    def __init__(self, fault: LogFault) -> None:
        super().__init__(f"the log failed its integrity check ({fault.describe()})")
        self.fault = fault


@dataclass(frozen=True)
class CheckResult:
    fault: LogFault | None
    tree: merkle.MerkleTree
    """The tree rebuilt from the stored leaves (up to the first bad leaf)."""
    checkpoint_size: int
    """Size of the latest stored checkpoint when the check began (0 for none)."""


# --- one leaf --------------------------------------------------------------------------------------


def check_leaf(record: LeafRecord, expected_index: int) -> LogFault | None:
    """Checks 1–2 for one leaf read at position ``expected_index`` of the log."""
    i = record.index
    if i != expected_index:
        return LogFault("leaf_dense", expected_index, f"log leaves are not dense: expected index {expected_index}, "
                        f"found {i}")
    if record.leaf_hash != merkle.leaf_hash(record.entry):
        return LogFault("leaf_hash", i, f"leaf_hash {record.leaf_hash.hex()} is not SHA-256(0x00 ‖ entry) = "
                        f"{merkle.leaf_hash(record.entry).hex()} (entry {record.entry.hex()})")
    if record.kind == LeafKind.TRANSCRIPT.value:
        return _logged_fault(record, "transcript", record.transcript_id)
    if record.kind == LeafKind.REPLAY_ATTESTATION.value:
        return _logged_fault(record, "replay job", record.replay_job_id)
    return LogFault("leaf_kind", i, f"leaf kind {record.kind!r} is not one of "
                    f"{[k.value for k in LeafKind]}")


def _logged_fault(record: LeafRecord, what: str, record_id: str | None) -> LogFault | None:
    i = record.index
    check = "leaf_record" if what == "transcript" else "leaf_replay"
    if record_id is None:
        return LogFault(check, i, f"{record.kind} leaf names no {what}")
    if record.logged is None:
        return LogFault(check, i, f"{what} {record_id} named by the leaf is missing (or has no stored envelope)")
    if record.logged_index != i:
        return LogFault(check, i, f"{what} {record_id} says it is at log index {record.logged_index}, its leaf is at {i}")
    digest = hashlib.sha256(record.logged).digest()
    if digest != record.entry:
        return LogFault("leaf_envelope", i, f"the stored envelope of {what} {record_id} hashes to {digest.hex()}, "
                        f"the leaf's entry is {record.entry.hex()}")
    if what == "transcript" and record.envelope_digest != digest.hex():
        return LogFault("leaf_envelope", i, f"transcript {record_id} envelope_digest column "
                        f"{record.envelope_digest} differs from SHA-256 of its envelope {digest.hex()}")
    return None


# --- the full check ---------------------------------------------------------------------------------------


async def check_log(sessionmaker: async_sessionmaker[AsyncSession], jwks: Mapping[str, Any]) -> CheckResult:
    """Checks 1–4 over the whole stored log (module docstring). Reads in chunks, one short session
    each, so appends go on meanwhile; what they add past the checkpoint read first is checked leaf by
    leaf and covered by the incremental check when it is signed."""
    async with sessionmaker() as session:
        latest = await repository.latest_checkpoint(session)
    tree = merkle.MerkleTree()
    fault = await _scan_leaves(sessionmaker, tree)
    async with sessionmaker() as session:
        missing = await _record_without_leaf(session)
        fault = _lowest(fault, missing)
        if fault is None:
            # Read after the scan: a leaf the scan saw committed with the checkpoint that covers it.
            fault = _coverage_fault(await repository.latest_checkpoint(session), tree.size)
        if fault is None:
            # Checked against the one read before the scan: every leaf it covers was scanned.
            fault = await _check_checkpoint(session, latest, tree, jwks, covered=0)
    return CheckResult(fault, tree, latest.tree_size if latest else 0)


async def _scan_leaves(sessionmaker: async_sessionmaker[AsyncSession], tree: merkle.MerkleTree) -> LogFault | None:
    while True:
        async with sessionmaker() as session:
            records = await repository.leaf_records(session, tree.size, tree.size + CHUNK)
        for record in records:
            fault = check_leaf(record, tree.size)
            if fault is not None:
                return fault
            tree.append_leaf_hash(record.leaf_hash)
        if len(records) < CHUNK:
            return None


async def _record_without_leaf(session: AsyncSession) -> LogFault | None:
    faults = [LogFault("transcript_leaf", index, f"transcript {tid} says it is at log index {index}, "
                       "but no leaf there names it")
              for tid, index in await repository.transcripts_without_leaf(session)]
    faults += [LogFault("replay_leaf", index, f"replay job {rid} says it is at log index {index}, "
                        "but no leaf there names it")
               for rid, index in await repository.replays_without_leaf(session)]
    return min(faults, key=lambda f: f.first_bad_index, default=None)


def _lowest(a: LogFault | None, b: LogFault | None) -> LogFault | None:
    candidates = [f for f in (a, b) if f is not None]
    return min(candidates, key=lambda f: f.first_bad_index, default=None)


async def _check_checkpoint(session: AsyncSession, latest: LogCheckpoint | None, tree: merkle.MerkleTree,
                            jwks: Mapping[str, Any], *, covered: int) -> LogFault | None:
    """Check 4 for ``latest`` against ``tree``; ``covered``: leaves that must lie under it."""
    size = latest.tree_size if latest is not None else 0
    fault = _coverage_fault(latest, covered)
    if fault is not None:
        return fault
    if latest is None:
        return None
    if size > tree.size:
        return LogFault("checkpoint_coverage", tree.size, f"the latest checkpoint covers {size} leaves, "
                        f"only {tree.size} are stored")
    note_fault = _note_fault(latest, jwks)
    if note_fault is not None:
        return LogFault("checkpoint_signature", await _previous_size(session, size), note_fault)
    root = tree.root(size)
    if root != bytes(latest.root_hash):
        first = await _first_changed(session, tree, size)
        return LogFault("checkpoint_root", first, f"the tree rebuilt from the stored leaves has root {root.hex()} at "
                        f"size {size}, the signed checkpoint says {bytes(latest.root_hash).hex()}; "
                        f"the stored checkpoints still match up to size {first}")
    return None


def _coverage_fault(latest: LogCheckpoint | None, covered: int) -> LogFault | None:
    """A leaf commits with the checkpoint that first covers it: one ``latest`` does not cover was not
    written by a ledger."""
    size = latest.tree_size if latest is not None else 0
    if size >= covered:
        return None
    return LogFault("checkpoint_coverage", size, f"leaves {size}..{covered - 1} are covered by no signed "
                    f"checkpoint (latest checkpoint size {size})")


def _note_fault(row: LogCheckpoint, jwks: Mapping[str, Any]) -> str | None:
    try:
        checkpoint = verify_checkpoint(row.note, jwks)
    except CheckpointError as exc:
        return f"checkpoint of size {row.tree_size}: {exc}"
    if (checkpoint.tree_size, checkpoint.root_hash) != (row.tree_size, bytes(row.root_hash)):
        return (f"checkpoint row says size {row.tree_size} root {bytes(row.root_hash).hex()}, its signed note "
                f"says size {checkpoint.tree_size} root {checkpoint.root_hash.hex()}")
    return None


async def _previous_size(session: AsyncSession, size: int) -> int:
    earlier = [s for s, _ in await repository.checkpoint_roots(session, size - 1)]
    return earlier[-1] if earlier else 0


async def _first_changed(session: AsyncSession, tree: merkle.MerkleTree, size: int) -> int:
    """The size of the last stored checkpoint whose root the rebuilt tree still has (0 if none): a leaf
    changed at or after it. Bisects, since a changed leaf changes the root of every size past it."""
    roots = await repository.checkpoint_roots(session, size)
    lo, hi = 0, len(roots) - 1  # roots[hi] (the latest) does not match
    while lo < hi:
        mid = (lo + hi) // 2
        mid_size, mid_root = roots[mid]
        if tree.root(mid_size) == mid_root:
            lo = mid + 1
        else:
            hi = mid
    return roots[lo - 1][0] if lo > 0 else 0


# --- the incremental check ---------------------------------------------------------------------------------


async def check_extension(session: AsyncSession, latest: LogCheckpoint | None, tree: merkle.MerkleTree,
                          covered: int, jwks: Callable[[], Mapping[str, Any]], known_note: str | None) -> LogFault | None:
    """Before signing a checkpoint for ``tree``: ``latest``, the latest stored checkpoint (read under
    the append lock), covers the first ``covered`` leaves, is signed, and ``tree`` is a consistent
    extension of it.

    ``known_note``: the last note this process signed; a stored note equal to it skips the signature
    check (we made it), nothing else. ``jwks`` is called only when a signature must be checked."""
    size = latest.tree_size if latest is not None else 0
    if latest is None or size < covered or size > tree.size:
        return await _check_checkpoint(session, latest, tree, jwks(), covered=covered)
    if latest.note != known_note:
        note_fault = _note_fault(latest, jwks())
        if note_fault is not None:
            return LogFault("checkpoint_signature", await _previous_size(session, size), note_fault)
    old_root, new_root = bytes(latest.root_hash), tree.root()
    try:
        merkle.verify_consistency(size, tree.size, old_root, new_root, tree.consistency_proof(size))
    except merkle.ProofError as exc:
        first = await _first_changed(session, tree, size)
        return LogFault("consistency", first, f"the new tree of size {tree.size} does not extend the latest signed "
                        f"checkpoint (size {size}): {exc}")
    return None


def check_leaves(records: Sequence[LeafRecord], start: int) -> LogFault | None:
    """``check_leaf`` over consecutive records expected from index ``start``."""
    for offset, record in enumerate(records):
        fault = check_leaf(record, start + offset)
        if fault is not None:
            return fault
    return None
