"""A small stand-in for ``engine.AsyncEngine``: it satisfies ``auditor.engine_seam.ServingEngine`` with the
engine's own data types (RequestOutput, EngineStats, ModelInfo, EngineConfig).

Test-only. Tokens are a pure function of (prompt ids, seed, position) when deterministic, random
otherwise; commits arrive in windows of ``window`` tokens with a short sleep between them so that
streaming and client disconnects can be exercised.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

from engine import EngineConfig, ReplayRequest, ReplayResult, RequestOutput, SamplingParams
from engine.async_engine import ReplayProgress
from engine.core import EngineStats
from engine.loader import ModelInfo
from engine.replay import check_replay

LAST_OUTPUTS_KEPT = 1024
"""Like the real engine, only the most recent outputs are kept for ``last_output`` / ``abort``."""

VOCAB = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [" ", ".", ","]
EOS_ID = len(VOCAB)


class CharTokenizer:
    """One token per character of VOCAB; anything else maps to ' '."""

    eos_token_id = EOS_ID
    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"

    def __len__(self) -> int:
        return len(VOCAB) + 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [VOCAB.index(c) if c in VOCAB else VOCAB.index(" ") for c in text.lower()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(VOCAB[i] for i in ids if i < len(VOCAB))

    def __len__(self) -> int:
        return len(VOCAB) + 1  # the characters and EOS

    def apply_chat_template(self, messages: list[dict[str, Any]], *, tokenize: bool = False,
                            add_generation_prompt: bool = True, **_: Any) -> str | list[int]:
        text = "".join(f"{m['role']} {m['content']}. " for m in messages) + "assistant "
        return self.encode(text) if tokenize else text


MODEL_INFO = ModelInfo(name="fake-model", weights_digest="sha256:" + "11" * 32, tokenizer_digest="sha256:" + "22" * 32,
                       chat_template_digest="sha256:" + "33" * 32, dtype="float32", max_model_len=512,
                       eos_token_ids=(EOS_ID,))


def new_output(request_id: str, prompt_token_ids: list[int], seed: int, deterministic: bool = False,
               window_shape: tuple[int, int] = (4, 8), logprobs: bool = False) -> RequestOutput:
    """An engine RequestOutput with nothing committed yet."""
    return RequestOutput(request_id=request_id, prompt_token_ids=list(prompt_token_ids), token_ids=[], text="",
                         finished=False, finish_reason=None, seed=seed, deterministic=deterministic,
                         token_logprobs=[], top_logprobs=[] if logprobs else None, logprobs=[] if logprobs else None,
                         windows=[], window_shape=window_shape, verify_passes=0, rollbacks=0, recomputed_tokens=0)


class FakeAsyncEngine:
    def __init__(self, *, window: int = 8, group: int = 4, step_delay: float = 0.002,
                 fail_after_commits: int | None = None) -> None:
        self.config = EngineConfig(window=window, group=group, device="cpu")
        self.tokenizer = CharTokenizer()
        self.model_info = MODEL_INFO
        self.step_delay = step_delay
        self.fail_after_commits = fail_after_commits
        self._last: OrderedDict[str, RequestOutput] = OrderedDict()
        self._stats = EngineStats()
        self.started = False

    @property
    def window(self) -> int:
        return self.config.window

    @property
    def group(self) -> int:
        return self.config.group

    async def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.started = False

    def runtime_fingerprint(self) -> dict[str, str | int]:
        return {"engine_version": "fake-0", "torch": "none", "device": "cpu", "mode": "dvr",
                "window": self.window, "group": self.group, "sampler": "fake-v1", "threads": 1}

    def system_fingerprint(self) -> str:
        return "fp_" + "0123456789ab"

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in prompt_token_ids if not 0 <= t < len(VOCAB)]
        if bad:
            raise ValueError(f"prompt_token_ids: ids must be in [0, {len(VOCAB)}), got {bad[:5]}")
        if len(prompt_token_ids) + params.max_tokens > self.model_info.max_model_len:
            raise ValueError(
                f"max_tokens: prompt ({len(prompt_token_ids)}) + max_tokens ({params.max_tokens}) "
                f"exceeds max_model_len {self.model_info.max_model_len}"
            )

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        self.validate(prompt_token_ids, params)
        request_id = request_id or secrets.token_hex(8)
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        out = new_output(request_id, prompt_token_ids, seed, params.deterministic, (self.group, self.window),
                         logprobs=params.logprobs is not None)
        self._last[request_id] = out
        while len(self._last) > LAST_OUTPUTS_KEPT:
            self._last.popitem(last=False)
        self._stats.running += 1
        self._stats.prompt_tokens += len(prompt_token_ids)
        try:
            commits = 0
            while not out.finished:
                await asyncio.sleep(self.step_delay)
                if commits == self.fail_after_commits:
                    raise RuntimeError("injected engine failure")
                self._commit(out, params)
                commits += 1
                yield replace(out, token_ids=list(out.token_ids), token_logprobs=list(out.token_logprobs),
                              logprobs=None if out.logprobs is None else list(out.logprobs), windows=list(out.windows))
        finally:
            self._stats.running -= 1
            if not out.finished:
                out.finish_reason = "abort"

    def _token(self, out: RequestOutput, params: SamplingParams, position: int) -> int:
        material = f"{out.prompt_token_ids}|{out.seed if params.deterministic else secrets.randbits(64)}|{position}"
        value = int.from_bytes(hashlib.sha256(material.encode()).digest()[:4], "little")
        if not params.ignore_eos and value % 97 == 0:
            return EOS_ID
        return value % len(VOCAB)

    def _commit(self, out: RequestOutput, params: SamplingParams) -> None:
        start = len(out.token_ids)
        end = min(params.max_tokens, start + (1 if start == 0 else self.window))
        for position in range(start, end):
            token = self._token(out, params, position)
            if token == EOS_ID:
                out.finished, out.finish_reason = True, "stop"
                break
            out.token_ids.append(token)
            out.token_logprobs.append(-0.5 - (token % 7) / 10)
            if out.logprobs is not None:
                out.logprobs.append(out.token_logprobs[-1])
        if start > 0 and len(out.token_ids) > start and params.deterministic:
            out.windows.append((start, len(out.token_ids)))
            out.verify_passes += 1
            self._stats.verify_passes += 1
        self._stats.generated_tokens += len(out.token_ids) - start
        if len(out.token_ids) >= params.max_tokens and not out.finished:
            out.finished, out.finish_reason = True, "length"
        out.text = self.tokenizer.decode(out.token_ids)
        hits = [out.text.find(stop) for stop in params.stop or [] if stop in out.text]
        if hits:
            out.text = out.text[:min(hits)]
            out.finished, out.finish_reason = True, "stop"

    def last_output(self, request_id: str) -> RequestOutput | None:
        return self._last.get(request_id)

    async def replay(self, requests: list[ReplayRequest],
                     on_progress: ReplayProgress | None = None) -> list[ReplayResult]:
        """Each recorded position predicted by the fake's own pure token function, so a faithful record
        replays as a match; on_progress hears (tokens replayed, tokens in the batch) once, at the end."""
        for r in requests:
            check_replay(r, self.group, self.window)
        results = [self._replay_one(r) for r in requests]
        if on_progress is not None:
            total = sum(len(r.token_ids) for r in requests)
            on_progress(total, total)
        return results

    def _replay_one(self, r: ReplayRequest) -> ReplayResult:
        probe = new_output(r.replay_id, r.prompt_token_ids, int(r.params.seed or 0))
        predicted = [self._token(probe, r.params, i) for i in range(len(r.token_ids))]
        first = next((i for i, (a, b) in enumerate(zip(predicted, r.token_ids)) if a != b), None)
        window = next((k for k, (s, e) in enumerate(r.windows) if s <= first < e), None) if first else None
        return ReplayResult(r.replay_id, predicted, [-0.5 - (t % 7) / 10 for t in predicted], first, window)

    async def abort(self, request_id: str) -> RequestOutput | None:
        return self._last.get(request_id)

    def stats(self) -> EngineStats:
        return self._stats


def from_settings(settings: Any) -> FakeAsyncEngine:
    """``VERBATIM_ENGINE_FACTORY=tests.auditor.fake_engine:from_settings``: the fake engine in a real
    ``python -m auditor serve`` process (multi-process tests and the replica benchmark)."""
    options = dict(settings.engine_options)
    return FakeAsyncEngine(step_delay=float(options.get("step_delay", 0.002)))
