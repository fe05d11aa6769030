"""Resolved engine configs for tests that build a Scheduler, a fingerprint or a runner part directly."""
from __future__ import annotations

from engine.config import EngineConfig

CONTEXT = 8192        # the model's context length the configs are resolved for
FREE_KV_BLOCKS = 4096  # CUDA: the KV blocks the free memory holds (no GPU needed to resolve)


def resolved(config: EngineConfig) -> EngineConfig:
    """`config` as the engine runs it (EngineConfig.resolve) for its device type."""
    return config.resolve(model_max_len=CONTEXT, free_kv_blocks=FREE_KV_BLOCKS)
