"""Replay and compare (DESIGN §5): re-execute a signed transcript on this server's engine and attest
the outcome.

    submit   (HTTP or CLI)  checks → replay_jobs row ``queued`` + access_log row, one transaction
    worker   claims queued jobs (``running``) → ONE ``engine.replay`` call for the whole batch
             (windows of several replays share G x W verify passes) → judge each → sign a replay
             attestation (``replay`` role key) → log leaf + checkpoint + job ``done``, one transaction
    restart  at start-up every job left ``running`` or ``queued`` is queued again and rerun

Refused with 409 before any job exists: a transcript whose signature does not verify, one made with
``deterministic=false`` (no verify windows: ``not_replayable``), one whose content (token ids, salt)
was erased or holds no output token, and one made by other model weights (``model_mismatch``).

Verdicts (``auditor.attestation.ReplayVerdict``):
- ``match``: the canonical prefill and the verifier predicted exactly the stored token ids, and the
  predictions hash to the signed output commitment and the signed float32 logprob digest.
- ``mismatch``: the first divergent output position, its window, the stored (expected) token and the
  replayed one. The comparison is against the stored token ids (the record under audit), teacher-
  forced, so positions after the first divergence see the stored (possibly altered) context. The
  details say whether the stored ids open the signed commitment (``record_checks``) and whether they
  do once the replayed token is put at the divergence (``corrected_matches_commitment``): true means
  the record was altered at exactly that position and the engine still reproduces what was signed.
- ``inconclusive_environment``: the runtime fingerprint differs from the recorded one (bit-exactness
  is promised on the same hardware and software). The replay still runs and its outcome is in the
  details; only a different verify shape (G, W) cannot run, because the recorded passes cannot be
  re-executed with another shape, nor a different tensor-parallel size or all-reduce
  (``tensor_parallel_size``, ``tp_reduction``; absent: one rank), because every GEMM's shape per rank and
  the order of the partial sums are part of the numerics (``executed: false``).

Several server processes (replicas) may share one database: a worker claims queued jobs with
``SELECT … FOR UPDATE SKIP LOCKED`` (on SQLite under the database's write lock, taken before the
select) and holds a lease on them (``claimed_by``, ``lease_expires_at``), renewed while it runs; a
``running`` job whose lease has passed (its process died) is queued again by any worker (one UPDATE).
A worker that lost its lease does not commit. The job row and its log leaf are written in one
``Ledger.transaction()``, so a crash leaves either a finished, logged job or a job that is rerun.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import logging
import os
import secrets
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.replay import ReplayRequest, ReplayResult
from engine.sampling import SamplingParams
from sqlalchemy import func, select, update
from sqlalchemy.ext.asyncio import AsyncSession

from auditor import canonical as cn
from auditor import repository
from auditor.attestation import ReplayAttestationInputs, ReplayVerdict, SignedAttestation, sign_replay_attestation
from auditor.auth import Principal
from auditor.db.models import AccessAction, LeafKind, ReplayJob, ReplayStatus, Role
from auditor.engine_seam import ReplayProgress, ServingEngine
from auditor.errors import ApiError, not_found
from auditor.logs import log_failure
from auditor.queries import record_access
from auditor.canonical import timestamp
from auditor.repository import iso_utc
from auditor.transcript import Check, uuid7, verify_transcript
from auditor.verify import bundle_entry

if TYPE_CHECKING:
    from auditor.routes.deps import Services

log = logging.getLogger("auditor.replay")

DEFAULT_MAX_QUEUED = 8
"""Per-tenant limit on replays queued or running at once (429 beyond)."""
MAX_BATCH = 32
"""Most jobs handed to one ``engine.replay`` call."""
MAX_WAIT_SECONDS = 600.0
POLL_SECONDS = 2.0
"""How often an idle worker looks for jobs queued by another process."""
LEASE_SECONDS = 60.0
"""A running job's lease; renewed every third of it while the job runs."""
_ACTIVE = (ReplayStatus.QUEUED.value, ReplayStatus.RUNNING.value)
_FINAL = (ReplayStatus.DONE.value, ReplayStatus.FAILED.value)


def conflict(message: str, code: str) -> ApiError:
    return ApiError(409, message, code=code)


# --- the record under replay ---------------------------------------------------------------------


@dataclass(frozen=True)
class Record:
    """A stored transcript whose signature verified, with its content."""

    transcript_id: str
    tenant: str
    payload_digest: str
    predicate: Mapping[str, Any]
    prompt_ids: list[int]
    output_ids: list[int]
    salt: bytes
    stored_logprobs: list[float]
    record_checks: list[Check]
    """Stored content against the signed commitments, window chain and logprob digest."""

    @property
    def shape(self) -> tuple[int, int]:
        s = self.predicate["windows"]["shape"]
        return int(s["G"]), int(s["W"])

    @property
    def spans(self) -> list[tuple[int, int]]:
        return [(int(s), int(e)) for s, e in self.predicate["windows"]["spans"]]

    def replay_request(self, replay_id: str) -> ReplayRequest:
        return ReplayRequest(replay_id, list(self.prompt_ids), list(self.output_ids), sampling_params(self.predicate),
                             self.spans, self.shape)


def sampling_params(predicate: Mapping[str, Any]) -> SamplingParams:
    """The signed sampling parameters with the signed seed (unknown keys are ignored)."""
    sampling = predicate["sampling"]
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    params = {k: v for k, v in sampling["params"].items() if k in names and k != "seed"}
    return SamplingParams(**{**params, "seed": int(sampling["seed"]), "deterministic": True})


async def load_record(session: AsyncSession, jwks: Mapping[str, Any], transcript_id: str,
                      tenant: str | None) -> Record:
    """The transcript as a replayable record; 404 (other tenant too) or 409 with the reason."""
    row = await repository.get_transcript(session, transcript_id)
    if row is None or (tenant is not None and row.tenant != tenant):
        raise not_found(f"transcript {transcript_id!r} not found")
    envelope = json.loads(row.envelope)
    content = await repository.get_content(session, row.id)
    ids = (content.prompt_token_ids, content.output_token_ids) if content else (None, None)
    verification = verify_transcript(envelope, jwks, prompt_ids=ids[0], output_ids=ids[1],
                                     salt=bytes(content.salt) if content else None,
                                     logprobs=content.token_logprobs if content else None)
    if verification.statement is None:
        raise conflict(f"transcript {row.id} cannot be replayed: its signature does not verify "
                       f"({verification.checks[0].detail})", "transcript_invalid")
    predicate = verification.statement["predicate"]
    _check_replayable(row.id, predicate, content is not None)
    assert content is not None
    return Record(row.id, row.tenant, str(verification.payload_digest), predicate, list(content.prompt_token_ids),
                  list(content.output_token_ids), bytes(content.salt), list(content.token_logprobs),
                  verification.checks[2:])


def _check_replayable(transcript_id: str, predicate: Mapping[str, Any], has_content: bool) -> None:
    if not predicate["sampling"].get("deterministic"):
        raise conflict(f"transcript {transcript_id} is not replayable: it was generated with deterministic=false, "
                       "so no canonical prefill or verify windows were recorded; only deterministic transcripts "
                       "can be replayed", "not_replayable")
    if not has_content:
        raise conflict(f"transcript {transcript_id} is not replayable: its token ids and salt were erased "
                       "(the signature and log proofs still verify)", "not_replayable")
    if int(predicate["tokens"]["output_count"]) == 0:
        raise conflict(f"transcript {transcript_id} is not replayable: it has no output token", "not_replayable")


def check_model(record: Record, model_info: Any) -> None:
    """409 when the engine runs other weights than the transcript's: a replay would prove nothing."""
    recorded = record.predicate["model"]
    if recorded["weights_digest"] != model_info.weights_digest:
        raise conflict(f"transcript {record.transcript_id} was generated by model {recorded['name']!r} "
                       f"(weights {recorded['weights_digest']}); this server runs {model_info.name!r} "
                       f"(weights {model_info.weights_digest}); replay refused", "model_mismatch")


# --- environment and verdict ----------------------------------------------------------------------


def engine_shape(engine: ServingEngine) -> tuple[int, int]:
    """(G, W) of the engine's verify passes."""
    return engine.config.group, engine.config.window


def environment_differences(recorded: Mapping[str, Any], current: Mapping[str, Any],
                            recorded_shape: tuple[int, int], current_shape: tuple[int, int]) -> dict[str, Any]:
    """``{field: {recorded, current}}`` for every runtime fingerprint field that differs, plus
    ``window_shape`` when the verify pass shape (G, W) differs."""
    diff = {k: {"recorded": recorded.get(k), "current": current.get(k)}
            for k in sorted(set(recorded) | set(current)) if recorded.get(k) != current.get(k)}
    if tuple(recorded_shape) != tuple(current_shape):
        diff["window_shape"] = {"recorded": list(recorded_shape), "current": list(current_shape)}
    return diff


@dataclass(frozen=True)
class Outcome:
    verdict: ReplayVerdict
    details: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "details": self.details}


def judge(record: Record, result: ReplayResult, differences: Mapping[str, Any]) -> Outcome:
    """Compare the replay with the stored tokens and the signed commitment / logprob digest."""
    tokens = record.predicate["tokens"]
    signed_lp = record.predicate["windows"]["logprob_digest"]
    replayed_lp = cn.logprob_digest(result.token_logprobs)
    details: dict[str, Any] = {
        "executed": True, "tokens": len(record.output_ids), "windows": len(record.spans),
        "tokens_match": result.first_mismatch is None,
        "output_commitment_match": cn.output_commitment(record.salt, result.token_ids) == tokens["output_commitment"],
        "logprob_digest_match": replayed_lp == signed_lp,
        "replayed_logprob_digest": replayed_lp, "signed_logprob_digest": signed_lp,
        "record_checks": {c.name: c.ok for c in record.record_checks},
    }
    divergence = _divergence(record, result, details)
    if differences:
        return Outcome(ReplayVerdict.INCONCLUSIVE_ENVIRONMENT,
                       {**details, "differences": dict(differences), "divergence": divergence})
    if divergence is not None:
        return Outcome(ReplayVerdict.MISMATCH, {**details, **divergence})
    return Outcome(ReplayVerdict.MATCH, details)


def _divergence(record: Record, result: ReplayResult, details: Mapping[str, Any]) -> dict[str, Any] | None:
    """Where the replay first departs from the record, or None when it reproduces it exactly."""
    position = result.first_mismatch
    if position is None and not (details["logprob_digest_match"] and details["output_commitment_match"]):
        position = _first_logprob_difference(record.stored_logprobs, result.token_logprobs)
    if position is None:
        if details["logprob_digest_match"] and details["output_commitment_match"]:
            return None
        return {"window_index": None, "window": None, "position": None, "expected_token": None,
                "replayed_token": None, "corrected_matches_commitment": False}
    window = _window_of(record.spans, position)
    corrected = list(record.output_ids)
    corrected[position] = result.token_ids[position]
    signed = record.predicate["tokens"]["output_commitment"]
    return {"window_index": window, "window": list(record.spans[window]) if window is not None else None,
            "position": position, "expected_token": record.output_ids[position],
            "replayed_token": result.token_ids[position],
            "corrected_matches_commitment": cn.output_commitment(record.salt, corrected) == signed}


def _first_logprob_difference(stored: Sequence[float], replayed: Sequence[float]) -> int | None:
    for i, (a, b) in enumerate(zip(stored, replayed)):
        if cn.logprob_digest([a]) != cn.logprob_digest([b]):  # compare the float32 bits, as signed
            return i
    return None


def _window_of(spans: Sequence[tuple[int, int]], position: int) -> int | None:
    """Index of the window holding output ``position`` (None for token 0, from the prefill)."""
    return next((k for k, (s, e) in enumerate(spans) if s <= position < e), None)


def not_executed(differences: Mapping[str, Any], recorded: tuple[int, int], current: tuple[int, int]) -> Outcome:
    return Outcome(ReplayVerdict.INCONCLUSIVE_ENVIRONMENT, {
        "executed": False, "differences": dict(differences),
        "reason": f"the transcript's verify passes have shape (G, W) = {recorded}; this engine runs {current}, "
                  "so the recorded passes cannot be re-executed"})


PARALLEL_FIELDS = {"tensor_parallel_size": 1, "tp_reduction": None}
"""Runtime fingerprint fields of tensor parallelism, with their value when absent (one rank)."""


def parallel_layout(runtime: Mapping[str, Any]) -> dict[str, Any]:
    """The fingerprint's tensor-parallel fields (size, reduction), one rank when it names none."""
    return {k: runtime.get(k, default) for k, default in PARALLEL_FIELDS.items()}


def not_executed_parallel(differences: Mapping[str, Any], recorded: Mapping[str, Any],
                          current: Mapping[str, Any]) -> Outcome:
    def named(layout: Mapping[str, Any]) -> str:
        reduction = f", reduction {layout['tp_reduction']}" if layout["tp_reduction"] else ""
        return f"tensor_parallel_size {layout['tensor_parallel_size']}{reduction}"

    return Outcome(ReplayVerdict.INCONCLUSIVE_ENVIRONMENT, {
        "executed": False, "differences": dict(differences),
        "reason": f"the transcript was generated at {named(recorded)}; this engine runs {named(current)}: the "
                  "per-rank GEMM shapes and the all-reduce order are part of the numerics, so the replay was "
                  "not run"})


# --- jobs -------------------------------------------------------------------------------------------


def job_json(job: ReplayJob) -> dict[str, Any]:
    result = job.result or {}
    return {
        "id": job.id, "object": "replay", "transcript_id": job.transcript_id, "status": job.status,
        "result": result.get("verdict"), "details": result.get("details"),
        "attestation": json.loads(job.attestation) if job.attestation else None, "log_index": job.log_index,
        "error": job.error, "requested_by": job.requested_by, "created_at": iso_utc(job.created_at),
        "finished_at": iso_utc(job.finished_at) if job.finished_at else None, "evidence": None,
    }


def _lease_end() -> dt.datetime:
    return _now() + dt.timedelta(seconds=LEASE_SECONDS)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


@dataclass
class _Claimed:
    job_id: str
    record: Record | None = None
    outcome: Outcome | None = None
    error: str | None = None
    differences: dict[str, Any] | None = None


class ReplayService:
    """Replay jobs of one app (``ReplayService.for_app``) or of the CLI (``run_now``)."""

    def __init__(self, services: Services, *, max_queued: int = DEFAULT_MAX_QUEUED, max_batch: int = MAX_BATCH) -> None:
        self.services = services
        self.max_queued = max_queued
        self.max_batch = max_batch
        self._submit_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._finished: dict[str, asyncio.Event] = {}
        self._task: asyncio.Task[None] | None = None
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"

    @classmethod
    def for_app(cls, app: Any) -> ReplayService:
        existing = getattr(app.state, "replays", None)
        if existing is None:
            services = app.state.services
            existing = app.state.replays = cls(services, max_queued=services.settings.replay_max_queued)
        return existing

    # --- submit / read ---------------------------------------------------------------------------

    async def submit(self, principal: Principal, transcript_id: str) -> dict[str, Any]:
        """Check the transcript, queue a job (429 past the tenant's limit), log the access."""
        engine = self._engine()
        async with self._submit_lock, self.services.sessionmaker() as session, session.begin():
            record = await load_record(session, self.services.keyring.jwks(), transcript_id, principal.tenant)
            check_model(record, engine.model_info)
            active = await _active_jobs(session, principal.tenant)
            if active >= self.max_queued:
                raise ApiError(429, f"tenant {principal.tenant!r} has {active} replays queued or running; the limit "
                               f"is {self.max_queued}", code="replay_queue_full", headers={"Retry-After": "5"})
            job = ReplayJob(id=str(uuid7()), tenant=principal.tenant, transcript_id=record.transcript_id,
                            requested_by=principal.key_id, status=ReplayStatus.QUEUED.value, created_at=_now())
            session.add(job)
            await session.flush()
            await record_access(session, principal, AccessAction.REPLAY, f"transcript:{record.transcript_id} "
                                f"replay:{job.id}")
        self._wake.set()
        log.info("replay queued", extra={"event": "replay_queued", "replay_id": job.id,
                                         "transcript_id": record.transcript_id, "tenant": principal.tenant})
        return job_json(job)

    async def get(self, principal: Principal, replay_id: str, *, record: bool = True) -> dict[str, Any]:
        async with self.services.sessionmaker() as session, session.begin():
            job = await session.get(ReplayJob, replay_id)
            if job is None or job.tenant != principal.tenant:
                raise not_found(f"replay {replay_id!r} not found")
            evidence = await self._evidence(session, job)
            # The access row last: on SQLite its INSERT holds the write lock to the commit, and the
            # evidence may wait for this process's ledger, which may be waiting for that lock.
            if record:
                await record_access(session, principal, AccessAction.READ, f"replay:{replay_id}")
            return {**job_json(job), "evidence": evidence}

    async def _evidence(self, session: AsyncSession, job: ReplayJob) -> dict[str, Any] | None:
        """The attestation as an offline-verifiable file (``auditor.verify``): envelope, inclusion proof
        and the checkpoint it is proved against."""
        if job.attestation is None or job.log_index is None:
            return None
        checkpoint = await self.services.ledger.checkpoint(session)
        proof = await self.services.ledger.inclusion_proof(session, job.log_index, checkpoint.tree_size)
        return bundle_entry(json.loads(job.attestation), proof, checkpoint.note)

    async def wait(self, principal: Principal, replay_id: str, timeout: float = MAX_WAIT_SECONDS) -> dict[str, Any]:
        """The job once finished (or as it stands after ``timeout`` seconds)."""
        event = self._finished.setdefault(replay_id, asyncio.Event())
        deadline = asyncio.get_running_loop().time() + timeout
        job = await self.get(principal, replay_id, record=False)
        while job["status"] not in _FINAL and asyncio.get_running_loop().time() < deadline:
            try:  # finished here (the event) or by another server process (the poll)
                await asyncio.wait_for(event.wait(), min(POLL_SECONDS, timeout))
            except TimeoutError:
                pass
            job = await self.get(principal, replay_id, record=False)
        self._finished.pop(replay_id, None)
        return job

    def _engine(self) -> ServingEngine:
        self.services.require_completions()  # 503 while the model loads or when it failed
        return self.services.engine

    # --- worker -----------------------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._work(), name="replay-worker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
            await self._release()

    async def _release(self) -> None:
        """On a clean stop, jobs this worker still holds go back to the queue at once (no lease wait)."""
        try:
            async with self.services.sessionmaker() as session, session.begin():
                await session.execute(update(ReplayJob).where(
                    ReplayJob.claimed_by == self.worker_id, ReplayJob.status == ReplayStatus.RUNNING.value)
                    .values(status=ReplayStatus.QUEUED.value, claimed_by=None, lease_expires_at=None))
        except Exception as exc:  # noqa: BLE001 - the lease expires on its own
            log_failure(log, "releasing replay jobs failed", exc)

    async def _work(self) -> None:
        await self.requeue()
        await self.services.engine_loaded.wait()
        if self.services.engine is None:
            log.error("replay worker idle: the engine failed to load (%s)", self.services.engine_error)
            return
        while True:
            try:
                await self.requeue()
                ran = await self.run_batch(await self._claim())
            except Exception as exc:  # noqa: BLE001 - the worker carries on
                log_failure(log, "replay batch failed", exc)
                ran = 0
            if not ran:
                try:
                    await asyncio.wait_for(self._wake.wait(), POLL_SECONDS)
                except TimeoutError:
                    pass
                self._wake.clear()

    async def requeue(self) -> int:
        """Jobs ``running`` under a lease that has passed (their process stopped or died; the result was
        never committed) are queued again."""
        async with self.services.sessionmaker() as session, session.begin():
            expired = (ReplayJob.lease_expires_at.is_(None)) | (ReplayJob.lease_expires_at < _now())
            result = await session.execute(
                update(ReplayJob).where(ReplayJob.status == ReplayStatus.RUNNING.value, expired)
                .values(status=ReplayStatus.QUEUED.value, claimed_by=None, lease_expires_at=None))
            count = int(result.rowcount or 0)
        if count:
            log.info("replay jobs requeued", extra={"event": "replay_requeued", "count": count})
        return count

    async def _claim(self, job_ids: Sequence[str] | None = None) -> list[str]:
        """Mark up to ``max_batch`` queued jobs (oldest first, or the given ones) running under this
        worker's lease; rows another worker is claiming at the same moment are skipped (PostgreSQL), or
        the other worker's claim commits first (SQLite: the write lock, taken before the rows are read)."""
        async with self.services.sessionmaker() as session, session.begin():
            await repository.lock_writes(session)
            query = select(ReplayJob.id).where(ReplayJob.status == ReplayStatus.QUEUED.value)
            if job_ids is not None:
                query = query.where(ReplayJob.id.in_(list(job_ids)))
            ids = list((await session.scalars(query.order_by(ReplayJob.created_at, ReplayJob.id)
                                              .limit(self.max_batch).with_for_update(skip_locked=True))).all())
            if ids:
                await session.execute(update(ReplayJob).where(ReplayJob.id.in_(ids)).values(
                    status=ReplayStatus.RUNNING.value, claimed_by=self.worker_id, lease_expires_at=_lease_end()))
        return ids

    async def _renew(self, job_ids: Sequence[str]) -> None:
        while True:
            await asyncio.sleep(LEASE_SECONDS / 3)
            async with self.services.sessionmaker() as session, session.begin():
                await session.execute(update(ReplayJob).where(
                    ReplayJob.id.in_(list(job_ids)), ReplayJob.claimed_by == self.worker_id,
                    ReplayJob.status == ReplayStatus.RUNNING.value).values(lease_expires_at=_lease_end()))

    async def run_batch(self, job_ids: Sequence[str], on_progress: ReplayProgress | None = None) -> int:
        """Replay ``job_ids`` (already ``running``) in one engine call and finish each job. ``on_progress``
        (tokens replayed, tokens in all) is handed to the engine."""
        if not job_ids:
            return 0
        engine = self.services.engine
        renewing = asyncio.get_running_loop().create_task(self._renew(job_ids))
        try:
            claimed = [await self._prepare_or_fail(job_id, engine) for job_id in job_ids]
            runnable = [c for c in claimed if c.record is not None and c.outcome is None and c.error is None]
            await self._execute(engine, runnable, on_progress)
            for c in claimed:
                await self._finish(c, engine)
        finally:
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
        return len(claimed)

    async def _prepare_or_fail(self, job_id: str, engine: ServingEngine) -> _Claimed:
        try:
            return await self._prepare(job_id, engine)
        except Exception as exc:  # noqa: BLE001 - the job fails with the reason; the batch goes on
            log_failure(log, "preparing a replay failed", exc, replay_id=job_id)
            return _Claimed(job_id, error=f"{type(exc).__name__}: {exc}")

    async def _prepare(self, job_id: str, engine: ServingEngine) -> _Claimed:
        claimed = _Claimed(job_id)
        try:
            async with self.services.sessionmaker() as session:
                job = await session.get(ReplayJob, job_id)
                assert job is not None, job_id
                claimed.record = await load_record(session, self.services.keyring.jwks(), job.transcript_id, job.tenant)
            check_model(claimed.record, engine.model_info)
        except ApiError as exc:
            claimed.error = exc.message
            return claimed
        current = engine_shape(engine)
        recorded_runtime, current_runtime = claimed.record.predicate["runtime"], engine.runtime_fingerprint()
        claimed.differences = environment_differences(recorded_runtime, current_runtime, claimed.record.shape,
                                                      current)
        recorded_tp, current_tp = parallel_layout(recorded_runtime), parallel_layout(current_runtime)
        if claimed.record.shape != current:
            claimed.outcome = not_executed(claimed.differences, claimed.record.shape, current)
        elif recorded_tp != current_tp:
            claimed.outcome = not_executed_parallel(claimed.differences, recorded_tp, current_tp)
        return claimed

    async def _execute(self, engine: ServingEngine, runnable: list[_Claimed], on_progress: ReplayProgress | None = None) -> None:
        """One ``engine.replay`` for all; if the engine refuses the batch, each alone (to name the bad one)."""
        if not runnable:
            return
        try:
            requests = [c.record.replay_request(c.job_id) for c in runnable if c.record is not None]
            results = await engine.replay(requests, on_progress=on_progress)
        except ValueError as exc:
            if len(runnable) == 1:
                runnable[0].error = f"the engine refused the recorded windows: {exc}"
                return
            for c in runnable:
                await self._execute(engine, [c], on_progress)
            return
        except Exception as exc:  # noqa: BLE001 - recorded on each job; the worker carries on
            log_failure(log, "engine replay failed", exc)
            for c in runnable:
                c.error = f"engine replay failed: {type(exc).__name__}: {exc}"
            return
        for c, result in zip(runnable, results):
            assert result.replay_id == c.job_id, (result.replay_id, c.job_id)
            assert c.record is not None
            c.outcome = judge(c.record, result, c.differences or {})

    async def _finish(self, claimed: _Claimed, engine: ServingEngine) -> None:
        signed = None
        if claimed.outcome is not None:
            assert claimed.record is not None
            signed = sign_replay_attestation(ReplayAttestationInputs(
                replay_id=claimed.job_id, transcript_id=claimed.record.transcript_id,
                transcript_payload_digest=claimed.record.payload_digest, result=claimed.outcome.verdict,
                replayed_at=timestamp(_now()), engine_fingerprint=engine.runtime_fingerprint(),
                system_fingerprint=engine.system_fingerprint(), details=claimed.outcome.details),
                self.services.keyring)
        await self._commit(claimed, signed)
        log.info("replay finished", extra={
            "event": "replay_done", "replay_id": claimed.job_id,
            "verdict": claimed.outcome.verdict.value if claimed.outcome else None, "error": claimed.error})
        waiters = self._finished.pop(claimed.job_id, None)
        if waiters is not None:
            waiters.set()

    async def _commit(self, claimed: _Claimed, signed: SignedAttestation | None) -> None:
        """Job completion and its attestation's log leaf + checkpoint in ONE ledger transaction."""
        async with self.services.ledger.transaction() as session:
            job = await session.get(ReplayJob, claimed.job_id)
            assert job is not None, claimed.job_id
            if job.status != ReplayStatus.RUNNING.value or job.claimed_by != self.worker_id:
                log.warning("replay %s lost its lease (now %s by %s); result not committed", job.id, job.status,
                            job.claimed_by, extra={"event": "replay_lease_lost"})
                return
            if signed is not None:
                job.log_index = await self.services.ledger.append_leaf(
                    session, signed.leaf_data, LeafKind.REPLAY_ATTESTATION, replay_job_id=job.id)
                job.attestation = cn.canonical_json(signed.envelope)
            job.result = claimed.outcome.to_json() if claimed.outcome else None
            job.status = ReplayStatus.DONE.value if signed is not None else ReplayStatus.FAILED.value
            job.error = claimed.error
            job.finished_at = _now()
            job.lease_expires_at = None

    # --- CLI ----------------------------------------------------------------------------------------

    async def run_now(self, transcript_id: str, requested_by: str = "cli",
                      on_progress: ReplayProgress | None = None) -> dict[str, Any]:
        """Queue and run one replay in this process (``verbatim replay``)."""
        async with self.services.sessionmaker() as session:
            row = await repository.get_transcript(session, transcript_id)
        if row is None:
            raise not_found(f"transcript {transcript_id!r} not found")
        principal = Principal(requested_by, row.tenant, Role.ADMIN)
        job = await self.submit(principal, transcript_id)
        await self.run_batch(await self._claim([job["id"]]), on_progress)
        job = await self.get(principal, job["id"], record=False)
        while job["status"] not in _FINAL:  # a server sharing the database claimed it first
            await asyncio.sleep(POLL_SECONDS)
            job = await self.get(principal, job["id"], record=False)
        return job


async def _active_jobs(session: AsyncSession, tenant: str) -> int:
    query = select(func.count()).select_from(ReplayJob).where(ReplayJob.tenant == tenant,
                                                               ReplayJob.status.in_(_ACTIVE))
    return int((await session.scalar(query)) or 0)

