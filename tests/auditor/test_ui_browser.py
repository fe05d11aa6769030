"""The console end to end in headless Chromium (Debian's /usr/bin/chromium driven by Playwright)
over the REAL engine (default SmolLM2 model, CPU; the session's shared ``real_engine`` with small W/G):
completions made through the official ``openai`` client against the live server, then sign in,
filter and open a real deterministic chat transcript, replay it and see ``match``, export and
download a report, verify it offline and find the access-log rows.

``VERBATIM_CONSOLE_SCREENSHOT=docs/console.png`` saves the transcript page (after the replay) as the
console screenshot of docs/api.md.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import openai
import pytest

from auditor.reports import verify_bundle
from tests.auditor.conftest import LiveServer
from tests.auditor.test_reports_api import unzip

CHROMIUM = "/usr/bin/chromium"
SCREENSHOT_ENV = "VERBATIM_CONSOLE_SCREENSHOT"
CHAT_PROMPT = "Name three colors."

pytestmark = [
    pytest.mark.browser,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"{CHROMIUM} missing: `apt-get install chromium` (make setup does); browser tests skipped"),
]


async def make_transcripts(server: LiveServer) -> tuple[str, str, str]:
    """Two deterministic requests (a sampled completion and a greedy chat) and one that is not;
    returns the model id, the chat's transcript id and its output text."""
    oai = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.keys["client"], max_retries=0, timeout=300)
    model = (await oai.models.list()).data[0].id
    await oai.completions.create(model=model, prompt="The capital of France is", max_tokens=6,
                                 extra_body={"deterministic": False})
    await oai.completions.create(model=model, prompt="Roses are red,", max_tokens=6, temperature=0.7, seed=1000,
                                 extra_body={"deterministic": True})
    chat = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT_PROMPT}],
                                             max_tokens=16, temperature=0, extra_body={"deterministic": True})
    transcript = (chat.model_extra or {})["transcript"]
    assert transcript["replayable"] is True
    return model, transcript["id"], chat.choices[0].message.content or ""


async def test_console_sign_in_replay_export_download(real_server: LiveServer, tmp_path: Path) -> None:
    from playwright.async_api import async_playwright, expect

    model, chat_id, chat_text = await make_transcripts(real_server)
    assert chat_text.strip()
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = await browser.new_page(accept_downloads=True, viewport={"width": 1280, "height": 900})
            await page.goto(f"{real_server.url}/ui")
            await expect(page).to_have_url(f"{real_server.url}/ui/login")

            await page.fill("#api_key", "vbk_not-a-real-key")
            await page.click("#sign-in")
            await expect(page.get_by_role("alert")).to_contain_text("invalid or revoked API key")

            await page.fill("#api_key", real_server.keys["auditor"])
            await page.click("#sign-in")
            await expect(page).to_have_url(f"{real_server.url}/ui/transcripts")
            await expect(page.locator("#transcripts tr")).to_have_count(4)  # header + 3
            await page.select_option("select[name=deterministic]", "true")
            await page.get_by_role("button", name="Filter").click()
            await expect(page.locator("#transcripts tr")).to_have_count(3)  # header + 2 deterministic
            await expect(page.locator("#transcripts")).to_contain_text(model)

            await page.click(f"#transcripts a[href='/ui/transcripts/{chat_id}']")
            await expect(page).to_have_url(f"{real_server.url}/ui/transcripts/{chat_id}")
            await expect(page.locator("#signature-status")).to_have_text("signature: valid")
            await expect(page.locator("#inclusion-status")).to_have_text("log inclusion: proven")
            await expect(page.locator("#windows .window")).not_to_have_count(0)
            await expect(page.locator("#dvr")).to_contain_text("Verify passes")
            await expect(page.locator("#prompt-text")).to_contain_text(CHAT_PROMPT)
            await expect(page.locator("#output-text")).to_have_text(chat_text)

            await page.click("#replay")
            await expect(page.locator("#replay-status")).to_have_text("match", timeout=300_000)
            shot = tmp_path / "console.png"
            await page.screenshot(path=str(shot), full_page=True)
            if os.environ.get(SCREENSHOT_ENV):
                shutil.copyfile(shot, os.environ[SCREENSHOT_ENV])

            await page.click("text=Reports")
            await page.check("input[name=include_content]")
            await page.click("#export")
            await expect(page.locator("#download")).to_be_visible(timeout=120_000)
            await expect(page.locator("#report-status")).to_have_text("done")
            async with page.expect_download() as info:
                await page.click("#download")
            download = await info.value
            bundle = tmp_path / download.suggested_filename
            await download.save_as(str(bundle))

            await page.click("text=Sign out")
            await expect(page).to_have_url(f"{real_server.url}/ui/login")
            await page.goto(f"{real_server.url}/ui/reports")
            await expect(page).to_have_url(f"{real_server.url}/ui/login")
        finally:
            await browser.close()

    assert bundle.name.startswith("verbatim-report-") and bundle.suffix == ".zip"
    result = verify_bundle(bundle)
    assert result.ok, result.render()
    assert sum(f.check == "output_commitment" and f.ok for f in result.findings) == 3  # content was asked for
    files = unzip(bundle.read_bytes())
    lines = [json.loads(x) for x in files["transcripts.jsonl"].splitlines()]
    assert len(lines) == 3 and chat_id in {x["transcript_id"] for x in lines}
    replays = [json.loads(x) for x in files["replays.jsonl"].splitlines()]
    assert [r["verdict"] for r in replays] == ["match"] and replays[0]["attestation"] is not None
    assert any(f.check == "replay_inclusion" and f.ok for f in result.findings)
    rows = [row.split(",") for row in files["access_log.csv"].decode().splitlines()[1:]]
    assert {"list", "read", "replay", "export"} <= {row[3] for row in rows}
    assert any(row[3] == "read" and chat_id in row[4] for row in rows), rows  # the console's read of the chat


async def test_console_client_role_cannot_export(real_server: LiveServer) -> None:
    from playwright.async_api import async_playwright, expect

    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = await browser.new_page()
            await page.goto(f"{real_server.url}/ui/login")
            await page.fill("#api_key", real_server.keys["client"])
            await page.click("#sign-in")
            await page.goto(f"{real_server.url}/ui/reports")
            await expect(page.get_by_role("alert")).to_contain_text("may not do this")
            export = await page.request.post(f"{real_server.url}/ui/reports", form={"include_content": "on"},
                                             max_redirects=0)
            assert export.status == 403 and "may not do this" in await export.text(), export.status
        finally:
            await browser.close()
    async with httpx.AsyncClient(base_url=real_server.url) as anonymous:
        response = await anonymous.get("/ui/transcripts", follow_redirects=False)
    assert response.status_code == 303 and response.headers["location"] == "/ui/login"
