"""Canonical decode attention, GQA-packed: the prefill/verify kernel's bits for one-query rows, faster.

A canonical decode row (a DVR row of a decode step, every row under mode="batch_invariant" or
decode="canonical") must get exactly the bits `triton_paged._prefill_kernel` gives its query. That
kernel runs one program per (row, query head) with a [BLOCK_M, BLOCK_N] tile (KernelSettings.query_tile
x 64) of which one MMA row is live, so a GQA group's K/V tiles are read once per query head and the grid
is R x Hq.

Here one program per (row, KV head) puts the GROUP query heads of that KV head in MMA rows 0..GROUP-1
of the same tile shape (same warps, stages, key tiles in the same absolute order, the same
online-softmax expressions), so each K/V tile is read once per group and the grid is R x Hkv. A live
row's arithmetic is the prefill kernel's: the two differ only in which MMA row holds the query, and
an MMA row's result does not depend on its index or on the other rows. That is a property of the
hardware, so it is checked, not assumed: `packed_matches_prefill` compares the two kernels once per
device and dtype, and the backend uses this kernel only where they agree bitwise (tests compare them too).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention import triton_paged as tp
from engine.config import (DEFAULT_KERNEL_SETTINGS, PREFILL_BLOCK_N, PREFILL_NUM_STAGES, PREFILL_NUM_WARPS,
                           KernelSettings)
from engine.attention.triton_paged_kernels import load_kv_tile, merge_chunk, rope_lanes, rope_q, rope_store_kv

_CHECKED: dict[tuple, bool] = {}  # check_key(...) -> agrees

# Programs per (row, KV head) = P: program p reduces key chunks p, p + P, p + 2P, ... of its row, so the grid
# is R x Hkv x P rather than one program per chunk of the table's width. A captured graph's table is as wide
# as its family's longest row (4096 or 8192 keys: 16 or 32 chunks) while most rows hold a chunk or two, and
# a program past its row's keys still costs a launch: R x Hkv x 32 of them on a verify pass's 64 carried
# rows (16384 programs a layer, 512 with work). P is chosen so that R x Hkv x P reaches `programs`
# (KernelSettings.chunk_programs; capped at the table's chunk count: a small batch keeps one program per
# chunk); 0 keeps one program per chunk. Each chunk's arithmetic and the merge order are the same for any P,
# so the bits do not depend on it (tests compare P = 1 .. chunks against the prefill kernel).


def chunk_programs(num_rows: int, num_kv_heads: int, num_chunks: int,
                   programs: int = DEFAULT_KERNEL_SETTINGS.chunk_programs) -> int:
    """P of a launch aiming at `programs` programs: a function of the grid's static shape, never of the rows'
    lengths (a captured graph keeps it)."""
    if programs <= 0:
        return num_chunks
    return max(1, min(num_chunks, -(-programs // max(1, num_rows * num_kv_heads))))


def check_key(device: torch.device | str, dtype: torch.dtype, group: int, head_dim: int,
              settings: KernelSettings) -> tuple:
    """The key of `packed_matches_prefill`'s per-process result: device, dtype, head shape, and the query tile
    and chunk, since the packed kernel copies the prefill kernel's."""
    return (str(device), dtype, group, head_dim, settings.query_tile, settings.chunk)


@triton.jit
def _canonical_decode_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    seq_lens_ptr, bt_ptr, row_mask_ptr,
    mid_m_ptr, mid_l_ptr, mid_acc_ptr, cnt_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt, table_cols,
    stride_ml_t, stride_ml_h, stride_ma_t, stride_ma_h, stride_ma_c, stride_cnt,
    kraw_ptr, vraw_ptr, cs_ptr, slot_ptr, stride_krt, stride_krh, stride_vrt, stride_vrh, stride_cst, stride_csw,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr, CHUNK: tl.constexpr, FUSE_ROPE: tl.constexpr,
):
    r = tl.program_id(0)
    if HAS_ROW_MASK:  # only flagged rows run; the others keep the split-KV output
        if tl.load(row_mask_ptr + r) == 0:
            return
    kvh = tl.program_id(1)
    cp = tl.program_id(2)                                    # chunks cp, cp + P, cp + 2P, ... (P = grid dim 2)
    n_progs = tl.num_programs(2)
    seq_len = tl.load(seq_lens_ptr + r)
    n_chunks = tl.cdiv(seq_len, CHUNK)
    if cp >= n_chunks:  # past the row's keys: no work, not counted
        return
    mine = tl.cdiv(n_chunks - cp, n_progs)                  # how many chunks this program reduces
    mrow = tl.arange(0, BLOCK_M)                            # MMA row i < GROUP: query head kvh*GROUP + i
    live = mrow < GROUP
    heads = kvh * GROUP + mrow
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    if FUSE_ROPE:  # q before RoPE: rotate it here, and store this step's K/V (as the split kernel's FUSE_ROPE)
        lo, partner, cos, sin = rope_lanes(cs_ptr, r, stride_cst, stride_csw, offs_d, d_mask, HEAD_DIM)
        q = rope_q(q_ptr + r * stride_qt + heads[:, None] * stride_qh, live[:, None] & d_mask[None, :], lo, partner,
                   cos, sin, offs_d)
        q = q.to(k_ptr.dtype.element_ty)  # [BM, BD]
        if (n_chunks - 1) % n_progs == cp:  # the program whose chunks include the one holding this step's key
            rope_store_kv(kraw_ptr, vraw_ptr, r, stride_krt, stride_krh, stride_vrt, stride_vrh, lo, partner, cos, sin,
                          slot_ptr, k_ptr, v_ptr, kvh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          offs_d, d_mask, BLOCK_SIZE)
        tl.debug_barrier()  # the stores before any thread's tile loads
    else:
        q = tl.load(q_ptr + r * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=live[:, None] & d_mask[None, :], other=0.0).to(k_ptr.dtype.element_ty)  # [BM, BD]

    tiles_per_chunk: tl.constexpr = CHUNK // BLOCK_N
    pos = seq_len - 1
    num_tiles = tl.cdiv(seq_len, BLOCK_N)
    out_mask = live[:, None] & d_mask[None, :]
    for c in range(cp, n_chunks, n_progs):
        # the prefill kernel's chunk loop body, with every live row's query at position `pos`
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for kt in range(c * tiles_per_chunk, tl.minimum(c * tiles_per_chunk + tiles_per_chunk, num_tiles)):
            kpos = kt * BLOCK_N + tl.arange(0, BLOCK_N)
            k_valid = kpos < seq_len
            k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr, r, stride_bt, table_cols, kpos, k_valid, kvh, offs_d, d_mask,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            causal = (kpos[None, :] <= (pos + 0 * mrow)[:, None]) & k_valid[None, :]
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        if n_chunks == 1:  # the whole row in this program: merge into the empty total, as the prefill kernel
            m_run, l_run, acc_run = merge_chunk(tl.full([BLOCK_M], float("-inf"), tl.float32),
                                                tl.zeros([BLOCK_M], tl.float32),
                                                tl.zeros([BLOCK_M, BLOCK_D], tl.float32), m_i, l_i, acc)
            out = acc_run / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
            tl.store(o_ptr + r * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=out_mask)
        else:  # park this chunk's (max, sum, acc) for the merge
            tl.store(mid_m_ptr + r * stride_ml_t + heads * stride_ml_h + c, m_i, mask=live)
            tl.store(mid_l_ptr + r * stride_ml_t + heads * stride_ml_h + c, l_i, mask=live)
            tl.store(mid_acc_ptr + r * stride_ma_t + heads[:, None] * stride_ma_h + c * stride_ma_c
                     + offs_d[None, :], acc, mask=out_mask)
    if n_chunks > 1:
        # the program that counts the row's last chunks (per KV head) merges them in increasing chunk order.
        # Ordering (CUTLASS's semaphore pattern): the barrier puts every thread's stores before the acq_rel
        # atomic; the merging program's barrier after its atomic puts the acquire before its loads, which
        # bypass L1 (.cg). No program waits on another.
        tl.debug_barrier()
        cnt = cnt_ptr + r * stride_cnt + kvh
        done = tl.atomic_add(cnt, mine, sem="acq_rel", scope="gpu")
        if done + mine == n_chunks:
            tl.debug_barrier()
            g_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
            s_run = tl.zeros([BLOCK_M], tl.float32)
            a_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            for j in range(0, n_chunks):  # increasing chunk order, as the prefill kernel
                g_j = tl.load(mid_m_ptr + r * stride_ml_t + heads * stride_ml_h + j, mask=live,
                              other=float("-inf"), cache_modifier=".cg")
                s_j = tl.load(mid_l_ptr + r * stride_ml_t + heads * stride_ml_h + j, mask=live, other=0.0,
                              cache_modifier=".cg")
                a_j = tl.load(mid_acc_ptr + r * stride_ma_t + heads[:, None] * stride_ma_h + j * stride_ma_c
                              + offs_d[None, :], mask=out_mask, other=0.0, cache_modifier=".cg")
                g_run, s_run, a_run = merge_chunk(g_run, s_run, a_run, g_j, s_j, a_j)
            res = a_run / tl.where(s_run == 0.0, 1.0, s_run)[:, None]
            tl.store(o_ptr + r * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                     res.to(o_ptr.dtype.element_ty), mask=out_mask)
            tl.store(cnt, 0)  # every chunk of this launch has been counted: ready for the next launch


class ChunkWorkspace:
    """Partial results of the chunk programs and their counters, preallocated (CUDA-graph capturable)."""

    def __init__(self, max_rows: int, num_heads: int, num_kv_heads: int, num_chunks: int, head_dim: int,
                 device: torch.device | str) -> None:
        self.num_chunks = num_chunks
        self.mid_m = torch.empty(max_rows, num_heads, num_chunks, dtype=torch.float32, device=device)
        self.mid_l = torch.empty(max_rows, num_heads, num_chunks, dtype=torch.float32, device=device)
        self.mid_acc = torch.empty(max_rows, num_heads, num_chunks, head_dim, dtype=torch.float32, device=device)
        self.cnt = torch.zeros(max_rows, num_kv_heads, dtype=torch.int32, device=device)  # the merger resets it


_WORKSPACES: dict[tuple, ChunkWorkspace] = {}
_RETIRED: list[ChunkWorkspace] = []  # a captured graph may still point at an outgrown workspace


def workspace(num_rows: int, num_heads: int, num_kv_heads: int, num_chunks: int, head_dim: int,
              device: torch.device) -> ChunkWorkspace:
    """A workspace with room for at least `num_rows` rows and `num_chunks` chunks (the kernel indexes it by
    strides, so a larger one serves), one per device and head shape, kept for the process. It grows by
    doubling, so eager passes of many table widths allocate O(log) times, not once per width."""
    key = (str(device), num_heads, num_kv_heads, head_dim)
    ws = _WORKSPACES.get(key)
    if ws is None or ws.mid_m.shape[0] < num_rows or ws.num_chunks < num_chunks:
        rows, chunks = max(num_rows, 64), num_chunks
        if ws is not None:
            _RETIRED.append(ws)  # a captured graph may still point at it
            old_rows, old_chunks = ws.mid_m.shape[0], ws.num_chunks
            rows = max(rows, old_rows if old_rows >= num_rows else 2 * old_rows)
            chunks = max(chunks, old_chunks if old_chunks >= num_chunks else 2 * old_chunks)
        ws = ChunkWorkspace(rows, num_heads, num_kv_heads, chunks, head_dim, device)
        _WORKSPACES[key] = ws
    return ws


def canonical_decode_attention(
    q: torch.Tensor,                  # [R, Hq, D]: one query per row, at position seq_lens[r] - 1
    k_cache: torch.Tensor,            # [num_blocks, block_size, Hkv, D] (this step's K/V already written)
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,           # Int[R]
    block_tables: torch.Tensor,       # Int[R, max_blocks]
    scale: float,
    out: torch.Tensor | None = None,
    only_rows: torch.Tensor | None = None,  # Int32[R]: rows with 0 return at once, their `out` untouched
    rope: tp.DecodeRope | None = None,
    settings: KernelSettings = DEFAULT_KERNEL_SETTINGS,
) -> torch.Tensor:
    """The prefill kernel's output for each row's one query: P programs per (row, KV head) share its key
    chunks (`chunk_programs`), the chunks merged in order by the program that counts the last of them. Allocation-free after the first call per shape.
    rope: q is before RoPE, and the kernel rotates q and K and stores K/V at rope.slots first, as
    triton_paged.decode_attention's `rope` (the bits of rope_write_kv then this call); rows `only_rows`
    leaves out get nothing written. settings: the prefill kernel's tile and chunk whose bits it gives, and
    the programs per launch it aims at."""
    block_m = settings.query_tile
    block_size, num_kv_heads, group = tp.check_cache(q, k_cache, v_cache)
    if rope is not None:
        rope.check(q, k_cache)
    if group > block_m:
        raise ValueError(f"GQA group {group} does not fit a {block_m}-row tile")
    num_rows, num_heads, head_dim = q.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    only_rows = tp.row_mask(only_rows, num_rows)
    rope_args = tp.rope_launch_args(rope, q, seq_lens)
    num_chunks = max(1, -(-block_tables.shape[1] * block_size // settings.chunk))  # static: the table width
    ws = workspace(num_rows, num_heads, num_kv_heads, num_chunks, head_dim, q.device)
    grid = (num_rows, num_kv_heads, chunk_programs(num_rows, num_kv_heads, num_chunks, settings.chunk_programs))
    _canonical_decode_kernel[grid](
        q, k_cache, v_cache, out,
        seq_lens, block_tables, only_rows,
        ws.mid_m, ws.mid_l, ws.mid_acc, ws.cnt,
        scale * tp.LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0), block_tables.shape[1],
        ws.mid_m.stride(0), ws.mid_m.stride(1), ws.mid_acc.stride(0), ws.mid_acc.stride(1), ws.mid_acc.stride(2),
        ws.cnt.stride(0),
        *rope_args,
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=max(16, tp.next_pow2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=PREFILL_BLOCK_N, DOT_PRECISION=tp.dot_precision(q),
        HAS_ROW_MASK=only_rows is not None, CHUNK=settings.chunk, FUSE_ROPE=rope is not None,
        num_warps=PREFILL_NUM_WARPS, num_stages=PREFILL_NUM_STAGES,
    )
    return out


def packed_matches_prefill(device: torch.device, dtype: torch.dtype, group: int, head_dim: int,
                           settings: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> bool:
    """Whether this kernel gives the prefill kernel's bits here (once per device, dtype, group, head_dim):
    random cache, 3 KV heads, rows whose queries sit at every MMA row index of the prefill tile and past
    one key tile, at the settings' tile and chunk. Never called under CUDA-graph capture (it syncs): see
    `use_packed`."""
    key = check_key(device, dtype, group, head_dim, settings)
    if key not in _CHECKED:
        g = torch.Generator(device="cpu").manual_seed(20261129)
        hkv, bs = 3, 16
        lens = list(range(1, 66)) + [127, 128, 129, 200, 256, 257, 700, 1025]
        nb = -(-max(lens) // bs)
        k_cache = torch.randn(len(lens) * nb + 1, bs, hkv, head_dim, generator=g).to(dtype).to(device)
        v_cache = torch.randn(len(lens) * nb + 1, bs, hkv, head_dim, generator=g).to(dtype).to(device)
        q = torch.randn(len(lens), hkv * group, head_dim, generator=g).to(dtype).to(device)
        tables = (1 + torch.randperm(len(lens) * nb, generator=g)).view(len(lens), nb).to(torch.int32).to(device)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=device)
        ref = tp.prefill_attention(q, k_cache, v_cache, qsl, seq_lens, tables, head_dim**-0.5, 1, settings=settings)
        got = canonical_decode_attention(q, k_cache, v_cache, seq_lens, tables, head_dim**-0.5, settings=settings)
        _CHECKED[key] = bool(torch.equal(ref, got))
    return _CHECKED[key]


def use_packed(q: torch.Tensor, k_cache: torch.Tensor, settings: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> bool:
    """The packed kernel where it is checked equal to the prefill kernel under `settings`; the prefill kernel
    otherwise (also under a CUDA-graph capture on a device not yet checked: both give the prefill kernel's
    bits)."""
    group, head_dim = q.shape[1] // k_cache.shape[2], q.shape[2]
    if group > settings.query_tile:
        return False
    key = check_key(q.device, q.dtype, group, head_dim, settings)
    if key not in _CHECKED and q.is_cuda and torch.cuda.is_current_stream_capturing():
        return False
    return packed_matches_prefill(q.device, q.dtype, group, head_dim, settings)
