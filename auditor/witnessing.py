"""The log's side of witnessing: submit each new checkpoint to the configured C2SP tlog-witnesses with a
consistency proof from the size each witness last cosigned, and store the cosignatures they return.

A background task per server process checks every ``witness_interval`` seconds for a latest checkpoint a
witness has not cosigned. Per witness, one process at a time submits (a PostgreSQL advisory lock held for
the transaction; on SQLite a file lock beside the database), so replicas do not race one another; a
witness that has moved on (409 with its size) is answered once more from that size. Stored cosignatures
are merged into every checkpoint the server serves (``with_cosignatures``), so transcripts, replays and
bundles carry them.

A witness refusing a correctly signed checkpoint (422: the proof from what it cosigned does not verify;
409 on a root conflict) means the log is not an extension of what was witnessed: it is logged as an
error and counted, and the checkpoint stays uncosigned.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from auditor import repository
from auditor.cosignature import CosignatureError, CosignerKey, signature_lines, verify_cosignatures, with_signature_lines
from auditor.db import filelock
from auditor.db.models import CheckpointCosignature, LogCheckpoint
from auditor.logs import log_failure
from auditor.witness.client import Answer, add_checkpoint

if TYPE_CHECKING:
    from auditor.ledger import Ledger

log = logging.getLogger("auditor.witnessing")


class WitnessingError(Exception):
    """The witnesses did not cosign in time (or none is configured)."""


@dataclass(frozen=True)
class WitnessEndpoint:
    url: str
    """The witness's submission prefix (``POST <url>/add-checkpoint``)."""
    key: CosignerKey


async def with_cosignatures(session: AsyncSession, tree_size: int, note: str) -> str:
    """``note`` (the checkpoint of ``tree_size``) with every stored witness cosignature appended."""
    lines = await repository.cosignature_lines(session, tree_size)
    return with_signature_lines(note, lines) if lines else note


class WitnessPool:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], ledger: Ledger,
                 endpoints: Sequence[WitnessEndpoint], quorum: int, *, interval: float, timeout: float,
                 on_result: Any = None) -> None:
        if not 1 <= quorum <= len(endpoints):
            raise ValueError(f"witness quorum must be in 1..{len(endpoints)}, got {quorum}")
        self._sessionmaker = sessionmaker
        self._ledger = ledger
        self.endpoints = list(endpoints)
        self.quorum = quorum
        self.interval = interval
        self.timeout = timeout
        self._on_result = on_result or (lambda witness, outcome: None)
        self._locks = {e.key.name: asyncio.Lock() for e in self.endpoints}
        self._refused: dict[str, int] = {}
        """Per witness, the checkpoint size it last refused: not submitted again (a new one will be)."""
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    @classmethod
    def from_settings(cls, settings: Any, sessionmaker: async_sessionmaker[AsyncSession], ledger: Ledger,
                      on_result: Any = None) -> WitnessPool | None:
        if not settings.witnesses:
            return None
        endpoints = [WitnessEndpoint(url, key) for url, key in settings.witness_keys()]
        return cls(sessionmaker, ledger, endpoints, settings.required_cosignatures, interval=settings.witness_interval,
                   timeout=settings.witness_timeout, on_result=on_result)

    @property
    def names(self) -> list[str]:
        return [e.key.name for e in self.endpoints]

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="witnessing")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _run(self) -> None:
        while True:
            await self.round()
            await asyncio.sleep(self.interval)

    # --- one round ------------------------------------------------------------------------------

    async def round(self) -> None:
        """Ask every witness, concurrently, to cosign the latest checkpoint it has not cosigned."""
        await asyncio.gather(*(self._guarded(e) for e in self.endpoints))

    async def ensure_witnessed(self, min_size: int = 0) -> int:
        """A checkpoint size at least ``min_size`` and at least the latest checkpoint's when called, with a
        quorum of cosignatures (the witnesses are asked now); raises ``WitnessingError`` after ``timeout``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        async with self._sessionmaker() as session:
            latest = await repository.latest_checkpoint(session)
        wanted = max(min_size, latest.tree_size if latest is not None else 0)
        while True:
            await self.round()
            async with self._sessionmaker() as session:
                size = await repository.latest_witnessed_size(session, self.names, self.quorum)
            if size is not None and size >= wanted:
                return size
            if loop.time() >= deadline:
                raise WitnessingError(f"checkpoint {wanted} has not got {self.quorum} of {len(self.endpoints)} "
                                      f"witness cosignatures after {self.timeout:g} s (largest witnessed: {size})")
            await asyncio.sleep(min(0.2, self.interval))

    async def _guarded(self, endpoint: WitnessEndpoint) -> None:
        try:
            await self._cosign_latest(endpoint)
        except (httpx.HTTPError, OSError) as exc:
            self._report(endpoint, "unreachable", f"witness {endpoint.key.name} at {endpoint.url} unreachable: "
                         f"{type(exc).__name__}: {exc}", logging.WARNING)
        except Exception as exc:  # noqa: BLE001 - the loop must survive; the next round retries
            log_failure(log, f"witnessing {endpoint.key.name} failed", exc)
            self._on_result(endpoint.key.name, "error")

    async def _cosign_latest(self, endpoint: WitnessEndpoint) -> None:
        name = endpoint.key.name
        async with self._locks[name], _round(self._sessionmaker, name) as session:
            if session is None:
                return  # another server process is talking to this witness
            checkpoint = await repository.latest_checkpoint(session)
            if checkpoint is None or self._refused.get(name) == checkpoint.tree_size or \
                    await repository.has_cosignature(session, checkpoint.tree_size, name):
                return
            old = await repository.latest_cosigned_size(session, name) or 0
            answer = await self._submit(session, endpoint, old, checkpoint)
            if answer.conflict_size is not None and answer.conflict_size != old:
                old = answer.conflict_size
                if old > checkpoint.tree_size:
                    self._report(endpoint, "ahead", f"witness {name} has cosigned size {old}, larger than this "
                                 f"log's latest checkpoint {checkpoint.tree_size}: the log lost entries it had "
                                 "published (restored from an old backup?)", logging.ERROR)
                    return
                answer = await self._submit(session, endpoint, old, checkpoint)
            if not answer.ok:
                self._refusal(endpoint, checkpoint, old, answer)
                return
            await self._store(session, endpoint, checkpoint, answer)

    async def _submit(self, session: AsyncSession, endpoint: WitnessEndpoint, old: int,
                      checkpoint: LogCheckpoint) -> Answer:
        proof: Sequence[bytes] = ()
        if 0 < old < checkpoint.tree_size:
            proof = (await self._ledger.consistency_proof(session, old, checkpoint.tree_size)).hashes
        return await add_checkpoint(self._http(), endpoint.url, old, proof, checkpoint.note)

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout)
        return self._client

    async def _store(self, session: AsyncSession, endpoint: WitnessEndpoint, checkpoint: LogCheckpoint,
                     answer: Answer) -> None:
        name = endpoint.key.name
        try:
            valid = verify_cosignatures(with_signature_lines(checkpoint.note, _lines(answer.body)), [endpoint.key])
        except CosignatureError as exc:
            self._report(endpoint, "bad_cosignature", f"witness {name} answered an invalid cosignature: {exc}",
                         logging.ERROR)
            return
        if not valid:
            self._report(endpoint, "bad_cosignature", f"witness {name} answered no cosignature by its configured key",
                         logging.ERROR)
            return
        await repository.add_cosignature(session, CheckpointCosignature(
            tree_size=checkpoint.tree_size, witness=name, timestamp=valid[0].timestamp,
            signature_line=valid[0].line, created_at=dt.datetime.now(dt.UTC)))
        self._on_result(name, "cosigned")

    def _refusal(self, endpoint: WitnessEndpoint, checkpoint: LogCheckpoint, old: int, answer: Answer) -> None:
        detail = answer.body.strip()[:300]
        if answer.status in (409, 422):
            self._refused[endpoint.key.name] = checkpoint.tree_size
            self._report(endpoint, "refused", f"witness {endpoint.key.name} refused checkpoint {checkpoint.tree_size} "
                         f"(from size {old}) with {answer.status}: {detail} -- the log is not an append-only "
                         "extension of what this witness cosigned", logging.ERROR)
        else:
            self._report(endpoint, f"http_{answer.status}", f"witness {endpoint.key.name} answered {answer.status} "
                         f"for checkpoint {checkpoint.tree_size}: {detail}", logging.WARNING)

    def _report(self, endpoint: WitnessEndpoint, outcome: str, message: str, level: int) -> None:
        log.log(level, message, extra={"event": "witness_" + outcome})
        self._on_result(endpoint.key.name, outcome)


@contextlib.asynccontextmanager
async def _round(sessionmaker: async_sessionmaker[AsyncSession], witness: str) -> AsyncIterator[AsyncSession | None]:
    """A session in one transaction holding the round's lock for ``witness``, or None when another
    process holds it: a PostgreSQL advisory lock released by the commit, or on SQLite a file lock
    (``auditor.db.filelock``; SQLite's write lock would stop every append while the witness answers)
    released after the commit, so the next holder sees the cosignature stored."""
    async with sessionmaker() as session:
        url = session.bind.url
        if url.get_backend_name() == "sqlite":
            with filelock.try_held(url, "witness-" + filelock.file_name(witness)) as mine:
                async with session.begin():
                    yield session if mine else None
            return
        async with session.begin():
            yield session if await repository.try_lock(session, f"verbatim-witness:{witness}") else None


def _lines(body: str) -> list[str]:
    """The signature lines of a witness's 200 body (``signature_lines`` wants a whole note)."""
    return signature_lines("x\n\n" + body) if body.endswith("\n") else []
