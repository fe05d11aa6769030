"""The witness's checks (C2SP tlog-witness add-checkpoint), HTTP-free.

Order of the checks and the status each failure answers with (the spec's):

    body malformed                                   400
    checkpoint origin not configured                 404
    no signature by a trusted log key verifies       403
    old size > checkpoint size                       400
    old size != the latest size cosigned for origin  409 (body: that size, text/x.tlog.size)
    old size == checkpoint size, root differs        409
    consistency proof does not verify                422
    otherwise: cosign, persist, answer               200 (body: the cosignature line)

The compare-and-persist step runs under one lock, so two submissions can never roll the record back.
Refusals of correctly signed checkpoints (409 on a root conflict, 422) are kept as evidence.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from auditor.checkpoint import Checkpoint, CheckpointError, split_note, verify_checkpoint
from auditor.cosignature import Cosigner
from auditor.crypto import KeyRole, KeyStatus, VerifierKey, jwk_thumbprint
from auditor.merkle import EMPTY_ROOT, ProofError, encode_hashes, verify_consistency
from auditor.witness.protocol import AddCheckpoint, ProtocolError
from auditor.witness.state import LogRecord, WitnessState


class Refusal(Exception):
    """A submission the witness does not cosign: the HTTP status, a message, and for 409 the latest size."""

    def __init__(self, status: int, message: str, size: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.size = size


def trusted_keys(public_keys: Sequence[bytes]) -> dict[str, VerifierKey]:
    """A log's checkpoint keys in the form ``verify_checkpoint`` takes."""
    return {jwk_thumbprint(raw): VerifierKey(jwk_thumbprint(raw), KeyRole.CHECKPOINT, KeyStatus.ACTIVE, raw)
            for raw in public_keys}


@dataclass(frozen=True)
class Cosigned:
    line: str
    size: int


class Witness:
    def __init__(self, cosigner: Cosigner, logs: Mapping[str, Sequence[bytes]], state: WitnessState,
                 clock: Callable[[], float] = time.time) -> None:
        self.cosigner = cosigner
        self.logs = {origin: trusted_keys(keys) for origin, keys in logs.items()}
        self.state = state
        self._clock = clock
        self._lock = asyncio.Lock()

    async def add_checkpoint(self, body: bytes) -> Cosigned:
        """Check ``body`` and cosign its checkpoint, or raise ``Refusal``."""
        request, checkpoint = self._parse(body)
        if request.old_size > checkpoint.tree_size:
            raise Refusal(400, f"old size {request.old_size} exceeds the checkpoint size {checkpoint.tree_size}")
        async with self._lock:
            record = self.state.get(checkpoint.origin)
            latest = record.size if record else 0
            if request.old_size != latest:
                raise Refusal(409, f"old size {request.old_size} is not the latest cosigned size {latest} of "
                              f"{checkpoint.origin!r}", size=latest)
            self._check_consistency(request, checkpoint, record)
            text = checkpoint.body()
            line = self.cosigner.cosign(text, int(self._clock()))
            if record is None or checkpoint.tree_size > record.size:
                self.state.put(checkpoint.origin, LogRecord(checkpoint.tree_size, checkpoint.root_hash, request.note))
        return Cosigned(line, checkpoint.tree_size)

    def _parse(self, body: bytes) -> tuple[AddCheckpoint, Checkpoint]:
        try:
            request = AddCheckpoint.parse(body)
            text, _ = split_note(request.note)
            checkpoint = Checkpoint.parse(text)
        except (ProtocolError, CheckpointError) as exc:
            raise Refusal(400, str(exc)) from None
        keys = self.logs.get(checkpoint.origin)
        if keys is None:
            raise Refusal(404, f"unknown log origin {checkpoint.origin!r}")
        try:
            verify_checkpoint(request.note, keys, origin=checkpoint.origin)
        except CheckpointError as exc:
            raise Refusal(403, f"checkpoint of {checkpoint.origin!r}: {exc}") from None
        return request, checkpoint

    def _check_consistency(self, request: AddCheckpoint, checkpoint: Checkpoint, record: LogRecord | None) -> None:
        old_root = record.root_hash if record else EMPTY_ROOT
        if request.old_size == checkpoint.tree_size and record is not None and old_root != checkpoint.root_hash:
            self._evidence("root_conflict", request, checkpoint, record)
            raise Refusal(409, f"checkpoint of size {checkpoint.tree_size} has root "
                          f"{checkpoint.root_hash.hex()}, the cosigned one has {old_root.hex()}",
                          size=record.size)
        try:
            verify_consistency(request.old_size, checkpoint.tree_size, old_root, checkpoint.root_hash,
                               list(request.proof))
        except ProofError as exc:
            self._evidence("inconsistent", request, checkpoint, record)
            raise Refusal(422, f"consistency proof {request.old_size} -> {checkpoint.tree_size} does not verify: "
                          f"{exc}") from None

    def _evidence(self, reason: str, request: AddCheckpoint, checkpoint: Checkpoint, record: LogRecord | None) -> None:
        self.state.record_evidence({
            "at": dt.datetime.fromtimestamp(self._clock(), dt.UTC).isoformat(), "reason": reason,
            "origin": checkpoint.origin, "old_size": request.old_size, "proof": encode_hashes(request.proof),
            "submitted": request.note, "cosigned": record.checkpoint if record else None})
