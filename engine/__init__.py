"""Verbatim engine: continuous batching with decode-verify-rollback (DVR) for bit-exact requests."""
from engine.config import DvrTuning, EngineConfig, Mode
from engine.grammar import GrammarError, GrammarSpec, validate_grammar
from engine.replay import ReplayRequest, ReplayResult
from engine.sampling import SAMPLER_ID, SamplingParams
from engine.sequence import RequestOutput

from engine.fingerprint import ENGINE_VERSION as __version__  # noqa: E402


def __getattr__(name: str) -> object:
    """LLM / AsyncEngine import lazily so `import engine` stays light for the auditor."""
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)


__all__ = ["LLM", "AsyncEngine", "EngineConfig", "DvrTuning", "Mode", "SamplingParams", "RequestOutput",
           "ReplayRequest", "ReplayResult", "SAMPLER_ID", "GrammarSpec", "GrammarError", "validate_grammar", "__version__"]
