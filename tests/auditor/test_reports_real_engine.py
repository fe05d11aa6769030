"""A report made from a real run: the default model behind a live server, completions through the
official ``openai`` client, a replay, then the bundle exported over HTTP and verified offline."""

from __future__ import annotations

import json

import openai
import pytest

from auditor.reports import verify_bundle
from tests.auditor.conftest import LiveServer
from tests.auditor.test_reports_api import export, unzip

pytestmark = pytest.mark.slow


async def test_report_from_a_real_run_verifies_offline(real_server: LiveServer) -> None:
    server = real_server
    oai = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.keys["client"], max_retries=0, timeout=300)
    model = (await oai.models.list()).data[0].id
    ids = []
    for i, det in enumerate((True, True, False)):
        raw = await oai.completions.with_raw_response.create(
            model=model, prompt=f"Name a colour ({i}):", max_tokens=6, temperature=0.7,
            extra_body={"deterministic": det, "seed": 1000 + i})
        ids.append(raw.headers["verbatim-transcript-id"])
    async with server.client(server.keys["auditor"]) as auditor:
        replay = await auditor.post(f"/v1/transcripts/{ids[0]}/replay", params={"wait": "true"})
        assert replay.status_code == 200 and replay.json()["result"] == "match", replay.text
        _, data = await export(auditor)
    result = verify_bundle(data)
    assert result.ok, result.render()
    files = unzip(data)
    assert sorted(json.loads(x)["transcript_id"] for x in files["transcripts.jsonl"].splitlines()) == sorted(ids)
    assert [json.loads(x)["verdict"] for x in files["replays.jsonl"].splitlines()] == ["match"]
    assert b"Name a colour" not in files["transcripts.jsonl"] + files["report.html"]
