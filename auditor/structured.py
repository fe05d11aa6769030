"""Structured output for the OpenAI API: ``response_format`` and ``tools`` as engine grammars, the tools'
presentation in the prompt, and the tool calls read back from the generated text. HTTP-free.

Tool-call text format (what the model writes, and what the grammars enforce)::

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

* ``tool_choice`` ``auto``: a ``tagged`` grammar. The model writes free text; once it writes the trigger
  ``<tool_call>``, the call object must follow the schema of one of the tools, then ``</tool_call>``.
  Several calls may follow one another; with ``parallel_tool_calls: false`` the stop string
  ``</tool_call>`` ends the generation after the first call.
* ``required`` and a named function: a ``json_schema`` grammar for exactly one call object (no tags):
  ``{"name": <one of the allowed names>, "arguments": <that tool's parameters>}``.
* ``none`` (and no tools): no grammar, and the tools are not shown to the model.

The call object's schema is ``{"type": "object", "properties": {"name": {"const": NAME}, "arguments":
PARAMETERS}, "required": ["name", "arguments"], "additionalProperties": false}`` (``anyOf`` over the
allowed tools); ``PARAMETERS`` defaults to ``{"type": "object"}``.

Tools in the prompt: a system message (appended to the conversation's first system message, or put
before the conversation) lists the tools as JSON inside ``<tools>…</tools>`` and shows the call format;
the model's own chat template then renders the messages. Earlier assistant tool calls in the history
are rendered in the call format above, and ``tool`` messages keep the role ``tool``. The prompt tokens
are committed in the transcript and the grammar is signed in its sampling parameters, so both are
auditable and replayed exactly.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from engine.grammar import GrammarSpec

TOOL_CALL_BEGIN = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


class ToolMode(StrEnum):
    AUTO = "auto"
    REQUIRED = "required"


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict[str, Any] | None
    index: int
    """Position in the request's ``tools`` (for errors)."""

    def to_json(self) -> dict[str, Any]:
        """The tool as OpenAI's function tool (what the prompt lists)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters if self.parameters is not None else {"type": "object"}
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class Structured:
    """The grammar of a request, the request field it came from (for errors) and, for tool calls,
    how to read the output back."""

    grammar: GrammarSpec
    param: str
    tool_mode: ToolMode | None = None
    tools: tuple[Tool, ...] = ()


def json_object() -> Structured:
    return Structured(GrammarSpec("json_object", ""), "response_format")


def json_schema(schema: dict[str, Any]) -> Structured:
    return Structured(GrammarSpec("json_schema", _dumps(schema)), "response_format.json_schema.schema")


def call_schema(tools: tuple[Tool, ...]) -> dict[str, Any]:
    """The schema of one call object to any of ``tools``."""
    schemas = [{"type": "object",
                "properties": {"name": {"const": t.name},
                               "arguments": t.parameters if t.parameters is not None else {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def parameters_grammar(tool: Tool) -> GrammarSpec:
    """One tool's parameters alone, to name a tool whose schema does not compile."""
    return GrammarSpec("json_schema", _dumps(tool.parameters if tool.parameters is not None else {"type": "object"}))


def tool_calls(tools: tuple[Tool, ...], mode: ToolMode) -> Structured:
    """The grammar of ``mode`` over the allowed ``tools`` (module docstring)."""
    schema = call_schema(tools)
    if mode is ToolMode.REQUIRED:
        return Structured(GrammarSpec("json_schema", _dumps(schema)), "tools", mode, tools)
    source = {"triggers": [TOOL_CALL_BEGIN],
              "tags": [{"begin": TOOL_CALL_BEGIN, "schema": schema, "end": TOOL_CALL_END}]}
    return Structured(GrammarSpec("tagged", _dumps(source)), "tools", mode, tools)


def tools_prompt(tools: tuple[Tool, ...]) -> str:
    """The system text that presents ``tools`` to the model."""
    listed = "\n".join(_dumps(t.to_json()) for t in tools)
    return ("You may call functions to answer. The functions, as JSON:\n<tools>\n" + listed + "\n</tools>\n"
            "To call a function, write " + TOOL_CALL_BEGIN + '{"name": <function name>, "arguments": '
            "<arguments as a JSON object>}" + TOOL_CALL_END + ".")


def call_text(name: str, arguments: str) -> str:
    """An earlier call in the history, in the format the model writes (``arguments`` is JSON text)."""
    return f'{TOOL_CALL_BEGIN}{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}{TOOL_CALL_END}'


# --- reading calls back ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str
    """JSON text of the arguments object, as OpenAI returns it."""


@dataclass(frozen=True)
class Parsed:
    content: str | None
    calls: list[ToolCall]


def parse_output(text: str, mode: ToolMode) -> Parsed:
    """The assistant content and the tool calls in ``text``. Text that does not form a complete call
    (a generation cut by ``max_tokens``) stays content."""
    if mode is ToolMode.REQUIRED:
        call = _call(text)
        return Parsed(None, [call]) if call is not None else Parsed(text, [])
    calls, content, rest = [], [], text
    while (start := rest.find(TOOL_CALL_BEGIN)) >= 0:
        end = rest.find(TOOL_CALL_END, start)
        body = rest[start + len(TOOL_CALL_BEGIN): end if end >= 0 else len(rest)]
        call = _call(body)
        if call is None:
            break
        content.append(rest[:start])
        calls.append(call)
        rest = rest[end + len(TOOL_CALL_END):] if end >= 0 else ""
    content.append(rest)
    joined = "".join(content)
    if not calls:
        return Parsed(text, [])
    return Parsed(joined if joined.strip() else None, calls)


def _call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and isinstance(obj.get("arguments"), dict)):
        return None
    return ToolCall(obj["name"], json.dumps(obj["arguments"], ensure_ascii=False))


def call_id(transcript_id: str, index: int) -> str:
    """A tool call's id: a function of the transcript and the call's position, so a stored transcript
    gives the same ids again."""
    return "call_" + hashlib.sha256(f"{transcript_id}:{index}".encode()).hexdigest()[:24]


def _dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
