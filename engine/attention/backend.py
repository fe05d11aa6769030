"""The attention-backend seam every implementation follows (torch, triton, ...)."""
from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.attention.metadata import AttentionMetadata
from engine.config import KernelSettings


class AttentionBackend(Protocol):
    """A backend may also set `kv_prewritten = True` (class attribute, optional; TritonPagedAttention does):
    its forward then takes k = v = None, meaning this pass's K/V are already in the cache at the plan's
    `slot_mapping` (the model wrote them with the ops' rope_write_kv, see engine.kernels.ops.Ops).

    And it may offer `forward_rope(q, k, v, cos_sin, k_cache, v_cache, plan, scale) -> out | None` (optional;
    TritonPagedAttention does): forward for q and k BEFORE RoPE, the backend rotating them with the ops'
    Triton RoPE arithmetic and writing K/V inside its own launch, for the passes where it can (None
    otherwise, having touched nothing). The model offers it only where `ops.triton_rope(q)` holds."""

    name: str

    def with_kernels(self, kernels: KernelSettings) -> AttentionBackend:
        """This backend with its Triton kernels launched under `kernels` (EngineConfig.kernels): itself where
        they already are, or where it runs none."""

    def plan(self, meta: AttentionMetadata, block_size: int) -> Any:
        """Index work done once per forward pass, shared by every layer."""

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor | None,  # [T, Hkv, D]; None (with v) only for a backend with kv_prewritten = True
        v: torch.Tensor | None,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: Any,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]; writes k, v to plan's slots first (when given)
        """Write this pass's K/V into the cache (unless already written: k = v = None), then attend."""
