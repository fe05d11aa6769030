"""The service as `serve` runs it by default: the real engine (SmolLM2) in a process of its own behind a live
server, driven by the official ``openai`` client. Streams arrive whole, deterministic bits do not depend on
the co-traffic, and a transcript replays as ``match`` in the engine process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from tests.auditor.conftest import REAL_ENGINE_OPTIONS, LiveServer, serving, sqlite_settings
from tests.auditor.test_replay_fake import replay


@pytest.fixture
async def process_server(tmp_path: Path) -> AsyncIterator[LiveServer]:
    from engine.config import EngineConfig
    from engine.engine_process import EngineProcess

    engine = await asyncio.to_thread(EngineProcess, EngineConfig(**REAL_ENGINE_OPTIONS, num_threads=1),
                                     start_timeout_s=900)
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    try:
        async with serving(settings, engine, {"client": "acme:client", "auditor": "acme:auditor"}) as server:
            yield server
    finally:
        await engine.shutdown()


async def test_streams_bits_and_replay_through_the_engine_process(process_server: LiveServer) -> None:
    oai = openai.AsyncOpenAI(base_url=process_server.url + "/v1", api_key=process_server.keys["client"],
                             max_retries=0, timeout=600)
    model = (await oai.models.list()).data[0].id
    request = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9,
               "seed": 77, "logprobs": 1, "extra_body": {"deterministic": True}}
    alone = await oai.completions.create(**request)

    async def streamed(i: int) -> tuple[str, dict]:
        stream = await oai.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"Count to {i + 3}."}], max_tokens=8, stream=True,
            seed=i, extra_body={"deterministic": i % 2 == 0})
        text, final = [], None
        async for chunk in stream:
            text += [c.delta.content or "" for c in chunk.choices]
            final = (chunk.model_extra or {}).get("transcript") or final
        assert final is not None
        return "".join(text), final

    loaded, *streams = await asyncio.gather(oai.completions.create(**request), *[streamed(i) for i in range(4)])
    assert loaded.choices[0].text == alone.choices[0].text
    assert loaded.choices[0].logprobs.token_logprobs == alone.choices[0].logprobs.token_logprobs
    async with process_server.client(process_server.keys["client"]) as client:
        for text, final in streams:
            doc = (await client.get(f"/v1/transcripts/{final['id']}",
                                    params={"include_content": "true", "verify": "true"})).json()
            assert doc["verification"]["ok"] and doc["output_text"] == text
    async with process_server.client(process_server.keys["auditor"]) as auditor:
        job = (await replay(auditor, loaded.model_extra["transcript"]["id"])).json()
    assert job["result"] == "match", job
