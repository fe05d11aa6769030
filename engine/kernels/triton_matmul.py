"""Batch-invariant Triton GEMM: out = x @ w.T (+ bias), CUDA only. Imported lazily (imports triton).

Invariance argument: the tile configuration is a function of (dtype, N, device) only — of the weight
matrix, never of the batch size M. Each program owns one [BLOCK_M, BLOCK_N] output tile and runs the
WHOLE K loop itself in increasing k (no split-K, no stream-K), accumulating in fp32 with tl.dot. An output element's reduction order is
thus fixed by K and the tile config; rows beyond M are masked loads of zero and do not touch other rows.

BLOCK_N shrinks for narrow weights so that decode (M <= BLOCK_M, one row of tiles) still launches about
one program per SM: with no split-K, the N tiles are the only parallelism a small batch has.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# dtype -> (BLOCK_M, BLOCK_K, num_stages); never autotuned, never a function of M.
_DTYPE_CONFIGS: dict[torch.dtype, tuple[int, int, int]] = {
    torch.bfloat16: (128, 64, 3),
    torch.float16: (128, 64, 3),
    torch.float32: (128, 32, 3),
}
_GROUP_M = 8


# M is not specialised: Triton would otherwise compile a separate variant for M == 1 or M % 16 == 0.
@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(
    a_ptr, b_ptr, bias_ptr, c_ptr,
    M, N, K,
    stride_am, stride_ak, stride_bn, stride_bk, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped launch order only improves L2 reuse; it does not change any element's arithmetic.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK] of x
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn  # [BK, BN] of w.T
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(offs_m[:, None] < M) & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(b_ptrs, mask=(offs_k[:, None] < k_left) & (offs_n[None, :] < N), other=0.0)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
        acc += bias[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def _block_n(n: int, device: torch.device) -> int:
    """Largest BLOCK_N in (128, 64, 32) giving at least one N tile per SM; depends on N and the GPU only."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    for block_n in (128, 64):
        if triton.cdiv(n, block_n) >= sms:
            return block_n
    return 32


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype; fp32 inputs use IEEE fp32 FMA."""
    if x.dtype not in _DTYPE_CONFIGS or weight.dtype != x.dtype:
        raise TypeError(f"bi_matmul supports {list(_DTYPE_CONFIGS)} with equal dtypes, got {x.dtype}, {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"inner dims differ: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    block_m, block_k, stages = _DTYPE_CONFIGS[x.dtype]
    block_n = _block_n(n, x.device)
    warps = 8 if block_n == 128 else 4
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else x, out,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M,
        num_warps=warps, num_stages=stages,
    )
    return out
