"""A start-up probe: are the model's own GEMM shapes batch invariant on this machine?

The CPU path's invariance inside a 16-row tile is measured, not guaranteed by a library contract
(tiles.py). An engine in `batch_invariant` mode can call `check_linear_shapes` once per model with
its weight shapes; it costs a few GEMMs per shape and raises with the shape that fails.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from engine.kernels.ops import Ops

_PROBE_ROWS = 40  # three 16-row tiles, the last one padded


def check_linear_shapes(
    ops: Ops, shapes: Iterable[tuple[int, int]], dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> None:
    """For each weight shape (N, K): batch 1, a row permutation and a prefix give the same rows bitwise."""
    g = torch.Generator().manual_seed(seed)
    for n, k in sorted(set(shapes)):
        x = torch.randn(_PROBE_ROWS, k, generator=g).to(device=device, dtype=dtype)
        w = torch.randn(n, k, generator=g).to(device=device, dtype=dtype)
        full = ops.linear(x, w)  # [40, N]
        perm = torch.randperm(_PROBE_ROWS, generator=g).to(device)
        checks = {
            "batch 1": torch.equal(ops.linear(x[:1], w), full[:1]),
            "prefix of 17": torch.equal(ops.linear(x[:17], w), full[:17]),
            "row permutation": torch.equal(ops.linear(x[perm], w), full[perm]),
        }
        failed = [name for name, ok in checks.items() if not ok]
        if failed:
            raise RuntimeError(
                f"{ops.name} linear is not batch invariant for weight [{n}, {k}] {dtype} on {device}: "
                f"{', '.join(failed)} differ"
            )
