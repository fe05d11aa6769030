"""The mock serving engines of the tests: their config, a loader of the mock model (a module-level function,
so a spawned engine process can import it), the in-process engine, the offline reference, a stream reader."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_runner import LoadedModel
from engine.sampling import SamplingParams
from tests.engine.mock_model import MockModel

SERVING_CFG = dict(window=8, group=4, num_kv_blocks=64, num_threads=1)


def mock_loaded(config: EngineConfig) -> LoadedModel:
    """The mock model with EOS id 1 (EngineProcess runs it in the engine process)."""
    model = MockModel()
    return LoadedModel(model, model.shape, None, SimpleNamespace(eos_token_ids=(1,), name="mock"))


def in_process_engine(**cfg: Any) -> AsyncEngine:
    config = EngineConfig.from_options({**SERVING_CFG, **cfg})
    return AsyncEngine(config, mock_loaded(config))


def offline(prompts: list[list[int]], params: list[SamplingParams]) -> list[Any]:
    model = MockModel()
    return LLM.from_parts(EngineConfig.from_options(SERVING_CFG), model, model.shape, {1}).generate(prompts, params)


async def collect(engine: Any, prompt: list[int], params: SamplingParams, rid: str | None = None) -> list[Any]:
    return [o async for o in engine.generate(prompt, params, rid)]
