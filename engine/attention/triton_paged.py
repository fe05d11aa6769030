"""Triton paged attention for CUDA (bf16/fp16/fp32 caches).

Two kernels over the paged KV cache (per layer `k_cache, v_cache: [num_blocks, block_size, Hkv, D]`):

* `prefill_attention` — PREFILL and VERIFY passes. No split-KV. Query tiles and key tiles are both
  ABSOLUTELY aligned: a program owns query positions [t*BM, (t+1)*BM) of one row and one head, and
  walks key tiles [j*BN, (j+1)*BN) for j = 0, 1, … in increasing order with an online softmax, masking
  keys with position > query position. The tiles are grouped in absolute chunks of KernelSettings.chunk keys:
  each chunk's online softmax starts afresh and its (max, sum, acc) is merged into the running total in
  increasing chunk order (`merge_chunk`), so a one-query row's chunks can be reduced in parallel and
  merged in the same order to the same bits (the canonical decode kernel, below). A query at position
  p therefore always sits in MMA row p % BM and sees the same tiles and chunks with the same contents
  in the same order, whatever the window's start, the row it sits in, or the batch. Tiles past a
  query's own position are fully masked for it and bitwise neutral (alpha = exp2(0) = 1, p = 0). Tile shapes and warps are constants, never tuned per
  shape, because the MMA instruction (and its accumulation order) follows the tile shape.

      keys of row r:   | tile 0 | tile 1 | tile 2 | ...        (absolute, BN keys each)
      queries of r:              |ctx_len ........ seq_len-1|  (this pass's tokens)
      query tiles:     |  qt 0  |  qt 1  |  qt 2  | ...        (absolute, BM positions each)

* `decode_attention` — DECODE passes (one query per row). Split-KV with a FIXED SPLIT SIZE (not a
  fixed split count): split s covers keys [s*SPLIT, (s+1)*SPLIT) of the row, and the splits are merged
  in increasing s. For a given SPLIT a row's result depends only on its own keys (but its bits are
  not the prefill kernel's, so the `batch_invariant` mode decodes canonically). The backend's default
  picks SPLIT by the step's padded batch (`decode_split_for_rows`: 64 keys at batch 1, 512 from 33
  rows), so small batches spread a row over more programs; a fixed `split_size` keeps one SPLIT for all.
  The grid's split count is static (from the block-table width), so the call is CUDA-graph capturable;
  with the fused merge, splits past a row's keys exit at once and the merge reads the active ones only
  (the separate merge kernel reads them all, an empty one as lse = -inf: the same bits).
  The query heads of one KV head (GQA group) share one program, so each K/V tile is read once.
  By default the merge is fused into the split kernel (one launch): each program counts itself done on a
  per-(row, KV head) counter of the workspace (atomic, acq_rel) and the last one merges the group's heads
  with the merge kernel's arithmetic; merge="kernel" keeps the separate merge launch (same bits).

Triton is imported lazily: this module is importable on a CPU-only machine; calling a kernel there
raises (or runs under TRITON_INTERPRET=1 for tests).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.config import (DEFAULT_KERNEL_SETTINGS, PREFILL_BLOCK_N, PREFILL_NUM_STAGES, PREFILL_NUM_WARPS,
                           KernelSettings)

DECODE_BLOCK_N = 64
DECODE_SPLIT_SIZE = 512  # keys per split (multiple of DECODE_BLOCK_N)
# the backend's default split size by padded batch (decode_split_for_rows): (at most this many rows, split)
DECODE_SPLITS_BY_ROWS = ((2, 64), (8, 128), (32, 256))
LOG2E = 1.4426950408889634


@functools.cache
def _kernels() -> tuple[ModuleType, object, object, object]:
    """Import triton (and compile on first launch) only when a kernel is first used."""
    import triton

    from engine.attention import triton_paged_kernels as k

    return triton, k._prefill_kernel, k._decode_split_kernel, k._decode_merge_kernel


def check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v cache must be [num_blocks, block_size, Hkv, D] and equal, got "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads, cache_dim = k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q heads {num_heads}x{head_dim} do not fit cache heads {num_kv_heads}x{cache_dim}")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or q.stride(2) != 1:
        raise ValueError("head_dim must be the contiguous dimension of q and the caches")
    return block_size, num_kv_heads, num_heads // num_kv_heads


def dot_precision(q: torch.Tensor) -> str | None:
    """fp32 caches get true fp32 products (Triton's default would be tf32); 16-bit inputs ignore it."""
    return "ieee" if q.dtype == torch.float32 else None


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def prefill_attention(
    q: torch.Tensor,                  # [T, Hq, D]
    k_cache: torch.Tensor,            # [num_blocks, block_size, Hkv, D] (this pass's K already written)
    v_cache: torch.Tensor,
    query_start_loc: torch.Tensor,    # Int[R+1]
    seq_lens: torch.Tensor,           # Int[R]
    block_tables: torch.Tensor,       # Int[R, max_blocks]
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [T, Hq, D]
    only_rows: torch.Tensor | None = None,  # Int32[R]: rows with 0 return at once, their `out` untouched
    block_m: int | None = None,       # query tile rows; None: settings.query_tile (the verifier's)
    settings: KernelSettings = DEFAULT_KERNEL_SETTINGS,
) -> torch.Tensor:
    """Causal attention of each query over its row's cache, window- and batch-invariant (module doc)."""
    block_m = settings.query_tile if block_m is None else block_m
    triton, kernel, _, _ = _kernels()
    block_size, _, group = check_cache(q, k_cache, v_cache)
    num_rows = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    head_dim = q.shape[2]
    # +1: a window that starts mid-tile spans one more absolute query tile than its length suggests
    # (a single query never does)
    query_tiles = 1 if max_query_len <= 1 else triton.cdiv(max_query_len, block_m) + 1
    grid = (num_rows, query_tiles, q.shape[1])
    kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_tables, row_mask(only_rows, num_rows),
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0), block_tables.shape[1],
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, next_pow2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=PREFILL_BLOCK_N, DOT_PRECISION=dot_precision(q),
        HAS_ROW_MASK=only_rows is not None, CHUNK=settings.chunk,
        num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES,
    )
    return out


def row_mask(mask: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
    if mask is not None and (mask.dtype != torch.int32 or tuple(mask.shape) != (num_rows,)):
        raise ValueError(f"row mask must be Int32[{num_rows}], got {mask.dtype}{list(mask.shape)}")
    return mask


def decode_split_for_rows(num_rows: int) -> int:
    """The split size the backend's default ("by rows") gives a decode step of `num_rows` rows (the padded
    batch, so one per captured graph): small batches get short splits, so a row's keys spread over more
    programs (batch 1 at 256 keys ran 8 programs, one per KV head, ~10 us a layer), large batches the
    default 512-key split. Splits past a row's keys exit at once, so a short split costs little when the
    row is short. Fast path only: it changes no committed bit (canonical rows and verify never split)."""
    for rows, split in DECODE_SPLITS_BY_ROWS:
        if num_rows <= rows:
            return split
    return DECODE_SPLIT_SIZE


def decode_num_splits(max_kv_len: int, split_size: int = DECODE_SPLIT_SIZE) -> int:
    """Static split count covering `max_kv_len` keys (e.g. block-table width * block_size)."""
    return max(1, math.ceil(max_kv_len / split_size))


@dataclass(frozen=True)
class DecodeRope:
    """What decode_attention needs to apply RoPE and write this step's K/V itself (its `rope` argument):
    the raw k, v [R, Hkv, D] (strided views of the qkv output are fine, head_dim contiguous), cos_sin
    [R, 2, D] (cos then sin of each row's position, in q's dtype) and slots Long/Int[R] (the plan's
    slot_mapping: block * block_size + offset of each row's new key)."""

    k: torch.Tensor
    v: torch.Tensor
    cos_sin: torch.Tensor
    slots: torch.Tensor

    def check(self, q: torch.Tensor, k_cache: torch.Tensor) -> None:
        r, hq, d = q.shape
        hkv = k_cache.shape[2]
        if (tuple(self.k.shape) != (r, hkv, d) or tuple(self.v.shape) != (r, hkv, d)
                or tuple(self.cos_sin.shape) != (r, 2, d) or tuple(self.slots.shape) != (r,) or d % 2):
            raise ValueError(f"decode rope: k {tuple(self.k.shape)}, v {tuple(self.v.shape)}, cos_sin "
                             f"{tuple(self.cos_sin.shape)}, slots {tuple(self.slots.shape)} must be [{r}, {hkv}, {d}] "
                             f"twice, [{r}, 2, {d}] and [{r}] (head_dim even)")
        if self.k.stride(2) != 1 or self.v.stride(2) != 1 or self.cos_sin.stride(2) != 1:
            raise ValueError("decode rope: head_dim must be the contiguous dimension of k, v and cos_sin")
        if self.slots.dtype not in (torch.int64, torch.int32) or self.k.dtype != q.dtype:
            raise ValueError(f"decode rope: slots must be Long or Int (got {self.slots.dtype}), k must have q's "
                             f"dtype {q.dtype} (got {self.k.dtype})")


def rope_launch_args(rope: DecodeRope | None, q: torch.Tensor, seq_lens: torch.Tensor) -> tuple:
    """The RoPE arguments of the decode kernels (kraw, vraw, cos_sin, slots and their six strides); without
    rope they are unused: any tensors, zero strides."""
    if rope is None:
        return (q, q, q, seq_lens) + (0,) * 6
    kr, vr, cs = rope.k, rope.v, rope.cos_sin
    return (kr, vr, cs, rope.slots, kr.stride(0), kr.stride(1), vr.stride(0), vr.stride(1), cs.stride(0), cs.stride(1))


class DecodeWorkspace:
    """Preallocated split buffers, so a decode step (and its CUDA graph) allocates nothing."""

    def __init__(self, max_rows: int, num_heads: int, head_dim: int, num_splits: int,
                 device: torch.device | str) -> None:
        self.num_splits = num_splits
        self.mid_o = torch.empty(max_rows, num_heads, num_splits, head_dim, dtype=torch.float32, device=device)
        self.mid_lse = torch.empty(max_rows, num_heads, num_splits, dtype=torch.float32, device=device)
        # merge="fused": per (row, KV head) the split programs that finished; zero between launches (the
        # merging program resets its own)
        self.done = torch.zeros(max_rows, num_heads, dtype=torch.int32, device=device)


def decode_attention(
    q: torch.Tensor,                  # [R, Hq, D], one query per row (the row's last position)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,           # Int[R] keys visible, including this step's token
    block_tables: torch.Tensor,       # Int[R, max_blocks]
    scale: float,
    workspace: DecodeWorkspace | None = None,
    out: torch.Tensor | None = None,
    split_size: int = DECODE_SPLIT_SIZE,
    skip_rows: torch.Tensor | None = None,  # Int32[R]: rows with nonzero are skipped, their `out` untouched
    merge: str = "fused",
    rope: DecodeRope | None = None,
    settings: KernelSettings = DEFAULT_KERNEL_SETTINGS,
) -> torch.Tensor:
    """Split-KV decode attention with a fixed split size (module doc). Allocation-free with a workspace.

    merge="fused": the last split program of each (row, KV head) merges its heads (one launch);
    "kernel": a separate merge kernel (two launches). The same arithmetic in the same order: the same bits.
    rope: q is this step's query BEFORE RoPE, and `rope` holds the step's raw K, V, cos/sin and slots: the
    kernel rotates q and K with triton_fused's RoPE arithmetic and stores K and V at the slots before
    reading the cache, in this one launch: the output and the caches get the bits of
    triton_fused.rope_write_kv followed by this call without `rope`. Rows skip_rows leaves out get nothing
    written (the canonical kernel's `rope` writes theirs). settings: the launch's warps and stages
    (fast path only, no committed bit depends on them)."""
    triton, _, split_kernel, merge_kernel = _kernels()
    if merge not in ("fused", "kernel"):
        raise ValueError(f"merge must be 'fused' or 'kernel', got {merge!r}")
    if rope is not None:
        rope.check(q, k_cache)
    if split_size % DECODE_BLOCK_N:
        raise ValueError(f"split_size {split_size} must be a multiple of {DECODE_BLOCK_N}")
    block_size, num_kv_heads, group = check_cache(q, k_cache, v_cache)
    num_rows, num_heads, head_dim = q.shape
    if workspace is None:
        num_splits = decode_num_splits(block_tables.shape[1] * block_size, split_size)
        workspace = DecodeWorkspace(num_rows, num_heads, head_dim, num_splits, q.device)
    num_splits = workspace.num_splits
    if workspace.mid_o.shape[0] < num_rows or num_splits * split_size < block_tables.shape[1] * block_size:
        raise ValueError(f"workspace for {workspace.mid_o.shape[0]} rows x {num_splits} splits cannot hold "
                         f"{num_rows} rows x {block_tables.shape[1] * block_size} keys")
    mid_o, mid_lse = workspace.mid_o, workspace.mid_lse
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    block_d = max(16, next_pow2(head_dim))
    skip_rows = row_mask(skip_rows, num_rows)
    split_kernel[(num_rows, num_kv_heads, num_splits)](
        q, k_cache, v_cache, mid_o, mid_lse,
        seq_lens, block_tables, skip_rows,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.shape[1],
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out, workspace.done, out.stride(0), out.stride(1), workspace.done.stride(0),
        *rope_launch_args(rope, q, seq_lens),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, SPLIT=split_size,
        DOT_PRECISION=dot_precision(q), HAS_ROW_MASK=skip_rows is not None,
        NUM_SPLITS=num_splits, FUSED_MERGE=merge == "fused", MERGE_PAD=next_pow2(group),
        FUSE_ROPE=rope is not None,
        num_warps=settings.decode_num_warps, num_stages=settings.decode_num_stages,
    )
    if merge == "fused":
        return out
    merge_kernel[(num_rows, num_heads)](
        mid_o, mid_lse, out, skip_rows,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, HEAD_DIM=head_dim, BLOCK_D=block_d, HAS_ROW_MASK=skip_rows is not None,
        num_warps=1,
    )
    return out
