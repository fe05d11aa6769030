"""Replay with the REAL engine (default SmolLM2 model, CPU) behind a live server.

Transcripts are made with the official ``openai`` client under concurrent load (deterministic greedy
and sampled requests mixed with non-deterministic ones) on an engine whose fast path has fault
injection on, so their windows carry rollbacks; every replay must then be ``match``, also while the
server keeps serving completions. A stored token id altered in the database must fail verification
and replay as ``mismatch`` at exactly that position; a server with another W gives
``inconclusive_environment``; a server with another model refuses with 409.
"""

from __future__ import annotations

import asyncio
import base64
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from auditor.attestation import verify_replay_attestation
from auditor.verify import verify_document
from tests.auditor.conftest import REAL_ENGINE_OPTIONS, LiveServer, LoopThread, make_key, sqlite_settings, with_port
from tests.auditor.test_replay_fake import alter_output_token, replay, until_status

FAULTY_OPTIONS = {**REAL_ENGINE_OPTIONS, "window": 8, "group": 2, "fault_rate": 0.3, "fault_seed": 11}
PROMPTS = ["The capital of France is", "List three prime numbers:", "Roses are red,", "def fibonacci(n):",
           "Once upon a time", "2 + 2 ="]


@pytest.fixture(scope="module")
def faulty_engine(real_engine: tuple[LoopThread, Any]) -> Iterator[Any]:
    """A second real engine (W=8, G=2) whose fast path flips 30 % of the candidates."""
    from engine import AsyncEngine, EngineConfig

    loop_thread, _ = real_engine
    engine = AsyncEngine(EngineConfig(**FAULTY_OPTIONS))
    loop_thread.run(engine.start())
    try:
        yield engine
    finally:
        loop_thread.run(engine.shutdown())


async def serve(settings: Any, engine: Any, loop_thread: LoopThread, keys: dict[str, str]) -> LiveServer:
    server = LiveServer(settings, engine, keys=keys)
    await asyncio.to_thread(server.start_in, loop_thread)
    return server


@pytest.fixture
async def faulty_server(real_engine: tuple[LoopThread, Any], faulty_engine: Any,
                        tmp_path: Path) -> AsyncIterator[LiveServer]:
    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    keys = {"client": await make_key(settings, "acme", "client"),
            "auditor": await make_key(settings, "acme", "auditor")}
    server = await serve(settings, faulty_engine, real_engine[0], keys)
    try:
        yield server
    finally:
        await asyncio.to_thread(server.stop)


def openai_client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=server.keys["client"], max_retries=0, timeout=600)


async def complete(oai: openai.AsyncOpenAI, prompt: str, index: int, deterministic: bool = True) -> tuple[str, Any]:
    sampled = index % 2 == 1
    model = (await oai.models.list()).data[0].id
    completion = await oai.completions.create(
        model=model, prompt=prompt, max_tokens=10 + 3 * (index % 4), temperature=0.8 if sampled else 0.0,
        top_p=0.9 if sampled else 1.0, seed=500 + index if sampled else None,
        extra_body={"deterministic": deterministic, "ignore_eos": True})
    return (completion.model_extra or {})["transcript"]["id"], completion


async def chat(oai: openai.AsyncOpenAI, stream: bool) -> str:
    """A deterministic chat completion (streamed or not); returns its transcript id."""
    model = (await oai.models.list()).data[0].id
    messages = [{"role": "user", "content": "Name two rivers."}]
    if not stream:
        reply = await oai.chat.completions.create(model=model, messages=messages, max_tokens=12, seed=3,
                                                  temperature=0.6, extra_body={"deterministic": True})
        return (reply.model_extra or {})["transcript"]["id"]
    chunks = await oai.chat.completions.create(model=model, messages=messages, max_tokens=12, stream=True,
                                               extra_body={"deterministic": True})
    ids = [c.model_extra["transcript"]["id"] async for c in chunks if (c.model_extra or {}).get("transcript")]
    return ids[0]


async def statement_of(server: LiveServer, transcript_id: str) -> dict[str, Any]:
    async with server.client(server.keys["client"]) as client:
        doc = (await client.get(f"/v1/transcripts/{transcript_id}")).json()
    return json.loads(base64.b64decode(doc["envelope"]["payload"]))


@pytest.mark.slow
async def test_transcripts_made_under_load_with_faults_replay_as_match(faulty_server: LiveServer) -> None:
    oai = openai_client(faulty_server)
    made = await asyncio.gather(*[complete(oai, p, i) for i, p in enumerate(PROMPTS)],
                                *[complete(oai, p, i, deterministic=False) for i, p in enumerate(PROMPTS[:3])],
                                chat(oai, stream=False), chat(oai, stream=True))
    tids = [tid for tid, _ in made[:len(PROMPTS)]] + list(made[-2:])
    statements = [await statement_of(faulty_server, t) for t in tids]
    assert sum(s["predicate"]["dvr"]["rollbacks"] for s in statements) > 0, "fault injection caused no rollback"
    async with faulty_server.client(faulty_server.keys["auditor"]) as auditor:
        queued = [(await replay(auditor, t, wait=False)).json() for t in tids]
        busy = asyncio.gather(*[complete(oai, p, i + 10) for i, p in enumerate(PROMPTS[:4])])
        jobs = [await until_status(auditor, j["id"], ("done", "failed"), timeout=600) for j in queued]
        served = await busy
        jwks = (await auditor.get("/.well-known/jwks.json")).json()
        later = [(await replay(auditor, tid)).json() for tid, _ in served]
        exported = (await auditor.get(f"/v1/transcripts/{tids[1]}", params={"include_content": "true"})).json()
    report = verify_document(exported, jwks)
    assert report.ok and {"output_commitment", "window_chain", "logprob_digest"} <= {c.name for c in report.checks}
    assert [j["result"] for j in jobs] == ["match"] * len(tids), [(j["result"], j["details"], j["error"]) for j in jobs]
    assert [j["result"] for j in later] == ["match"] * len(served), [j["details"] for j in later]
    for job, statement in zip(jobs, statements):
        assert job["details"]["logprob_digest_match"] and job["details"]["output_commitment_match"]
        assert job["details"]["tokens"] == statement["predicate"]["tokens"]["output_count"]
        verify_replay_attestation(job["attestation"], jwks)


async def test_altered_token_is_reported_by_verify_and_replay_at_that_position(faulty_server: LiveServer) -> None:
    oai = openai_client(faulty_server)
    tid, completion = await complete(oai, PROMPTS[0], 2)
    n = completion.usage.completion_tokens
    position = n - 3
    original, altered = alter_output_token(faulty_server, tid, position)
    async with faulty_server.client(faulty_server.keys["auditor"]) as auditor:
        doc = (await auditor.get(f"/v1/transcripts/{tid}", params={"include_content": "true",
                                                                    "verify": "true"})).json()
        job = (await replay(auditor, tid)).json()
    checks = {c["name"]: c["ok"] for c in doc["verification"]["checks"]}
    assert checks["signature"] and not checks["output_commitment"] and not doc["verification"]["ok"]
    assert job["result"] == "mismatch", job
    details = job["details"]
    assert (details["position"], details["expected_token"], details["replayed_token"]) == (position, altered, original)
    start, end = details["window"]
    assert start <= position < end and details["corrected_matches_commitment"] is True
    assert details["record_checks"]["output_commitment"] is False


async def test_other_window_size_is_inconclusive_and_other_model_is_409(
        real_engine: tuple[LoopThread, Any], faulty_server: LiveServer, tmp_path: Path) -> None:
    from engine import AsyncEngine, EngineConfig

    loop_thread, plain_engine = real_engine
    tid, _ = await complete(openai_client(faulty_server), PROMPTS[1], 0)
    await asyncio.to_thread(faulty_server.stop)
    other_w = await serve(with_port(faulty_server.settings), plain_engine, loop_thread, faulty_server.keys)
    try:
        async with other_w.client(other_w.keys["auditor"]) as auditor:
            job = (await replay(auditor, tid)).json()
    finally:
        await asyncio.to_thread(other_w.stop)
    assert job["result"] == "inconclusive_environment", job
    assert job["details"]["differences"]["window_shape"] == {"recorded": [2, 8], "current": [2, 4]}
    assert job["details"]["executed"] is False

    tiny = AsyncEngine(EngineConfig(model=str(tiny_llama_dir(tmp_path / "tiny", plain_engine.tokenizer)), window=8,
                                    group=2))
    loop_thread.run(tiny.start())
    other_model = await serve(with_port(faulty_server.settings), tiny, loop_thread, faulty_server.keys)
    try:
        async with other_model.client(other_model.keys["auditor"]) as auditor:
            refused = await replay(auditor, tid)
    finally:
        await asyncio.to_thread(other_model.stop)
        loop_thread.run(tiny.shutdown())
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_mismatch", refused.text
    with sqlite3.connect(faulty_server.settings.data_dir / "verbatim.db") as db:
        assert db.execute("SELECT count(*) FROM replay_jobs WHERE transcript_id = ?", (tid,)).fetchone() == (1,)


def tiny_llama_dir(folder: Path, tokenizer: Any) -> Path:
    """A local HF folder with a tiny random Llama and the default model's tokenizer: other weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


async def test_replays_interrupted_by_shutdown_are_rerun_after_restart(
        real_engine: tuple[LoopThread, Any], faulty_engine: Any, faulty_server: LiveServer) -> None:
    oai = openai_client(faulty_server)
    tids = [tid for tid, _ in await asyncio.gather(*[complete(oai, p, i) for i, p in enumerate(PROMPTS[:3])])]
    async with faulty_server.client(faulty_server.keys["auditor"]) as auditor:
        jobs = [(await replay(auditor, t, wait=False)).json() for t in tids + tids]
    await asyncio.to_thread(faulty_server.stop)
    with sqlite3.connect(faulty_server.settings.data_dir / "verbatim.db") as db:
        left = db.execute("SELECT count(*) FROM replay_jobs WHERE status IN ('queued', 'running')").fetchone()[0]
    assert left > 0, "every replay finished before the shutdown: nothing to rerun"
    again = await serve(with_port(faulty_server.settings), faulty_engine, real_engine[0], faulty_server.keys)
    try:
        async with again.client(again.keys["auditor"]) as auditor:
            done = [await until_status(auditor, j["id"], ("done", "failed"), timeout=600) for j in jobs]
    finally:
        await asyncio.to_thread(again.stop)
    assert [j["result"] for j in done] == ["match"] * len(jobs), [(j["result"], j["error"]) for j in done]
