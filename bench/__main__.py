"""`python -m bench COMMAND ...`: the engine benchmarks, from the source root.

    engine      the GPU engine benchmark by section (core, modes, long, ...): bench/engine_bench/cli.py
    replay      replay cost against generation (GPU; --device cpu for a smoke run): bench/engine_bench/replay.py
    cpu         engine throughput on the CPU against transformers, or --replay: bench/engine_bench/cpu.py
    bi-matmul   the batch-invariant GEMM's tile shapes, time and bits (GPU): bench/engine_bench/bi_matmul.py

`python -m bench COMMAND --help` lists a command's flags. The service benchmarks are scripts of their own
(bench/serve_bench.py, bench/ledger_bench.py, bench/sampler_bench.py).
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {"engine": "bench.engine_bench.cli", "replay": "bench.engine_bench.replay",
            "cpu": "bench.engine_bench.cpu", "bi-matmul": "bench.engine_bench.bi_matmul"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__, file=sys.stderr)
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return int(importlib.import_module(COMMANDS[argv[0]]).main(argv[1:]) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
