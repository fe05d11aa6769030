"""The engine as the service sees it: the ``ServingEngine`` seam, and ``load_engine``, the one place the service
builds an engine.

``engine.AsyncEngine`` (in this process), ``engine.engine_process.EngineProcess`` (in a process of its own) and
the tests' ``FakeAsyncEngine`` all satisfy ``ServingEngine``; every other auditor module holds the engine as a
``ServingEngine`` and uses only what it declares. Its data types (``RequestOutput``, ``EngineStats``,
``ReplayRequest`` / ``ReplayResult``, ``ModelInfo``, ``EngineConfig``) are the engine's own.
"""

from __future__ import annotations

import importlib
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from engine import EngineConfig, ReplayRequest, ReplayResult, RequestOutput, SamplingParams
from engine.async_engine import AsyncEngine, ReplayProgress
from engine.cli import engine_config
from engine.core import EngineStats
from engine.engine_process import EngineProcess
from engine.loader import ModelInfo

from auditor.settings import Settings

class Tokenizer(Protocol):
    """What the service asks of the served model's tokenizer (a Hugging Face tokenizer has all of it)."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...
    def apply_chat_template(self, conversation: list[dict[str, Any]], **kwargs: Any) -> Any: ...
    def __len__(self) -> int: ...


class ServingEngine(Protocol):
    """The engine seam of docs/engine.md: validate, generate (streaming committed outputs), abort, replay,
    fingerprints and stats; started once, shut down once."""

    config: EngineConfig
    """The engine's resolved options; the service reads the verify pass shape (group, window) from it."""
    tokenizer: Tokenizer
    model_info: ModelInfo

    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...
    def runtime_fingerprint(self) -> dict[str, str | int]: ...
    def system_fingerprint(self) -> str: ...
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; nothing is queued."""
    def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                 request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of committed tokens, the last one finished."""
    async def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request; its output so far (None when the engine no longer knows it)."""
    def last_output(self, request_id: str) -> RequestOutput | None:
        """The most recent output of a request still remembered (finished or aborted ones included)."""
    async def replay(self, requests: list[ReplayRequest],
                     on_progress: ReplayProgress | None = None) -> list[ReplayResult]:
        """Re-execute recorded windows, teacher-forced, in shared verify passes."""
    def stats(self) -> EngineStats: ...


EngineLoader = Callable[[Settings], ServingEngine]


def load_engine(settings: Settings) -> ServingEngine:
    """Build the real engine (blocking: resolves, loads and fingerprints the model; in a process of its own
    unless ``settings.engine_process`` is off), or the one ``settings.engine_factory`` (``module:callable``)
    builds from the settings."""
    if settings.engine_factory:
        module, _, name = settings.engine_factory.partition(":")
        factory: EngineLoader = getattr(importlib.import_module(module), name)
        return factory(settings)
    config = engine_config({**settings.engine_options, "model": settings.model, "device": settings.device,
                            "tensor_parallel_size": settings.tensor_parallel_size})
    return EngineProcess(config) if settings.engine_process else AsyncEngine(config)
