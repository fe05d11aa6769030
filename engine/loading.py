"""An engine's model: `load_model(config)` loads it in this process; with tensor_parallel_size > 1 it starts the
worker ranks first (engine.tp_workers), and this process (rank 0) and each worker load their shard
(engine.model_runner.load_shard)."""
from __future__ import annotations

from engine.config import EngineConfig
from engine.model_runner import LoadedModel, load_shard
from engine.tp_workers import start_workers


def load_model(config: EngineConfig) -> LoadedModel:
    """The model config.model names, built and loaded (rank 0's shard, its workers started, under tensor
    parallelism)."""
    if config.tensor_parallel_size == 1:
        return load_shard(config)
    tp = start_workers(config)
    try:
        return load_shard(config, tp)
    except BaseException:
        tp.close()
        raise
