"""Paged KV cache: one K and one V tensor per layer, addressed by (block, offset)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCache:
    """k[i], v[i]: [num_blocks, block_size, num_kv_heads, head_dim] for layer i.

    Zero-initialised so that a masked key read from an unused block never brings a NaN into
    0 * v. Block 0 is the engine's reserved scratch block; attention never depends on its content.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]

    @classmethod
    def allocate(
        cls,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVCache:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        k = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers))
        v = tuple(torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers))
        return cls(k=k, v=v)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    @property
    def num_blocks(self) -> int:
        return int(self.k[0].shape[0])

    @property
    def block_size(self) -> int:
        return int(self.k[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
