"""The ledger: appends signed transcripts to the store and the Merkle log in ONE transaction, and
answers checkpoint / inclusion / consistency questions.

One append = (per-tenant chain head → sign the Statement → transcript row → content row → log leaf
→ signed checkpoint), all inside a single database transaction under the append lock, so after any
failure either everything exists or nothing does. The Merkle tree is rebuilt from the persisted leaf
hashes (``log_leaves``) and kept in memory; a failed append drops the in-memory copy.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from auditor import merkle, repository
from auditor.canonical import canonical_json, parse_timestamp
from auditor.checkpoint import Checkpoint, sign_checkpoint
from auditor.crypto import KeyRing, KeyRole
from auditor.db.models import LeafKind, LogCheckpoint, LogLeaf, Transcript, TranscriptContent
from auditor.transcript import SignedTranscript, TranscriptInputs, sign_transcript
from auditor.witnessing import with_cosignatures


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
    envelope: dict[str, Any]


@dataclass(frozen=True)
class SignedCheckpoint:
    tree_size: int
    root_hash: bytes
    note: str

    def to_json(self) -> dict[str, Any]:
        return {"tree_size": self.tree_size, "root_hash": base64.b64encode(self.root_hash).decode("ascii"),
                "note": self.note}


class Ledger:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], keyring: KeyRing, origin: str) -> None:
        self._sessionmaker = sessionmaker
        self._keyring = keyring
        self.origin = origin
        self._lock = asyncio.Lock()
        self._tree: merkle.MerkleTree | None = None

    # --- appending ------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[AsyncSession]:
        """A session in ONE transaction under the append lock (in-process asyncio lock plus, on
        PostgreSQL, an advisory lock): use ``append_leaf`` inside it. A failure rolls everything back
        and drops the in-memory tree (it is rebuilt from the committed leaves)."""
        async with self._lock:
            try:
                async with self._sessionmaker() as session, session.begin():
                    await repository.lock_log(session)
                    yield session
            except BaseException:
                self._tree = None
                raise

    async def append_leaf(self, session: AsyncSession, entry: bytes, kind: LeafKind, *,
                          transcript_id: str | None = None, replay_job_id: str | None = None) -> int:
        """Append ``entry`` (a 32-byte envelope digest) and a signed checkpoint for the new size, in the
        caller's ``transaction()``; returns the leaf index."""
        tree = await self._synced_tree(session)
        index = tree.size
        leaf_hash = merkle.leaf_hash(entry)
        await repository.add_leaf(session, LogLeaf(
            index=index, leaf_hash=leaf_hash, entry=entry, kind=kind.value, transcript_id=transcript_id,
            replay_job_id=replay_job_id, created_at=_now()))
        tree.append_leaf_hash(leaf_hash)
        checkpoint = self._sign(tree.size, tree.root())
        await repository.add_checkpoint(session, LogCheckpoint(
            tree_size=checkpoint.tree_size, root_hash=checkpoint.root_hash, note=checkpoint.note, created_at=_now()))
        return index

    async def append(self, draft: TranscriptDraft) -> Appended:
        """Chain head → sign → transcript + content rows → log leaf → checkpoint, in one transaction."""
        async with self.transaction() as session:
            head = await repository.chain_head(session, draft.inputs["tenant"])
            inputs = TranscriptInputs(**draft.inputs, sequence=head.sequence, previous_digest=head.previous_digest)
            signed = sign_transcript(inputs, self._keyring)
            index = (await self._synced_tree(session)).size
            await repository.add_transcript(session, _transcript_row(inputs, signed, draft, index),
                                            _content_row(inputs, draft))
            appended = await self.append_leaf(session, signed.leaf_data, LeafKind.TRANSCRIPT,
                                              transcript_id=inputs.transcript_id)
            assert appended == index, (appended, index)
            return Appended(inputs.transcript_id, head.sequence, index, index + 1, signed.envelope)

    async def _synced_tree(self, session: AsyncSession) -> merkle.MerkleTree:
        """The in-memory tree, extended with leaves other processes may have appended."""
        if self._tree is None:
            self._tree = merkle.MerkleTree()
        for leaf_hash in await repository.leaf_hashes(session, self._tree.size):
            self._tree.append_leaf_hash(leaf_hash)
        return self._tree

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


def _transcript_row(x: TranscriptInputs, signed: SignedTranscript, draft: TranscriptDraft, index: int) -> Transcript:
    return Transcript(
        id=x.transcript_id, tenant=x.tenant, sequence=x.sequence, previous_digest=x.previous_digest,
        api=str(x.api), model=x.model.name,
        deterministic=x.deterministic, status=str(x.status), finish_reason=x.finish_reason, seed=str(x.seed),
        prompt_tokens=len(x.prompt_ids), completion_tokens=len(x.output_ids),
        system_fingerprint=draft.system_fingerprint, key_id=signed.envelope["signatures"][0]["keyid"],
        api_key_id=draft.api_key_id, envelope=canonical_json(signed.envelope),
        payload_digest=signed.payload_digest, envelope_digest=signed.envelope_digest, log_index=index,
        created_at=parse_timestamp(x.received_at), completed_at=parse_timestamp(x.completed_at),
    )


def _content_row(x: TranscriptInputs, draft: TranscriptDraft) -> TranscriptContent:
    return TranscriptContent(
        transcript_id=x.transcript_id, salt=x.salt, prompt_token_ids=list(x.prompt_ids),
        output_token_ids=list(x.output_ids), token_logprobs=[float(v) for v in x.logprobs],
        request_json=draft.request_json, prompt_text=draft.prompt_text, output_text=draft.output_text,
    )
