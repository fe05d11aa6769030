"""The console end to end in headless Chromium (Debian's /usr/bin/chromium driven by Playwright):
sign in, filter and open a transcript, replay it and see ``match``, export and download a report.

When the server has no replay API mounted yet, a stand-in with the same routes is mounted for the
test: it re-generates the transcript with the (deterministic) fake engine from the stored token ids
and seed, and compares token by token — so ``match`` is earned, not hard-coded.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from litestar import Controller, get, post
from litestar.di import Provide

from auditor import repository
from auditor.auth import Principal
from auditor.errors import not_found
from auditor.reports import verify_bundle
from auditor.routes.deps import Services, provide_principal
from auditor.ui.api import has_route
from auditor.ui.controller import REPLAY_START
from engine.sampling import SamplingParams
from tests.auditor.conftest import LiveServer, sqlite_settings
from tests.auditor.fake_engine import FakeAsyncEngine
from tests.auditor.reports_server import extra_routes, start_reports_server

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT_ENV = "VERBATIM_CONSOLE_SCREENSHOT"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"{CHROMIUM} missing: `apt-get install chromium` (make setup does)"),
]


class StandInReplay(Controller):
    """``POST /v1/transcripts/{id}/replay`` and ``GET /v1/replays/{id}`` over the fake engine."""

    path = "/v1"
    dependencies = {"principal": Provide(provide_principal)}
    jobs: dict[str, dict[str, Any]] = {}

    @post("/transcripts/{transcript_id:str}/replay", status_code=202)
    async def start(self, transcript_id: str, services: Services, principal: Principal) -> dict[str, Any]:
        async with services.sessionmaker() as session:
            row = await repository.get_transcript(session, transcript_id)
            content = await repository.get_content(session, transcript_id)
        if row is None or row.tenant != principal.tenant or content is None:
            raise not_found(f"transcript {transcript_id!r} not found")
        job_id = str(uuid.uuid4())
        self.jobs[job_id] = {"id": job_id, "transcript_id": transcript_id, "status": "running", "result": None}
        asyncio.get_running_loop().create_task(self._run(job_id, services, row.seed, content))
        return self.jobs[job_id]

    async def _run(self, job_id: str, services: Services, seed: str | None, content: Any) -> None:
        await asyncio.sleep(0.3)  # long enough for the page to show "running"
        params = SamplingParams(max_tokens=len(content.output_token_ids), seed=int(seed or 0), deterministic=True,
                                ignore_eos=True)
        final = None
        async for out in services.engine.generate(list(content.prompt_token_ids), params):
            final = out
        replayed = list(final.token_ids) if final else []
        same = replayed == list(content.output_token_ids)
        self.jobs[job_id].update(status="done", result={"result": "match" if same else "mismatch",
                                                        "tokens": len(replayed)})

    @get("/replays/{replay_id:str}")
    async def status(self, replay_id: str, principal: Principal) -> dict[str, Any]:
        if replay_id not in self.jobs:
            raise not_found(f"replay {replay_id!r} not found")
        return self.jobs[replay_id]


def replay_routes_present(settings: Any) -> bool:
    from auditor.app import create_app

    return has_route(create_app(settings, engine=FakeAsyncEngine(), routes=extra_routes()), REPLAY_START)


@pytest.fixture
async def console(tmp_path: Path) -> AsyncIterator[LiveServer]:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    extra = () if replay_routes_present(settings) else (StandInReplay,)
    live = await start_reports_server(settings, FakeAsyncEngine(), {"auditor": "acme:auditor", "client": "acme:client"},
                                      extra)
    async with live.client(live.keys["client"]) as client:
        for i, det in enumerate((True, True, True, False)):
            body = {"model": "fake-model", "prompt": f"the quick brown fox number {i}", "max_tokens": 24,
                    "deterministic": det}
            response = await client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
    try:
        yield live
    finally:
        await asyncio.to_thread(live.stop)


async def test_console_sign_in_replay_export_download(console: LiveServer, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright, expect

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = await browser.new_page(accept_downloads=True, viewport={"width": 1280, "height": 900})
            await page.goto(f"{console.url}/ui")
            await expect(page).to_have_url(f"{console.url}/ui/login")

            await page.fill("#api_key", "vbk_not-a-real-key")
            await page.click("#sign-in")
            await expect(page.get_by_role("alert")).to_contain_text("invalid or revoked API key")

            await page.fill("#api_key", console.keys["auditor"])
            await page.click("#sign-in")
            await expect(page).to_have_url(f"{console.url}/ui/transcripts")
            await expect(page.locator("#transcripts tr")).to_have_count(5)  # header + 4
            await page.select_option("select[name=deterministic]", "true")
            await page.get_by_role("button", name="Filter").click()
            await expect(page.locator("#transcripts tr")).to_have_count(4)

            await page.locator("#transcripts a").first.click()
            await expect(page.locator("#signature-status")).to_have_text("signature: valid")
            await expect(page.locator("#inclusion-status")).to_have_text("log inclusion: proven")
            await expect(page.locator("#windows .window")).not_to_have_count(0)
            await expect(page.locator("#dvr")).to_contain_text("Verify passes")
            await expect(page.locator("#prompt-text")).to_contain_text("the quick brown fox")

            await page.click("#replay")
            await expect(page.locator("#replay-status")).to_have_text("match", timeout=30_000)
            shot = tmp_path / "console.png"
            await page.screenshot(path=str(shot), full_page=True)
            if os.environ.get(SCREENSHOT_ENV):
                shutil.copyfile(shot, os.environ[SCREENSHOT_ENV])

            await page.click("text=Reports")
            await page.check("input[name=include_content]")
            await page.click("#export")
            await expect(page.locator("#download")).to_be_visible(timeout=60_000)
            await expect(page.locator("#report-status")).to_have_text("done")
            async with page.expect_download() as info:
                await page.click("#download")
            download = await info.value
            bundle = tmp_path / download.suggested_filename
            await download.save_as(str(bundle))

            await page.click("text=Sign out")
            await expect(page).to_have_url(f"{console.url}/ui/login")
            await page.goto(f"{console.url}/ui/reports")
            await expect(page).to_have_url(f"{console.url}/ui/login")
        finally:
            await browser.close()

    assert bundle.name.startswith("verbatim-report-") and bundle.suffix == ".zip"
    result = verify_bundle(bundle)
    assert result.ok, result.render()
    assert sum(f.check == "output_commitment" and f.ok for f in result.findings) == 4  # content was asked for


async def test_console_client_role_cannot_export(console: LiveServer) -> None:
    from playwright.async_api import async_playwright, expect

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            await page.goto(f"{console.url}/ui/login")
            await page.fill("#api_key", console.keys["client"])
            await page.click("#sign-in")
            await page.goto(f"{console.url}/ui/reports")
            await expect(page.get_by_role("alert")).to_contain_text("may not do this")
        finally:
            await browser.close()
    async with httpx.AsyncClient(base_url=console.url) as anonymous:
        response = await anonymous.get("/ui/transcripts", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/ui/login"
