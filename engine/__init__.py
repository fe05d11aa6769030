"""Verbatim engine: continuous batching with decode-verify-rollback (DVR) for bit-exact requests.

Every name below imports on first use, so `import engine` (and a submodule that needs no torch, such as
engine.cli for the auditor's command line) stays light."""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig, Mode
    from engine.grammar import GrammarError, GrammarSpec, validate_grammar
    from engine.llm import LLM
    from engine.replay import ReplayRequest, ReplayResult
    from engine.sampling import SAMPLER_ID, SamplingParams
    from engine.sequence import RequestOutput

_WHERE = {
    "LLM": "engine.llm", "AsyncEngine": "engine.async_engine", "EngineConfig": "engine.config",
    "Mode": "engine.config", "GrammarError": "engine.grammar", "GrammarSpec": "engine.grammar",
    "validate_grammar": "engine.grammar", "ReplayRequest": "engine.replay", "ReplayResult": "engine.replay",
    "SAMPLER_ID": "engine.sampling", "SamplingParams": "engine.sampling", "RequestOutput": "engine.sequence",
}


def __getattr__(name: str) -> object:
    if name == "__version__":
        from engine.fingerprint import ENGINE_VERSION
        return ENGINE_VERSION
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = ["LLM", "AsyncEngine", "EngineConfig", "Mode", "SamplingParams", "RequestOutput", "ReplayRequest",
           "ReplayResult", "SAMPLER_ID", "GrammarSpec", "GrammarError", "validate_grammar", "__version__"]
