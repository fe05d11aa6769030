"""Row-wise batch-invariant Triton log-softmax (and `as_rows`), CUDA only; imported lazily. RMSNorm,
SwiGLU and RoPE are the fused kernels of engine.kernels.triton_fused, shared by both ops objects.

One program per row; the block size comes from the row length alone, and each row is reduced in a fixed
lane layout and fixed chunk order, so a row's bits never depend on how many rows share the launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 4096


def _block(width: int) -> int:
    return min(triton.next_power_of_2(width), _MAX_BLOCK)


@triton.jit
def _log_softmax_kernel(x_ptr, out_ptr, V, stride_x, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    offs = tl.arange(0, BLOCK)
    # Pass 1: per-lane online max / sum of exp over the chunks, in order; combined across lanes once.
    m = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, V, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # lanes that saw only -inf stay at 0
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    row_max = tl.max(m, axis=0)
    lane_scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - row_max))
    log_sum = tl.log(tl.sum(s * lane_scale, axis=0))
    for start in range(0, V, BLOCK):
        mask = start + offs < V
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + start + offs, (x - row_max - log_sum).to(out_ptr.dtype.element_ty), mask=mask)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [M, H] with a unit last stride (the kernels index rows by stride)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_log_softmax(x: torch.Tensor) -> torch.Tensor:
    rows = as_rows(x)
    out = torch.empty_like(rows)
    v = rows.shape[1]
    if rows.shape[0]:
        _log_softmax_kernel[(rows.shape[0],)](rows, out, v, rows.stride(0), out.stride(0), BLOCK=_block(v))
    return out.reshape(x.shape)
