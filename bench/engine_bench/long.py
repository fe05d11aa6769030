"""The mode comparison on the long fixed set(s) (compare_modes_synthetic_long: 4k in / 1k out)."""
from __future__ import annotations

from typing import Any

from bench.engine_bench.common import Ctx
from bench.engine_bench.modes import synthetic_modes


def bench_compare_modes_synthetic_long(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 on the synthetic 8B, the long fixed set(s) of --long-sets (4k in / 1k out)."""
    return synthetic_modes(ctx, ctx.args.long_sets)
