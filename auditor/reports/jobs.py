"""Report jobs persisted as files beside the bundles they produce (they survive a restart).

    <data_dir>/reports/                  0700
      <report id>/job.json               the job (``ReportJob.to_json``), rewritten atomically
      <report id>/report.zip             the bundle, once done

Bundles are files an auditor downloads and keeps, so they live on disk rather than in SQL rows;
a job found ``queued`` or ``running`` at start-up is run again (``ReportService.resume``).
"""

from __future__ import annotations

import datetime as dt
import json
import os
import uuid
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from auditor.reports.inputs import ReportFilters, iso_utc

JOB_FILE = "job.json"
BUNDLE_FILE = "report.zip"


class JobStatus(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


def _time(text: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def filters_from_json(obj: dict[str, Any]) -> ReportFilters:
    return ReportFilters(tenant=obj["tenant"], since=_time(obj.get("since")), until=_time(obj.get("until")),
                         model=obj.get("model"), deterministic_only=bool(obj.get("deterministic_only")),
                         include_content=bool(obj.get("include_content")))


@dataclass(frozen=True)
class ReportJob:
    id: str
    tenant: str
    requested_by: str
    filters: ReportFilters
    status: JobStatus
    created_at: dt.datetime
    finished_at: dt.datetime | None = None
    error: str | None = None
    bundle_sha256: str | None = None
    bundle_size: int | None = None
    transcripts: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "report", "tenant": self.tenant, "requested_by": self.requested_by,
            "filters": self.filters.to_json(), "status": self.status.value, "created_at": iso_utc(self.created_at),
            "finished_at": iso_utc(self.finished_at) if self.finished_at else None, "error": self.error,
            "bundle_sha256": self.bundle_sha256, "bundle_size": self.bundle_size, "transcripts": self.transcripts,
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> ReportJob:
        return cls(obj["id"], obj["tenant"], obj["requested_by"], filters_from_json(obj["filters"]),
                   JobStatus(obj["status"]), _time(obj["created_at"]) or dt.datetime.now(dt.UTC),
                   _time(obj.get("finished_at")), obj.get("error"), obj.get("bundle_sha256"),
                   obj.get("bundle_size"), obj.get("transcripts"))


class JobStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _dir(self, report_id: str) -> Path:
        uuid.UUID(report_id)  # refuses path tricks: only canonical ids name a directory
        return self.root / report_id

    def create(self, tenant: str, requested_by: str, filters: ReportFilters, now: dt.datetime) -> ReportJob:
        job = ReportJob(str(uuid.uuid4()), tenant, requested_by, filters, JobStatus.QUEUED, now)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._dir(job.id).mkdir(mode=0o700)
        return self.save(job)

    def save(self, job: ReportJob) -> ReportJob:
        path = self._dir(job.id) / JOB_FILE
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(job.to_json(), indent=2) + "\n")
        os.replace(tmp, path)
        return job

    def get(self, report_id: str) -> ReportJob | None:
        try:
            path = self._dir(report_id) / JOB_FILE
        except ValueError:
            return None
        if not path.exists():
            return None
        return ReportJob.from_json(json.loads(path.read_text()))

    def list(self, tenant: str) -> list[ReportJob]:
        if not self.root.exists():
            return []
        jobs = [self.get(p.name) for p in self.root.iterdir() if p.is_dir()]
        return sorted((j for j in jobs if j is not None and j.tenant == tenant), key=lambda j: j.created_at, reverse=True)

    def unfinished(self) -> list[ReportJob]:
        if not self.root.exists():
            return []
        jobs = [self.get(p.name) for p in self.root.iterdir() if p.is_dir()]
        return [j for j in jobs if j is not None and j.status in (JobStatus.QUEUED, JobStatus.RUNNING)]

    def bundle_path(self, report_id: str) -> Path:
        return self._dir(report_id) / BUNDLE_FILE

    def write_bundle(self, job: ReportJob, data: bytes, transcripts: int, sha256: str, now: dt.datetime) -> ReportJob:
        path = self.bundle_path(job.id)
        tmp = path.with_suffix(".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return self.save(replace(job, status=JobStatus.DONE, finished_at=now, bundle_sha256=sha256,
                                 bundle_size=len(data), transcripts=transcripts))
