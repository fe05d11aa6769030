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


def _completion_logprobs(output: Any, tokenizer: Any, prepared: Prepared) -> dict[str, Any] | None:
    if prepared.params.logprobs is None:
        return None
    tokens = [tokenizer.decode([t]) for t in output.token_ids]
    tops = output.top_logprobs or [{} for _ in tokens]
    return {
        "tokens": tokens,
        "token_logprobs": list(output.token_logprobs),
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top.items()} for top in tops],
        "text_offset": _offsets(tokens),
    }


def _chat_logprobs(output: Any, tokenizer: Any, prepared: Prepared) -> dict[str, Any] | None:
    if prepared.params.logprobs is None:
        return None
    tops = output.top_logprobs or [{} for _ in output.token_ids]
    content = []
    for token_id, logprob, top in zip(output.token_ids, output.token_logprobs, tops):
        token = tokenizer.decode([token_id])
        content.append({
            "token": token, "logprob": logprob, "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": tokenizer.decode([t]), "logprob": lp, "bytes": list(tokenizer.decode([t]).encode())}
                             for t, lp in top.items()],
        })
    return {"content": content}


def _offsets(tokens: list[str]) -> list[int]:
    offsets, position = [], 0
    for token in tokens:
        offsets.append(position)
        position += len(token)
    return offsets


def final_body(prepared: Prepared, output: Any, recorded: Recorded, model: str, fingerprint: str,
               tokenizer: Any) -> dict[str, Any]:
    chat = prepared.request.api is Api.CHAT_COMPLETIONS
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": output.text},
                  "finish_reason": output.finish_reason, "logprobs": _chat_logprobs(output, tokenizer, prepared)}
    else:
        choice = {"index": 0, "text": output.text, "finish_reason": output.finish_reason,
                  "logprobs": _completion_logprobs(output, tokenizer, prepared)}
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

    def __init__(self, prepared: Prepared, model: str, fingerprint: str) -> None:
        self.prepared = prepared
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
        if self.chat:
            choice = {"index": 0, "delta": {"content": piece} if piece else {}, "finish_reason": finish,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": piece, "finish_reason": finish, "logprobs": None}
        return self._chunk([choice])

    def last(self, output: Any, recorded: Recorded) -> dict[str, Any]:
        """After the finish chunk: no choices, the usage, the seed and the transcript object."""
        return self._chunk([], usage=_usage(self.prepared, output), seed=int(output.seed),
                           transcript=recorded.to_json())
