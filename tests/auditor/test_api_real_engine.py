"""The service with the REAL engine (default SmolLM2 model, loaded once per test session) behind a
live uvicorn server, driven by the official ``openai`` client. Small W/G and max_tokens keep it quick
on the CPU. Signatures and proofs are checked with independent code (``tests/auditor/independent.py``)
and pymerkle."""

from __future__ import annotations

import asyncio
import base64
import json
import warnings
from typing import Any

import openai
import pytest
from pymerkle import InmemoryTree

from tests.auditor import independent
from tests.auditor.conftest import LiveServer

PROMPT = "List three colours:"


def client_for(server: LiveServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)


async def fetch(server: LiveServer, key: str, transcript_id: str, **params: str) -> dict[str, Any]:
    async with server.client(key) as client:
        response = await client.get(f"/v1/transcripts/{transcript_id}", params=params)
    assert response.status_code == 200, response.text
    return response.json()


async def test_openai_client_completions_and_chat(real_server: LiveServer) -> None:
    key = real_server.keys["client"]
    oai = client_for(real_server, key)
    model = (await oai.models.list()).data[0].id

    raw = await oai.completions.with_raw_response.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body={"deterministic": True})
    completion = raw.parse()
    logprobs = completion.choices[0].logprobs
    assert logprobs is not None and len(logprobs.tokens) == completion.usage.completion_tokens
    assert all(len(top) <= 2 for top in logprobs.top_logprobs) and all(lp <= 0 for lp in logprobs.token_logprobs)
    extra = completion.model_extra or {}
    assert raw.headers["verbatim-transcript-id"] == extra["transcript"]["id"]
    assert extra["transcript"]["replayable"] is True and isinstance(extra["seed"], int)
    assert completion.system_fingerprint and completion.system_fingerprint.startswith("fp_")
    assert completion.choices[0].text and completion.usage.completion_tokens <= 6

    chat = await oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hi."}], max_tokens=5,
        extra_body={"deterministic": False})
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].message.content is not None
    assert (chat.model_extra or {})["transcript"]["replayable"] is False

    stream = await oai.completions.create(model=model, prompt=PROMPT, max_tokens=6, stream=True,
                                          extra_body={"deterministic": False})
    pieces, transcripts = [], []
    async for chunk in stream:
        pieces += [c.text for c in chunk.choices]
        transcripts += [chunk.model_extra["transcript"]] if chunk.model_extra.get("transcript") else []
    assert len(transcripts) == 1 and "".join(pieces)

    chat_stream = await oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name a fruit."}], max_tokens=6, stream=True,
        seed=7, extra_body={"deterministic": True})
    content, final = [], None
    async for chunk in chat_stream:
        content += [c.delta.content or "" for c in chunk.choices]
        final = chunk.model_extra.get("transcript") or final
    assert final is not None and final["replayable"] is True
    doc = await fetch(real_server, key, final["id"], include_content="true", verify="true")
    assert doc["verification"]["ok"], doc["verification"]
    assert doc["output_text"] == "".join(content)
    statement = json.loads(base64.b64decode(doc["envelope"]["payload"]))
    assert statement["predicate"]["sampling"]["seed"] == "7"
    assert statement["predicate"]["model"]["name"] == model


async def test_deterministic_request_is_identical_under_different_load(real_server: LiveServer) -> None:
    key = real_server.keys["client"]
    oai = client_for(real_server, key)
    model = (await oai.models.list()).data[0].id
    request = {"model": model, "prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8,
               "seed": 1234, "extra_body": {"deterministic": True}}

    alone = await oai.completions.create(**request)
    noise = [oai.completions.create(model=model, prompt=f"Noise {i}: the weather is", max_tokens=8,
                                    temperature=1.0, extra_body={"deterministic": i % 2 == 0}) for i in range(5)]
    loaded, *_ = await asyncio.gather(oai.completions.create(**request), *noise)

    first = await fetch(real_server, key, alone.model_extra["transcript"]["id"], include_content="true", verify="true")
    second = await fetch(real_server, key, loaded.model_extra["transcript"]["id"], include_content="true",
                         verify="true")
    assert first["token_ids"] == second["token_ids"] and alone.choices[0].text == loaded.choices[0].text
    assert first["token_logprobs"] == second["token_logprobs"]
    assert first["transcript"]["id"] != second["transcript"]["id"]
    assert first["verification"]["ok"] and second["verification"]["ok"], second["verification"]
    assert second["transcript"]["sequence"] > first["transcript"]["sequence"]


async def test_fifty_concurrent_completions_make_a_consistent_log(real_server: LiveServer) -> None:
    key = real_server.keys["client"]
    async with real_server.client(key) as http:
        assert (await http.get("/v1/log/checkpoint")).json()["tree_size"] == 0
        model = (await http.get("/v1/models")).json()["data"][0]["id"]

        async def one(i: int) -> dict[str, Any]:
            response = await http.post("/v1/completions", json={
                "model": model, "prompt": f"Fact {i}:", "max_tokens": 2, "deterministic": i % 5 == 0, "seed": i})
            assert response.status_code == 200, response.text
            return response.json()

        bodies = await asyncio.gather(*(one(i) for i in range(50)))
        after = (await http.get("/v1/log/checkpoint")).json()
        jwks = (await http.get("/.well-known/jwks.json")).json()
        docs = [(await http.get(f"/v1/transcripts/{b['transcript']['id']}")).json() for b in bodies]
        listed = (await http.get("/v1/transcripts", params={"limit": 100})).json()["data"]
        consistency = {m: (await http.get("/v1/log/proofs/consistency", params={"first": m, "second": 50})).json()
                       for m in (1, 7, 32, 49, 50)}

    assert after["tree_size"] == 50 and len(listed) == 50
    assert sorted(b["transcript"]["log_index"] for b in bodies) == list(range(50))
    # Independent leaf data: SHA-256 of each envelope as served (RFC 8785), at its log index.
    entries = {d["inclusion_proof"]["log_index"]: independent.envelope_digest(d["envelope"]) for d in docs}
    assert sorted(entries) == list(range(50))
    leaves = [independent.leaf(entries[i]) for i in range(50)]
    assert base64.b64decode(after["root_hash"]) == independent.mth(leaves)
    for doc in docs:
        independent.verify_dsse(doc["envelope"], jwks)
        _, note_size, note_root = independent.parse_checkpoint(doc["checkpoint"])
        proof = doc["inclusion_proof"]
        assert proof["tree_size"] == note_size and note_root == independent.mth(leaves[:note_size])
        assert [base64.b64decode(h) for h in proof["hashes"]] == independent.path(proof["log_index"], leaves[:note_size])
    for m, proof in consistency.items():
        assert [base64.b64decode(h) for h in proof["hashes"]] == independent.proof(m, leaves), m

    tree = InmemoryTree(algorithm="sha256")  # a second, third-party RFC 6962 implementation
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i in range(50):
            tree.append_entry(entries[i])
        assert tree.get_root() == independent.mth(leaves)
        for doc in docs[::7]:
            proof = doc["inclusion_proof"]
            theirs = tree.prove_inclusion(proof["log_index"] + 1, proof["tree_size"]).serialize()["path"]
            assert [bytes.fromhex(h) for h in theirs][1:] == [base64.b64decode(h) for h in proof["hashes"]]


async def test_disconnect_with_the_real_engine(real_server: LiveServer) -> None:
    key = real_server.keys["client"]
    async with real_server.client(key) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        async with http.stream("POST", "/v1/completions", json={
                "model": model, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True,
                "deterministic": True}) as response:
            transcript_id = response.headers["Verbatim-Transcript-Id"]
            async for line in response.aiter_lines():
                if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                    break
        for _ in range(600):
            found = await http.get(f"/v1/transcripts/{transcript_id}", params={"include_content": "true",
                                                                              "verify": "true"})
            if found.status_code == 200:
                break
            await asyncio.sleep(0.1)
    doc = found.json()
    assert doc["transcript"]["status"] == "client_disconnected"
    assert 0 < len(doc["token_ids"]) < 200
    assert doc["verification"]["ok"], doc["verification"]


@pytest.mark.postgres
async def test_openai_client_on_postgres(real_pg_server: LiveServer) -> None:
    key = real_pg_server.keys["client"]
    oai = client_for(real_pg_server, key)
    model = (await oai.models.list()).data[0].id
    results = await asyncio.gather(*(oai.completions.create(
        model=model, prompt=f"{PROMPT} {i}", max_tokens=4, extra_body={"deterministic": i % 2 == 0})
        for i in range(6)))
    chat = await oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=4, seed=3)
    ids = [r.model_extra["transcript"]["id"] for r in results] + [chat.model_extra["transcript"]["id"]]
    docs = [await fetch(real_pg_server, key, i, include_content="true", verify="true") for i in ids]
    assert all(d["verification"]["ok"] for d in docs), [d["verification"] for d in docs if not d["verification"]["ok"]]
    assert sorted(d["transcript"]["sequence"] for d in docs) == list(range(1, 8))
    assert sorted(d["inclusion_proof"]["log_index"] for d in docs) == list(range(7))


pytestmark = pytest.mark.timeout(600)


async def test_sampling_filters_are_checked_recorded_and_replayed(real_server: LiveServer) -> None:
    """min_p / top_k / top_p reach the engine, are signed into the transcript and replay; out-of-range values are
    a 400 naming the field (top_k above the vocabulary included), with nothing recorded."""
    key = real_server.keys["client"]
    oai = client_for(real_server, key)
    model = (await oai.models.list()).data[0].id
    for body, param in (({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"), ({"top_k": -1}, "top_k"),
                        ({"top_k": 10**6}, "top_k")):
        with pytest.raises(openai.BadRequestError) as err:
            await oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=body)
        assert err.value.body["param"] == param, (body, err.value.body)
    completion = await oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.9, seed=7,
        extra_body={"deterministic": True, "top_k": 40, "min_p": 0.05})
    transcript_id = (completion.model_extra or {})["transcript"]["id"]
    record = await fetch(real_server, key, transcript_id)
    payload = json.loads(base64.b64decode(record["envelope"]["payload"]))
    params = payload["predicate"]["sampling"]["params"]
    assert (params["top_k"], params["top_p"], params["min_p"]) == (40, 0.9, 0.05)
    async with real_server.client(real_server.keys["auditor"]) as client:
        response = await client.post(f"/v1/transcripts/{transcript_id}/replay", params={"wait": "true"})
    assert response.status_code in (200, 201), response.text
    assert response.json()["result"] == "match", response.json()
