"""Attention for mode="batch_invariant": fixed-split-size paged attention for EVERY pass kind.

Every query (prefill, decode, verify alike) reduces over its keys in absolute chunks of `split_size`
keys combined in increasing order (engine.kernels.bi_paged_attention), so its bits depend only on its
position and the cache contents. Prefill, chunked prefill and decode of the same tokens therefore give
the same K/V and outputs bit for bit, whatever else is in the batch, and a preempted request
recomputed by an ordinary prefill gets back exactly the KV it had.

The plan does the index work once per forward (the kernels' `query_layout`); a DECODE plan is built
from tensor shapes and device ops only (no host sync), so a decode step stays CUDA-graph capturable.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, PassKind
from engine.attention.torch_backend import write_kv
from engine.kernels.attention import DEFAULT_SPLIT_SIZE, check_shapes, query_layout, tile_paged_attention
from engine.kernels.ops import Backend


@dataclass(frozen=True)
class BatchInvariantPlan:
    slot_mapping: torch.Tensor  # Long[T]
    block_tables: torch.Tensor  # Int[R, max_blocks]
    rows: torch.Tensor  # Long[T]: row of each query
    positions: torch.Tensor  # Long[T]: absolute position of each query
    max_seq_len: int  # host bound >= every seq_len (block-table width * block size): CUDA launch width only


class BatchInvariantAttention:
    """The attention-backend seam (plan / forward) over the fixed-split-size kernels."""

    name = "batch_invariant"

    def __init__(self, split_size: int = DEFAULT_SPLIT_SIZE, backend: Backend = "auto") -> None:
        if split_size <= 0 or split_size & (split_size - 1):
            raise ValueError(f"split_size must be a power of two, got {split_size}")
        if backend not in ("auto", "triton", "tiles"):
            raise ValueError(f"unknown backend {backend!r}; expected auto, triton or tiles")
        self.split_size, self.backend = split_size, backend

    def plan(self, meta: AttentionMetadata, block_size: int) -> BatchInvariantPlan:
        num_tokens = meta.num_tokens
        # None: query_layout's one-query-per-row layout, built without a host sync (CUDA-graph capturable)
        decode = meta.kind is PassKind.DECODE and num_tokens == meta.num_rows
        rows, positions = query_layout(meta.seq_lens, None if decode else meta.query_start_loc, num_tokens)
        return BatchInvariantPlan(meta.slot_mapping.to(torch.long), meta.block_tables, rows, positions,
                                  meta.block_tables.shape[1] * block_size)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: BatchInvariantPlan,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        write_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        q = q.contiguous()
        check_shapes(q, k_cache, v_cache, plan.block_tables)
        if self.backend == "tiles" or (self.backend == "auto" and not q.is_cuda):
            return tile_paged_attention(q, k_cache, v_cache, plan.block_tables, plan.rows, plan.positions, scale,
                                        self.split_size)
        from engine.kernels.triton_attention import triton_paged_attention

        return triton_paged_attention(q, k_cache, v_cache, plan.block_tables, plan.rows, plan.positions, scale,
                                      self.split_size, plan.max_seq_len - 1)
