"""Fixed-split-size paged attention in Triton (two stages), CUDA only; imported lazily.

Stage 1, grid (T, Hq, max_splits): program (t, h, c) reduces query t, head h over the absolute key
chunk [c*S, min((c+1)*S, pos_t+1)) in sub-blocks of BLOCK_N keys (online softmax, fp32) and writes
(max, sum of exp, weighted V). Stage 2, grid (T, Hq): combines the query's own chunks 0…pos_t // S in
increasing order. Both loops are bounded by the query's position, never by the batch, so a query's
bits depend only on its position and the cache contents (see engine/kernels/attention.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 32


@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, rows_ptr, pos_ptr, mid_ml_ptr, mid_acc_ptr,
    scale, D,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_tr,
    stride_ml_t, stride_ml_h, stride_ml_c,
    stride_acc_t, stride_acc_h, stride_acc_c,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    row = tl.load(rows_ptr + t)
    pos = tl.load(pos_ptr + t)
    kv_h = h // GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + offs_d, mask=d_mask, other=0.0).to(tl.float32)

    e_max = float("-inf")
    e_sum = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    chunk_start = c * SPLIT
    chunk_end = tl.minimum(chunk_start + SPLIT, pos + 1)
    for start in range(chunk_start, chunk_end, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute key positions
        valid = offs_n < chunk_end
        block = tl.load(tables_ptr + row * stride_tr + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        slot = offs_n % BLOCK_SIZE
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(
            k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_h * stride_kh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        qk = tl.sum(k * q[None, :], axis=1) * scale  # [BLOCK_N]
        qk = tl.where(valid, qk, float("-inf"))
        v = tl.load(
            v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_h * stride_vh + offs_d[None, :],
            mask=kv_mask, other=0.0,
        ).to(tl.float32)
        n_max = tl.maximum(tl.max(qk, axis=0), e_max)  # finite: every sub-block has a valid key
        re_scale = tl.exp(e_max - n_max)
        p = tl.exp(qk - n_max)
        acc = acc * re_scale + tl.sum(p[:, None] * v, axis=0)
        e_sum = e_sum * re_scale + tl.sum(p, axis=0)
        e_max = n_max

    ml = mid_ml_ptr + t * stride_ml_t + h * stride_ml_h + c * stride_ml_c
    tl.store(ml, e_max)
    tl.store(ml + 1, e_sum)
    tl.store(mid_acc_ptr + t * stride_acc_t + h * stride_acc_h + c * stride_acc_c + offs_d, acc, mask=d_mask)


@triton.jit
def _combine_kernel(
    pos_ptr, mid_ml_ptr, mid_acc_ptr, out_ptr, D,
    stride_ml_t, stride_ml_h, stride_ml_c,
    stride_acc_t, stride_acc_h, stride_acc_c,
    stride_ot, stride_oh,
    SPLIT: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    ml = mid_ml_ptr + t * stride_ml_t + h * stride_ml_h
    accs = mid_acc_ptr + t * stride_acc_t + h * stride_acc_h
    m = tl.load(ml)  # chunk 0 always exists (key 0 <= pos)
    s = tl.load(ml + 1)
    acc = tl.load(accs + offs_d, mask=d_mask, other=0.0)
    for c in range(1, pos // SPLIT + 1):
        m_c = tl.load(ml + c * stride_ml_c)
        s_c = tl.load(ml + c * stride_ml_c + 1)
        acc_c = tl.load(accs + c * stride_acc_c + offs_d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, m_c)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(m_c - m_new)
        s = s * alpha + s_c * beta
        acc = acc * alpha + acc_c * beta
        m = m_new
    out = acc / s
    tl.store(out_ptr + t * stride_ot + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def triton_paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [R, max_blocks]
    rows: torch.Tensor,  # [T]
    positions: torch.Tensor,  # [T]
    scale: float,
    split_size: int,
    max_position: int,
) -> torch.Tensor:
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q and the KV cache need a unit stride on head_dim")
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_splits = max_position // split_size + 1  # launch width only; programs past a query's chunk idle
    mid_ml = torch.empty((num_tokens, num_heads, num_splits, 2), device=q.device, dtype=torch.float32)
    mid_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim), device=q.device, dtype=torch.float32)
    tables = block_tables.to(torch.int32).contiguous()
    rows32 = rows.to(torch.int32).contiguous()
    pos32 = positions.to(torch.int32).contiguous()
    block_d = triton.next_power_of_2(head_dim)
    _split_kernel[(num_tokens, num_heads, num_splits)](
        q, k_cache, v_cache, tables, rows32, pos32, mid_ml, mid_acc,
        scale, head_dim,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        tables.stride(0),
        mid_ml.stride(0), mid_ml.stride(1), mid_ml.stride(2),
        mid_acc.stride(0), mid_acc.stride(1), mid_acc.stride(2),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, SPLIT=split_size,
        BLOCK_N=_BLOCK_N, BLOCK_D=block_d,
    )
    _combine_kernel[(num_tokens, num_heads)](
        pos32, mid_ml, mid_acc, out, head_dim,
        mid_ml.stride(0), mid_ml.stride(1), mid_ml.stride(2),
        mid_acc.stride(0), mid_acc.stride(1), mid_acc.stride(2),
        out.stride(0), out.stride(1),
        SPLIT=split_size, BLOCK_D=block_d,
    )
    return out
