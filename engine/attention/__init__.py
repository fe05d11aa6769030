"""Attention over the paged KV cache: metadata, cache, backends (torch; triton on CUDA)."""
from engine.attention.backend import AttentionBackend
from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata, PassKind
from engine.attention.paging import RowSpec, build_metadata, positions_of
from engine.attention.torch_backend import AttentionPlan, TorchAttention
from engine.config import DEFAULT_KERNEL_SETTINGS, KernelSettings

BACKEND_NAMES = ("torch", "triton", "flash", "batch_invariant")


def get_backend(name: str, kernels: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> AttentionBackend:
    """Attention backend by name, its Triton kernels (where it has any) launched with `kernels`; raises
    ValueError naming `attention_backend`."""
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        from engine.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention(settings=kernels)
    if name == "flash":
        from engine.attention.flash import FlashAttention

        return FlashAttention(settings=kernels)
    if name == "batch_invariant":
        from engine.attention.batch_invariant import BatchInvariantAttention

        return BatchInvariantAttention(settings=kernels)
    raise ValueError(f"attention_backend must be one of {list(BACKEND_NAMES)}, got {name!r}")


__all__ = [
    "AttentionBackend",
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
