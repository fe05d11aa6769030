"""Batch-invariant Triton GEMM: out = x @ w.T (+ bias), CUDA only. Imported lazily (imports triton).

Invariance argument: each program owns one [BLOCK_M, BLOCK_N] output tile and runs the WHOLE K loop
itself in increasing k (no split-K, no stream-K), accumulating in fp32 with tl.dot. An output element's
reduction is thus the same chain of 16-wide MMA steps in increasing k whatever the tile shape; rows
beyond M are masked loads of zero and do not touch other rows.

16-bit inputs: the tile shape follows the batch size M (`_BUCKETS`: small tiles for decode, large for
prefill), which is only sound if the MMA bits do not depend on the tile shape. The bits were measured
equal across 11 tile shapes (BLOCK_M 16..128, BLOCK_N 32..256, BLOCK_K 64/128) on the H200
(`python -m bench bi-matmul`, bench/results/2026-11-29-h200/bi-matmul-probe.json), and every
process re-checks it once per device and dtype before using more than one shape
(`tile_shapes_agree`); where they disagree it falls back to the single `_FIXED` shape for every M.
fp32 (IEEE FMA) always uses the single fixed shape.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); never autotuned.
Tile = tuple[int, int, int, int, int]
# 16-bit: (largest M, tile) in increasing M; the tile of the first bucket holding M (fastest measured on
# the H200 for the Llama-3.1-8B shapes, bench/results/2026-11-29-h200/bi-matmul-probe.json)
_BUCKETS: tuple[tuple[int, Tile], ...] = (
    (128, (64, 64, 128, 4, 3)),
    (512, (128, 128, 64, 8, 3)),
    (1 << 62, (128, 256, 64, 8, 3)),
)
_FIXED: dict[torch.dtype, Tile] = {  # the one shape for every M (fp32, or 16-bit where shapes disagree)
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (128, 32, 32, 4, 3),
}
_GROUP_M = 8
# names every tile a 16-bit GEMM can run with: the buckets, then the fixed shape (graph capture before the
# device check, or a device whose shapes disagree)
KERNEL_ID = "verbatim-bi-matmul-v2-" + "-".join("x".join(map(str, t)) for t in
                                                 [tile for _, tile in _BUCKETS] + [_FIXED[torch.bfloat16]])
_AGREE: dict[tuple[str, torch.dtype], bool] = {}


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


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, tile: Tile) -> None:
    (m, k), n = x.shape, weight.shape[0]
    block_m, block_n, block_k, warps, stages = tile
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _matmul_kernel[grid](
        x, weight, bias if bias is not None else x, out,
        m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=_GROUP_M,
        num_warps=warps, num_stages=stages,
    )


def tile_shapes_agree(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether every bucket's tile shape gives bitwise the fixed shape's output on this device and dtype
    (checked once per process: random [192, 1000] @ [300, 1000].T with a bias, ragged on purpose)."""
    key = (str(device), dtype)
    if key not in _AGREE:
        g = torch.Generator(device=device).manual_seed(20261129)
        x = torch.randn(192, 1000, device=device, generator=g).to(dtype)
        w = (torch.randn(300, 1000, device=device, generator=g) * 0.05).to(dtype)
        b = torch.randn(300, device=device, generator=g).to(dtype)
        outs = []
        for tile in [_FIXED[dtype]] + [tile for _, tile in _BUCKETS]:
            outs.append(torch.empty(192, 300, device=device, dtype=dtype))
            _launch(x, w, b, outs[-1], tile)
        _AGREE[key] = all(torch.equal(out, outs[0]) for out in outs[1:])
    return _AGREE[key]


def tile_for(m: int, dtype: torch.dtype, device: torch.device) -> Tile:
    """The tile shape of an [m, K] input: by M bucket for 16-bit dtypes whose shapes agree, else fixed."""
    if dtype == torch.float32:
        return _FIXED[dtype]
    if (str(device), dtype) not in _AGREE and torch.cuda.is_current_stream_capturing():
        # the check syncs, which a CUDA-graph capture forbids: the fixed shape is right either way (if the
        # shapes agree it gives the buckets' bits; if not, the check will pick it for every later call)
        return _FIXED[dtype]
    if not tile_shapes_agree(device, dtype):
        return _FIXED[dtype]
    return next(tile for limit, tile in _BUCKETS if m <= limit)


def triton_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias [N]) -> [M, N] in x's dtype; fp32 inputs use IEEE fp32 FMA."""
    if x.dtype not in _FIXED or weight.dtype != x.dtype:
        raise TypeError(f"bi_matmul supports {list(_FIXED)} with equal dtypes, got {x.dtype}, {weight.dtype}")
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"inner dims differ: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    if m == 0 or n == 0:
        return out
    _launch(x, weight, bias, out, tile_for(m, x.dtype, x.device))
    return out
