"""The console end to end in headless Chromium (Debian's /usr/bin/chromium driven by Playwright):
sign in, filter and open a transcript, replay it and see ``match``, export and download a report.

The server is the real app (real DB, real replay service and signed attestations) over the replay
tests' fake engine, whose ``replay`` re-predicts every recorded token: ``match`` is earned.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from auditor.reports import verify_bundle
from tests.auditor.conftest import LiveServer, sqlite_settings
from tests.auditor.reports_server import start_reports_server
from tests.auditor.test_replay_fake import ReplayFakeEngine

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT_ENV = "VERBATIM_CONSOLE_SCREENSHOT"

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"{CHROMIUM} missing: `apt-get install chromium` (make setup does)"),
]


@pytest.fixture
async def console(tmp_path: Path) -> AsyncIterator[LiveServer]:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    live = await start_reports_server(settings, ReplayFakeEngine(), {"auditor": "acme:auditor", "client": "acme:client"})
    async with live.client(live.keys["client"]) as client:
        for i, det in enumerate((True, True, True, False)):
            body = {"model": "fake-model", "prompt": f"the quick brown fox number {i}", "max_tokens": 24,
                    "ignore_eos": True, "deterministic": det}
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
    files = unzip(bundle.read_bytes())
    replays = [json.loads(x) for x in files["replays.jsonl"].splitlines()]
    assert [r["verdict"] for r in replays] == ["match"] and replays[0]["attestation"] is not None
    assert any(f.check == "replay_inclusion" and f.ok for f in result.findings)
    actions = {row.split(",")[3] for row in files["access_log.csv"].decode().splitlines()[1:]}
    assert {"list", "read", "replay", "export"} <= actions


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


def unzip(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {n: zf.read(n) for n in zf.namelist()}
