"""Triton paged attention for CUDA (bf16/fp16/fp32 caches).

Two kernels over the paged KV cache (per layer `k_cache, v_cache: [num_blocks, block_size, Hkv, D]`):

* `prefill_attention` — PREFILL and VERIFY passes. No split-KV. Query tiles and key tiles are both
  ABSOLUTELY aligned: a program owns query positions [t*BM, (t+1)*BM) of one row and one head, and
  walks key tiles [j*BN, (j+1)*BN) for j = 0, 1, … in increasing order with an online softmax, masking
  keys with position > query position. The tiles are grouped in absolute chunks of PREFILL_CHUNK keys:
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

* Canonical decode rows (`AttentionMetadata.canonical_rows`, the DVR rows of a DECODE pass; every row
  with decode="canonical"): the split kernels skip the flagged rows, then the prefill kernel's numerics
  run over the same rows with `only_rows`, where the programs of unflagged rows return before any work
  — as its GQA-packed one-query twin (engine.attention.triton_canonical_decode: one program per row, KV
  head and key chunk instead of per row and query head, checked bitwise equal on the device) or the
  prefill kernel. A flagged row thus gets bitwise the verifier's output for its position (a 1-query
  row is a window like any other), an unflagged row the split-KV output, and both launches have
  static grids (CUDA-graph capturable).

Triton is imported lazily: this module is importable on a CPU-only machine; calling a kernel there
raises (or runs under TRITON_INTERPRET=1 for tests).
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from engine.attention.metadata import AttentionMetadata, PassKind
from engine.attention.torch_backend import write_kv

# Canonical tile configuration of the no-split kernel. Changing any of these changes committed bits:
# it is part of the runtime identity (see `KERNEL_ID`).
# The query tile: 16 rows. A canonical decode row packs its GQA group into one tile, so at 64 rows 60 of them
# would be dead MMA rows (Llama-3.1-8B); on the H200 a 16-row tile runs dvr and batch_invariant faster than 64.
DEFAULT_QUERY_TILE = 16
PREFILL_BLOCK_M = DEFAULT_QUERY_TILE
PREFILL_BLOCK_N = 64
PREFILL_NUM_WARPS = 4
PREFILL_NUM_STAGES = 2
PREFILL_CHUNK = 256  # keys per absolute chunk, reduced alone then merged in order (a multiple of BLOCK_N)


# The query tile of plain PREFILL passes (TritonPagedAttention with decode="split": modes dvr and
# nondeterministic), or None for PREFILL_BLOCK_M. Only the verifier's kernels (verify passes, canonical decode)
# must share one tile: no committed bit needs a prompt's prefill to equal a verify pass over the same positions
# (DVR prompts, their rebuilds and their replays are all prefill passes), while mode batch_invariant (whose
# decode must equal its prefill) always keeps PREFILL_BLOCK_M. An experiment switch (off, not run on a GPU):
# the 16-row tile may cost long prompts' prefill, and 64 rows may suit it better. `set_prefill_pass_tile`,
# bench --prefill-pass-tile.
PREFILL_PASS_BLOCK_M: int | None = None


def canonical_kernel_id() -> str:
    """The verifier's kernels (and every kernel of mode batch_invariant): tile shapes and chunk."""
    return f"triton-paged-v2-m{PREFILL_BLOCK_M}n{PREFILL_BLOCK_N}w{PREFILL_NUM_WARPS}c{PREFILL_CHUNK}"


def _kernel_id() -> str:
    """canonical_kernel_id, and the plain prefill passes' tile where it differs (`-p<rows>`)."""
    p = PREFILL_PASS_BLOCK_M
    return canonical_kernel_id() + ("" if p is None or p == PREFILL_BLOCK_M else f"-p{p}")


KERNEL_ID = _kernel_id()
QUERY_TILES = (16, 32, 64)  # the query-tile heights set_query_tile accepts


def set_prefill_pass_tile(block_m: int | None) -> str:
    """Make plain PREFILL passes' query tile `block_m` rows (None: the canonical tile) for this process, and
    KERNEL_ID with it (a DVR prompt's first token and K/V come from a prefill pass, so its committed bits
    follow this tile). Call it before any kernel runs. Returns the new KERNEL_ID."""
    global PREFILL_PASS_BLOCK_M, KERNEL_ID
    if block_m is not None and block_m not in QUERY_TILES:
        raise ValueError(f"prefill pass tile must be None or one of {QUERY_TILES} rows, got {block_m}")
    PREFILL_PASS_BLOCK_M = block_m
    KERNEL_ID = _kernel_id()
    return KERNEL_ID


def set_query_tile(block_m: int) -> str:
    """Make the canonical kernels' query tile `block_m` rows (PREFILL_BLOCK_M) for this process, and KERNEL_ID
    with it: prefill, verify and canonical decode change their committed bits together, so transcripts made
    under one tile replay only under the same one (the fingerprint names it). DEFAULT_QUERY_TILE is 16: a
    canonical decode row packs its GQA group into one tile, so a 16-row tile carries
    12 dead MMA rows instead of 64's 60 (Llama-3.1-8B). Call it before any kernel runs (decode graphs
    capture the tile); the packed kernel's per-device check is keyed by the tile. Returns the new
    KERNEL_ID."""
    global PREFILL_BLOCK_M, KERNEL_ID
    if block_m not in QUERY_TILES:
        raise ValueError(f"query tile must be one of {QUERY_TILES} rows, got {block_m}")
    PREFILL_BLOCK_M = block_m
    KERNEL_ID = _kernel_id()
    return KERNEL_ID

DECODE_BLOCK_N = 64
# launch parameters of the split-KV decode kernel (fast path only: no committed bit depends on them);
# module constants so that bench/step_probe.py can sweep them
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2
DECODE_SPLIT_SIZE = 512  # keys per split (multiple of DECODE_BLOCK_N)
# the backend's default split size by padded batch (decode_split_for_rows): (at most this many rows, split)
DECODE_SPLITS_BY_ROWS = ((2, 64), (8, 128), (32, 256))
# RoPE and the K/V store inside the canonical (GQA-packed) decode kernel too, for decode steps with canonical
# rows (DVR) and every decode step of mode="batch_invariant" (forward_rope). Tested on the CPU (interpreter,
# bitwise against rope_write_kv + the kernel) and on the H200 (the gpu tests with it on and off). The gpu tests
# and the bench
# (--fuse-rope-canonical) switch it per run. With canonical rows the committed bits depend on it only through
# the K/V it stores, which the tests compare.
FUSE_ROPE_CANONICAL = True
# A verify pass's carried decode rows (AttentionMetadata.carried_rows) on the side stream, their canonical
# decode kernel beside the verify rows' prefill kernel (disjoint slices of one output; a CUDA graph captures
# the fork and join as two branches, as for a decode step's canonical rows). The same kernels on the same
# inputs: the same bits. Off, not run on a GPU; bench --concurrent-carried on|off.
CONCURRENT_CARRIED = False
_LOG2E = 1.4426950408889634


@functools.cache
def _kernels() -> tuple[ModuleType, object, object, object]:
    """Import triton (and compile on first launch) only when a kernel is first used."""
    import triton

    from engine.attention import triton_paged_kernels as k

    return triton, k._prefill_kernel, k._decode_split_kernel, k._decode_merge_kernel


def _check_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int]:
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


def _dot_precision(q: torch.Tensor) -> str | None:
    """fp32 caches get true fp32 products (Triton's default would be tf32); 16-bit inputs ignore it."""
    return "ieee" if q.dtype == torch.float32 else None


def _next_pow2(n: int) -> int:
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
    block_m: int | None = None,       # query tile rows; None: PREFILL_BLOCK_M (the verifier's)
) -> torch.Tensor:
    """Causal attention of each query over its row's cache, window- and batch-invariant (module doc)."""
    block_m = PREFILL_BLOCK_M if block_m is None else block_m
    triton, kernel, _, _ = _kernels()
    block_size, _, group = _check_cache(q, k_cache, v_cache)
    num_rows = seq_lens.shape[0]
    out = torch.empty_like(q) if out is None else out
    head_dim = q.shape[2]
    # +1: a window that starts mid-tile spans one more absolute query tile than its length suggests
    # (a single query never does)
    query_tiles = 1 if max_query_len <= 1 else triton.cdiv(max_query_len, block_m) + 1
    grid = (num_rows, query_tiles, q.shape[1])
    kernel[grid](
        q, k_cache, v_cache, out,
        query_start_loc, seq_lens, block_tables, _row_mask(only_rows, num_rows),
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0), block_tables.shape[1],
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, _next_pow2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=PREFILL_BLOCK_N, DOT_PRECISION=_dot_precision(q),
        HAS_ROW_MASK=only_rows is not None, CHUNK=PREFILL_CHUNK,
        num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES,
    )
    return out


def _row_mask(mask: torch.Tensor | None, num_rows: int) -> torch.Tensor | None:
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
) -> torch.Tensor:
    """Split-KV decode attention with a fixed split size (module doc). Allocation-free with a workspace.

    merge="fused": the last split program of each (row, KV head) merges its heads (one launch);
    "kernel": a separate merge kernel (two launches). The same arithmetic in the same order: the same bits.
    rope: q is this step's query BEFORE RoPE, and `rope` holds the step's raw K, V, cos/sin and slots: the
    kernel rotates q and K with triton_fused's RoPE arithmetic and stores K and V at the slots before
    reading the cache, in this one launch: the output and the caches get the bits of
    triton_fused.rope_write_kv followed by this call without `rope`. Rows skip_rows leaves out get nothing
    written (the canonical kernel's `rope` writes theirs)."""
    triton, _, split_kernel, merge_kernel = _kernels()
    if merge not in ("fused", "kernel"):
        raise ValueError(f"merge must be 'fused' or 'kernel', got {merge!r}")
    if rope is not None:
        rope.check(q, k_cache)
    if split_size % DECODE_BLOCK_N:
        raise ValueError(f"split_size {split_size} must be a multiple of {DECODE_BLOCK_N}")
    block_size, num_kv_heads, group = _check_cache(q, k_cache, v_cache)
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
    block_d = max(16, _next_pow2(head_dim))
    skip_rows = _row_mask(skip_rows, num_rows)
    split_kernel[(num_rows, num_kv_heads, num_splits)](
        q, k_cache, v_cache, mid_o, mid_lse,
        seq_lens, block_tables, skip_rows,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), block_tables.shape[1],
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out, workspace.done, out.stride(0), out.stride(1), workspace.done.stride(0),
        *rope_launch_args(rope, q, seq_lens),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, _next_pow2(group)),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=DECODE_BLOCK_N, SPLIT=split_size,
        DOT_PRECISION=_dot_precision(q), HAS_ROW_MASK=skip_rows is not None,
        NUM_SPLITS=num_splits, FUSED_MERGE=merge == "fused", MERGE_PAD=_next_pow2(group),
        FUSE_ROPE=rope is not None,
        num_warps=DECODE_NUM_WARPS, num_stages=DECODE_NUM_STAGES,
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


def _canonical_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TritonPlan,
                      scale: float, out: torch.Tensor | None, only_rows: torch.Tensor | None,
                      rope: DecodeRope | None = None) -> torch.Tensor:
    """One-query rows with the prefill kernel's bits: its GQA-packed twin where that is checked to give
    them on this device (engine.attention.triton_canonical_decode), the prefill kernel itself otherwise.
    `rope` (q before RoPE; the caller has checked use_packed) goes to the packed kernel."""
    from engine.attention import triton_canonical_decode as packed

    if rope is not None or packed.use_packed(q, k_cache):
        return packed.canonical_decode_attention(q, k_cache, v_cache, plan.seq_lens, plan.block_tables, scale,
                                                 out=out, only_rows=only_rows, rope=rope)
    return prefill_attention(q, k_cache, v_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables,
                             scale, 1, out=out, only_rows=only_rows)


@dataclass(frozen=True)
class TritonPlan:
    """Per-forward launch parameters, shared by every layer; built without a host sync for DECODE/VERIFY."""

    kind: PassKind
    slot_mapping: torch.Tensor     # Long[T]
    query_start_loc: torch.Tensor  # Int[R+1]
    seq_lens: torch.Tensor         # Int[R]
    block_tables: torch.Tensor     # Int[R, max_blocks]
    max_query_len: int
    one_query_per_row: bool        # DECODE with T == R: the split-KV decode kernel
    canonical_rows: torch.Tensor | None = None  # Int32[R] with one_query_per_row: 1 = the prefill kernel
    canonical_decode: bool = False  # decode="canonical", DECODE with T == R: every row the prefill kernel's bits
    # VERIFY with carried decode rows (AttentionMetadata.carried_rows): the plan of those last rows, one query
    # each, as a canonical decode step (the G verify rows before them keep this plan's prefill kernel)
    carried: TritonPlan | None = None


class TritonPagedAttention:
    """The attention-backend seam (plan / forward, as TorchAttention) on the Triton kernels above.

    DECODE steps are CUDA-graph capturable: `plan` reads only tensor shapes, and the split buffers
    come from a workspace kept for the backend's lifetime (grown, never freed, so captured graphs
    keep valid pointers).
    """

    name = "triton"

    @property
    def kernel_id(self) -> str:
        # the module's, which set_query_tile / set_prefill_pass_tile change; decode="canonical" (mode
        # batch_invariant) runs every pass at the canonical tile
        return canonical_kernel_id() if self.decode == "canonical" else KERNEL_ID
    # forward accepts k = v = None: this pass's K/V already sit in the cache at plan.slot_mapping (written by
    # the ops' rope_write_kv, in the RoPE launch), so the write_kv launches are skipped
    kv_prewritten = True

    def __init__(self, split_size: int | None = None, decode: str = "split", merge: str = "fused") -> None:
        """decode="split": the split-KV decode kernel (fast), except for the rows a DECODE pass flags in
        `canonical_rows`; "canonical": every decode query goes through the prefill/verify kernel, so the
        fast path's attention numerics equal the verifier's. merge: decode_attention's (same bits either way).
        split_size: keys per split of the split-KV kernel; None (the default) chooses it by the step's
        padded batch (decode_split_for_rows), an int fixes it for every batch (a row's split output then
        does not depend on its batch)."""
        if decode not in ("split", "canonical"):
            raise ValueError(f"decode must be 'split' or 'canonical', got {decode!r}")
        if merge not in ("fused", "kernel"):
            raise ValueError(f"merge must be 'fused' or 'kernel', got {merge!r}")
        self.split_size, self.decode, self.merge = split_size, decode, merge
        self.concurrent_canonical = True  # canonical decode rows on a side stream (see _side_stream)
        self._streams: dict[int | None, torch.cuda.Stream] = {}
        self._workspaces: dict[tuple, DecodeWorkspace] = {}
        self._retired: list[DecodeWorkspace] = []

    def plan(self, meta: AttentionMetadata, block_size: int) -> TritonPlan:
        num_tokens, num_rows = meta.num_tokens, meta.num_rows
        decode_shape = meta.kind is PassKind.DECODE and num_tokens == num_rows
        # a step whose flagged rows ask for it (canonical_step) runs every row canonical, like decode="canonical"
        whole = decode_shape and (self.decode == "canonical"
                                  or (meta.canonical_step and meta.canonical_rows is not None))
        one_per_row = decode_shape and not whole
        if decode_shape:
            max_q = 1
        elif meta.kind is PassKind.VERIFY and meta.verify_window:
            # packed: rows of 0 .. W tokens; a query's tiles are absolute, so its bits are the padded pass's
            if not 0 <= meta.carried_rows < num_rows:
                raise ValueError(f"VERIFY: {meta.carried_rows} carried rows of {num_rows}")
            max_q = meta.verify_window
        elif meta.kind is PassKind.VERIFY:
            d = meta.carried_rows
            if not 0 <= d < num_rows or (num_tokens - d) % (num_rows - d):
                raise ValueError(f"VERIFY rows must all hold W tokens (then {d} carried one-token rows): "
                                 f"{num_tokens} tokens in {num_rows} rows")
            max_q = (num_tokens - d) // (num_rows - d)
        elif num_rows == 1:
            max_q = num_tokens
        else:
            max_q = int((meta.query_start_loc[1:] - meta.query_start_loc[:-1]).max().item())
        # decode="canonical" already sends every decode row through the prefill kernel
        canonical = _row_mask(meta.canonical_rows, num_rows) if one_per_row else None
        slots = meta.slot_mapping.to(torch.long)
        carried = None
        if meta.kind is PassKind.VERIFY and meta.carried_rows:
            # the carried rows as a canonical decode step of their own (query starts rebased on the device)
            gv, tv = num_rows - meta.carried_rows, num_tokens - meta.carried_rows
            carried = TritonPlan(PassKind.DECODE, slots[tv:], meta.query_start_loc[gv:] - tv, meta.seq_lens[gv:],
                                 meta.block_tables[gv:], 1, False, None, canonical_decode=True)
        return TritonPlan(meta.kind, slots, meta.query_start_loc, meta.seq_lens,
                          meta.block_tables, max_q, one_per_row, canonical,
                          canonical_decode=whole, carried=carried)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The stream canonical decode rows run on, beside the split kernel on the current stream (both
        write disjoint rows of one output; a CUDA graph captures the fork and join as two branches). The
        kernels and their inputs are the same as on one stream, so are the bits. None off CUDA."""
        if device.type != "cuda" or not self.concurrent_canonical:
            return None
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        return stream

    def workspace(self, num_rows: int, num_heads: int, head_dim: int, num_splits: int,
                  device: torch.device) -> DecodeWorkspace:
        key = (str(device), num_heads, head_dim, num_splits)
        ws = self._workspaces.get(key)
        if ws is None or ws.mid_o.shape[0] < num_rows:
            if ws is not None:
                self._retired.append(ws)  # a captured graph may still point at it
            # 64 rows at least (eager steps of other batch sizes reuse it), fewer for many short splits
            # (batch-1 graphs of a long-context family: 512 splits of 64 keys)
            floor = 64 if num_splits <= 64 else 8
            ws = DecodeWorkspace(max(num_rows, floor, 2 * ws.mid_o.shape[0] if ws is not None else 0),
                                 num_heads, head_dim, num_splits, device)
            self._workspaces[key] = ws
        return ws

    def forward_rope(
        self,
        q: torch.Tensor,        # [T, Hq, D], before RoPE (a strided view of the qkv output is fine)
        k: torch.Tensor,        # [T, Hkv, D], before RoPE
        v: torch.Tensor,
        cos_sin: torch.Tensor,  # [T, 2, D]: cos, sin of each token's position, in q's dtype
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TritonPlan,
        scale: float,
    ) -> torch.Tensor | None:   # [T, Hq, D], or None
        """`forward` of q and k before RoPE, for a pass where this backend can rotate them and write K/V
        inside its attention launch: a DECODE step whose rows all take the split-KV kernel (no canonical
        rows). The split kernel then applies triton_fused's RoPE arithmetic to q and K and stores K and V
        at plan.slot_mapping itself (decode_attention's `rope`), one launch a layer fewer than
        rope_write_kv + forward, with the same bits (output and caches). With FUSE_ROPE_CANONICAL also a
        DECODE step with canonical rows, or of decode="canonical", where the packed canonical kernel serves
        them (use_packed): each kernel rotates and stores its own rows. Any other pass: None, having
        touched nothing (the caller ropes and writes as usual). The model calls it only where its ops'
        RoPE is triton_fused's (Ops.triton_rope), so the arithmetic is the ops' own."""
        if not (plan.one_query_per_row or plan.canonical_decode):
            return None
        if plan.canonical_decode or plan.canonical_rows is not None:  # rows for the canonical kernel
            from engine.attention import triton_canonical_decode as packed

            # off, or the prefill kernel serves them (it reads K/V already written): the caller's path
            if not FUSE_ROPE_CANONICAL or not packed.use_packed(q, k_cache):
                return None
        rope = DecodeRope(k, v, cos_sin, plan.slot_mapping)
        if plan.canonical_decode:
            return _canonical_decode(q, k_cache, v_cache, plan, scale, None, None, rope)
        return self._split_decode(q, k_cache, v_cache, plan, scale, rope)

    def _split_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TritonPlan,
                      scale: float, rope: DecodeRope | None) -> torch.Tensor:
        """A DECODE step of one query per row: the split-KV kernel, and the canonical kernel for the rows
        plan.canonical_rows flags (on a side stream where there is one). With `rope`, q is before RoPE and
        each kernel rotates and stores its own rows' K/V (the canonical rows through the packed kernel)."""
        split_size = self.split_size or decode_split_for_rows(q.shape[0])
        splits = decode_num_splits(plan.block_tables.shape[1] * k_cache.shape[1], split_size)
        ws = self.workspace(q.shape[0], q.shape[1], q.shape[2], splits, q.device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

        def split() -> None:
            decode_attention(q, k_cache, v_cache, plan.seq_lens, plan.block_tables, scale,
                             workspace=ws, out=out, split_size=split_size, skip_rows=plan.canonical_rows,
                             merge=self.merge, rope=rope)

        if plan.canonical_rows is None:
            split()
        else:  # the canonical rows on a second stream, concurrent with the split rows
            self._beside(q.device, True, split,
                         lambda: _canonical_decode(q, k_cache, v_cache, plan, scale, out, plan.canonical_rows, rope))
        return out

    def _beside(self, device: torch.device, concurrent: bool, main: Callable[[], object],
                beside: Callable[[], object]) -> None:
        """`beside` on the side stream concurrently with `main` on the current one (fork before, join after)
        where `concurrent` and there is a side stream (_side_stream); else `main`, then `beside`. The two
        write disjoint outputs; the kernels and their inputs are the same either way, so are the bits."""
        side = self._side_stream(device) if concurrent else None
        if side is None:
            main()
            beside()
            return
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            beside()
        main()
        current.wait_stream(side)

    def forward(
        self,
        q: torch.Tensor,        # [T, Hq, D]
        k: torch.Tensor | None,  # [T, Hkv, D]; None with v: already written to plan.slot_mapping (kv_prewritten)
        v: torch.Tensor | None,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: TritonPlan,
        scale: float,
    ) -> torch.Tensor:          # [T, Hq, D]
        if k is not None or v is not None:
            if k is None or v is None:
                raise ValueError("k and v are written together: pass both, or neither (kv_prewritten)")
            write_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        q = q.contiguous()
        if plan.one_query_per_row:
            return self._split_decode(q, k_cache, v_cache, plan, scale, None)
        if plan.canonical_decode:
            return _canonical_decode(q, k_cache, v_cache, plan, scale, None, None)
        if plan.carried is not None:
            # a verify pass carrying decode rows: the G rows of W tokens through the prefill kernel as in any
            # verify pass (its grid and each row's arithmetic do not see the carried rows), then the carried
            # rows through the canonical decode kernel; disjoint slices of one output
            d = plan.carried.seq_lens.shape[0]
            tv, gv = q.shape[0] - d, plan.seq_lens.shape[0] - d
            out = torch.empty_like(q)
            self._beside(q.device, CONCURRENT_CARRIED,
                         lambda: prefill_attention(q[:tv], k_cache, v_cache, plan.query_start_loc[: gv + 1],
                                                   plan.seq_lens[:gv], plan.block_tables[:gv], scale,
                                                   plan.max_query_len, out=out[:tv]),
                         lambda: _canonical_decode(q[tv:], k_cache, v_cache, plan.carried, scale, out[tv:], None))
            return out
        # plain prefill passes may take their own tile (PREFILL_PASS_BLOCK_M); verify passes and every pass of
        # decode="canonical" keep the verifier's
        block_m = PREFILL_PASS_BLOCK_M if plan.kind is PassKind.PREFILL and self.decode == "split" else None
        return prefill_attention(q, k_cache, v_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables,
                                 scale, plan.max_query_len, block_m=block_m)
