"""OpenAI request bodies (typed with msgspec) and their conversion to a ``GenerationRequest``.

Decoding is strict (``auditor.routes.validation.json_body``): wrong types, unknown fields, malformed
JSON and lone surrogates become a 400 naming the field, and so does a chat message without text
content; range checks are left to ``SamplingParams.validate`` / ``engine.validate`` (also 400, mapped
by the service), so there is one source of truth for limits.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from auditor.errors import ApiError, bad_request
from auditor.service import GenerationRequest
from auditor.transcript import Api


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class _Common(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions (send with the openai client's extra_body):
    deterministic: bool | None = None
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False


class CompletionBody(_Common, kw_only=True):
    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: str
    text: str | None = None
    # Other part kinds' fields, named so that they are refused as unsupported parts, not unknown fields:
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: Any = None


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # A returned assistant message sent back as history carries these as null; anything else is refused.
    refusal: None = None
    tool_calls: None = None
    function_call: None = None
    audio: None = None
    annotations: None = None


class ChatBody(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None


CHAT_DEFAULT_MAX_TOKENS = 256


def _unsupported(body: _Common) -> None:
    if body.n != 1:
        raise bad_request(f"n must be 1 (got {body.n}); one choice per request", param="n")
    if body.presence_penalty != 0.0 or body.frequency_penalty != 0.0:
        raise bad_request("presence_penalty and frequency_penalty are not supported (must be 0)",
                          param="presence_penalty" if body.presence_penalty else "frequency_penalty")
    if body.logit_bias:
        raise bad_request("logit_bias is not supported", param="logit_bias")


def _stop(stop: str | list[str] | None) -> list[str] | None:
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if len(stops) > 4 or any(not s for s in stops):
        raise bad_request("stop must be at most 4 non-empty strings", param="stop")
    return stops


def _prompt(prompt: str | list[Any]) -> str | list[int]:
    if isinstance(prompt, str):
        return prompt
    if len(prompt) == 1 and isinstance(prompt[0], str):
        return prompt[0]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise bad_request("prompt must be a string, a list of one string, or a list of token ids (one prompt per request)",
                      param="prompt")


def completion_request(body: CompletionBody, deterministic_default: bool) -> GenerationRequest:
    _unsupported(body)
    if body.echo or body.suffix is not None or body.best_of not in (None, 1):
        raise bad_request("echo, suffix and best_of are not supported",
                          param="echo" if body.echo else "suffix" if body.suffix is not None else "best_of")
    return GenerationRequest(
        api=Api.COMPLETIONS,
        model=body.model,
        prompt=_prompt(body.prompt),
        messages=None,
        max_tokens=16 if body.max_tokens is None else body.max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=_stop(body.stop),
        ignore_eos=body.ignore_eos,
        logprobs=body.logprobs,
        deterministic=deterministic_default if body.deterministic is None else body.deterministic,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        request_json=msgspec.to_builtins(body),
    )


def _message_text(message: ChatMessage, index: int) -> dict[str, str]:
    param = f"messages[{index}].content"
    content = message.content
    if content is None:
        raise bad_request(f"{param} is required: every message needs text content", param=param)
    if isinstance(content, list):
        if any(part.type != "text" or part.text is None for part in content):
            raise bad_request("only text content parts are supported", param=param)
        content = "".join(part.text or "" for part in content)
    if not content:
        raise bad_request(f"{param} is empty: every message needs text content", param=param)
    role = "system" if message.role == "developer" else message.role
    return {"role": role, "content": content}


def chat_request(body: ChatBody, deterministic_default: bool) -> GenerationRequest:
    _unsupported(body)
    if body.tools:
        raise bad_request("tools are not supported", param="tools")
    if body.response_format not in (None, {"type": "text"}):
        raise bad_request("only response_format {'type': 'text'} is supported", param="response_format")
    if not body.messages:
        raise bad_request("messages must contain at least one message", param="messages")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top_logprobs = body.top_logprobs if body.top_logprobs is not None else 0
    return GenerationRequest(
        api=Api.CHAT_COMPLETIONS,
        model=body.model,
        prompt=None,
        messages=[_message_text(m, i) for i, m in enumerate(body.messages)],
        max_tokens=CHAT_DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0,
        min_p=body.min_p or 0.0,
        seed=body.seed,
        stop=_stop(body.stop),
        ignore_eos=body.ignore_eos,
        logprobs=top_logprobs if body.logprobs else None,
        deterministic=deterministic_default if body.deterministic is None else body.deterministic,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        request_json=msgspec.to_builtins(body),
    )


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise ApiError(404, f"model {requested!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")
