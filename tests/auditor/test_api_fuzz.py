"""Property-based fuzzing of every operation in the published OpenAPI document (schemathesis).

For each operation, schemathesis generates requests that fit the schema (positive) and requests
that break it (negative: wrong types, out-of-range values, missing fields), and sends them to a
live server (uvicorn, the fake engine, SQLite) with an admin key. Every answer must be below 500, and
every error answer must be JSON in the one error shape. Examples per operation are bounded so the
whole run stays within about a minute on two CPU cores; ``derandomize`` makes it repeatable.
"""

from __future__ import annotations

import asyncio
import time
import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from tests.auditor.conftest import serving, sqlite_settings
from tests.auditor.fake_engine import FakeAsyncEngine

EXAMPLES = 20
FEWER = {"POST /v1/reports": 3}
"""Operations whose accepted requests start expensive work (a report renders charts and a PDF)."""


@dataclass(frozen=True)
class Answer:
    operation: str
    mode: str
    status: int
    problem: str | None
    request: str


def _problem(status: int, content_type: str, body: bytes) -> str | None:
    if status >= 500:
        return f"server error {status}"
    if status < 400:
        return None
    if not content_type.startswith("application/json"):
        return f"error answer is {content_type or 'untyped'}, not JSON"
    try:
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        assert "param" in error and "code" in error
    except (ValueError, KeyError, TypeError, AssertionError):
        return "error answer is not in the error shape"
    return None


def _fuzz(base_url: str, api_key: str) -> list[Answer]:
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    answers: list[Answer] = []
    headers = {"Authorization": f"Bearer {api_key}"}
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run(operation, label, mode, base_url, headers, answers)
    return answers


def _run(operation: Any, label: str, mode: GenerationMode, base_url: str, headers: dict[str, str],
         answers: list[Answer]) -> None:
    @settings(max_examples=FEWER.get(label, EXAMPLES), deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def send(case: Any) -> None:
        response = case.call(base_url=base_url, headers=headers, timeout=60)
        content_type = response.headers.get("content-type", [""])
        content_type = content_type[0] if isinstance(content_type, list) else content_type
        problem = _problem(response.status_code, content_type, response.content)
        request = f"{case.method} {case.formatted_path} query={case.query} body={str(case.body)[:200]}"
        answers.append(Answer(label, mode.value, response.status_code, problem, request))

    try:
        send()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        # An operation with nothing to break (no parameters, no body) has no negative cases.


@pytest.mark.slow
async def test_fuzzing_the_published_schema_finds_no_5xx_and_no_non_json_error(tmp_path: Path) -> None:
    settings_ = await asyncio.to_thread(sqlite_settings, tmp_path, rate_limit_per_second=10_000.0,
                                        rate_limit_burst=10_000)
    async with serving(settings_, FakeAsyncEngine(), {"admin": "acme:admin"}) as server:
        async with server.client(server.keys["admin"]) as client:
            assert (await client.post("/v1/completions", json={"model": "fake-model", "prompt": "seed the log",
                                                               "max_tokens": 4})).status_code == 200
        answers = await asyncio.to_thread(_fuzz, server.url, server.keys["admin"])
        # report jobs the fuzzing started run on the server's own event loop: wait for them to end there
        reports = getattr(server.app.state, "reports", None)
        deadline = time.monotonic() + 60
        while reports is not None and any(not t.done() for t in list(reports._tasks)):
            assert time.monotonic() < deadline, "report jobs still running after 60 s"
            await asyncio.sleep(0.05)
    operations = {a.operation for a in answers}
    assert len(operations) >= 19, sorted(operations)
    assert len(answers) > 400
    assert {a.status for a in answers} & {200, 201, 202} and {a.status for a in answers} & {400}
    failures = [a for a in answers if a.problem is not None]
    assert failures == [], "\n".join(f"{a.operation} [{a.mode}] {a.status}: {a.problem}: {a.request}"
                                     for a in failures[:20])


def _text_round_trips(base_url: str, api_key: str) -> list[tuple[str, int, str | None]]:
    """Random text (NUL, controls, astral planes, unassigned code points) as a prompt and a chat
    message: stored exactly. The same text with a lone surrogate escape spliced in: a 400 naming the
    field, before generation."""
    import httpx
    from hypothesis import strategies as st

    wrong: list[tuple[str, int, str | None]] = []
    client = httpx.Client(base_url=base_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60)
    text = st.text(st.characters(codec="utf-8"), min_size=1, max_size=40)

    @settings(max_examples=30, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(prompt=text, surrogate=st.integers(0xD800, 0xDFFF))
    def round_trip(prompt: str, surrogate: int) -> None:
        body = client.post("/v1/completions", json={"model": "fake-model", "prompt": prompt, "max_tokens": 2})
        if body.status_code != 200:  # the fake tokenizer maps every character to a token: never empty
            wrong.append((prompt, body.status_code, "completion refused"))
            return
        doc = client.get(f"/v1/transcripts/{body.json()['transcript']['id']}",
                         params={"include_content": "true", "verify": "true"}).json()
        if doc["prompt_text"] != prompt or not doc["verification"]["ok"]:
            wrong.append((prompt, 200, "stored text differs or does not verify"))
        spliced = json.dumps({"model": "fake-model", "messages": [{"role": "user", "content": prompt}]})
        spliced = spliced.replace('"content": "', f'"content": "\\u{surrogate:04x}', 1)
        refused = client.post("/v1/chat/completions", content=spliced, headers={"Content-Type": "application/json"})
        if refused.status_code != 400 or refused.json()["error"]["param"] != "messages[0].content":
            wrong.append((prompt, refused.status_code, refused.text[:200]))

    try:
        round_trip()
    finally:
        client.close()
    return wrong


async def test_any_text_is_stored_exactly_or_refused_before_generation(any_database: Any) -> None:
    unlimited = dataclasses.replace(any_database, rate_limit_per_second=10_000.0, rate_limit_burst=10_000)
    async with serving(unlimited, FakeAsyncEngine(), {"client": "acme:client"}) as server:
        wrong = await asyncio.to_thread(_text_round_trips, server.url, server.keys["client"])
    assert wrong == []
