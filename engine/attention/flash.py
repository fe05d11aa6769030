"""flash-attn backend (used only when `flash_attn` imports). UNRUN: flash-attn is not installed on the
H200 this project can borrow, so this file has never executed; it is kept small on purpose.

DECODE uses `flash_attn_with_kvcache` over the paged cache (any split count: the fast path may be
shape-dependent). PREFILL and VERIFY do NOT use flash-attn: FlashAttention-2 walks key blocks from the
query tile's last block backwards, and the tile is aligned to the window's start, so a query's online
softmax order depends on where its window begins — even with `num_splits=1` (which only removes the
dependence on the batch). Window-boundary invariance (DESIGN §2) needs the absolutely aligned schedule of
the Triton kernel, so those passes go to `TritonPagedAttention`. Set `verify_with_flash=True` to run
VERIFY through flash-attn with `num_splits=1` anyway (batch-invariant, not window-invariant: replay can
then mismatch when rollbacks moved the windows).

flash-attn's paged KV needs block_size % 256 == 0 (FA2); smaller blocks raise at plan time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, PassKind
from engine.attention.torch_backend import write_kv
from engine.attention.triton_backend import TritonPagedAttention, TritonPlan
from engine.config import DEFAULT_KERNEL_SETTINGS, KernelSettings


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class FlashPlan:
    triton: TritonPlan
    use_flash: bool


class FlashAttention:
    name = "flash"

    def __init__(self, verify_with_flash: bool = False, settings: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> None:
        if not flash_available():
            raise ValueError("attention_backend 'flash' needs the flash_attn package, which is not installed")
        self.verify_with_flash = verify_with_flash
        self.canonical = TritonPagedAttention(settings=settings)

    def with_kernels(self, kernels: KernelSettings) -> FlashAttention:
        return self if kernels == self.canonical.settings else FlashAttention(self.verify_with_flash, kernels)

    def plan(self, meta: AttentionMetadata, block_size: int) -> FlashPlan:
        base = self.canonical.plan(meta, block_size)
        use = base.one_query_per_row or (self.verify_with_flash and meta.kind is PassKind.VERIFY)
        if use and block_size % 256:
            raise ValueError(f"flash-attn paged KV needs block_size % 256 == 0, got {block_size}")
        return FlashPlan(base, use)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, plan: FlashPlan, scale: float) -> torch.Tensor:
        if not plan.use_flash:
            return self.canonical.forward(q, k, v, k_cache, v_cache, plan.triton, scale)
        from flash_attn import flash_attn_with_kvcache

        p = plan.triton
        write_kv(k, v, k_cache, v_cache, p.slot_mapping)
        rows = p.seq_lens.shape[0]
        n = q.shape[0] // rows  # 1 for decode, W for verify
        out = flash_attn_with_kvcache(
            q.view(rows, n, *q.shape[1:]), k_cache, v_cache, cache_seqlens=p.seq_lens,
            block_table=p.block_tables, softmax_scale=scale, causal=True,
            num_splits=0 if p.one_query_per_row else 1)  # 0: heuristic (fast path); 1: no split-KV
        return out.reshape(q.shape)
