"""Attention over the paged KV cache: metadata, cache, backends (torch; GPU kernels later)."""
from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata, PassKind
from engine.attention.paging import RowSpec, build_metadata, positions_of
from engine.attention.torch_backend import AttentionPlan, TorchAttention

BACKENDS = {"torch": TorchAttention}


def get_backend(name: str) -> TorchAttention:
    """Attention backend by name ("torch"); raises ValueError naming `attention_backend`."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)}, got {name!r}")
    return BACKENDS[name]()


__all__ = [
    "AttentionMetadata",
    "AttentionPlan",
    "KVCache",
    "PassKind",
    "RowSpec",
    "TorchAttention",
    "build_metadata",
    "get_backend",
    "positions_of",
]
