"""Attention for mode="batch_invariant": every query's bits depend only on its position and the cache.

CUDA (backend "auto" / "triton"): the Triton paged kernels of engine.attention.triton_paged with
decode="canonical" — prefill, chunked prefill and verify passes through the prefill kernel (each query
reduced over its keys in absolute 256-key chunks merged in increasing order: a fixed split size, as in
SGLang's deterministic mode), decode queries through its GQA-packed one-query twin
(engine.attention.triton_canonical_decode, the chunks in parallel), which gives the same bits. So a token's K/V
and output are the same whether it was computed in a prefill, a chunk of one, a decode step or a
recompute after preemption, and whatever else is in the batch.

CPU (or backend "tiles"): fixed-split-size attention for every pass kind — every query reduces over
its keys in absolute chunks of `split_size` keys combined in increasing order
(engine.kernels.bi_paged_attention), with the same guarantees.

The plan does the index work once per forward (the kernels' `query_layout`); a DECODE plan is built
from tensor shapes and device ops only (no host sync), so a decode step stays CUDA-graph capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, PassKind
from engine.attention.torch_backend import write_kv
from engine.kernels.attention import DEFAULT_SPLIT_SIZE, check_shapes, query_layout, tile_paged_attention
from engine.config import DEFAULT_KERNEL_SETTINGS, KernelSettings
from engine.kernels.ops import Backend


@dataclass(frozen=True)
class BatchInvariantPlan:
    slot_mapping: torch.Tensor  # Long[T]
    block_tables: torch.Tensor  # Int[R, max_blocks]
    rows: torch.Tensor  # Long[T]: row of each query
    positions: torch.Tensor  # Long[T]: absolute position of each query


class BatchInvariantAttention:
    """The attention-backend seam (plan / forward): Triton paged kernels on CUDA, fixed-split tiles elsewhere."""

    name = "batch_invariant"
    # forward takes k = v = None on CUDA (K/V written by the ops' rope_write_kv, see TritonPagedAttention);
    # on the tiles path the ops have no fused write, so k and v always come
    kv_prewritten = True

    def __init__(self, split_size: int = DEFAULT_SPLIT_SIZE, backend: Backend = "auto",
                 settings: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> None:
        if split_size <= 0 or split_size & (split_size - 1):
            raise ValueError(f"split_size must be a power of two, got {split_size}")
        if backend not in ("auto", "triton", "tiles"):
            raise ValueError(f"unknown backend {backend!r}; expected auto, triton or tiles")
        self.split_size, self.backend, self.settings = split_size, backend, settings
        self._triton: object | None = None  # the CUDA backend, made on first use

    def with_kernels(self, kernels: KernelSettings) -> BatchInvariantAttention:
        return self if kernels == self.settings else BatchInvariantAttention(self.split_size, self.backend, kernels)

    def _paged(self, device: torch.device) -> object | None:
        """The Triton paged backend (decode="canonical") this object runs on `device`, or None (tiles)."""
        if self.backend == "triton" and device.type != "cuda":
            raise ValueError(f"backend='triton' needs CUDA tensors, got device {device}")
        if self.backend == "tiles" or device.type != "cuda":
            return None
        if self._triton is None:
            from engine.attention.triton_backend import TritonPagedAttention

            self._triton = TritonPagedAttention(decode="canonical", settings=self.settings)
        return self._triton

    def plan(self, meta: AttentionMetadata, block_size: int) -> object:
        paged = self._paged(meta.seq_lens.device)
        if paged is not None:
            return paged.plan(meta, block_size)  # decode="canonical" ignores canonical_rows
        num_tokens = meta.num_tokens
        # None: query_layout's one-query-per-row layout, built without a host sync (CUDA-graph capturable)
        decode = meta.kind is PassKind.DECODE and num_tokens == meta.num_rows
        rows, positions = query_layout(meta.seq_lens, None if decode else meta.query_start_loc, num_tokens)
        return BatchInvariantPlan(meta.slot_mapping.to(torch.long), meta.block_tables, rows, positions)

    def forward_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, plan: object, scale: float) -> torch.Tensor | None:
        """The CUDA backend's forward_rope (RoPE and the K/V store inside the canonical decode kernel, where
        KernelSettings.fuse_rope_canonical allows it); None on the tiles path."""
        if isinstance(plan, BatchInvariantPlan):
            return None
        assert self._triton is not None
        return self._triton.forward_rope(q, k, v, cos_sin, k_cache, v_cache, plan, scale)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor | None,  # [T, Hkv, D]; None with v on CUDA: already in the cache (kv_prewritten)
        v: torch.Tensor | None,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: object,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        if not isinstance(plan, BatchInvariantPlan):  # a TritonPlan: the CUDA kernels
            assert self._triton is not None
            return self._triton.forward(q, k, v, k_cache, v_cache, plan, scale)
        if k is None or v is None:
            raise ValueError("the tiles path writes K/V itself: pass k and v")
        write_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        q = q.contiguous()
        check_shapes(q, k_cache, v_cache, plan.block_tables)
        return tile_paged_attention(q, k_cache, v_cache, plan.block_tables, plan.rows, plan.positions, scale,
                                    self.split_size)
