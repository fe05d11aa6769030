"""Torch backend details: every pass kind against a float64 reference, and stale cache slots holding NaN."""
from __future__ import annotations

import math

import pytest
import torch

from engine.attention import PassKind, RowSpec, TorchAttention, build_metadata

BLOCK, HQ, HKV, D = 16, 4, 2, 8
ROWS = {
    PassKind.PREFILL: [RowSpec([3, 7, 5], 0, 37), RowSpec([9, 2], 10, 13)],
    PassKind.DECODE: [RowSpec([3, 7, 5], 40, 1), RowSpec([9], 0, 1), RowSpec([2, 4], 16, 1)],
    PassKind.VERIFY: [RowSpec([3, 7, 5], 30, 8), RowSpec([9, 2], 3, 8), RowSpec([4], 0, 8)],
}


def _run(kind: PassKind, fill: float) -> tuple[torch.Tensor, list[RowSpec], torch.Tensor, torch.Tensor]:
    """Attend with every slot that holds no key of any row (block 0 included) set to `fill`."""
    g = torch.Generator().manual_seed(0)
    rows = ROWS[kind]
    k_cache = torch.full((10, BLOCK, HKV, D), fill)
    v_cache = torch.full((10, BLOCK, HKV, D), fill)
    for row in rows:  # the context each row already has
        for pos in range(row.context_len):
            blk, off = row.block_table[pos // BLOCK], pos % BLOCK
            k_cache[blk, off] = torch.randn(HKV, D, generator=g)
            v_cache[blk, off] = torch.randn(HKV, D, generator=g)
    t = sum(r.num_tokens for r in rows)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HKV, HKV))
    backend = TorchAttention()
    meta = build_metadata(kind, rows, BLOCK)
    out = backend.forward(q, k, v, k_cache, v_cache, backend.plan(meta, BLOCK), D**-0.5)
    return out, rows, q, torch.stack((k_cache, v_cache))


def _reference(rows: list[RowSpec], q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """float64 causal attention of each query over its row's keys 0..position."""
    out, i = [], 0
    for row in rows:
        slots = [row.block_table[p // BLOCK] * BLOCK + p % BLOCK for p in range(row.context_len + row.num_tokens)]
        keys, values = (kv[j].view(-1, HKV, D)[slots].double().repeat_interleave(HQ // HKV, 1) for j in (0, 1))
        for n in range(row.num_tokens):
            visible = row.context_len + n + 1
            w = torch.softmax(torch.einsum("hd,khd->hk", q[i].double(), keys[:visible]) * D**-0.5, -1)
            out.append(torch.einsum("hk,khd->hd", w, values[:visible]))
            i += 1
    return torch.stack(out)


@pytest.mark.parametrize("kind", list(PassKind))
def test_each_pass_kind_matches_a_float64_reference(kind: PassKind) -> None:
    out, rows, q, kv = _run(kind, 0.0)
    assert torch.allclose(out.double(), _reference(rows, q, kv), atol=1e-5)


@pytest.mark.parametrize("kind", list(PassKind))
def test_stale_nan_slots_never_reach_a_result(kind: PassKind) -> None:
    clean, *_ = _run(kind, 0.0)
    dirty, *_ = _run(kind, math.nan)
    assert torch.isfinite(dirty).all()
    assert torch.equal(clean, dirty)
