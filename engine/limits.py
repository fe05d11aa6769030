"""Request validation: `validate_request`, the one check of a request (prompt + SamplingParams) against the
engine's limits, made once where the request comes in (LLM, AsyncEngine, EngineProcess) before anything is
queued. The engine core admits requests that passed it.

`RequestLimits` is what the check needs of an engine, constant once the engine is built; a serving process
that holds no engine (engine/engine_process.py) gets a copy at start-up and checks there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.grammar import compile_request_grammar

if TYPE_CHECKING:
    from engine.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits on one request."""

    vocab_size: int
    max_model_len: int
    max_num_batched_tokens: int
    kv_slots: int                  # usable KV blocks x block size
    window: int                    # W: a verify window's KV slots past the request's last token
    group: int                     # G: windows of a verify pass (a replay's records must have this shape)
    eos_ids: tuple[int, ...] = ()  # the model's stop ids (a grammar needs them)


def validate_request(limits: RequestLimits, tokenizer: Any, prompt: list[int], params: SamplingParams) -> None:
    """Raise ValueError naming the field and the limit: the params' own ranges, then the engine's limits, then
    the grammar compiled for the model's vocabulary (`tokenizer`: the model's, None when the engine has none)."""
    if not prompt:
        raise ValueError("prompt: must contain at least 1 token, got an empty prompt")
    params.validate()
    if params.top_k > limits.vocab_size:
        raise ValueError(f"top_k: must be <= the vocabulary size {limits.vocab_size} (0 = off), "
                         f"got {params.top_k}")
    over = [t for t, _ in params.logit_bias if t >= limits.vocab_size]
    if over:
        raise ValueError(f"SamplingParams.logit_bias: token ids must be < the vocabulary size "
                         f"{limits.vocab_size}, got {over[:5]}")
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        raise ValueError(f"prompt_token_ids: ids must be in [0, {limits.vocab_size}), got {bad[:5]}")
    total = len(prompt) + params.max_tokens
    if total > limits.max_model_len:
        raise ValueError(f"max_tokens: prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = "
                         f"{total} exceeds the model's context of {limits.max_model_len} tokens")
    if len(prompt) > limits.max_num_batched_tokens:
        raise ValueError(f"prompt: {len(prompt)} tokens exceed max_num_batched_tokens "
                         f"({limits.max_num_batched_tokens})")
    if total + limits.window > limits.kv_slots:
        raise ValueError(f"max_tokens: prompt + max_tokens + W = {total + limits.window} exceeds the "
                         f"KV budget of {limits.kv_slots} token slots (num_kv_blocks)")
    if params.grammar is not None:
        compile_request_grammar(params.grammar, tokenizer, limits.vocab_size, limits.eos_ids)
