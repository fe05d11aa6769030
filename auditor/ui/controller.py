"""``/ui``: the auditor's console — server-rendered pages over the public API.

Pages: sign in / out, transcript list with filters, transcript detail (tokens by window, signature
and inclusion status, DVR statistics, replay with live status), report export and download.
Nothing is fetched from the internet: styles and the few lines of script are inline.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from jinja2 import Environment, PackageLoader, select_autoescape
from litestar import Controller, MediaType, Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.response import Redirect

from auditor.errors import ApiError
from auditor.ui.api import ApiClient, ApiFailure, has_route
from auditor.ui.sessions import COOKIE, Session, SessionStore
from auditor.ui.views import safe_decoder, transcript_view

REPLAY_START = "/v1/transcripts/{transcript_id:str}/replay"
REPLAY_STATUS = "/v1/replays/{replay_id:str}"
TRANSCRIPT_FILTERS = ("model", "deterministic", "status", "since", "until", "after", "order")

_ENV = Environment(loader=PackageLoader("auditor.ui", "templates"), autoescape=select_autoescape(["html", "j2"]))


def render(name: str, status: int = 200, **context: Any) -> Response[str]:
    html = _ENV.get_template(name).render(**context)
    return Response(html, media_type=MediaType.HTML, status_code=status,
                    headers={"Cache-Control": "no-store", "Content-Security-Policy":
                             "default-src 'self'; img-src 'self' data:; style-src 'unsafe-inline'; "
                             "script-src 'unsafe-inline'; connect-src 'self'; frame-ancestors 'none'"})


async def _session(request: Request[Any, Any, Any]) -> Session | None:
    return await SessionStore.for_app(request.app).get(request.cookies.get(COOKIE))


def _client(session: Session, request: Request[Any, Any, Any]) -> ApiClient:
    return ApiClient(request.app, session.api_key)


def _to_login() -> Redirect:
    return Redirect("/ui/login", status_code=303)


def _utc_param(value: str | None) -> str | None:
    """An HTML ``datetime-local`` value (no zone) read as UTC, in the API's form."""
    if not value:
        return None
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise ApiError(400, f"not a date and time: {value!r}", param="since/until") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    return parsed.astimezone(dt.UTC).isoformat().replace("+00:00", "Z")


def _replay_json(raw: dict[str, Any]) -> dict[str, Any]:
    """The replay job as the page shows it, whatever extra fields the replay API carries."""
    result = raw.get("result")
    verdict = raw.get("verdict")
    if verdict is None and isinstance(result, str):
        verdict = result
    if verdict is None and isinstance(result, dict):
        verdict = result.get("result") or result.get("verdict")
    summary = {k: raw[k] for k in ("status", "result", "details", "error", "log_index", "finished_at")
               if raw.get(k) is not None}
    if raw.get("attestation") is not None:
        summary["attestation"] = "signed (replay key), appended to the log"
    return {"id": raw.get("id") or raw.get("replay_id"), "status": raw.get("status"), "verdict": verdict,
            "error": raw.get("error"), "summary": summary}


async def _script_call(request: Request[Any, Any, Any], method: str, path: str, *,
                       params: dict[str, Any] | None = None,
                       shape: Callable[[dict[str, Any]], dict[str, Any]] = lambda doc: doc) -> Response[Any]:
    """One API call for a page's script: the document (as ``shape`` shows it), or ``{"error": ...}``."""
    session = await _session(request)
    if session is None:
        return Response({"error": "signed out"}, status_code=401)
    try:
        doc = await _client(session, request).json(method, path, params=params)
    except ApiFailure as exc:
        return Response({"error": exc.message}, status_code=exc.status)
    return Response(shape(doc), status_code=200)


def _failure_page(exc: ApiFailure, session: Session, template: str, **context: Any) -> Response[Any]:
    """A page whose API call failed: back to sign-in when the key no longer authenticates."""
    if exc.status == 401:
        return _to_login()
    return render(template, status=exc.status, session=session, error=exc.message, **context)


class ConsoleController(Controller):
    path = "/ui"
    include_in_schema = False
    opt = {"strict": False}  # HTML pages and forms, validated here; their API calls meet the strict API

    @get("/")
    async def home(self, request: Request[Any, Any, Any]) -> Redirect:
        return Redirect("/ui/transcripts" if await _session(request) else "/ui/login", status_code=303)

    # --- sign in / out -----------------------------------------------------------------------------

    @get("/login")
    async def login_page(self) -> Response[str]:
        return render("login.html.j2", session=None, error=None)

    @post("/login")
    async def login(self, request: Request[Any, Any, Any]) -> Response[Any]:
        form = await request.form()
        api_key = str(form.get("api_key", "")).strip()
        services = request.app.state.services
        try:
            principal = await services.authenticator.authenticate(f"Bearer {api_key}")
        except ApiError as exc:
            return render("login.html.j2", status=401, session=None, error=exc.message)
        token = await SessionStore.for_app(request.app).create(api_key, principal.key_id, principal.tenant,
                                                          principal.role.value)
        cookie = Cookie(key=COOKIE, value=token, path="/ui", httponly=True, samesite="strict",
                        secure=request.url.scheme == "https")
        return Redirect("/ui/transcripts", status_code=303, cookies=[cookie])

    @post("/logout")
    async def logout(self, request: Request[Any, Any, Any]) -> Redirect:
        await SessionStore.for_app(request.app).end(request.cookies.get(COOKIE))
        return Redirect("/ui/login", status_code=303, cookies=[Cookie(key=COOKIE, value="", path="/ui", max_age=0)])

    # --- transcripts --------------------------------------------------------------------------------

    @get("/transcripts")
    async def transcripts(self, request: Request[Any, Any, Any]) -> Response[Any]:
        session = await _session(request)
        if session is None:
            return _to_login()
        filters = {k: request.query_params.get(k) or "" for k in TRANSCRIPT_FILTERS}
        params = {**filters, "since": _utc_param(filters["since"]), "until": _utc_param(filters["until"]), "limit": 50}
        try:
            page = await _client(session, request).json("GET", "/v1/transcripts", params=params)
        except ApiFailure as exc:
            return _failure_page(exc, session, "transcripts.html.j2", filters=filters, page=None)
        return render("transcripts.html.j2", session=session, filters=filters, page=page, error=None)

    @get("/transcripts/{transcript_id:str}")
    async def transcript(self, transcript_id: str, request: Request[Any, Any, Any]) -> Response[Any]:
        session = await _session(request)
        if session is None:
            return _to_login()
        try:
            doc = await _client(session, request).json(
                "GET", f"/v1/transcripts/{transcript_id}", params={"include_content": "true", "verify": "true"})
        except ApiFailure as exc:
            return _failure_page(exc, session, "error.html.j2")
        engine = request.app.state.services.engine
        view = transcript_view(doc, safe_decoder(None if engine is None else engine.tokenizer))
        replay_ready = has_route(request.app, REPLAY_START) and has_route(request.app, REPLAY_STATUS)
        return render("transcript.html.j2", session=session, t=view, replay_ready=replay_ready)

    @post("/transcripts/{transcript_id:str}/replay")
    async def start_replay(self, transcript_id: str, request: Request[Any, Any, Any]) -> Response[Any]:
        return await _script_call(request, "POST", f"/v1/transcripts/{transcript_id}/replay", shape=_replay_json)

    @get("/replays/{replay_id:str}")
    async def replay_status(self, replay_id: str, request: Request[Any, Any, Any]) -> Response[Any]:
        return await _script_call(request, "GET", f"/v1/replays/{replay_id}", shape=_replay_json)

    # --- reports --------------------------------------------------------------------------------------

    @get("/reports")
    async def reports(self, request: Request[Any, Any, Any]) -> Response[Any]:
        session = await _session(request)
        if session is None:
            return _to_login()
        try:
            listing = await _client(session, request).json("GET", "/v1/reports")
        except ApiFailure as exc:
            return _failure_page(exc, session, "reports.html.j2", reports=None)
        return render("reports.html.j2", session=session, reports=listing["data"], error=None)

    @post("/reports")
    async def export(self, request: Request[Any, Any, Any]) -> Response[Any]:
        session = await _session(request)
        if session is None:
            return _to_login()
        form = await request.form()
        body = {"since": _utc_param(str(form.get("since") or "")), "until": _utc_param(str(form.get("until") or "")),
                "model": str(form.get("model") or "") or None,
                "deterministic_only": form.get("deterministic_only") == "on",
                "include_content": form.get("include_content") == "on"}
        try:
            job = await _client(session, request).json("POST", "/v1/reports", json=body)
        except ApiFailure as exc:
            return _failure_page(exc, session, "reports.html.j2", reports=None)
        return Redirect(f"/ui/reports/{job['id']}", status_code=303)

    @get("/reports/{report_id:str}")
    async def report(self, report_id: str, request: Request[Any, Any, Any]) -> Response[Any]:
        session = await _session(request)
        if session is None:
            return _to_login()
        try:
            job = await _client(session, request).json("GET", f"/v1/reports/{report_id}", params={"format": "json"})
        except ApiFailure as exc:
            return _failure_page(exc, session, "error.html.j2")
        return render("report.html.j2", session=session, job=job)

    @get("/reports/{report_id:str}/status")
    async def report_status(self, report_id: str, request: Request[Any, Any, Any]) -> Response[Any]:
        return await _script_call(request, "GET", f"/v1/reports/{report_id}", params={"format": "json"})

    @get("/reports/{report_id:str}/download")
    async def download(self, report_id: str, request: Request[Any, Any, Any]) -> Response[Any]:
        session = await _session(request)
        if session is None:
            return _to_login()
        response = await _client(session, request).request("GET", f"/v1/reports/{report_id}")
        if response.status_code == 401:  # the key no longer authenticates (revoked): back to sign-in
            return _to_login()
        if response.headers.get("content-type") != "application/zip":
            return render("error.html.j2", status=409 if response.status_code < 400 else response.status_code,
                          session=session, error="the report is not ready (or not yours)")
        return Response(response.content, media_type="application/zip", headers={
            "Content-Disposition": f'attachment; filename="verbatim-report-{report_id}.zip"',
            "Verbatim-Bundle-SHA256": response.headers.get("verbatim-bundle-sha256", "")})
