"""OpenAI's request surface with the REAL engine (default SmolLM2 model, CPU) behind a live server, driven
by the official ``openai`` client: every request field known (used, refused by name, or signed as
``request.extras``), OpenAI's ranges, ``n`` with derived seeds and one transcript per choice, ``echo``,
logit biases and penalties, ``response_format`` and ``tools`` by constrained decoding. Deterministic
structured requests are compared bit for bit (token ids and logprobs) alone and under co-traffic, and
replayed to ``match``; refused requests leave the log as it was."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import openai
import pytest

from auditor.service import choice_seed
from tests.auditor.conftest import LiveServer
from tests.auditor.test_api_real_engine import client_for, fetch

pytestmark = pytest.mark.timeout(900)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
COLOUR_SCHEMA = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
                 "required": ["colour"], "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


async def predicate(server: LiveServer, transcript_id: str) -> dict[str, Any]:
    record = await fetch(server, server.keys["client"], transcript_id)
    return json.loads(base64.b64decode(record["envelope"]["payload"]))["predicate"]


async def tree_size(server: LiveServer) -> int:
    async with server.client() as http:
        return (await http.get("/v1/log/checkpoint")).json()["tree_size"]


async def replay_result(server: LiveServer, transcript_id: str) -> str:
    async with server.client(server.keys["auditor"]) as http:
        response = await http.post(f"/v1/transcripts/{transcript_id}/replay", params={"wait": "true"})
    assert response.status_code == 200, response.text
    return response.json()["result"]


async def content(server: LiveServer, transcript_id: str) -> tuple[list[int], list[float]]:
    doc = await fetch(server, server.keys["client"], transcript_id, include_content="true", verify="true")
    assert doc["verification"]["ok"], doc["verification"]
    return doc["token_ids"], doc["token_logprobs"]


async def noise(oai: openai.AsyncOpenAI, model: str) -> list[Any]:
    """Co-traffic: deterministic and not, sampled, some under a schema of their own."""
    return [oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"Tell me about the number {i}."}], max_tokens=10,
        temperature=1.0, extra_body={"deterministic": i % 2 == 0},
        **({"response_format": {"type": "json_object"}} if i % 3 == 0 else {})) for i in range(5)]


async def test_fields_ranges_and_models(real_server: LiveServer) -> None:
    oai = client_for(real_server, real_server.keys["client"])
    model = (await oai.models.list()).data[0].id
    assert (await oai.models.retrieve(model)).id == model
    with pytest.raises(openai.NotFoundError) as missing:
        await oai.models.retrieve("gpt-9")
    assert missing.value.body["code"] == "model_not_found"

    chat = await oai.chat.completions.create(
        model=model, messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_completion_tokens=3, metadata={"ticket": "T-1"}, store=False, service_tier="auto", user="u-7",
        safety_identifier="s-1", prompt_cache_key="k", modalities=["text"], parallel_tool_calls=True,
        prediction={"type": "content", "content": "Hello"}, stream=False)
    extras = (await predicate(real_server, chat.model_extra["transcript"]["id"]))["request"]["extras"]
    assert extras["metadata"] == {"ticket": "T-1"} and extras["user"] == "u-7" and extras["store"] is False
    assert extras["service_tier"] == "auto" and extras["modalities"] == ["text"] and len(extras["prediction_sha256"]) == 64

    before = await tree_size(real_server)
    refused = [({"audio": {"voice": "alloy", "format": "wav"}}, "audio"), ({"reasoning_effort": "low"}, "reasoning_effort"),
               ({"verbosity": "low"}, "verbosity"), ({"web_search_options": {}}, "web_search_options"),
               ({"functions": [{"name": "f"}]}, "functions"), ({"modalities": ["text", "audio"]}, "modalities"),
               ({"stream_options": {"include_usage": True}}, "stream_options"), ({"temperature": 3}, "temperature"),
               ({"presence_penalty": 2.5}, "presence_penalty"), ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
               ({"logit_bias": {"49152": 5}}, "logit_bias"), ({"logit_bias": {"7": -101}}, "logit_bias"),
               ({"n": 9}, "n")]
    for fields, param in refused:
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model=model, messages=ASK, max_tokens=2, **fields)
        assert param in (err.value.body["param"] or ""), (fields, err.value.body)
    with pytest.raises(openai.BadRequestError) as err:
        await oai.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"repetition_penalty": 2.5})
    assert err.value.body["param"] == "repetition_penalty"
    assert await tree_size(real_server) == before


async def test_n_choices_have_derived_seeds_and_replay(real_server: LiveServer) -> None:
    oai = client_for(real_server, real_server.keys["client"])
    model = (await oai.models.list()).data[0].id
    request = {"model": model, "prompt": "My favourite animal is", "max_tokens": 6, "temperature": 1.0, "n": 2,
               "seed": 99, "extra_body": {"deterministic": True}}
    first = await oai.completions.create(**request)
    again, *_ = await asyncio.gather(oai.completions.create(**request), *await noise(oai, model))
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    listed = first.model_extra["transcripts"]
    assert [t["seed"] for t in listed] == [99, choice_seed(99, 1)] and first.model_extra["seed"] == 99
    for index, entry in enumerate(listed):
        signed = await predicate(real_server, entry["id"])
        assert signed["request"]["choice"] == {"index": index, "count": 2, "request_seed": "99"}
        assert signed["sampling"]["seed"] == str(entry["seed"])
        assert await replay_result(real_server, entry["id"]) == "match"
    for a, b in zip(listed, again.model_extra["transcripts"]):
        assert await content(real_server, a["id"]) == await content(real_server, b["id"])


async def test_echo_biases_and_penalties(real_server: LiveServer) -> None:
    oai = client_for(real_server, real_server.keys["client"])
    model = (await oai.models.list()).data[0].id
    echoed = await oai.completions.create(model=model, prompt="Red, green and", max_tokens=3, temperature=0,
                                          echo=True, logprobs=2)
    logprobs = echoed.choices[0].logprobs
    assert echoed.choices[0].text.startswith("Red, green and")
    assert len(logprobs.tokens) == echoed.usage.prompt_tokens + echoed.usage.completion_tokens
    assert logprobs.token_logprobs[0] is None and all(lp <= 0 for lp in logprobs.token_logprobs[1:])

    favoured = 28  # a token id; +100 makes it the argmax at every step
    biased = await oai.completions.create(
        model=model, prompt="Once upon a time", max_tokens=4, temperature=0, logit_bias={str(favoured): 100},
        presence_penalty=0.5, frequency_penalty=0.25, extra_body={"deterministic": True, "repetition_penalty": 1.1,
                                                                   "ignore_eos": True})
    transcript_id = biased.model_extra["transcript"]["id"]
    ids, _ = await content(real_server, transcript_id)
    assert ids == [favoured] * 4
    params = (await predicate(real_server, transcript_id))["sampling"]["params"]
    assert params["logit_bias"] == [[favoured, 100]]
    assert (params["presence_penalty"], params["frequency_penalty"], params["repetition_penalty"]) == (0.5, 0.25, 1.1)
    assert await replay_result(real_server, transcript_id) == "match"


async def test_json_schema_is_bit_exact_under_co_traffic_and_replays(real_server: LiveServer) -> None:
    oai = client_for(real_server, real_server.keys["client"])
    model = (await oai.models.list()).data[0].id
    request = {"model": model, "messages": [{"role": "user", "content": "Pick a colour."}], "max_tokens": 24,
               "temperature": 0.7, "seed": 5, "extra_body": {"deterministic": True},
               "response_format": {"type": "json_schema",
                                   "json_schema": {"name": "pick", "schema": COLOUR_SCHEMA, "strict": True}}}
    alone = await oai.chat.completions.create(**request)
    loaded, *_ = await asyncio.gather(oai.chat.completions.create(**request), *await noise(oai, model))
    assert json.loads(alone.choices[0].message.content)["colour"] in ("red", "green", "blue")
    first, second = alone.model_extra["transcript"]["id"], loaded.model_extra["transcript"]["id"]
    assert await content(real_server, first) == await content(real_server, second)
    grammar = (await predicate(real_server, first))["sampling"]["params"]["grammar"]
    assert grammar["kind"] == "json_schema" and json.loads(grammar["source"]) == COLOUR_SCHEMA
    assert await replay_result(real_server, first) == "match"

    json_object = await oai.chat.completions.create(model=model, messages=ASK, max_tokens=12, temperature=0,
                                                    response_format={"type": "json_object"})
    assert json_object.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.slow
async def test_tool_calls_are_bit_exact_stream_and_replay(real_server: LiveServer) -> None:
    oai = client_for(real_server, real_server.keys["client"])
    model = (await oai.models.list()).data[0].id
    request = {"model": model, "messages": ASK, "tools": [WEATHER], "max_tokens": 32, "temperature": 0.5,
               "seed": 11, "tool_choice": "required", "extra_body": {"deterministic": True}}
    alone = await oai.chat.completions.create(**request)
    loaded, *_ = await asyncio.gather(oai.chat.completions.create(**request), *await noise(oai, model))
    message = alone.choices[0].message
    assert alone.choices[0].finish_reason == "tool_calls" and message.content is None
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
    first, second = alone.model_extra["transcript"]["id"], loaded.model_extra["transcript"]["id"]
    assert await content(real_server, first) == await content(real_server, second)
    assert await replay_result(real_server, first) == "match"

    stream = await oai.chat.completions.create(**{**request, "stream": True})
    streamed, final = [], None
    async for chunk in stream:
        for choice in chunk.choices:
            streamed += choice.delta.tool_calls or []
            final = choice.finish_reason or final
    assert final == "tool_calls" and [(c.function.name, c.function.arguments) for c in streamed] == [
        (call.function.name, call.function.arguments)]

    named = await oai.chat.completions.create(**{**request, "tool_choice": {"type": "function",
                                                                            "function": {"name": "get_weather"}}})
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    auto = await oai.chat.completions.create(**{**request, "tool_choice": "auto", "max_tokens": 8})
    grammar = (await predicate(real_server, auto.model_extra["transcript"]["id"]))["sampling"]["params"]["grammar"]
    assert grammar["kind"] == "tagged" and json.loads(grammar["source"])["triggers"] == ["<tool_call>"]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer = await oai.chat.completions.create(model=model, messages=history, tools=[WEATHER], tool_choice="none",
                                               max_tokens=4)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


async def test_uncompilable_schemas_are_refused_and_nothing_recorded(real_server: LiveServer) -> None:
    oai = client_for(real_server, real_server.keys["client"])
    model = (await oai.models.list()).data[0].id
    before = await tree_size(real_server)
    bad_tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                              "properties": {"x": {"type": 5}}}}}
    cases = [({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
              "response_format.json_schema.schema"),
             ({"tools": [WEATHER, bad_tool], "tool_choice": "required"}, "tools[1].function.parameters"),
             ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
              "tool_choice.function.name")]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as err:
            await oai.chat.completions.create(model=model, messages=ASK, max_tokens=2, **fields)
        assert err.value.body["param"] == param, (fields, err.value.body)
    assert await tree_size(real_server) == before
