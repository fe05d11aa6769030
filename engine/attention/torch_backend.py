"""Torch attention over the paged KV cache (CPU, and the GPU reference).

PREFILL and VERIFY reduce every query over the cache in fixed, absolutely aligned key tiles:
tile t covers key positions [t*tile, (t+1)*tile), tiles are visited in increasing order with an
online softmax, and keys after the query's position are masked to -inf. Every per-tile op has a
shape fixed by (rows, queries per row, tile), never by where the window starts, so a query's
result depends only on its position and the cache contents:
- the keys a query sees inside a tile sit in the same slots whatever the window start;
- a tile wholly after the query is an exact no-op (max unchanged, alpha = exp(0) = 1, p = 0);
- rows never mix (batched matmuls over rows, row-wise reductions).
DECODE gathers each row's keys into one padded batch and calls SDPA (fast, shape-dependent). The rows
a DECODE pass flags in `canonical_rows` are then recomputed with the tiled schedule, so they get the
verifier's numerics: as rows of CANONICAL_DECODE_QUERIES queries whose last one is the decode query,
because CPU BLAS takes another path (other bits) for a matmul of very few rows (group * n < 4 seen).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata, PassKind
from engine.config import KernelSettings

DEFAULT_TILE_KEYS = 64
CANONICAL_DECODE_QUERIES = 8  # queries per canonical decode row (copies of the one query; the last counts)


@dataclass(frozen=True)
class TileGroup:
    """Rows attended together with the tiled schedule; all have the same query count n."""

    token_start: int  # first token of the group in the pass
    num_rows: int
    queries_per_row: int
    q_pos: torch.Tensor  # Long[R, n]: absolute query positions
    key_masks: tuple[torch.Tensor | None, ...]  # per tile, Bool[R, 1, 1, n, tile]: key pos > query pos;
    # None for a tile every query sees whole (masking it would be an exact no-op)
    stale_keys: tuple[torch.Tensor | None, ...]  # per tile, Bool[R, 1, tile, 1]: key pos >= the row's seq_len;
    # their V is zeroed so a stale NaN never meets p = 0 (0 * NaN); None when no key is stale
    block_ids: torch.Tensor  # Long[R, num_tiles * blocks_per_tile]
    # a packed verify pass (AttentionMetadata.verify_window): the group's [R, n] queries are gathered from
    # these tokens (Long[R * n]; a padding query repeats a token of its row, its output dropped) and the
    # outputs of `scatter[0]` (Long[K], indices into R * n) go to the tokens `scatter[1]` (Long[K])
    gather: torch.Tensor | None = None
    scatter: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class DecodeBatch:
    """One query per row; keys gathered into [R, L] with L = num_blocks * block_size."""

    block_ids: torch.Tensor  # Long[R, num_blocks]
    key_mask: torch.Tensor  # Bool[R, 1, 1, L]: key position < seq_len
    stale_keys: torch.Tensor  # Bool[R, 1, L, 1]: ~key_mask; K/V zeroed there so a stale NaN never meets 0 * NaN
    canonical_rows: torch.Tensor | None = None  # Long[C]: flagged rows (= their tokens), tiled schedule
    canonical: TileGroup | None = None  # those C rows, CANONICAL_DECODE_QUERIES queries each


@dataclass(frozen=True)
class AttentionPlan:
    """Index work done once per forward pass and shared by every layer."""

    slot_mapping: torch.Tensor  # Long[T]
    tiled: tuple[TileGroup, ...]
    decode: DecodeBatch | None
    blocks_per_tile: int


class TorchAttention:
    """Paged attention in plain torch; see the module docstring for the invariance argument."""

    name = "torch"

    def __init__(self, tile_keys: int = DEFAULT_TILE_KEYS) -> None:
        if tile_keys < 1:
            raise ValueError(f"tile_keys must be >= 1, got {tile_keys}")
        self.tile_keys = tile_keys

    def with_kernels(self, kernels: KernelSettings) -> TorchAttention:
        return self  # no Triton kernels

    def tile_size(self, block_size: int) -> int:
        """Keys per tile: the smallest multiple of block_size that is >= tile_keys."""
        return block_size * math.ceil(self.tile_keys / block_size)

    def plan(self, meta: AttentionMetadata, block_size: int) -> AttentionPlan:
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        counts = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
        _check_rows(counts, seq_lens, meta)
        bpt = self.tile_size(block_size) // block_size
        slots = meta.slot_mapping.to(torch.long)
        if meta.kind is PassKind.DECODE and all(n == 1 for n in counts):
            decode = _decode_batch(meta, seq_lens, block_size)
            if meta.canonical_rows is not None:
                decode = _with_canonical_rows(decode, meta.canonical_rows, meta, starts, seq_lens, bpt, block_size)
            return AttentionPlan(slots, (), decode, bpt)
        if meta.kind is PassKind.VERIFY:
            gv = len(counts) - meta.carried_rows  # the verify rows; carried one-token decode rows after them
            w = meta.verify_window  # packed: rows of 0 .. W tokens; 0: every verify row holds W tokens
            rows_ok = all(0 <= n <= w for n in counts[:gv]) if w else len(set(counts[:gv])) == 1
            if gv < 1 or not rows_ok or any(n != 1 for n in counts[gv:]):
                held = f"0 .. {w}" if w else "exactly W"
                raise ValueError(f"VERIFY rows must hold {held} tokens (then {meta.carried_rows} carried one-token "
                                 f"rows), got counts {counts}")
            # the verify rows form the same tile group whatever is carried (packed: as the padded pass tiles
            # them); the carried rows a group of their own
            verify = (_packed_group(meta, gv, w, starts, counts, seq_lens, bpt, block_size) if w
                      else _tile_group(meta, range(gv), starts, counts, seq_lens, bpt, block_size))
            groups = (verify,)
            if meta.carried_rows:
                groups += (_tile_group(meta, range(gv, len(counts)), starts, counts, seq_lens, bpt, block_size),)
        else:
            groups = tuple(
                _tile_group(meta, [r], starts, counts, seq_lens, bpt, block_size)
                for r in range(len(counts))
                if counts[r] > 0
            )
        return AttentionPlan(slots, groups, None, bpt)

    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: AttentionPlan,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        write_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        if plan.decode is not None:
            out = _decode_attention(q, k_cache, v_cache, plan.decode, scale)
            g, rows = plan.decode.canonical, plan.decode.canonical_rows
            if g is not None and rows is not None:
                # queries before the last sit at earlier (possibly negative: fully masked) positions, ignored
                qg = q[rows][:, None].expand(-1, g.queries_per_row, -1, -1)  # [C, n, Hq, D]
                og = tiled_attention(qg, g.key_masks, g.stale_keys, g.block_ids, plan.blocks_per_tile,
                                     k_cache, v_cache, scale)  # [C, n, Hq, D]
                out[rows] = og[:, -1].to(q.dtype)
            return out
        out = torch.empty_like(q)
        for g in plan.tiled:
            n_tok = g.num_rows * g.queries_per_row
            rows = q[g.token_start : g.token_start + n_tok] if g.gather is None else q.index_select(0, g.gather)
            qg = rows.view(g.num_rows, g.queries_per_row, *q.shape[1:])
            og = tiled_attention(qg, g.key_masks, g.stale_keys, g.block_ids, plan.blocks_per_tile, k_cache, v_cache,
                                 scale).reshape(n_tok, *q.shape[1:])
            if g.scatter is None:
                out[g.token_start : g.token_start + n_tok] = og.to(q.dtype)
            else:
                out.index_copy_(0, g.scatter[1], og.index_select(0, g.scatter[0]).to(q.dtype))
        return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """Scatter this pass's K/V ([T, Hkv, D]) into their cache slots before anyone attends (no host sync:
    CUDA-graph capturable; every backend writes through this unless the ops wrote K/V in the RoPE launch,
    see `kv_prewritten`)."""
    flat_shape = (-1, *k_cache.shape[2:])
    k_cache.view(flat_shape).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(flat_shape).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] -> [*block_ids.shape, block_size, Hkv, D]; index_select, not advanced
    indexing, whose CPU kernel is orders of magnitude slower for these small gathers."""
    return cache.index_select(0, block_ids.reshape(-1)).view(*block_ids.shape, *cache.shape[1:])


def tiled_attention(
    q: torch.Tensor,  # [R, n, Hq, D]
    key_masks: tuple[torch.Tensor | None, ...],  # per tile, Bool[R, 1, 1, n, tile] or None
    stale_keys: tuple[torch.Tensor | None, ...],  # per tile, Bool[R, 1, tile, 1] or None
    block_ids: torch.Tensor,  # Long[R, num_tiles * bpt]
    bpt: int,
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # float32 [R, n, Hq, D]
    r, n, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = hq // hkv
    tile = bpt * k_cache.shape[1]
    # queries grouped under their KV head: [R, Hkv, group * n, D], index = group_idx * n + query_idx
    qf = q.float().view(r, n, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(r, hkv, group * n, d)
    m = torch.full((r, hkv, group * n), -math.inf, dtype=torch.float32, device=q.device)
    denom = torch.zeros((r, hkv, group * n), dtype=torch.float32, device=q.device)
    acc = torch.zeros((r, hkv, group * n, d), dtype=torch.float32, device=q.device)
    for t, (masked, stale) in enumerate(zip(key_masks, stale_keys, strict=True)):
        blk = block_ids[:, t * bpt : (t + 1) * bpt]  # [R, bpt]
        kt = gather_blocks(k_cache, blk).view(r, tile, hkv, d).float().permute(0, 2, 3, 1)  # [R, Hkv, D, tile]
        vt = gather_blocks(v_cache, blk).view(r, tile, hkv, d).float().permute(0, 2, 1, 3)  # [R, Hkv, tile, D]
        if stale is not None:
            vt.masked_fill_(stale, 0.0)
        s = torch.matmul(qf, kt) * scale  # [R, Hkv, group * n, tile]
        if masked is not None:
            s.view(r, hkv, group, n, tile).masked_fill_(masked, -math.inf)
        m_new = torch.maximum(m, s.amax(dim=-1))
        alpha = torch.exp(m - m_new)
        p = torch.exp(s - m_new[..., None])
        denom = denom * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.matmul(p, vt)
        m = m_new
    out = acc / denom[..., None]  # [R, Hkv, group * n, D]
    return out.view(r, hkv, group, n, d).permute(0, 3, 1, 2, 4).reshape(r, n, hq, d)


def _check_rows(counts: list[int], seq_lens: list[int], meta: AttentionMetadata) -> None:
    if len(counts) != len(seq_lens):
        raise ValueError(f"query_start_loc has {len(counts) + 1} entries but seq_lens has {len(seq_lens)}")
    if sum(counts) != meta.num_tokens:
        raise ValueError(f"query_start_loc covers {sum(counts)} tokens but slot_mapping has {meta.num_tokens}")
    for r, (n, s) in enumerate(zip(counts, seq_lens, strict=True)):
        if n < 0 or s < n:
            raise ValueError(f"row {r}: seq_lens={s} must be >= its query count {n} >= 0")


def _padded_blocks(block_tables: torch.Tensor, rows: list[int], width: int) -> torch.Tensor:
    """Block ids [len(rows), width]; columns past the table point at the reserved block 0."""
    bt = block_tables[rows].to(torch.long)[:, :width]
    if bt.shape[1] < width:
        bt = F.pad(bt, (0, width - bt.shape[1]), value=0)
    return bt


def _tile_group(
    meta: AttentionMetadata,
    rows: list[int] | range,
    starts: list[int],
    counts: list[int],
    seq_lens: list[int],
    bpt: int,
    block_size: int,
) -> TileGroup:
    rows = list(rows)
    n = counts[rows[0]]
    tile = bpt * block_size
    num_tiles = math.ceil(max(seq_lens[r] for r in rows) / tile)
    device = meta.slot_mapping.device
    last = torch.tensor([seq_lens[r] for r in rows], dtype=torch.long, device=device)
    q_pos = last[:, None] - n + torch.arange(n, device=device)[None, :]
    keys = torch.arange(num_tiles * tile, device=device).view(num_tiles, 1, 1, 1, 1, tile)
    shortest = min(seq_lens[r] for r in rows)  # the group's first query sits at shortest - n
    masks = tuple(
        None if (t + 1) * tile <= shortest - n + 1 else keys[t] > q_pos[:, None, None, :, None]
        for t in range(num_tiles)
    )
    block_ids = _padded_blocks(meta.block_tables, rows, num_tiles * bpt)
    stale = tuple(
        None if (t + 1) * tile <= shortest else keys[t].view(1, 1, tile, 1) >= last.view(-1, 1, 1, 1)
        for t in range(num_tiles)
    )
    return TileGroup(starts[rows[0]], len(rows), n, q_pos, masks, stale, block_ids)


def _packed_group(meta: AttentionMetadata, rows: int, w: int, starts: list[int], counts: list[int],
                  seq_lens: list[int], bpt: int, block_size: int) -> TileGroup:
    """The first `rows` rows of a packed verify pass (0 .. w tokens each) as the padded pass computes them:
    every row w queries, at positions start .. start + w - 1 (start = its first token's position; 0 for a
    row without tokens), its keys up to start + w. The real queries get the padded pass's bits (its masks,
    stale keys and matmul shapes); the padding queries' outputs are dropped."""
    index = range(rows)
    padded_lens = [seq_lens[r] - counts[r] + w for r in index]
    group = _tile_group(meta, index, starts, [w] * rows, padded_lens, bpt, block_size)
    device = meta.slot_mapping.device
    gather, src, dst = [], [], []
    for r in index:
        c, first = counts[r], starts[r]
        gather += [first + min(i, c - 1) for i in range(w)] if c else [0] * w
        src += range(r * w, r * w + c)
        dst += range(first, first + c)

    def as_long(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    return replace(group, gather=as_long(gather), scatter=(as_long(src), as_long(dst)))


def _decode_batch(meta: AttentionMetadata, seq_lens: list[int], block_size: int) -> DecodeBatch:
    num_blocks = math.ceil(max(seq_lens) / block_size)
    block_ids = _padded_blocks(meta.block_tables, list(range(len(seq_lens))), num_blocks)
    key_pos = torch.arange(num_blocks * block_size, device=block_ids.device)
    key_mask = key_pos[None, :] < meta.seq_lens.to(block_ids.device)[:, None]  # [R, L]
    return DecodeBatch(block_ids, key_mask[:, None, None, :], ~key_mask[:, None, :, None])


def _with_canonical_rows(
    decode: DecodeBatch,
    mask: torch.Tensor,  # Int[R]: meta.canonical_rows
    meta: AttentionMetadata,
    starts: list[int],
    seq_lens: list[int],
    bpt: int,
    block_size: int,
) -> DecodeBatch:
    """`decode` plus the rows `mask` flags, as a tiled group of CANONICAL_DECODE_QUERIES queries per row."""
    if tuple(mask.shape) != (len(seq_lens),):
        raise ValueError(f"canonical_rows must be Int32[{len(seq_lens)}], got shape {list(mask.shape)}")
    index = mask.nonzero()[:, 0]  # Long[C]
    if index.numel() == 0:
        return decode
    padded = [CANONICAL_DECODE_QUERIES] * len(seq_lens)
    group = _tile_group(meta, index.tolist(), starts, padded, seq_lens, bpt, block_size)
    return replace(decode, canonical_rows=index, canonical=group)


def _decode_attention(
    q: torch.Tensor,  # [R, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    batch: DecodeBatch,
    scale: float,
) -> torch.Tensor:  # [R, Hq, D]
    r, nb = batch.block_ids.shape
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    length = nb * k_cache.shape[1]
    keys = gather_blocks(k_cache, batch.block_ids).view(r, length, hkv, d).transpose(1, 2)  # [R, Hkv, L, D]
    values = gather_blocks(v_cache, batch.block_ids).view(r, length, hkv, d).transpose(1, 2)
    keys.masked_fill_(batch.stale_keys, 0.0)
    values.masked_fill_(batch.stale_keys, 0.0)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :].to(keys.dtype), keys, values, attn_mask=batch.key_mask, scale=scale, enable_gqa=True
    )  # [R, Hq, 1, D]
    return out[:, :, 0, :].to(q.dtype)
