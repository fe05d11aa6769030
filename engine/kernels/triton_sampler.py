"""The counter-based Gumbel sampler on the GPU (engine.sampling's algorithm, on the device).

Why: on CUDA the host sampler had to copy every logits row off the GPU (a verify pass of 8 x 32 rows on a
128k vocab is 131 MB) and run log-softmax and the Gumbel draw in numpy; that, not the model, bounded the
engine's throughput and a replay's speed. Here a row never leaves the device; only (token, logprob, lse)
come back.

Numerics (fixed, batch-invariant, named in the runtime fingerprint as `SAMPLER_IMPL`):

    vocab of one row:  | split 0 | split 1 | ... | split S-1 |     fixed SPLIT ids each (not a fixed count)
    pass 1  program (row, s):   walks its split in BLOCK-wide chunks, in order, keeping
                                best score + first id reaching it   score = x / T + g(seed, pos, id)  (x if T = 0)
                                running max m and sum s of exp(x - m)   (online log-sum-exp, float64)
    pass 2  program (row):      merges splits 0..S-1 in order (strict '>' keeps the lowest id on ties),
                                lse = M + log(sum_s s_s * exp(m_s - M)); logprob = float32(x[token] - lse)

A row's result depends only on its own logits, seed and position — never on the batch, the row's index,
or how many rows share the launch — so the fast path, the verifier and a replay agree. The noise is the
same integer hash as the host sampler (splitmix64 of key ^ id, top 53 bits -> u in (0, 1),
g = -log(-log(u)) in float64); only the last bits of log/exp (libdevice vs libm) and the summation order
of the log-sum-exp differ from the numpy implementation, which is why the implementation is fingerprinted.

Triton is imported lazily, so this module imports on a CPU-only machine; the kernels also run on CPU tensors
under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import functools
from types import ModuleType

import numpy as np
import torch

SPLIT = 8192        # vocab ids per pass-1 program (multiple of BLOCK)
BLOCK = 1024        # ids per chunk inside a program
NUM_WARPS = 4
SAMPLER_IMPL = f"triton-fp64-split{SPLIT}-block{BLOCK}-w{NUM_WARPS}"

def row_key(seed: int, position: int) -> int:
    """engine.sampling.noise_key(seed, position) as a signed int64 (bit pattern kept) for the kernel."""
    from engine.sampling import noise_key

    return int(noise_key(seed, position).view(np.int64)[0])


@functools.cache
def _kernels() -> tuple[ModuleType, object, object]:
    """Import triton (and compile on first launch) only when a kernel is first used."""
    import triton

    from engine.kernels import triton_sampler_kernels as k

    return triton, k.split_kernel, k.merge_kernel


def gumbel_sample(logits: torch.Tensor, row_ids: torch.Tensor, keys: torch.Tensor, temps: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample rows `row_ids` of `logits` [N, vocab] (any float dtype; read as float32).

    keys: Int64[R], the bit patterns of `engine.sampling.noise_keys` (`row_key` for one row); temps: Float64[R] (0 = greedy argmax, first id on ties).
    Returns (token Int64[R], logprob Float32[R], lse Float64[R]) on the logits' device.
    """
    triton, split_kernel, merge_kernel = _kernels()
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, vocab] with a contiguous vocab dim, got {tuple(logits.shape)}")
    n, vocab = row_ids.shape[0], logits.shape[1]
    dev = logits.device
    num_splits = triton.cdiv(vocab, SPLIT)
    best = torch.empty(n * num_splits, dtype=torch.float64, device=dev)
    arg = torch.empty(n * num_splits, dtype=torch.int64, device=dev)
    m = torch.empty(n * num_splits, dtype=torch.float64, device=dev)
    s = torch.empty(n * num_splits, dtype=torch.float64, device=dev)
    token = torch.empty(n, dtype=torch.int64, device=dev)
    logprob = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float64, device=dev)
    if n == 0:
        return token, logprob, lse
    split_kernel[(n, num_splits)](logits, logits.stride(0), row_ids, keys, temps, best, arg, m, s, vocab,
                                  NUM_SPLITS=num_splits, SPLIT_=SPLIT, BLOCK_=BLOCK, num_warps=NUM_WARPS)
    merge_kernel[(n,)](logits, logits.stride(0), row_ids, best, arg, m, s, token, logprob, lse,
                       NUM_SPLITS=num_splits,
                       num_warps=1)
    return token, logprob, lse
