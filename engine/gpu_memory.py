"""Sizing the paged KV cache from the GPU memory left after the weights (issue 5: default share 90 %)."""
from __future__ import annotations

import torch

DEFAULT_KV_SHARE = 0.9


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
                       dtype: torch.dtype) -> int:
    """K and V of one block over all layers: 2 * L * block_size * Hkv * D * itemsize."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize


def kv_blocks_for_free_memory(bytes_per_block: int, share: float = DEFAULT_KV_SHARE,
                              device: torch.device | str = "cuda") -> int:
    """Blocks that fit in `share` of the device memory free now (call after the weights are loaded).

    The rest (1 - share) is left for activations, logits, CUDA-graph pools and the allocator's slack.
    """
    if not 0.0 < share <= 1.0:
        raise ValueError(f"kv share must be in (0, 1], got {share}")
    free, _total = torch.cuda.mem_get_info(torch.device(device))
    blocks = int(free * share) // bytes_per_block
    if blocks < 3:
        raise ValueError(f"only {free / 2**30:.2f} GiB free: {share:.0%} holds {blocks} KV blocks "
                         f"of {bytes_per_block} bytes (need >= 3)")
    return blocks
