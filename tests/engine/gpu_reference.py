"""Float64 reference for paged attention and random paged-cache fixtures (shared by the gpu tests)."""
from __future__ import annotations

from types import ModuleType
from typing import Any

import torch


def make_paged_case(seq_lens: list[int], q_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
                    block_size: int, dtype: torch.dtype, device: str | torch.device, seed: int = 0,
                    spare_blocks: int = 3) -> dict:
    """A random cache whose rows own shuffled (non-contiguous) blocks; block 0 stays the zero block."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks_per_row = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_row) + spare_blocks
    num_blocks = 1 + sum(blocks_per_row)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for r, n in enumerate(blocks_per_row):
        block_tables[r, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    k_cache[0].zero_()
    v_cache[0].zero_()
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return {
        "q": q.to(device), "k_cache": k_cache.to(device), "v_cache": v_cache.to(device),
        "query_start_loc": qsl.to(device), "seq_lens": torch.tensor(seq_lens, dtype=torch.int32).to(device),
        "block_tables": block_tables.to(device), "max_query_len": max(q_lens),
    }


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                        scale: float) -> torch.Tensor:
    """Causal paged attention in float64 on the CPU: query i of row r sits at seq_len - q_len + i."""
    q, kc, vc = (t.detach().cpu().double() for t in (q, k_cache, v_cache))
    qsl, sl, bt = query_start_loc.cpu().tolist(), seq_lens.cpu().tolist(), block_tables.cpu().long()
    group = q.shape[1] // kc.shape[2]
    out = torch.empty_like(q)
    block_size = kc.shape[1]
    for r, seq_len in enumerate(sl):
        n_blocks = (seq_len + block_size - 1) // block_size
        keys = kc[bt[r, :n_blocks]].reshape(-1, kc.shape[2], kc.shape[3])[:seq_len].repeat_interleave(group, 1)
        vals = vc[bt[r, :n_blocks]].reshape(-1, vc.shape[2], vc.shape[3])[:seq_len].repeat_interleave(group, 1)
        start, end = qsl[r], qsl[r + 1]
        ctx = seq_len - (end - start)
        for i in range(end - start):
            p = ctx + i
            s = torch.einsum("hd,khd->hk", q[start + i], keys[: p + 1]) * scale
            out[start + i] = torch.einsum("hk,khd->hd", s.softmax(-1), vals[: p + 1])
    return out


def check_decode_rope_fusion(tf: ModuleType, tp: ModuleType, device: str, dtype: torch.dtype, lens: list[int],
                             heads: tuple[int, int, int, int], splits: tuple[int, ...], seed: int = 0,
                             canonical: list[int] | None = None, settings: Any = None) -> None:
    """decode_attention with `rope` (q and K rotated, K/V stored, inside the split kernel) against
    triton_fused.rope_write_kv then decode_attention on the rotated q: the output and both caches bitwise
    equal, per split size and merge. The caches start random at the written slots too (so a program that
    read its key before storing it would differ), and the check asserts the store really changed them.
    canonical (0/1 per row): also the mixed step (the split kernel skipping the flagged rows, the packed
    canonical kernel with `rope` taking them, each storing its own rows' K/V) and the all-canonical step
    (the packed kernel alone), against rope_write_kv then the same kernels on the rotated q.
    heads: (Hq, Hkv, D, block_size). settings: the canonical kernel's KernelSettings (None: the defaults)."""
    from engine.attention import triton_canonical_decode as packed
    from engine.config import DEFAULT_KERNEL_SETTINGS

    settings = settings or DEFAULT_KERNEL_SETTINGS

    hq, hkv, d, bs = heads
    case = make_paged_case(lens, [1] * len(lens), hq, hkv, d, bs, dtype, device, seed=seed, spare_blocks=1)
    rows = len(lens)
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(dtype).to(device)
    q, k, v = (x.view(rows, -1, d) for x in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))  # strided views
    angles = torch.rand(rows, 1, d // 2, generator=g).double() * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).repeat(1, 1, 2).to(dtype).to(device)  # [R, 2, D]
    seq_lens, tables = case["seq_lens"], case["block_tables"]
    last = seq_lens.long() - 1
    slots = tables.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    scale = d ** -0.5
    rope = tp.DecodeRope(k, v, cos_sin, slots)

    def split(qq: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, size: int, merge: str, mask: torch.Tensor | None,
              fused: bool) -> torch.Tensor:
        out = torch.full_like(case["q"], float("nan"))
        tp.decode_attention(qq, kc, vc, seq_lens, tables, scale, split_size=size, merge=merge, out=out,
                            skip_rows=mask, rope=rope if fused else None)
        if mask is not None:
            packed.canonical_decode_attention(qq, kc, vc, seq_lens, tables, scale, out=out, only_rows=mask,
                                              rope=rope if fused else None, settings=settings)
        return out

    def whole(qq: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, size: int, merge: str, mask: None,
              fused: bool) -> torch.Tensor:
        return packed.canonical_decode_attention(qq, kc, vc, seq_lens, tables, scale, rope=rope if fused else None,
                                                 settings=settings)

    masks: list[torch.Tensor | None] = [None]
    if canonical is not None:
        masks.append(torch.tensor(canonical, dtype=torch.int32, device=device))
    runs = [(split, size, merge, mask) for size in splits for merge in ("fused", "kernel") for mask in masks]
    if canonical is not None:
        runs.append((whole, 0, "", None))
    for step, size, merge, mask in runs:
        name = f"{step.__name__} split {size} merge {merge} mask {mask is not None}"
        kc_ref, vc_ref = case["k_cache"].clone(), case["v_cache"].clone()
        q_rot = tf.rope_write_kv(q, k, v, cos_sin, kc_ref, vc_ref, slots)
        ref = step(q_rot, kc_ref, vc_ref, size, merge, mask, False)
        kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
        out = step(q, kc, vc, size, merge, mask, True)
        assert torch.isfinite(ref).all(), name
        assert torch.equal(out, ref), f"{name}: output differs"
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), f"{name}: caches differ"
    assert not torch.equal(kc_ref, case["k_cache"]) and not torch.equal(vc_ref, case["v_cache"])  # keys were written
