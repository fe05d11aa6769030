"""What a decode step pays for canonical DVR rows, on the synthetic 8B (H200 diagnostic).

    python bench/canonical_step_probe.py --out DIR [--context 256] [--reps 50]

Times the captured decode step (CUDA events, median of --reps) at batch 16 and 64, rows at --context
keys, with no / one / every row flagged canonical: canonical rows on a side stream beside the split kernel
(dvr_decode_attention="canonical", the default: "side"), on the current stream ("same"), and every row of
a step with a flagged row canonical (dvr_decode_attention="canonical_step": "step"); "none" replays the
plain graph. Writes canonical-step-probe.json to DIR.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench.common import BLOCK_SIZE, contiguous_tables, environment, fill_cache_, time_cuda  # noqa: E402
from bench.results import write_result  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=50)
    a = ap.parse_args()
    from engine.cuda_graphs import DecodeGraphs
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    model = build_synthetic_model(synthetic_hf_config("llama-3.1-8b"), torch.bfloat16, "cuda", seed=0,
                                  attention_backend="triton")
    batches = (16, 64)
    nb = -(-(a.context + 1) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(2 + max(batches) * nb, BLOCK_SIZE)
    fill_cache_(kv)
    result: dict = {"environment": environment(sys.argv), "context": a.context, "runs": {}}
    for variant, concurrent, step in (("side", True, False), ("same", False, False), ("step", True, True)):
        model.attention.concurrent_canonical = concurrent
        graphs = DecodeGraphs(model, kv, max(batches), nb * BLOCK_SIZE, scratch_slot=BLOCK_SIZE,
                              batch_sizes=batches, canonical=True, canonical_step=step)
        graphs.capture()
        for b in batches:
            tables = contiguous_tables(b, nb)
            ids = [(5 * r + 3) % model.arch.vocab_size for r in range(b)]
            pos, lens = [a.context - 1] * b, [a.context] * b
            for name, flags in (("none", [0] * b), ("one", [1] + [0] * (b - 1)), ("all", [1] * b)):
                t = time_cuda(lambda: graphs.run(ids, pos, lens, tables, flags), reps=a.reps)
                key = f"b{b}-{variant}-{name}"
                result["runs"][key] = t["median_ms"]
                print(key, round(t["median_ms"], 4), "ms", flush=True)
        del graphs
        torch.cuda.synchronize()
    write_result(result, a.out, "canonical-step-probe")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
