"""OpenAI response bodies (completion, chat completion, and their stream chunks) from engine outputs.

Verbatim adds three fields to every final body: ``system_fingerprint`` (standard), ``seed`` (the
seed used, drawn by the server when a deterministic request had none) and ``transcript``
``{id, log_index, replayable}``.
"""

from __future__ import annotations

from typing import Any

from auditor.service import Prepared, Recorded
from auditor.transcript import Api


def response_id(prepared: Prepared) -> str:
    prefix = "chatcmpl-" if prepared.request.api is Api.CHAT_COMPLETIONS else "cmpl-"
    return prefix + prepared.transcript_id


def _usage(prepared: Prepared, output: Any) -> dict[str, int]:
    completion = len(output.token_ids)
    return {"prompt_tokens": len(prepared.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(prepared.prompt_ids) + completion}


def _span(output: Any, start: int, end: int | None = None) -> tuple[list[int], list[float], list[dict[int, float]]]:
    """Token ids, logprobs and top logprobs of output tokens ``start:end``."""
    ids = list(output.token_ids[start:end])
    tops = list(output.top_logprobs[start:end]) if output.top_logprobs else []
    return ids, list(output.token_logprobs[start:end]), tops + [{}] * (len(ids) - len(tops))


def completion_logprobs(output: Any, tokenizer: Any, start: int = 0, end: int | None = None) -> dict[str, Any]:
    ids, logprobs, tops = _span(output, start, end)
    tokens = [tokenizer.decode([t]) for t in ids]
    return {
        "tokens": tokens,
        "token_logprobs": logprobs,
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top.items()} for top in tops],
        "text_offset": _offsets(tokens),
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


def _offsets(tokens: list[str]) -> list[int]:
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return offsets


def final_body(prepared: Prepared, output: Any, recorded: Recorded, model: str, fingerprint: str,
               tokenizer: Any) -> dict[str, Any]:
    chat = prepared.request.api is Api.CHAT_COMPLETIONS
    wants = prepared.params.logprobs is not None
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                  "finish_reason": output.finish_reason,
                  "logprobs": chat_logprobs(output, tokenizer) if wants else None}
    else:
        choice = {"index": 0, "text": output.text, "finish_reason": output.finish_reason,
                  "logprobs": completion_logprobs(output, tokenizer) if wants else None}
    return {
        "id": response_id(prepared),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(prepared.received_at.timestamp()),
        "model": model,
        "system_fingerprint": fingerprint,
        "choices": [choice],
        "usage": _usage(prepared, output),
        "seed": int(output.seed),
        "transcript": recorded.to_json(),
    }


class ChunkWriter:
    """Builds the SSE events of one streamed response."""

    def __init__(self, prepared: Prepared, model: str, fingerprint: str, tokenizer: Any) -> None:
        self.prepared = prepared
        self.tokenizer = tokenizer
        self.sent_tokens = 0
        self.chat = prepared.request.api is Api.CHAT_COMPLETIONS
        self.model = model
        self.fingerprint = fingerprint
        self.sent_text = ""
        self.holdback = max((len(stop) - 1 for stop in prepared.params.stop or []), default=0)

    def _chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {"id": response_id(self.prepared),
                "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": int(self.prepared.received_at.timestamp()), "model": self.model,
                "system_fingerprint": self.fingerprint, "choices": choices, **extra}

    def first(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role; completions have no opening chunk."""
        if not self.chat:
            return None
        return self._chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None, "logprobs": None}])

    def delta(self, output: Any) -> dict[str, Any] | None:
        """New committed text since the last chunk. While generating, the tail that could still turn
        out to be the start of a stop string (whose text the engine then cuts) or a partial character
        (U+FFFD) is held back; the final output releases whatever is left."""
        text: str = output.text
        if not output.finished:
            text = text[:max(0, len(text) - self.holdback)]
            text = text[:-1] if text.endswith("\ufffd") else text
        piece = text[len(self.sent_text):] if text.startswith(self.sent_text) else ""
        finish = output.finish_reason if output.finished else None
        if not piece and finish is None:
            return None
        self.sent_text += piece
        logprobs = self._logprobs(output)
        if self.chat:
            choice = {"index": 0, "delta": {"content": piece} if piece else {}, "finish_reason": finish,
                      "logprobs": logprobs}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": logprobs}
        return self._chunk([choice])

    def _logprobs(self, output: Any) -> dict[str, Any] | None:
        """Logprobs of the tokens committed since the last chunk (token-aligned; the text piece may
        lag by a held-back stop-string prefix)."""
        if self.prepared.params.logprobs is None:
            return None
        start, self.sent_tokens = self.sent_tokens, len(output.token_ids)
        span = chat_logprobs if self.chat else completion_logprobs
        return span(output, self.tokenizer, start, self.sent_tokens)

    def last(self, output: Any, recorded: Recorded) -> dict[str, Any]:
        """After the finish chunk: no choices, the usage, the seed and the transcript object."""
        return self._chunk([], usage=_usage(self.prepared, output), seed=int(output.seed),
                           transcript=recorded.to_json())
