"""Streaming through the service with the REAL engine (SmolLM2, CPU) at the default window W = 32, driven by the
official ``openai`` client: a deterministic stream arrives commit by commit (the prefill's first token, then
one chunk per verify pass, each holding exactly the tokens that pass committed: nothing between the engine and
the client batches them), and at the CPU's default verify cadence 64 tokens alone arrive in at least 4 chunks
(with the cadence off, 3: the first token and two full windows). G = 2 keeps a verify pass at 64 tokens."""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.auditor.conftest import LiveServer, LoopThread, serving, sqlite_settings

STREAM_OPTIONS: dict[str, Any] = {"window": 32, "group": 2, "max_num_seqs": 4}


@pytest.fixture(scope="module")
def stream_engine(real_engine: tuple[LoopThread, Any]) -> Iterator[Any]:
    from engine import AsyncEngine, EngineConfig

    loop_thread, _ = real_engine
    engine = AsyncEngine(EngineConfig(**STREAM_OPTIONS))
    loop_thread.run(engine.start())
    try:
        yield engine
    finally:
        loop_thread.run(engine.shutdown())


@pytest.fixture
async def stream_server(real_engine: tuple[LoopThread, Any], stream_engine: Any,
                        tmp_path: Path) -> AsyncIterator[LiveServer]:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    async with serving(settings, stream_engine, {"client": "acme:client"}, loop_thread=real_engine[0]) as server:
        yield server


async def test_deterministic_stream_arrives_commit_by_commit(stream_server: LiveServer) -> None:
    key = stream_server.keys["client"]
    oai = openai.AsyncOpenAI(base_url=stream_server.url + "/v1", api_key=key, max_retries=0, timeout=600)
    model = (await oai.models.list()).data[0].id
    stream = await oai.completions.create(
        model=model, prompt="The history of the printing press", max_tokens=64, temperature=0, logprobs=0,
        stream=True, extra_body={"deterministic": True, "ignore_eos": True})
    tokens_per_chunk: list[int] = []
    transcript = None
    async for chunk in stream:
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.tokens:
                tokens_per_chunk.append(len(choice.logprobs.tokens))
        transcript = (chunk.model_extra or {}).get("transcript") or transcript
    assert transcript is not None
    async with stream_server.client(key) as client:
        doc = (await client.get(f"/v1/transcripts/{transcript['id']}")).json()
    predicate = json.loads(base64.b64decode(doc["envelope"]["payload"]))["predicate"]
    spans = [(int(s), int(e)) for s, e in predicate["windows"]["spans"]]
    assert sum(tokens_per_chunk) == 64
    assert tokens_per_chunk == [1] + [e - s for s, e in spans], (tokens_per_chunk, spans)
    assert len(tokens_per_chunk) >= 4, tokens_per_chunk
    assert stream_server.engine.config.tuning.verify_cadence_steps < STREAM_OPTIONS["window"] - 1
