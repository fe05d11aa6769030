"""Resolved engine configs for tests that build a Scheduler, a fingerprint or a runner part directly."""
from __future__ import annotations

from typing import Any

from engine.config import EngineConfig

CONTEXT = 8192        # the model's context length the configs are resolved for
FREE_KV_BLOCKS = 4096  # CUDA: the KV blocks the free memory holds (no GPU needed to resolve)


def resolved(**fields: Any) -> EngineConfig:
    """EngineConfig(**fields) as the engine runs it (EngineConfig.resolve) on the device it names."""
    return EngineConfig(**fields).resolve(model_max_len=CONTEXT, free_kv_blocks=FREE_KV_BLOCKS)
