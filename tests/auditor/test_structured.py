"""Tool-call text read back (``auditor.structured``) and streamed as OpenAI deltas (``ChoiceStream``), on the
texts the grammars allow; the choice seeds' documented derivation."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from engine.sampling import SamplingParams

from auditor import structured
from auditor.routes.openai_format import ChoiceStream
from auditor.service import GenerationRequest, Prepared, choice_seed
from auditor.structured import ToolMode
from auditor.transcript import Api, Choice

TOOLS = (structured.Tool("get_weather", "Weather of a city",
                         {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, 0),)
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


def test_auto_text_and_calls_are_split() -> None:
    parsed = structured.parse_output("Let me look. " + CALL + CALL.replace("Paris", "Rome"), ToolMode.AUTO)
    assert parsed.content == "Let me look. "
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]
    assert structured.parse_output("No call here.", ToolMode.AUTO).calls == []
    cut = structured.parse_output('Hm <tool_call>{"name": "get_wea', ToolMode.AUTO)
    assert (cut.content, cut.calls) == ('Hm <tool_call>{"name": "get_wea', [])
    # parallel_tool_calls=false: the stop string </tool_call> is cut from the text
    assert structured.parse_output(CALL[: -len("</tool_call>")], ToolMode.AUTO).calls[0].name == "get_weather"


def test_required_output_is_one_call_object() -> None:
    parsed = structured.parse_output('{"name": "get_weather", "arguments": {"city": "Oslo"}}', ToolMode.REQUIRED)
    assert parsed.content is None and json.loads(parsed.calls[0].arguments) == {"city": "Oslo"}
    assert structured.parse_output('{"name": "get_weather", "argu', ToolMode.REQUIRED).calls == []


def test_grammars_name_their_tools() -> None:
    required = structured.tool_calls(TOOLS, ToolMode.REQUIRED)
    assert required.grammar.kind == "json_schema" and required.param == "tools"
    schema = json.loads(required.grammar.source)
    assert schema["properties"]["name"] == {"const": "get_weather"} and schema["required"] == ["name", "arguments"]
    auto = json.loads(structured.tool_calls(TOOLS, ToolMode.AUTO).grammar.source)
    assert auto["triggers"] == ["<tool_call>"] and auto["tags"][0]["schema"] == schema
    two = TOOLS + (structured.Tool("get_time", None, None, 1),)
    assert len(json.loads(structured.tool_calls(two, ToolMode.REQUIRED).grammar.source)["anyOf"]) == 2


def test_choice_seeds_follow_the_documented_hash() -> None:
    assert choice_seed(42, 0) == 42
    digest = hashlib.sha256(b"verbatim-choice-seed-v1" + (42).to_bytes(8, "little") + (3).to_bytes(4, "little"))
    assert choice_seed(42, 3) == int.from_bytes(digest.digest()[:8], "little")
    assert len({choice_seed(7, i) for i in range(16)}) == 16


@dataclass
class Output:
    text: str
    finished: bool = False
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)


def _prepared(mode: ToolMode | None) -> Prepared:
    spec = structured.tool_calls(TOOLS, mode) if mode is not None else None
    request = GenerationRequest(api=Api.CHAT_COMPLETIONS, model="m", prompt=None, messages=[], max_tokens=8,
                                temperature=0, top_p=1, top_k=0, min_p=0, seed=1, stop=None, ignore_eos=False,
                                logprobs=None, deterministic=True, stream=True, include_usage=False,
                                request_json={}, structured=spec)
    return Prepared(request, "01900000-0000-7000-8000-000000000000", dt.datetime.now(dt.UTC), [1], "", SamplingParams(),
                    "t", "k", Choice(0, 1, None))


def _stream(mode: ToolMode | None, texts: list[str], reason: str = "stop") -> list[dict[str, Any]]:
    writer = ChoiceStream(_prepared(mode), tokenizer=None, chat=True)
    deltas = [writer.delta(Output(t)) for t in texts]
    deltas.append(writer.delta(Output(texts[-1], True, reason)))
    return [d for d in deltas if d is not None]


def test_streamed_tool_calls_come_whole_in_openai_shape() -> None:
    text = "Sure. " + CALL
    deltas = _stream(ToolMode.AUTO, [text[:3], text[:8], text[:20], text[:-3], text])
    content = "".join(d["delta"].get("content", "") for d in deltas)
    calls = [c for d in deltas for c in d["delta"].get("tool_calls", [])]
    assert content == "Sure. " and "<" not in content
    assert calls == [{"index": 0, "id": structured.call_id("01900000-0000-7000-8000-000000000000", 0),
                      "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert all(d["finish_reason"] is None for d in deltas[:-1])


def test_streamed_required_call_and_plain_text() -> None:
    body = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    deltas = _stream(ToolMode.REQUIRED, [body[:10], body])
    assert len(deltas) == 1 and "content" not in deltas[0]["delta"]  # nothing until the call is complete
    assert deltas[-1]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    plain = _stream(None, ["Hello", "Hello there"], "length")
    assert "".join(d["delta"].get("content", "") for d in plain) == "Hello there"
    assert plain[-1]["finish_reason"] == "length"
