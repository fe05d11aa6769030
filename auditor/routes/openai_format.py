"""OpenAI response bodies (completion, chat completion, and their stream chunks) from engine outputs.

A request with ``n`` choices has one ``Prepared`` (and one signed transcript) per choice. Verbatim adds
to every final body: ``system_fingerprint`` (standard), ``seed`` (the request seed: choice 0's, drawn by
the server when a deterministic request had none), ``transcript`` ``{id, log_index, tree_size,
replayable}`` of choice 0, and ``transcripts``: one such object per choice, in choice order, each with
its choice's ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from auditor import structured
from auditor.service import Prepared, Recorded
from auditor.structured import ToolMode
from auditor.transcript import Api


@dataclass(frozen=True)
class Done:
    """One finished choice."""

    prepared: Prepared
    output: Any
    recorded: Recorded


def response_id(prepared: Prepared) -> str:
    prefix = "chatcmpl-" if prepared.request.api is Api.CHAT_COMPLETIONS else "cmpl-"
    return prefix + prepared.transcript_id


def usage(done: list[Done]) -> dict[str, int]:
    """Prompt tokens once, completion tokens over every choice (as OpenAI counts ``n``)."""
    prompt = len(done[0].prepared.prompt_ids)
    completion = sum(len(d.output.token_ids) for d in done)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def transcripts(done: list[Done]) -> dict[str, Any]:
    """``seed``, ``transcript`` and ``transcripts`` of a finished response."""
    listed = [{**d.recorded.to_json(), "seed": int(d.output.seed)} for d in done]
    return {"seed": int(done[0].output.seed), "transcript": done[0].recorded.to_json(), "transcripts": listed}


# --- logprobs ---------------------------------------------------------------------------------------


def _span(output: Any, start: int, end: int | None = None) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """Token ids, logprobs and top logprobs of output tokens ``start:end``."""
    ids = list(output.token_ids[start:end])
    tops = list(output.top_logprobs[start:end]) if output.top_logprobs else []
    return ids, list(output.token_logprobs[start:end]), tops + [{}] * (len(ids) - len(tops))


def prompt_logprobs(output: Any) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """Per prompt token: its logprob and top logprobs (``None`` for the first, which has no context)."""
    logprobs = list(getattr(output, "prompt_logprobs", None) or [])
    tops = list(getattr(output, "prompt_top_logprobs", None) or [])
    count = len(output.prompt_token_ids)
    logprobs = [None] * (count - len(logprobs)) + logprobs
    tops = [None] * (count - len(tops)) + tops
    return logprobs, tops


def completion_logprobs(output: Any, tokenizer: Any, start: int = 0, end: int | None = None, *,
                        echo: bool = False, offset: int = 0) -> dict[str, Any]:
    """OpenAI's completions logprobs of output tokens ``start:end``; with ``echo``, the prompt tokens first.
    ``text_offset`` counts characters from ``offset``."""
    ids, logprobs, tops = _span(output, start, end)
    lps: list[float | None] = list(logprobs)
    top_lps: list[dict[int, float] | None] = list(tops)
    if echo:
        prompt_lps, prompt_tops = prompt_logprobs(output)
        ids, lps, top_lps = list(output.prompt_token_ids) + ids, prompt_lps + lps, prompt_tops + top_lps
    tokens = [tokenizer.decode([t]) for t in ids]
    return {
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": [None if top is None else {tokenizer.decode([t]): lp for t, lp in top.items()}
                         for top in top_lps],
        "text_offset": _offsets(tokens, offset),
    }


def chat_logprobs(output: Any, tokenizer: Any, start: int = 0, end: int | None = None) -> dict[str, Any]:
    ids, logprobs, tops = _span(output, start, end)
    content = []
    for token_id, logprob, top in zip(ids, logprobs, tops):
        token = tokenizer.decode([token_id])
        content.append({"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
                        "top_logprobs": [_chat_top(tokenizer.decode([t]), lp) for t, lp in top.items()]})
    return {"content": content}


def _chat_top(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    offsets, position = [], start
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return offsets


# --- tool calls ---------------------------------------------------------------------------------------


def tool_call_json(prepared: Prepared, index: int, call: structured.ToolCall) -> dict[str, Any]:
    return {"id": structured.call_id(prepared.transcript_id, index), "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def finish_reason(output: Any, calls: int) -> str | None:
    """``tool_calls`` when the model stopped after writing calls, else the engine's reason."""
    return "tool_calls" if calls and output.finish_reason == "stop" else output.finish_reason


# --- final bodies ---------------------------------------------------------------------------------------


def _chat_choice(d: Done, tokenizer: Any) -> dict[str, Any]:
    mode = d.prepared.request.structured.tool_mode if d.prepared.request.structured else None
    message: dict[str, Any] = {"role": "assistant", "content": d.output.text}
    reason = d.output.finish_reason
    if mode is not None:
        parsed = structured.parse_output(d.output.text, mode)
        message["content"] = parsed.content
        if parsed.calls:
            message["tool_calls"] = [tool_call_json(d.prepared, k, c) for k, c in enumerate(parsed.calls)]
        reason = finish_reason(d.output, len(parsed.calls))
    wants = d.prepared.params.logprobs is not None
    return {"index": d.prepared.choice.index, "message": message, "finish_reason": reason,
            "logprobs": chat_logprobs(d.output, tokenizer) if wants else None}


def _completion_choice(d: Done, tokenizer: Any) -> dict[str, Any]:
    echo = d.prepared.request.echo
    text = (d.prepared.prompt_text if echo else "") + d.output.text
    logprobs = (completion_logprobs(d.output, tokenizer, echo=echo) if d.prepared.params.logprobs is not None
                else None)
    return {"index": d.prepared.choice.index, "text": text, "finish_reason": d.output.finish_reason,
            "logprobs": logprobs}


def final_body(done: list[Done], model: str, fingerprint: str, tokenizer: Any) -> dict[str, Any]:
    first = done[0].prepared
    chat = first.request.api is Api.CHAT_COMPLETIONS
    choice = _chat_choice if chat else _completion_choice
    return {
        "id": response_id(first),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(first.received_at.timestamp()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [choice(d, tokenizer) for d in done],
        "usage": usage(done),
        **transcripts(done),
    }


# --- streams ------------------------------------------------------------------------------------------------


class ChunkWriter:
    """Builds the SSE events of one streamed response (every choice)."""

    def __init__(self, choices: list[Prepared], model: str, fingerprint: str, tokenizer: Any) -> None:
        first = choices[0]
        self.first_prepared = first
        self.chat = first.request.api is Api.CHAT_COMPLETIONS
        self.model = model
        self.fingerprint = fingerprint
        self.choices = [ChoiceStream(p, tokenizer, self.chat) for p in choices]

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": response_id(self.first_prepared),
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(self.first_prepared.received_at.timestamp()), "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def first(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role; completions have no opening chunk."""
        if not self.chat:
            return []
        return [self.chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None, "logprobs": None}]) for c in self.choices]

    def delta(self, index: int, output: Any) -> dict[str, Any] | None:
        choice = self.choices[index].delta(output)
        return self.chunk([choice]) if choice is not None else None

    def last(self, done: list[Done]) -> dict[str, Any]:
        """After the finish chunks: no choices, the usage, the seeds and the transcripts."""
        return self.chunk([], usage=usage(done), **transcripts(done))


class ChoiceStream:
    """The deltas of one choice. While generating, the tail that could still turn out to be the start of a
    stop string (whose text the engine then cuts) or a partial character (U+FFFD) is held back; the final
    output releases whatever is left. Tool calls (``tools``) are sent whole, one delta per call with its id,
    name and complete arguments, as soon as the call's text is complete; text that may be the start of a
    call is held back."""

    def __init__(self, prepared: Prepared, tokenizer: Any, chat: bool) -> None:
        self.prepared = prepared
        self.index = prepared.choice.index
        self.tokenizer = tokenizer
        self.chat = chat
        self.mode = prepared.request.structured.tool_mode if prepared.request.structured else None
        self.sent_text = ""
        self.sent_tokens = 0
        self.sent_calls = 0
        self.echo_pending = prepared.request.echo
        self.holdback = max((len(stop) - 1 for stop in prepared.params.stop or []), default=0)

    def delta(self, output: Any) -> dict[str, Any] | None:
        text: str = output.text
        if not output.finished:
            text = text[:max(0, len(text) - self.holdback)]
            text = text[:-1] if text.endswith("\ufffd") else text
        content, calls = self._split(text, output.finished)
        piece = content[len(self.sent_text):] if content.startswith(self.sent_text) else ""
        new_calls = calls[self.sent_calls:]
        finish = finish_reason(output, len(calls)) if output.finished else None
        if not piece and not new_calls and finish is None and not self.echo_pending:
            return None
        self.sent_text += piece
        self.sent_calls = len(calls)
        logprobs = self._logprobs(output)
        if not self.chat:
            if self.echo_pending:
                piece, self.echo_pending = self.prepared.prompt_text + piece, False
            return {"index": self.index, "text": piece, "finish_reason": finish, "logprobs": logprobs}
        delta: dict[str, Any] = {"content": piece} if piece else {}
        if new_calls:
            first = len(calls) - len(new_calls)
            delta["tool_calls"] = [{"index": first + k, **tool_call_json(self.prepared, first + k, call)}
                                   for k, call in enumerate(new_calls)]
        return {"index": self.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}

    def _split(self, text: str, finished: bool) -> tuple[str, list[structured.ToolCall]]:
        """(content that may be sent, complete tool calls) of the text so far."""
        if self.mode is None:
            return text, []
        if finished:
            parsed = structured.parse_output(text, self.mode)
            return parsed.content or "", parsed.calls
        if self.mode is ToolMode.REQUIRED:
            return "", []
        start = text.find(structured.TOOL_CALL_BEGIN)
        if start < 0:
            return text[:len(text) - _partial_suffix(text, structured.TOOL_CALL_BEGIN)], []
        closed = text.rfind(structured.TOOL_CALL_END)
        calls = (structured.parse_output(text[:closed + len(structured.TOOL_CALL_END)], self.mode).calls
                 if closed > start else [])
        return text[:start], calls

    def _logprobs(self, output: Any) -> dict[str, Any] | None:
        """Logprobs of the tokens committed since the last chunk (token-aligned; the text piece may
        lag by held-back text); with ``echo``, the prompt's first."""
        if self.prepared.params.logprobs is None:
            return None
        start, self.sent_tokens = self.sent_tokens, len(output.token_ids)
        if self.chat:
            return chat_logprobs(output, self.tokenizer, start, self.sent_tokens)
        return completion_logprobs(output, self.tokenizer, start, self.sent_tokens, echo=self.echo_pending)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1) if text.endswith(tag[:k])), 0)
