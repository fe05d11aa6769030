"""The counter-based Gumbel sampler on the GPU (engine.sampling's algorithm, on the device).

Why: a row never leaves the device; only (token, logprob) and the top logprobs come back, for every sampling
parameter (temperature, top-k, top-p, min-p, logprobs) and for batches where every row has its own.

Numerics (fixed, batch-invariant, named in the runtime fingerprint as `SAMPLER_IMPL`):

    vocab of one row:  | split 0 | split 1 | ... | split S-1 |     fixed SPLIT ids each (not a fixed count)
    pass 1  program (row, s):   walks its split in BLOCK-wide chunks, in order, keeping
                                best score + first id reaching it   score = x / T + g(seed, pos, id)  (x if T = 0)
                                running max m and sum s of exp(x - m)   (online log-sum-exp, float64)
                                every chunk's max x, best score and its id (for the filter)
                                top-p rows without top-k: running max and sum of exp(x / T - max)  (the top-p
                                total, online, float64)
    pass 2  program (row):      merges splits 0..S-1 in order (strict '>' keeps the lowest id on ties),
                                lse = M + log(sum_s s_s * exp(m_s - M)); logprob = float32(x[token] - lse)
    filter  program (row):      rows with top-k / top-p / min-p: rejection from the unfiltered argmax, walking
                                the row's BLOCK-wide chunks (engine.sampling's specification), only those
                                whose max can hold an id the scan counts, the mass before a candidate summed
                                in the order of the chunks' max and the scan stopped once it rejects; other
                                rows return at once
    top-n   program (row):      rows asking for top logprobs: n ordered passes (x desc, id asc)

A row's result depends only on its own logits, seed, position and parameters — never on the batch, the row's
index, or how many rows share the launch — so the fast path, the verifier and a replay agree. The noise is the
same integer hash as the host sampler; only the last bits of log/exp (libdevice vs libm) and the summation order
of the log-sum-exp and of the top-p masses differ from the numpy implementation, which is why the
implementation is fingerprinted.

Every per-row parameter travels in one int64 tensor [PARAM_ROWS, R] (float64 values as their bit patterns), so
a launch costs one host-to-device copy whatever the parameters.

Triton is imported lazily, so this module imports on a CPU-only machine; the kernels also run on CPU tensors
under TRITON_INTERPRET=1 (tests).
"""
from __future__ import annotations

import functools
import math
from types import ModuleType

import numpy as np
import torch

from engine.noise import noise_key

SPLIT = 8192        # vocab ids per pass-1 program (multiple of BLOCK)
BLOCK = 1024        # ids per chunk inside a program
NUM_WARPS = 4
# the filter and top-n programs walk the same BLOCK-wide chunks as pass 1 (the filter skips by their maxima)
SAMPLER_IMPL = f"triton-fp64-split{SPLIT}-block{BLOCK}-w{NUM_WARPS}-filter{BLOCK}-chunked2"
# rows of the packed parameter tensor
P_KEY, P_TEMP, P_TOP_K, P_TOP_P, P_LOG_MIN_P, P_ROW, P_TOP_N = range(7)
PARAM_ROWS = 7


def row_key(seed: int, position: int) -> int:
    """engine.noise.noise_key(seed, position) as a signed int64 (bit pattern kept) for the kernel."""
    return int(noise_key(seed, position).view(np.int64)[0])


def pack_params(rows: list[int], keys: np.ndarray, temps: list[float], top_k: list[int] | None = None,
                top_p: list[float] | None = None, min_p: list[float] | None = None,
                top_n: list[int] | None = None) -> np.ndarray:
    """The per-row parameters as one int64 array [PARAM_ROWS, R]. keys: uint64 or int64 [R] (bit patterns);
    log(min_p) is taken here, on the host (math.log, -inf for 0), as the host sampler takes it."""
    r = len(rows)
    out = np.zeros((PARAM_ROWS, r), np.int64)
    out[P_KEY] = np.asarray(keys).view(np.int64)
    out[P_TEMP] = np.asarray(temps, np.float64).view(np.int64)
    out[P_TOP_K] = top_k if top_k is not None else 0
    out[P_TOP_P] = np.asarray(top_p if top_p is not None else [1.0] * r, np.float64).view(np.int64)
    logs = [math.log(m) if m > 0 else -math.inf for m in (min_p or [0.0] * r)]
    out[P_LOG_MIN_P] = np.asarray(logs, np.float64).view(np.int64)
    out[P_ROW] = rows
    out[P_TOP_N] = top_n if top_n is not None else 0
    return out


@functools.cache
def _kernels() -> tuple[ModuleType, ModuleType]:
    """Import triton (and compile on first launch) only when a kernel is first used."""
    import triton

    from engine.kernels import triton_sampler_kernels as k

    return triton, k


def sample_packed(logits: torch.Tensor, params: torch.Tensor, top_n: int = 0, filtered: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sample the rows described by `params` (Int64[PARAM_ROWS, R] from `pack_params`, on the logits' device)
    of `logits` [N, vocab] (any float dtype; read as float32). top_n: the largest P_TOP_N of the rows (0: none).
    filtered: some row asks for top-k / top-p / min-p (False skips the filter launch; the filter kernel leaves
    every other row as it is, so a row's result does not depend on it).

    Returns (token Int64[R], logprob Float32[R], lse Float64[R], top ids Int64[R, top_n] | None,
    top logprobs Float32[R, top_n] | None) on the logits' device, without waiting for them.
    """
    triton, k = _kernels()
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [N, vocab] with a contiguous vocab dim, got {tuple(logits.shape)}")
    n, vocab = params.shape[1], logits.shape[1]
    dev = logits.device
    num_splits = triton.cdiv(vocab, SPLIT)
    best = torch.empty(n * num_splits, dtype=torch.float64, device=dev)
    arg = torch.empty(n * num_splits, dtype=torch.int64, device=dev)
    m = torch.empty(n * num_splits, dtype=torch.float64, device=dev)
    s = torch.empty(n * num_splits, dtype=torch.float64, device=dev)
    token = torch.empty(n, dtype=torch.int64, device=dev)
    logprob = torch.empty(n, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float64, device=dev)
    xmax = torch.empty(n, dtype=torch.float64, device=dev)
    top_ids = torch.empty((n, top_n), dtype=torch.int64, device=dev) if top_n else None
    top_lps = torch.empty((n, top_n), dtype=torch.float32, device=dev) if top_n else None
    if n == 0:
        return token, logprob, lse, top_ids, top_lps
    n_chunks = triton.cdiv(vocab, BLOCK)
    row_ids, keys, temps = params[P_ROW], params[P_KEY], params[P_TEMP].view(torch.float64)
    # what pass 1 leaves the filter: per split the top-p total's (max, sum), per chunk (max x, best score, its id)
    tm = torch.empty(n * num_splits, dtype=torch.float64, device=dev)
    ts = torch.empty(n * num_splits, dtype=torch.float64, device=dev)
    cmax = torch.empty(n * n_chunks, dtype=torch.float32, device=dev)
    cbest = torch.empty(n * n_chunks, dtype=torch.float64, device=dev)
    cid = torch.empty(n * n_chunks, dtype=torch.int64, device=dev)
    k.split_kernel[(n, num_splits)](logits, logits.stride(0), row_ids, keys, temps, params[P_TOP_K],
                                    params[P_TOP_P].view(torch.float64), best, arg, m, s, tm, ts, cmax, cbest, cid,
                                    vocab, n_chunks, NUM_SPLITS=num_splits, SPLIT_=SPLIT, BLOCK_=BLOCK,
                                    num_warps=NUM_WARPS)
    k.merge_kernel[(n,)](logits, logits.stride(0), row_ids, best, arg, m, s, token, logprob, lse, xmax,
                         NUM_SPLITS=num_splits, num_warps=1)
    if filtered:  # the filtered rows' tokens and logprobs replace the unfiltered ones in place
        k.filter_kernel[(n,)](logits, logits.stride(0), params, n, xmax, lse, token, logprob, cmax, cbest, cid,
                              tm, ts, vocab, n_chunks, NUM_SPLITS=num_splits,
                              NCHUNK_PAD=triton.next_power_of_2(n_chunks), BLOCK_=BLOCK, num_warps=NUM_WARPS)
    if top_n:
        k.top_logprobs_kernel[(n,)](logits, logits.stride(0), params, n, lse, top_ids, top_lps, vocab,
                                    NMAX=top_n, VOCAB_PAD=n_chunks * BLOCK, BLOCK_=BLOCK, num_warps=NUM_WARPS)
    return token, logprob, lse, top_ids, top_lps


def gumbel_sample(logits: torch.Tensor, row_ids: torch.Tensor, keys: torch.Tensor, temps: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unfiltered rows `row_ids` of `logits` [N, vocab]: keys Int64[R] (`row_key`), temps Float64[R]
    (0 = greedy argmax, first id on ties). Returns (token Int64[R], logprob Float32[R], lse Float64[R])."""
    params = pack_params(row_ids.tolist(), keys.cpu().numpy(), temps.cpu().tolist())
    token, logprob, lse, _, _ = sample_packed(logits, torch.from_numpy(params).to(logits.device))
    return token, logprob, lse
