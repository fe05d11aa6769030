"""OpenAI request bodies (typed with msgspec) and their conversion to a ``GenerationRequest``.

Every field of OpenAI's chat-completions and completions requests is known here. Decoding is strict
(``auditor.routes.validation.json_body``): wrong types, unknown fields, values outside OpenAI's ranges
(``msgspec.Meta`` below, also what the published OpenAPI document says), malformed JSON and lone
surrogates become a 400 naming the field. Then each field is one of:

* **used**: it changes generation and is implemented (sampling, penalties, biases, ``n``, ``echo``,
  ``response_format``, ``tools``);
* **refused**: it would change generation and is not implemented (``audio``, ``modalities`` with
  audio, ``reasoning_effort``, ``verbosity``, ``web_search_options``, ``moderation``, ``functions`` /
  ``function_call``, ``suffix``, ``best_of`` other than ``n``, custom tools): a 400 naming it;
* **recorded**: it does not change generation (``metadata``, ``store``, ``service_tier``, ``user``, …,
  ``EXTRA_FIELDS``): accepted and signed into the transcript as ``request.extras``.

Limits that depend on the engine or the settings (vocabulary, context, ``max_n``) are checked by the
service, the sampling parameters' own ranges by ``SamplingParams.validate``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

import msgspec

from auditor import structured
from auditor.canonical import canonical_json
from auditor.errors import ApiError, bad_request
from auditor.service import GenerationRequest
from auditor.transcript import Api

Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
Bias = Annotated[float, msgspec.Meta(ge=-100, le=100)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]
Choices = Annotated[int, msgspec.Meta(ge=1)]
FunctionName = Annotated[str, msgspec.Meta(pattern="^[a-zA-Z0-9_-]{1,64}$")]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    n: Choices | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Bias] | None = None
    user: str | None = None
    # Extensions (send with the openai client's extra_body):
    deterministic: bool | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: TopLogprobs | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: Choices | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    text: str | None = None
    # Other part kinds' fields, named so that they are refused as unsupported parts, not unknown fields:
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: Any = None


Content = str | list[ContentPart]


class FunctionCallText(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    arguments: str


class ToolCallParam(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A tool call of an earlier assistant message, sent back as history."""

    id: str
    type: Literal["function"]
    function: FunctionCallText


class SystemMessage(msgspec.Struct, tag="system", tag_field="role", forbid_unknown_fields=True, kw_only=True):
    content: Content
    name: str | None = None


class DeveloperMessage(msgspec.Struct, tag="developer", tag_field="role", forbid_unknown_fields=True, kw_only=True):
    content: Content
    name: str | None = None


class UserMessage(msgspec.Struct, tag="user", tag_field="role", forbid_unknown_fields=True, kw_only=True):
    content: Content
    name: str | None = None


class AssistantMessage(msgspec.Struct, tag="assistant", tag_field="role", forbid_unknown_fields=True, kw_only=True):
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    # A returned assistant message sent back as history carries these as null; anything else is refused.
    refusal: None = None
    function_call: None = None
    audio: None = None
    annotations: None = None


class ToolMessage(msgspec.Struct, tag="tool", tag_field="role", forbid_unknown_fields=True, kw_only=True):
    content: Content
    tool_call_id: str


class FunctionMessage(msgspec.Struct, tag="function", tag_field="role", forbid_unknown_fields=True, kw_only=True):
    """The deprecated function-calling history; refused like ``functions`` (use tools)."""

    name: str
    content: str | None = None


ChatMessage = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(msgspec.Struct, tag="function", tag_field="type", forbid_unknown_fields=True, kw_only=True):
    function: FunctionDefinition


class CustomTool(msgspec.Struct, tag="custom", tag_field="type", forbid_unknown_fields=True, kw_only=True):
    custom: dict[str, Any]


class ToolName(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str


class NamedToolChoice(msgspec.Struct, tag="function", tag_field="type", forbid_unknown_fields=True, kw_only=True):
    function: ToolName


class CustomToolChoice(msgspec.Struct, tag="custom", tag_field="type", forbid_unknown_fields=True, kw_only=True):
    custom: ToolName


class AllowedTools(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice]


class AllowedToolsChoice(msgspec.Struct, tag="allowed_tools", tag_field="type", forbid_unknown_fields=True,
                         kw_only=True):
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice | CustomToolChoice | AllowedToolsChoice


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True, kw_only=True):
    pass


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True,
                       kw_only=True):
    pass


class JsonSchema(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True,
                       kw_only=True):
    json_schema: JsonSchema


class Prediction(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["content"]
    content: Content


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    response_format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None
    tools: list[FunctionTool | CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Recorded, without effect on generation:
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prediction: Prediction | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    # Refused when set (they would change generation):
    audio: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None


CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
EXTRA_FIELDS = ("metadata", "store", "service_tier", "user", "safety_identifier", "prompt_cache_key",
                "prompt_cache_options", "prompt_cache_retention", "modalities", "parallel_tool_calls")
"""Accepted fields without effect on generation, signed as given into ``request.extras`` (``prediction``
as the SHA-256 of its canonical JSON, ``prediction_sha256``; ``parallel_tool_calls`` also acts on tools)."""
_REFUSED = {
    "audio": "audio output is not supported (text only)",
    "reasoning_effort": "reasoning_effort is not supported: the served model has no reasoning mode",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
    "moderation": "moderation is not supported",
    "functions": "functions (deprecated) is not supported; send tools",
    "function_call": "function_call (deprecated) is not supported; send tool_choice",
}


def _refuse_unsupported(body: ChatBody) -> None:
    for name, why in _REFUSED.items():
        if getattr(body, name) is not None:
            raise bad_request(f"{why} (got {name}={msgspec.json.encode(getattr(body, name)).decode()[:80]})",
                              param=name, code="unsupported_parameter")
    if body.modalities is not None and body.modalities != ["text"]:
        raise bad_request(f"modalities must be ['text'] (got {body.modalities}); only text output is supported",
                          param="modalities", code="unsupported_parameter")


def _stream(body: _Common) -> tuple[bool, bool]:
    """(stream, include_usage); ``stream_options`` only goes with ``stream: true``, as OpenAI requires."""
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    return bool(body.stream), bool(body.stream_options and body.stream_options.include_usage)


def _stop(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 4 or any(not s for s in stops):
        raise bad_request("stop must be at most 4 non-empty strings", param="stop")
    return stops


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``{"token id": bias}`` as (id, bias) pairs sorted by id; the vocabulary bound is the service's."""
    pairs = []
    for key, value in (bias or {}).items():
        if not key.isdigit() or not key.isascii():
            raise bad_request(f"logit_bias keys must be token ids (decimal integers >= 0), got {key[:40]!r}",
                              param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _prompt(prompt: str | list[Any]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise bad_request("prompt must be a string, a list of one string, or a list of token ids (one prompt per request)",
                      param="prompt")


def _sampling(body: _Common, deterministic_default: bool) -> dict[str, Any]:
    """The ``GenerationRequest`` fields both APIs share."""
    stream, include_usage = _stream(body)
    return {
        "model": body.model,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "top_k": body.top_k or 0,
        "min_p": body.min_p or 0.0,
        "seed": body.seed,
        "stop": _stop(body.stop),
        "ignore_eos": bool(body.ignore_eos),
        "deterministic": deterministic_default if body.deterministic is None else body.deterministic,
        "stream": stream,
        "include_usage": include_usage,
        "n": body.n or 1,
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "repetition_penalty": 1.0 if body.repetition_penalty is None else body.repetition_penalty,
        "logit_bias": _logit_bias(body.logit_bias),
        "request_json": msgspec.to_builtins(body),
    }


def _extras(body: _Common) -> dict[str, Any]:
    extras = {name: msgspec.to_builtins(getattr(body, name)) for name in EXTRA_FIELDS
              if getattr(body, name, None) is not None}
    prediction = getattr(body, "prediction", None)
    if prediction is not None:
        extras["prediction_sha256"] = hashlib.sha256(canonical_json(msgspec.to_builtins(prediction))).hexdigest()
    return extras


def completion_request(body: CompletionBody, deterministic_default: bool) -> GenerationRequest:
    if body.suffix is not None:
        raise bad_request("suffix is not supported", param="suffix", code="unsupported_parameter")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise bad_request(f"best_of must equal n (got best_of={body.best_of}, n={body.n or 1}): the server does "
                          "not choose among extra candidates", param="best_of", code="unsupported_parameter")
    echo = bool(body.echo)
    return GenerationRequest(
        api=Api.COMPLETIONS,
        prompt=_prompt(body.prompt),
        messages=None,
        max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens,
        logprobs=body.logprobs,
        prompt_logprobs=body.logprobs if echo and body.logprobs is not None else None,
        echo=echo,
        extras=_extras(body),
        **_sampling(body, deterministic_default),
    )


# --- chat --------------------------------------------------------------------------------------------


def _text(content: Content | None, param: str) -> str:
    if content is None:
        raise bad_request(f"{param} is required: every message needs text content", param=param)
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise bad_request("only text content parts are supported", param=param)
        content = "".join(part.text or "" for part in content)
    return content


def _message(message: ChatMessage, index: int) -> dict[str, str]:
    """One message as the chat template takes it: a role and text (module ``auditor.structured``)."""
    param = f"messages[{index}].content"
    if isinstance(message, FunctionMessage):
        raise bad_request("function messages (deprecated) are not supported; send tool messages",
                          param=f"messages[{index}].role", code="unsupported_parameter")
    if isinstance(message, AssistantMessage) and message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            where = f"messages[{index}].tool_calls[{j}].function.arguments"
            try:
                arguments = json.loads(call.function.arguments)
            except ValueError as exc:
                raise bad_request(f"{where} is not JSON: {exc}", param=where) from None
            if not isinstance(arguments, dict):
                raise bad_request(f"{where} must be a JSON object", param=where)
            calls.append(structured.call_text(call.function.name, call.function.arguments))
        text = (_text(message.content, param) if message.content is not None else "") + "".join(calls)
        return {"role": "assistant", "content": text}
    text = _text(message.content, param)
    if not text:
        raise bad_request(f"{param} is empty: every message needs text content", param=param)
    role = {SystemMessage: "system", DeveloperMessage: "system", UserMessage: "user", AssistantMessage: "assistant",
            ToolMessage: "tool"}[type(message)]
    return {"role": role, "content": text}


def _tools(body: ChatBody) -> tuple[structured.Tool, ...]:
    tools = []
    for i, tool in enumerate(body.tools or []):
        if isinstance(tool, CustomTool):
            raise bad_request("custom tools are not supported; send function tools", param=f"tools[{i}]",
                              code="unsupported_parameter")
        f = tool.function
        tools.append(structured.Tool(f.name, f.description, f.parameters, i))
    names = [t.name for t in tools]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate is not None:
        raise bad_request(f"tools: two functions are named {duplicate!r}", param="tools")
    return tuple(tools)


def _tool_use(body: ChatBody) -> tuple[tuple[structured.Tool, ...], structured.ToolMode | None]:
    """The tools shown to the model and how it must use them; ``(tools, None)`` when it may not."""
    tools = _tools(body)
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return tools, None
    if not tools:
        raise bad_request(f"tool_choice {msgspec.json.encode(choice).decode()[:80]} needs tools", param="tool_choice")
    if isinstance(choice, CustomToolChoice):
        raise bad_request("custom tools are not supported", param="tool_choice", code="unsupported_parameter")
    if isinstance(choice, NamedToolChoice):
        return _allowed(tools, [choice.function.name], "tool_choice.function.name"), structured.ToolMode.REQUIRED
    if isinstance(choice, AllowedToolsChoice):
        names = [t.function.name for t in choice.allowed_tools.tools]
        return (_allowed(tools, names, "tool_choice.allowed_tools.tools"),
                structured.ToolMode(choice.allowed_tools.mode))
    return tools, structured.ToolMode(choice)


def _allowed(tools: tuple[structured.Tool, ...], names: list[str], param: str) -> tuple[structured.Tool, ...]:
    known = {t.name for t in tools}
    missing = [n for n in names if n not in known]
    if missing or not names:
        raise bad_request(f"{param}: {missing or names} not among the tools {sorted(known)}", param=param)
    return tuple(t for t in tools if t.name in names)


def _structured(body: ChatBody, tools: tuple[structured.Tool, ...],
                mode: structured.ToolMode | None) -> structured.Structured | None:
    fmt = body.response_format
    if mode is not None:
        if isinstance(fmt, (JsonObjectFormat, JsonSchemaFormat)):
            raise bad_request("response_format json_object / json_schema cannot be combined with tool calls; "
                              "send tool_choice 'none' or leave response_format out", param="response_format")
        return structured.tool_calls(tools, mode)
    if isinstance(fmt, JsonObjectFormat):
        return structured.json_object()
    if isinstance(fmt, JsonSchemaFormat):
        if fmt.json_schema.schema is None:
            raise bad_request("response_format.json_schema.schema is required",
                              param="response_format.json_schema.schema")
        return structured.json_schema(fmt.json_schema.schema)
    return None


def _messages(body: ChatBody, tools: tuple[structured.Tool, ...], shown: bool) -> list[dict[str, str]]:
    if not body.messages:
        raise bad_request("messages must contain at least one message", param="messages")
    messages = [_message(m, i) for i, m in enumerate(body.messages)]
    if shown:
        prompt = structured.tools_prompt(tools)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": messages[0]["content"] + "\n\n" + prompt}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
    return messages


def chat_request(body: ChatBody, deterministic_default: bool) -> GenerationRequest:
    _refuse_unsupported(body)
    tools, mode = _tool_use(body)
    spec = _structured(body, tools, mode)
    sampling = _sampling(body, deterministic_default)
    if mode is structured.ToolMode.AUTO and body.parallel_tool_calls is False:
        sampling["stop"] = [*(sampling["stop"] or []), structured.TOOL_CALL_END]
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")
    return GenerationRequest(
        api=Api.CHAT_COMPLETIONS,
        prompt=None,
        messages=_messages(body, tools, mode is not None),
        max_tokens=CHAT_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        structured=spec,
        extras=_extras(body),
        **sampling,
    )


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"model {requested!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")
