"""Paged attention with a FIXED SPLIT SIZE: batch invariant by construction.

Split-KV kernels usually pick a split *count* from the batch size (few rows → many splits to fill the
GPU), which changes each query's reduction order with the load. Here the split *size* is fixed: keys are
cut into chunks [c*S, (c+1)*S) of absolute positions, each chunk gives (max, sum of exp, weighted V) in
fp32, and the chunks are combined by online softmax in increasing c. A query's reduction therefore
depends only on its own position and the cache contents — never on the batch, its row, or other rows'
lengths.

Layout (the model seam's):
  q            [T, Hq, D]
  k/v_cache    [num_blocks, block_size, Hkv, D]   (Hq % Hkv == 0, GQA)
  block_tables [R, max_blocks]  int               (padding entries → block 0)
  seq_lens     [R]              int               (keys visible to the row's LAST query)
  query_start_loc [R+1] | None                    (None: decode, one query per row, T == R)
Row r's queries are its last n_r positions: seq_lens[r]-n_r … seq_lens[r]-1; a query at position p
sees keys 0…p.

The CPU path here processes queries in tiles of TILE_ROWS (fixed shape again) and, for each tile, the
chunks up to the tile's largest position. A chunk lying wholly after a query's position is an exact
no-op in the combine (scale exp(0) = 1, contribution exactly 0), so the tile's other queries cannot
change a query's bits.
"""

from __future__ import annotations

import math

import torch

from engine.kernels.tiles import TILE_ROWS

DEFAULT_SPLIT_SIZE = 256


def query_layout(
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor | None, num_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row of each query [T] long, absolute position of each query [T] long)."""
    seq_lens = seq_lens.long()
    num_rows = seq_lens.shape[0]
    if query_start_loc is None:
        if num_tokens != num_rows:
            raise ValueError(f"decode layout needs one query per row: T={num_tokens}, R={num_rows}")
        return torch.arange(num_rows, device=seq_lens.device), seq_lens - 1
    qsl = query_start_loc.long()
    if qsl.shape[0] != num_rows + 1 or int(qsl[-1]) != num_tokens:
        raise ValueError(
            f"query_start_loc must be [R+1]={num_rows + 1} ending at T={num_tokens}, got {qsl.tolist()}"
        )
    counts = qsl[1:] - qsl[:-1]  # [R] queries per row
    rows = torch.repeat_interleave(torch.arange(num_rows, device=qsl.device), counts)  # [T]
    offset = torch.arange(num_tokens, device=qsl.device) - qsl[rows]  # index within the row
    positions = seq_lens[rows] - counts[rows] + offset
    if num_tokens and int(positions.min()) < 0:
        raise ValueError("a row has more queries than visible keys (seq_lens too small)")
    return rows, positions


def check_shapes(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor
) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"bad shapes q={tuple(q.shape)} k={tuple(k_cache.shape)} v={tuple(v_cache.shape)}")
    if q.shape[-1] != k_cache.shape[-1] or q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"q heads/dim {tuple(q.shape[1:])} do not fit kv heads/dim {tuple(k_cache.shape[2:])}")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [R, max_blocks], got {tuple(block_tables.shape)}")


def tile_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    split_size: int = DEFAULT_SPLIT_SIZE,
) -> torch.Tensor:
    """Fixed-split-size attention from fixed-shape torch calls; returns [T, Hq, D] in q's dtype."""
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q)
    for start in range(0, num_tokens, TILE_ROWS):
        n = min(TILE_ROWS, num_tokens - start)
        q_t = q.new_zeros((TILE_ROWS, num_heads, head_dim))  # [16, Hq, D]; padding queries at position 0
        q_t[:n] = q[start : start + n]
        rows_t = rows.new_zeros(TILE_ROWS)
        rows_t[:n] = rows[start : start + n]
        pos_t = positions.new_zeros(TILE_ROWS)
        pos_t[:n] = positions[start : start + n]
        out[start : start + n] = _attend_tile(
            q_t, k_cache, v_cache, block_tables[rows_t], pos_t, scale, split_size
        )[:n].to(q.dtype)
    return out


def _attend_tile(
    q: torch.Tensor,  # [16, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,  # [16, max_blocks]
    positions: torch.Tensor,  # [16]
    scale: float,
    split_size: int,
) -> torch.Tensor:
    tile, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    # GQA without copying K/V per query head: query heads h = kv * group + g share kv head `kv`.
    qf = q.float().view(tile, num_kv_heads, group, head_dim)  # [16, Hkv, G, D]
    m = torch.full((tile, num_kv_heads, group, 1), -math.inf, device=q.device)  # running max
    l = torch.zeros((tile, num_kv_heads, group, 1), device=q.device)  # running sum of exp
    acc = torch.zeros((tile, num_kv_heads, group, head_dim), device=q.device)  # running weighted V
    num_chunks = int(positions.max()) // split_size + 1
    for c in range(num_chunks):
        key_pos = c * split_size + torch.arange(split_size, device=q.device)  # [S] absolute
        valid = key_pos[None, :] <= positions[:, None]  # [16, S]
        block_idx = (key_pos // block_size).clamp(max=tables.shape[1] - 1)
        # Masked keys read the reserved zero block 0, so stale slots never reach p @ v (0 * NaN).
        phys = torch.where(valid, tables[:, block_idx].long(), 0)  # [16, S]
        slot = (key_pos % block_size)[None, :]
        k = k_cache[phys, slot].float().permute(0, 2, 3, 1)  # [16, Hkv, D, S]
        v = v_cache[phys, slot].float().transpose(1, 2)  # [16, Hkv, S, D]
        scores = (qf @ k) * scale  # [16, Hkv, G, S]
        scores.masked_fill_(~valid[:, None, None, :], -math.inf)
        m_c = scores.amax(dim=-1, keepdim=True)  # [16, Hkv, G, 1]; -inf where the chunk is all masked
        p = torch.exp(scores - torch.where(m_c == -math.inf, 0.0, m_c))
        m_new = torch.maximum(m, m_c)  # finite: chunk 0 always holds key 0 <= position
        alpha = torch.exp(m - m_new)  # 1 exactly when this chunk does not raise the max
        beta = torch.exp(m_c - m_new)  # 0 exactly for a fully masked chunk
        l = l * alpha + p.sum(dim=-1, keepdim=True) * beta
        acc = acc * alpha + (p @ v) * beta
        m = m_new
    return (acc / l).reshape(tile, num_heads, head_dim)  # [16, Hq, D] fp32


def bi_paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    split_size: int = DEFAULT_SPLIT_SIZE,
) -> torch.Tensor:
    """Causal paged attention with a fixed split size, on fixed-shape torch tiles (any device): q [T, Hq,
    D] -> [T, Hq, D] in q's dtype. `split_size` is part of the numerics (record it with the runtime
    identity). The CUDA path of mode="batch_invariant" runs the Triton paged kernels instead
    (engine.attention.batch_invariant)."""
    check_shapes(q, k_cache, v_cache, block_tables)
    if split_size <= 0 or split_size & (split_size - 1):
        raise ValueError(f"split_size must be a power of two, got {split_size}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    rows, positions = query_layout(seq_lens, query_start_loc, q.shape[0])
    return tile_paged_attention(q, k_cache, v_cache, block_tables, rows, positions, scale, split_size)
