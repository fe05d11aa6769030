"""Batch-invariant ops built from fixed-shape torch calls (the CPU path, and a reference anywhere).

Why this works: a torch kernel picks its reduction strategy (GEMM blocking, GEMV vs GEMM, how a
reduction is split over threads) from the *shape* of its inputs. On the CPU, fp32 `x[:1] @ W.T`
differs from `(x[:M] @ W.T)[:1]`. If every call sees exactly the same shape, the strategy is fixed, and
a row's result depends only on its own values. So each op here cuts its rows into tiles of exactly
`TILE_ROWS` rows (the last one zero-padded), runs the plain torch op on each tile, and stitches the
rows back. Rows never interact inside these ops (no reduction runs across rows), so padding rows and
neighbours cannot leak into a row's result, and the tests check that a row's bits do not depend on
its position inside a tile either.

Rule for code in this module: transcendental functions only in fp32 and only through torch.exp /
torch.log_softmax / fp32 rsqrt, which were checked to give the same bits in the vectorised body and in
the tail; F.silu and bf16 rsqrt were checked NOT to (tests/engine/test_batch_invariant_ops.py).

Slow but correct: one extra copy per tile and a Python loop over ceil(M / TILE_ROWS) tiles.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

TILE_ROWS = 16

RowFn = Callable[[torch.Tensor], torch.Tensor]


def map_row_tiles(fn: RowFn, x: torch.Tensor, tile_rows: int = TILE_ROWS) -> torch.Tensor:
    """Apply `fn` ([tile_rows, *rest] -> [tile_rows, *out]) to x [M, *rest] in fixed-size row tiles.

    `fn` must treat rows independently; it always sees a contiguous tensor of exactly `tile_rows` rows.
    """
    m = x.shape[0]
    if m == 0:
        return fn(x.new_zeros((tile_rows, *x.shape[1:])))[:0]
    outs: list[torch.Tensor] = []
    for start in range(0, m, tile_rows):
        rows = min(tile_rows, m - start)
        tile = x.new_zeros((tile_rows, *x.shape[1:]))  # [tile_rows, *rest], zero padding rows
        tile[:rows] = x[start : start + rows]
        outs.append(fn(tile)[:rows])
    return torch.cat(outs, dim=0)


def _flatten_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Size]:
    """[..., H] -> ([M, H], leading shape)."""
    return x.reshape(-1, x.shape[-1]), x.shape[:-1]


# Narrow GEMMs take another CPU code path in which a row's bits DO depend on its position in the
# tile (measured, fp32: N <= 9 with K odd, e.g. [16, 33] @ [33, 7]); they are cheap, so they run
# one row per call, which is invariant by construction. Wider ones were measured position invariant.
MIN_TILED_N = 16


def tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N], in x's dtype."""
    rows, lead = _flatten_rows(x)
    tile_rows = TILE_ROWS if weight.shape[0] >= MIN_TILED_N else 1
    out = map_row_tiles(lambda t: F.linear(t, weight, bias), rows, tile_rows)  # [M, N]
    return out.reshape(*lead, weight.shape[0])


def tile_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm (fp32 statistics, normalise, cast back, then scale): x [..., H] -> [..., H]."""
    rows, lead = _flatten_rows(x)
    out = map_row_tiles(lambda t: rms_norm_rows(t, weight, eps), rows)
    return out.reshape(*lead, x.shape[-1])


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain (shape-dependent) Llama RMSNorm on [M, H]; the semantics every backend reproduces."""
    xf = x.float()
    var = xf.pow(2).mean(dim=-1, keepdim=True)  # [M, 1]
    return weight * (xf * torch.rsqrt(var + eps)).to(x.dtype)


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Plain RoPE, rotate-half convention (HF Llama): x [T, heads, D]; cos, sin [T, 1, D] in x's dtype.

    Exact IEEE multiplies and adds in x's dtype, so a row's bits do not depend on its position either.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def tile_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, computed in fp32, returned in x's dtype: [..., V] -> [..., V]."""
    rows, lead = _flatten_rows(x)
    out = map_row_tiles(lambda t: torch.log_softmax(t.float(), dim=-1).to(x.dtype), rows)
    return out.reshape(*lead, x.shape[-1])


def tile_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU: silu(gate) * up, gate and up [..., I] -> [..., I], computed in fp32, rounded once.

    Elementwise, yet not free on the CPU: torch's vectorised elementwise loops finish with a scalar
    tail, and F.silu's scalar and vector formulas round differently, so a row's bits would depend on
    where it sits (measured: [16, 7] tiles). Here silu is g / (1 + exp(-g)): division, addition and
    multiplication are exact IEEE ops in both paths, and torch's exp maps the tail through the vector
    routine. Fixed tiles keep the thread split fixed as well.
    """
    inter = gate.shape[-1]
    rows, lead = _flatten_rows(torch.cat([gate, up], dim=-1))  # [M, 2I] = [gate | up]

    def fn(t: torch.Tensor) -> torch.Tensor:
        g, u = t[:, :inter].float(), t[:, inter:].float()
        return (g / (1.0 + torch.exp(-g)) * u).to(t.dtype)

    return map_row_tiles(fn, rows).reshape(*lead, inter)
