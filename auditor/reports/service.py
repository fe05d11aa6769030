"""Report jobs end to end: submit (access-logged) → collect from the DB → build off the event loop → file.

One ``ReportService`` per app (``ReportService.for_app`` keeps it on ``app.state``); the CLI builds its
own with ``ReportService.open`` and calls ``export`` directly, with a progress callback.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from dataclasses import replace
from importlib import metadata
from pathlib import Path
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from auditor import canonical as cn
from auditor.auth import Principal
from auditor.crypto import KeyRing, KeyRole
from auditor.db.models import AccessAction
from auditor.ledger import Ledger
from auditor.logs import log_failure
from auditor.queries import record_access
from auditor.reports.bundle import build_bundle
from auditor.reports.collect import Progress, collect
from auditor.reports.inputs import ReportFilters
from auditor.reports.scope import Scope
from auditor.reports.jobs import JobStatus, JobStore, ReportJob
from auditor.witnessing import WitnessingError, WitnessPool

log = logging.getLogger("auditor.reports")
REPORTS_DIR = "reports"


def generator_version() -> str:
    try:
        return metadata.version("verbatim")
    except metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _quiet(stage: str, done: int, total: int) -> None:
    return None


class ReportService:
    def __init__(self, sessionmaker: async_sessionmaker[AsyncSession], ledger: Ledger, keyring: KeyRing,
                 jobs: JobStore, witnesses: WitnessPool | None = None) -> None:
        self._sessionmaker = sessionmaker
        self._ledger = ledger
        self._keyring = keyring
        self.jobs = jobs
        self.witnesses = witnesses
        """When set, a bundle ends at a checkpoint the witnesses cosigned (asked at export time)."""
        self._tasks: set[asyncio.Task[Any]] = set()

    @classmethod
    def for_app(cls, app: Any) -> ReportService:
        """The app's report service, made on first use from ``app.state.services`` (resumes old jobs)."""
        existing = getattr(app.state, "reports", None)
        if existing is None:
            s = app.state.services
            existing = cls(s.sessionmaker, s.ledger, s.keyring, JobStore(Path(s.settings.data_dir) / REPORTS_DIR),
                           s.witnesses)
            app.state.reports = existing
            existing.resume()
        return existing

    async def submit(self, principal: Principal, filters: ReportFilters) -> ReportJob:
        """Persist a queued job, log the export in the access log, and start building it."""
        if filters.tenant != principal.tenant:
            raise ValueError(f"tenant {filters.tenant!r} is not the caller's tenant {principal.tenant!r}")
        job = await asyncio.to_thread(self.jobs.create, principal.tenant, principal.key_id, filters, _now())
        async with self._sessionmaker() as session, session.begin():
            await record_access(session, principal, AccessAction.EXPORT, f"report:{job.id}")
        self._start(job)
        return job

    def get(self, principal: Principal, report_id: str) -> ReportJob | None:
        """The job if it exists and belongs to the caller's tenant (else None: no existence leak)."""
        job = self.jobs.get(report_id)
        return job if job is not None and job.tenant == principal.tenant else None

    def list(self, principal: Principal) -> list[ReportJob]:
        return self.jobs.list(principal.tenant)

    async def record_download(self, principal: Principal, job: ReportJob) -> None:
        async with self._sessionmaker() as session, session.begin():
            await record_access(session, principal, AccessAction.READ, f"report:{job.id}/report.zip")

    def resume(self) -> None:
        for job in self.jobs.unfinished():
            log.info("resuming report job", extra={"event": "report_resume", "report_id": job.id})
            self._start(job)

    def _start(self, job: ReportJob) -> None:
        try:
            task = asyncio.get_running_loop().create_task(self.run(job))
        except RuntimeError:
            return  # no loop (CLI listing): the next app start resumes it
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, job: ReportJob, progress: Progress = _quiet) -> ReportJob:
        """Build the job's bundle; a failure is recorded on the job, never raised."""
        job = self.jobs.save(replace(job, status=JobStatus.RUNNING))
        try:
            end_size = await self._witnessed_end()
            async with self._sessionmaker() as session, session.begin():
                inputs = await collect(session, self._ledger, self._keyring, job.filters, report_id=job.id,
                                       generator_version=generator_version(), now=_now(), progress=progress,
                                       end_size=end_size)
            progress("render", 0, 1)
            data = await asyncio.to_thread(build_bundle, inputs, self._keyring.signer(KeyRole.REPORT))
            progress("render", 1, 1)
        except Exception as exc:  # noqa: BLE001 - the job records why it failed
            log_failure(log, "report job failed", exc, event="report_failed", report_id=job.id)
            return self.jobs.save(replace(job, status=JobStatus.FAILED, finished_at=_now(),
                                          error=f"{type(exc).__name__}: {exc}"))
        reported = sum(entry.scope == Scope.REPORT for entry in inputs.transcripts)
        return self.jobs.write_bundle(job, data, reported, cn.sha256_hex(data), _now())

    async def _witnessed_end(self) -> int | None:
        """The witnessed checkpoint a bundle ends at; without one in time, the latest (and a warning:
        the verifier, given the witness keys, then reports the missing cosignatures)."""
        if self.witnesses is None:
            return None
        try:
            return await self.witnesses.ensure_witnessed()
        except WitnessingError as exc:
            log.warning("report ends at an unwitnessed checkpoint: %s", exc, extra={"event": "report_unwitnessed"})
            return None

    async def export(self, principal: Principal, filters: ReportFilters, progress: Progress = _quiet) -> ReportJob:
        """Submit and wait (the CLI path): returns the finished (or failed) job."""
        job = await asyncio.to_thread(self.jobs.create, principal.tenant, principal.key_id, filters, _now())
        async with self._sessionmaker() as session, session.begin():
            await record_access(session, principal, AccessAction.EXPORT, f"report:{job.id}")
        return await self.run(job, progress)

    async def drain(self) -> None:
        """Wait for running jobs (tests and shutdown)."""
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
