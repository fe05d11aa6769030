"""Compliance report export: ``POST /v1/reports`` → job; ``GET /v1/reports/{id}`` → status, then the ZIP.

Auditors and admins only, within their own tenant. ``GET /v1/reports/{id}`` answers the job as JSON
(202 while queued or running, 200 with ``status: failed``) and the bundle itself once done;
``?format=json`` always answers the job. ``GET /v1/reports`` lists the tenant's reports.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

import msgspec
from litestar import Controller, Request, Response, get, post
from litestar.di import Provide
from litestar.response import File

from auditor.auth import Principal, require_role
from auditor.db.models import Role
from auditor.errors import bad_request, not_found
from auditor.reports.inputs import ReportFilters
from auditor.reports.jobs import JobStatus, ReportJob
from auditor.reports.service import ReportService
from auditor.routes.deps import provide_principal
from auditor.routes.openapi import SECURITY
from auditor.routes.validation import aware, check_text, json_body

REPORT_ROLES = (Role.AUDITOR, Role.ADMIN)


class NewReport(msgspec.Struct, forbid_unknown_fields=True):
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    model: str | None = None
    deterministic_only: bool = False
    include_content: bool = False


def provide_reports(request: Request[Any, Any, Any]) -> ReportService:
    return ReportService.for_app(request.app)


def filters_from(body: NewReport, tenant: str) -> ReportFilters:
    """The tenant's report filters from a decoded request; every refusal is a 400 naming the field."""
    since, until = aware(body.since, "since"), aware(body.until, "until")
    try:
        return ReportFilters(tenant, since, until, check_text(body.model, "model") or None, body.deterministic_only,
                             body.include_content)
    except ValueError as exc:
        raise bad_request(str(exc), param="until") from None


def job_json(job: ReportJob) -> dict[str, Any]:
    return {**job.to_json(), "download_url": f"/v1/reports/{job.id}" if job.status is JobStatus.DONE else None}


class ReportsController(Controller):
    path = "/v1/reports"
    security = SECURITY
    dependencies = {"principal": Provide(provide_principal), "reports": Provide(provide_reports, sync_to_thread=False)}

    @post("/", status_code=202, opt={"body": NewReport})
    async def create(self, request: Request[Any, Any, Any], principal: Principal, reports: ReportService) -> dict[str, Any]:
        require_role(principal, REPORT_ROLES)
        filters = filters_from(await json_body(request, NewReport), principal.tenant)
        job = await reports.submit(principal, filters)
        return job_json(job)

    @get("/")
    async def list_reports(self, principal: Principal, reports: ReportService) -> dict[str, Any]:
        require_role(principal, REPORT_ROLES)
        return {"object": "list", "data": [job_json(j) for j in reports.list(principal)]}

    @get("/{report_id:str}")
    async def fetch(self, report_id: str, principal: Principal, reports: ReportService,
                    format: Literal["zip", "json"] = "zip") -> Response[Any]:
        require_role(principal, REPORT_ROLES)
        job = reports.get(principal, report_id)
        if job is None:
            raise not_found(f"report {report_id!r} not found")
        if job.status is not JobStatus.DONE or format == "json":
            pending = job.status in (JobStatus.QUEUED, JobStatus.RUNNING)
            return Response(job_json(job), status_code=202 if pending else 200,
                            headers={"Retry-After": "1"} if pending else None)
        await reports.record_download(principal, job)
        return File(path=reports.jobs.bundle_path(job.id), filename=f"verbatim-report-{job.id}.zip",
                    media_type="application/zip", headers={"Verbatim-Bundle-SHA256": job.bundle_sha256 or ""})
