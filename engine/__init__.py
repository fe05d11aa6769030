"""Verbatim engine: continuous batching with decode-verify-rollback (DVR) for bit-exact requests.

The names below are imported on first use: `import engine` stays light for the auditor, and the pure-Python
modules (scheduler, verifier, sequence, block_manager) import without torch."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.config import DvrTuning, EngineConfig, Mode
    from engine.fingerprint import ENGINE_VERSION as __version__
    from engine.grammar import GrammarError, GrammarSpec, validate_grammar
    from engine.llm import LLM
    from engine.replay import ReplayRequest, ReplayResult
    from engine.sampling import SAMPLER_ID, SamplingParams
    from engine.sequence import RequestOutput

_EXPORTS: dict[str, tuple[str, str]] = {
    "LLM": ("engine.llm", "LLM"),
    "AsyncEngine": ("engine.async_engine", "AsyncEngine"),
    "EngineConfig": ("engine.config", "EngineConfig"),
    "DvrTuning": ("engine.config", "DvrTuning"),
    "Mode": ("engine.config", "Mode"),
    "GrammarError": ("engine.grammar", "GrammarError"),
    "GrammarSpec": ("engine.grammar", "GrammarSpec"),
    "validate_grammar": ("engine.grammar", "validate_grammar"),
    "ReplayRequest": ("engine.replay", "ReplayRequest"),
    "ReplayResult": ("engine.replay", "ReplayResult"),
    "SAMPLER_ID": ("engine.sampling", "SAMPLER_ID"),
    "SamplingParams": ("engine.sampling", "SamplingParams"),
    "RequestOutput": ("engine.sequence", "RequestOutput"),
    "__version__": ("engine.fingerprint", "ENGINE_VERSION"),
}


def __getattr__(name: str) -> object:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    module, attr = _EXPORTS[name]
    return getattr(importlib.import_module(module), attr)


__all__ = ["LLM", "AsyncEngine", "EngineConfig", "Mode", "SamplingParams", "RequestOutput", "ReplayRequest",
           "ReplayResult", "SAMPLER_ID", "GrammarSpec", "GrammarError", "validate_grammar", "__version__"]
