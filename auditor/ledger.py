"""The ledger: appends signed transcripts to the store and the Merkle log, and answers checkpoint /
inclusion / consistency questions.

**Group commit.** Concurrent ``append`` calls queue up; one writer task takes everything queued (up to
``max_batch``) and records it in ONE database transaction under the append lock: per-tenant chain
heads → sign each Statement (chained within the batch) → transcript rows → content rows → log leaves
→ ONE signed checkpoint over the new tree. So after any failure either the whole batch exists or
none of it does; a transcript never exists without its leaf, nor a leaf without the checkpoint that
first covers it. Each caller gets its transcript id, log index and the size of that checkpoint once
the transaction has committed, so the checkpoint covering its leaf is already served. If a batch
fails, its drafts are retried one per transaction, so one bad draft fails alone.

Groups commit one after the other; the next group is signed while the one before waits on the
database, against chain heads that include it. Those heads are dropped (``_generation``) whenever a
transaction fails or another process appended: a group signed against dropped heads is signed again
inside its transaction, from what is committed.

Other log entries (replay attestations) use ``transaction()`` + ``append_leaf``; the transaction signs
one checkpoint for whatever it appended.

**Self-check** (``auditor.logcheck``): the full check runs at start (``start``) and on a schedule;
the incremental check runs before every checkpoint. After a mismatch the ledger signs nothing and
every append raises ``LogIntegrityError`` until the process restarts on a repaired database.

The Merkle tree is rebuilt from the stored leaf hashes and kept in memory; a rolled-back transaction
truncates it back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import enum
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from auditor import logcheck, merkle, repository
from auditor.canonical import parse_timestamp
from auditor.checkpoint import Checkpoint, sign_checkpoint
from auditor.crypto import KeyRing, KeyRole
from auditor.db import filelock
from auditor.db.models import LeafKind, LogCheckpoint
from auditor.logcheck import LogFault, LogIntegrityError
from auditor.transcript import SignedTranscript, TranscriptInputs, sign_transcript
from auditor.witnessing import with_cosignatures

log = logging.getLogger("auditor.ledger")

MAX_BATCH = 256
"""Appends recorded in one transaction at most."""


@dataclass(frozen=True)
class TranscriptDraft:
    """Everything of a transcript except its place in the chain and the log (filled in by ``append``)."""

    inputs: dict[str, Any]
    """``TranscriptInputs`` keyword arguments without ``sequence`` and ``previous_digest``."""
    api_key_id: str | None
    system_fingerprint: str
    request_json: dict[str, Any]
    prompt_text: str
    output_text: str


@dataclass(frozen=True)
class Appended:
    transcript_id: str
    sequence: int
    log_index: int
    tree_size: int
    """Size of the signed checkpoint committed with this transcript (the first that covers it)."""
    envelope: dict[str, Any]


@dataclass(frozen=True)
class SignedCheckpoint:
    tree_size: int
    root_hash: bytes
    note: str

    def to_json(self) -> dict[str, Any]:
        return {"tree_size": self.tree_size, "root_hash": base64.b64encode(self.root_hash).decode("ascii"),
                "note": self.note}


class Integrity(enum.Enum):
    UNCHECKED = "unchecked"
    """No full check has finished yet (the first append runs one)."""
    OK = "ok"
    FAULT = "fault"


@dataclass
class LedgerStats:
    """Counters for ``/metrics`` and ``/readyz`` (read at scrape time)."""

    integrity: Integrity = Integrity.UNCHECKED
    fault: LogFault | None = None
    tree_size: int = 0
    appends: int = 0
    """Transcripts recorded."""
    leaves: int = 0
    batches: int = 0
    """Append transactions committed."""
    checkpoints: int = 0
    signed_ahead: int = 0
    """Groups signed while the group before them committed."""
    signed_again: int = 0
    """Of those, groups signed again in their transaction (the heads they were signed against were dropped)."""
    checks: dict[str, int] = field(default_factory=lambda: {"ok": 0, "fault": 0, "error": 0})
    """Full checks finished, by result."""
    last_check_seconds: float | None = None


Pending = tuple[TranscriptDraft, "asyncio.Future[Appended]"]
_Signed = tuple[TranscriptInputs, SignedTranscript, TranscriptDraft]


@dataclass
class _Group:
    """Drafts recorded in one transaction, in queue order."""

    items: list[Pending]
    presigned: list[_Signed] | None
    """Signed ahead of the transaction (None: signed in it)."""
    generation: int
    """``Ledger._generation`` when signed ahead: the signatures hold while it is unchanged."""
    signed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the group's chain heads are final (or it failed): the next group may be signed."""


class Ledger:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], keyring: KeyRing, origin: str, *,
                 writer: async_sessionmaker[AsyncSession] | None = None, max_batch: int = MAX_BATCH) -> None:
        """``sessionmaker`` serves the checks and reads; ``writer`` (default: the same) the append
        transactions: give it a connection of its own so appends never queue behind reads for one."""
        self._sessionmaker = sessionmaker
        self._writer_sessions = writer or sessionmaker
        self._keyring = keyring
        self.origin = origin
        self.max_batch = max_batch
        self._lock = asyncio.Lock()
        self._file_lock: filelock.AsyncHeld | None = None
        self._check_lock = asyncio.Lock()
        self._tree: merkle.MerkleTree | None = None
        self._queue: list[Pending] = []
        self._writer: asyncio.Task[None] | None = None
        self._schedule: asyncio.Task[None] | None = None
        self._last_note: str | None = None
        self._rows: repository.LogRows | None = None
        """Rows of the open transaction, written with its checkpoint."""
        self._heads: dict[str, repository.ChainHead] = {}
        """Per-tenant chain heads after the last group signed (committed, or committing and then ahead
        of the store), valid while the latest checkpoint is the one this process signed."""
        self._generation = 0
        """Bumped whenever ``_heads`` is dropped: a group signed before that is signed again."""
        self._alone = False
        """The last transaction found no other process's appends: signing ahead is likely to hold (with
        busy replicas it rarely does, and every group would be signed twice)."""
        self.stats = LedgerStats()

    # --- self-check ---------------------------------------------------------------------------------

    @property
    def fault(self) -> LogFault | None:
        return self.stats.fault

    async def start(self, interval_seconds: float) -> None:
        """The full check now (a failure to read is logged; the first append retries it), then every
        ``interval_seconds`` (0: never again)."""
        with contextlib.suppress(Exception):
            await self.verify()
        if interval_seconds > 0:
            self._schedule = asyncio.get_running_loop().create_task(self._every(interval_seconds), name="log-check")

    async def stop(self) -> None:
        if self._schedule is not None:
            self._schedule.cancel()
            await asyncio.gather(self._schedule, return_exceptions=True)
            self._schedule = None
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)

    async def _every(self, interval_seconds: float) -> None:
        while True:
            await asyncio.sleep(interval_seconds)
            with contextlib.suppress(Exception):
                await self.verify()

    async def verify(self) -> LogFault | None:
        """Run the full check (``auditor.logcheck``); a fault stops signing and appends for good."""
        async with self._check_lock:
            started = time.perf_counter()
            try:
                result = await logcheck.check_log(self._sessionmaker, self._keyring.jwks())
                if await self._keys_reloaded(result.fault):
                    result = await logcheck.check_log(self._sessionmaker, self._keyring.jwks())
            except Exception:
                self.stats.checks["error"] += 1
                log.exception("log check could not run", extra={"event": "log_check"})
                raise
            self.stats.last_check_seconds = time.perf_counter() - started
            if result.fault is not None:
                self.stats.checks["fault"] += 1
                self._fail(result.fault)
                return result.fault
            self.stats.checks["ok"] += 1
            if self.stats.integrity is Integrity.UNCHECKED:
                self.stats.integrity = Integrity.OK
            log.info("log check passed", extra={"event": "log_check", "log_index": result.tree.size})
            if self._tree is None:
                async with self._lock:
                    self._adopt(result.tree)
            return None

    async def _keys_reloaded(self, fault: LogFault | None) -> bool:
        """Before a checkpoint signature is called bad: another replica may have signed it with a key
        rotated into the shared key directory since this process last read it. True if keys changed."""
        if fault is None or fault.check != "checkpoint_signature":
            return False
        return await asyncio.to_thread(self._keyring.reload_if_changed)

    def _adopt(self, tree: merkle.MerkleTree) -> None:
        if self._tree is None:
            self._tree = tree
            self.stats.tree_size = max(self.stats.tree_size, tree.size)

    def _fail(self, fault: LogFault) -> None:
        """Keep the first fault: nothing is signed or appended after it."""
        if self.stats.fault is None:
            self.stats.fault = fault
            self.stats.integrity = Integrity.FAULT
        log.error("log integrity check failed: appends refused, no checkpoint signed", extra={
            "event": "log_integrity", "log_index": fault.first_bad_index, "error": f"{fault.check}: {fault.detail}"})

    async def _writable(self) -> None:
        """Raise ``LogIntegrityError`` after a fault; run the full check first if none has finished."""
        if self.stats.integrity is Integrity.UNCHECKED:
            await self.verify()
        if self.stats.fault is not None:
            raise LogIntegrityError(self.stats.fault)

    # --- appending ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        """A session in ONE transaction under the append lock (in-process asyncio lock plus, across
        processes, ``repository.lock_log``: an advisory lock on PostgreSQL, the write lock on SQLite,
        taken before the transaction reads anything): use ``append_leaf`` inside it. Before it
        commits, one checkpoint is signed over what was appended (after the incremental check). A
        failure rolls everything back and truncates the in-memory tree to what is committed."""
        await self._writable()
        async with self._lock, self._process_lock():
            start: int | None = None
            try:
                async with self._writer_sessions() as session, session.begin():
                    await repository.lock_log(session)
                    latest = await repository.latest_checkpoint(session)
                    tree = await self._current_tree(session, latest)
                    start = tree.size
                    self._rows = repository.LogRows()
                    yield session
                    if tree.size > start:
                        await self._seal(session, latest, tree, start, self._rows)
            except BaseException:
                self._forget_heads()
                self._last_note = None  # the next transaction reads what is committed
                if self._tree is not None and start is not None:
                    self._tree.truncate(start)
                else:
                    self._tree = None
                raise
            finally:
                self._rows = None
            self.stats.batches += 1
            self.stats.tree_size = max(self.stats.tree_size, tree.size)

    def _process_lock(self) -> filelock.AsyncHeld:
        """Appends of the processes sharing a SQLite file queue on a file lock before ``BEGIN IMMEDIATE``, so
        the write lock passes from one to the next at once instead of through SQLite's sleeping busy handler."""
        if self._file_lock is None:
            bind = self._writer_sessions.kw.get("bind")
            self._file_lock = filelock.AsyncHeld(None if bind is None else bind.url, "log-append")
        return self._file_lock

    async def _current_tree(self, session: AsyncSession, latest: LogCheckpoint | None) -> merkle.MerkleTree:
        """The in-memory tree; synced with the stored leaves unless the latest checkpoint is the one this
        process signed last (every leaf commits with a checkpoint covering it, so then none is new)."""
        if self._tree is not None and latest is not None and latest.note == self._last_note:
            self._alone = True
            return self._tree
        self._alone = False
        self._forget_heads()
        tree = await self._synced_tree(session)
        if self.stats.fault is not None:
            raise LogIntegrityError(self.stats.fault)
        return tree

    async def append_leaf(self, session: AsyncSession, entry: bytes, kind: LeafKind, *,
                          transcript_id: str | None = None, replay_job_id: str | None = None) -> int:
        """Append ``entry`` (a 32-byte envelope digest) in the caller's ``transaction()``; returns the
        leaf index. The leaf row is written, and the checkpoint covering it signed, when the
        transaction ends."""
        return self._append_leaves([(entry, kind, transcript_id, replay_job_id)])[0]

    def _append_leaves(self, leaves: Sequence[tuple[bytes, LeafKind, str | None, str | None]]) -> list[int]:
        assert self._rows is not None and self._tree is not None, "append leaves inside Ledger.transaction()"
        tree, now = self._tree, _now()
        first = tree.size
        for entry, kind, transcript_id, replay_job_id in leaves:
            leaf_hash = merkle.leaf_hash(entry)
            self._rows.leaves.append({"index": tree.size, "leaf_hash": leaf_hash, "entry": entry, "kind": kind.value,
                                      "transcript_id": transcript_id, "replay_job_id": replay_job_id,
                                      "created_at": now})
            tree.append_leaf_hash(leaf_hash)
        self.stats.leaves += len(leaves)
        return list(range(first, tree.size))

    async def _seal(self, session: AsyncSession, latest: LogCheckpoint | None, tree: merkle.MerkleTree,
                    start: int, rows: repository.LogRows) -> None:
        """The incremental check against ``latest`` (read under the lock), then the transaction's rows
        with the signed checkpoint for ``tree``'s size."""
        fault = await logcheck.check_extension(session, latest, tree, start, self._keyring.jwks, self._last_note)
        if await self._keys_reloaded(fault):
            fault = await logcheck.check_extension(session, latest, tree, start, self._keyring.jwks, self._last_note)
        if fault is not None:
            self._fail(fault)
            raise LogIntegrityError(fault)
        checkpoint = self._sign(tree.size, tree.root())
        await repository.add_log_rows(session, rows, {
            "tree_size": checkpoint.tree_size, "root_hash": checkpoint.root_hash, "note": checkpoint.note,
            "created_at": _now()})
        self._last_note = checkpoint.note
        self.stats.checkpoints += 1

    async def append(self, draft: TranscriptDraft) -> Appended:
        """Record one transcript; concurrent calls share a transaction and a checkpoint (module docstring)."""
        if self.stats.fault is not None:
            raise LogIntegrityError(self.stats.fault)
        future: asyncio.Future[Appended] = asyncio.get_running_loop().create_future()
        self._queue.append((draft, future))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_queued(), name="ledger-writer")
        return await future

    async def _write_queued(self) -> None:
        """Commit the queued groups one after the other; each next group is signed while the one
        before waits on the database (signing is CPU, a commit mostly waiting), as soon as that one's
        chain heads are final. A group signed ahead is signed again in its transaction if the heads
        it was signed against were dropped meanwhile (a failed commit, another process's appends)."""
        group = self._next_group()
        while group is not None:
            committing = asyncio.ensure_future(self._write(group))
            signed = asyncio.ensure_future(group.signed.wait())
            await asyncio.wait((committing, signed), return_when=asyncio.FIRST_COMPLETED)
            signed.cancel()
            ahead = self._next_group()
            await committing
            group = ahead or self._next_group()

    def _next_group(self) -> _Group | None:
        """The next group of queued drafts (None when the queue is empty)."""
        while self._queue:
            items, self._queue = self._queue[:self.max_batch], self._queue[self.max_batch:]
            group = self._presign([(draft, future) for draft, future in items if not future.done()])
            if group is not None:
                return group
        return None

    def _presign(self, items: list[Pending]) -> _Group | None:
        """``items`` signed against ``_heads`` when every tenant's head is known (a draft the Statement
        refuses fails alone, here); else left to sign in the transaction. None if nothing is left."""
        if not items:
            return None
        group = _Group(items, None, self._generation)
        if not self._alone or not {draft.inputs["tenant"] for draft, _ in items} <= self._heads.keys():
            return group
        heads, kept, signed = dict(self._heads), [], []
        for draft, future in items:
            try:
                signed.append(self._sign_draft(draft, heads))
            except ValueError as exc:
                future.set_exception(exc)
                continue
            kept.append((draft, future))
        self._heads.update(heads)
        group.items, group.presigned = kept, signed
        self.stats.signed_ahead += 1
        return group if kept else None

    def _sign_draft(self, draft: TranscriptDraft, heads: dict[str, repository.ChainHead]) -> _Signed:
        """Sign ``draft`` as the next link of its tenant's chain in ``heads`` (which it advances)."""
        head = heads[draft.inputs["tenant"]]
        inputs = TranscriptInputs(**draft.inputs, sequence=head.sequence, previous_digest=head.previous_digest)
        signed = sign_transcript(inputs, self._keyring)
        heads[inputs.tenant] = repository.ChainHead(head.sequence + 1, signed.payload_digest)
        return inputs, signed, draft

    def _forget_heads(self) -> None:
        self._heads.clear()
        self._generation += 1

    async def _write(self, group: _Group) -> None:
        try:
            appended = await self._append_group(group)
        except Exception as exc:  # noqa: BLE001 - handed to the callers (or retried one by one)
            if len(group.items) > 1 and not isinstance(exc, LogIntegrityError):
                for item in group.items:
                    await self._write(_Group([item], None, self._generation))
                return
            for _, future in group.items:
                if not future.done():
                    future.set_exception(exc)
            return
        finally:
            group.signed.set()
        for (_, future), result in zip(group.items, appended):
            if not future.done():
                future.set_result(result)

    async def _append_group(self, group: _Group) -> list[Appended]:
        """Chain heads → sign (unless signed ahead, against heads still valid) → transcript and content
        rows → leaves → checkpoint, in one transaction."""
        async with self.transaction() as session:
            signed = group.presigned if group.generation == self._generation else None
            if signed is None:
                self.stats.signed_again += group.presigned is not None
                signed = await self._sign_in(session, [draft for draft, _ in group.items])
            group.signed.set()
            first = self._tree.size if self._tree is not None else 0
            assert self._rows is not None
            self._rows.transcripts += [_transcript_row(x, s, d, first + i) for i, (x, s, d) in enumerate(signed)]
            self._rows.contents += [_content_row(x, d) for x, _, d in signed]
            indices = self._append_leaves([(s.leaf_data, LeafKind.TRANSCRIPT, x.transcript_id, None)
                                           for x, s, _ in signed])
            assert indices == list(range(first, first + len(signed))), (indices, first)
        size = first + len(signed)
        self.stats.appends += len(signed)
        return [Appended(x.transcript_id, x.sequence, first + i, size, s.envelope)
                for i, (x, s, _) in enumerate(signed)]

    async def _sign_in(self, session: AsyncSession, drafts: Sequence[TranscriptDraft]) -> list[_Signed]:
        """Sign ``drafts`` inside the transaction, reading the heads of tenants not known yet."""
        unknown = {d.inputs["tenant"] for d in drafts} - self._heads.keys()
        if unknown:
            self._heads.update(await repository.chain_heads(session, unknown))
        return [self._sign_draft(draft, self._heads) for draft in drafts]

    async def _synced_tree(self, session: AsyncSession) -> merkle.MerkleTree:
        """The in-memory tree, extended with leaves other processes may have appended (each one checked
        against what it logs; a mismatch is recorded as the ledger's fault)."""
        if self._tree is None:
            self._tree = merkle.MerkleTree()
        tree = self._tree
        records = await repository.leaf_records(session, tree.size)
        fault = logcheck.check_leaves(records, tree.size)
        if fault is not None:
            self._fail(fault)
        for record in records:
            tree.append_leaf_hash(record.leaf_hash)
        return tree

    def _sign(self, tree_size: int, root: bytes) -> SignedCheckpoint:
        note = sign_checkpoint(Checkpoint(self.origin, tree_size, root), self._keyring.signer(KeyRole.CHECKPOINT))
        return SignedCheckpoint(tree_size, root, note)

    # --- reading -------------------------------------------------------------------------------------

    async def checkpoint(self, session: AsyncSession) -> SignedCheckpoint:
        """The latest committed checkpoint with the witnesses' stored cosignatures (an empty log gets a
        freshly signed size-0 checkpoint)."""
        row = await repository.latest_checkpoint(session)
        if row is None:
            return self._sign(0, merkle.EMPTY_ROOT)
        return SignedCheckpoint(row.tree_size, bytes(row.root_hash),
                                await with_cosignatures(session, row.tree_size, row.note))

    async def checkpoint_at(self, session: AsyncSession, tree_size: int) -> SignedCheckpoint | None:
        """The stored checkpoint of ``tree_size`` with its cosignatures, if one was signed."""
        row = await repository.checkpoint_at(session, tree_size)
        if row is None:
            return None
        return SignedCheckpoint(row.tree_size, bytes(row.root_hash),
                                await with_cosignatures(session, row.tree_size, row.note))

    async def tree_for(self, session: AsyncSession, size: int) -> merkle.MerkleTree:
        """A tree holding at least ``size`` committed leaves (proofs must name a size)."""
        tree = self._tree
        if tree is None or tree.size < size:
            async with self._lock:
                tree = await self._synced_tree(session)
        if tree.size < size:
            raise ValueError(f"tree_size {size} exceeds the log size {tree.size}")
        return tree

    async def inclusion_proof(self, session: AsyncSession, index: int, tree_size: int) -> merkle.InclusionProof:
        tree = await self.tree_for(session, tree_size)
        return merkle.InclusionProof(index, tree_size, tuple(tree.inclusion_proof(index, tree_size)))

    async def consistency_proof(self, session: AsyncSession, old_size: int, new_size: int) -> merkle.ConsistencyProof:
        tree = await self.tree_for(session, new_size)
        return merkle.ConsistencyProof(old_size, new_size, tuple(tree.consistency_proof(old_size, new_size)))

    async def leaf_hash(self, session: AsyncSession, index: int, tree_size: int) -> bytes:
        return (await self.tree_for(session, tree_size)).leaf_hash(index)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _transcript_row(x: TranscriptInputs, signed: SignedTranscript, draft: TranscriptDraft, index: int) -> dict[str, Any]:
    return {
        "id": x.transcript_id, "tenant": x.tenant, "sequence": x.sequence, "previous_digest": x.previous_digest,
        "api": str(x.api), "model": x.model.name,
        "deterministic": x.deterministic, "status": str(x.status), "finish_reason": x.finish_reason,
        "seed": str(x.seed), "prompt_tokens": len(x.prompt_ids), "completion_tokens": len(x.output_ids),
        "system_fingerprint": draft.system_fingerprint, "key_id": signed.envelope["signatures"][0]["keyid"],
        "api_key_id": draft.api_key_id, "envelope": signed.envelope_bytes,
        "payload_digest": signed.payload_digest, "envelope_digest": signed.envelope_digest, "log_index": index,
        "created_at": parse_timestamp(x.received_at), "completed_at": parse_timestamp(x.completed_at),
    }


def _content_row(x: TranscriptInputs, draft: TranscriptDraft) -> dict[str, Any]:
    return {
        "transcript_id": x.transcript_id, "salt": x.salt, "prompt_token_ids": list(x.prompt_ids),
        "output_token_ids": list(x.output_ids), "token_logprobs": [float(v) for v in x.logprobs],
        "request_json": draft.request_json, "prompt_text": draft.prompt_text, "output_text": draft.output_text,
    }
