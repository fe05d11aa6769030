"""Row-wise batch-invariant Triton kernels (RMSNorm, log-softmax, SwiGLU), CUDA only; imported lazily.

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
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_out, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    offs = tl.arange(0, BLOCK)
    sq = tl.zeros((BLOCK,), dtype=tl.float32)  # per-lane partial sums, reduced once at the end
    for start in range(0, H, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < H, other=0.0).to(tl.float32)
        sq += x * x
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(sq, axis=0) / H + eps))
    for start in range(0, H, BLOCK):
        mask = start + offs < H
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        # Llama semantics: normalise in fp32, round to the input dtype, then scale by the weight. The
        # product of two bf16 values is exact in fp32, so this rounds once, as a bf16 multiply would.
        y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_row + start + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


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


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, stride_g, stride_u, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    for start in range(0, I, BLOCK):
        mask = start + offs < I
        g = tl.load(g_ptr + row * stride_g + start + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * stride_u + start + offs, mask=mask, other=0.0).to(tl.float32)
        y = g / (1.0 + tl.exp(-g)) * u
        tl.store(out_ptr + row * stride_out + start + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def as_rows(x: torch.Tensor) -> torch.Tensor:
    """[..., H] -> [M, H] with a unit last stride (the kernels index rows by stride)."""
    x = x.reshape(-1, x.shape[-1])
    return x if x.stride(-1) == 1 else x.contiguous()


def triton_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    rows = as_rows(x)
    out = torch.empty_like(rows)
    h = rows.shape[1]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight.contiguous(), out, h, rows.stride(0), out.stride(0), eps, BLOCK=_block(h)
        )
    return out.reshape(x.shape)


def triton_log_softmax(x: torch.Tensor) -> torch.Tensor:
    rows = as_rows(x)
    out = torch.empty_like(rows)
    v = rows.shape[1]
    if rows.shape[0]:
        _log_softmax_kernel[(rows.shape[0],)](rows, out, v, rows.stride(0), out.stride(0), BLOCK=_block(v))
    return out.reshape(x.shape)


def triton_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    g, u = as_rows(gate), as_rows(up)
    out = torch.empty_like(g)
    i = g.shape[1]
    if g.shape[0]:
        _silu_mul_kernel[(g.shape[0],)](g, u, out, i, g.stride(0), u.stride(0), out.stride(0), BLOCK=_block(i))
    return out.reshape(gate.shape)
