"""What the canonical decode kernel's grid costs a verify pass's carried rows and a DVR decode step, on the
synthetic 8B (H200 diagnostic).

    python bench/verify_probe.py --out DIR [--context 256] [--reps 30] [--programs 0,2048,4096]

For each value of KernelSettings.chunk_programs in --programs (0: one program per key chunk of the
table), captured as the engine captures them:
- the G x W + D verify graph (G = 8, W = 32, D = 64, tables as wide as the served context, 8192 keys), its 8
  verify rows and 64 carried rows at --context keys; and once the same pass with D = 0;
- the decode graph of 96 rows at --context keys in the first family (tables of GRAPH_MAX_LEN keys), every row
  canonical (dvr_decode_attention="canonical_step_short", the dvr default at 100 % deterministic traffic, and
  batch_invariant's decode), and the plain split-KV step of the same rows (nondeterministic).
Median ms over --reps (CUDA events), each graph's kernels under the profiler, and whether the outputs of every
chunk_programs value are bitwise those of the first. Writes verify-probe.json to DIR.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.step_probe import profile_replays  # noqa: E402
from bench.engine_bench.common import BLOCK_SIZE, contiguous_tables, environment, fill_cache_, time_cuda  # noqa: E402
from bench.results import write_result  # noqa: E402
from engine.config import RESERVED_BLOCKS  # noqa: E402

G, W, D, DECODE_ROWS, SERVED = 8, 32, 64, 96, 8192


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--programs", default="0,2048,4096")
    a = ap.parse_args()
    from engine.config import KernelSettings
    from engine.cuda_graphs import GRAPH_MAX_LEN, DecodeGraphs, VerifyGraph
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    programs = [int(x) for x in a.programs.split(",")]
    result: dict[str, Any] = {"environment": environment(sys.argv), "context": a.context, "runs": {}}

    def dump() -> None:
        write_result(result, a.out, "verify-probe")

    model = build_synthetic_model(synthetic_hf_config("llama-3.1-8b"), torch.bfloat16, "cuda", seed=0,
                                  attention_backend="triton")
    vocab = model.arch.vocab_size
    ctx = a.context
    nb = -(-(ctx + W + 1) // BLOCK_SIZE)
    rows_total = G + D + DECODE_ROWS
    kv = model.allocate_kv_cache(RESERVED_BLOCKS + rows_total * nb, BLOCK_SIZE)
    fill_cache_(kv)
    tables = contiguous_tables(rows_total, nb)
    vt, ct, dt = tables[:G], tables[G:G + D], tables[G + D:]

    def slot(table: list[int], p: int) -> int:
        return table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE

    def verify_inputs(carried: int) -> tuple[list[int], list[int], list[int], list[int], list[list[int]]]:
        ids, pos, slots, lens = [], [], [], []
        for r in range(G):  # window tokens at positions ctx .. ctx + W - 1
            ids += [(7 * r + i) % vocab for i in range(W)]
            pos += list(range(ctx, ctx + W))
            slots += [slot(vt[r], p) for p in range(ctx, ctx + W)]
            lens.append(ctx + W)
        for r in range(carried):  # one decode token at position ctx - 1
            ids.append((11 * r + 3) % vocab)
            pos.append(ctx - 1)
            slots.append(slot(ct[r], ctx - 1))
            lens.append(ctx)
        return ids, pos, slots, lens, vt + ct[:carried]

    outputs: dict[str, torch.Tensor] = {}

    def record(key: str, fn: Any, logits: torch.Tensor) -> None:
        t = time_cuda(fn, reps=a.reps)
        prof = profile_replays(fn)
        base = key.split("@")[0]
        fn()
        torch.cuda.synchronize()
        same = None
        if base in outputs:
            same = bool(torch.equal(outputs[base], logits))
        else:
            outputs[base] = logits.clone()
        result["runs"][key] = {"median_ms": t["median_ms"], "bitwise_equal_to_first": same, "profile": prof}
        print(key, round(t["median_ms"], 4), "ms", "kernel us", prof["kernel_us_per_replay"], "same", same, flush=True)
        dump()

    with torch.inference_mode():
        vg0 = VerifyGraph(model, kv, G, W, SERVED, 0)
        vg0.stage(*verify_inputs(0))
        vg0.capture()
        record("verify_d0", vg0.graph.replay, vg0.logits)
        del vg0
        base = model
        for p in programs:
            model = base.with_kernels(KernelSettings(chunk_programs=p))
            vg = VerifyGraph(model, kv, G, W, SERVED, D)
            vg.stage(*verify_inputs(D))
            vg.capture()
            result["runs"].setdefault(f"verify_d{D}_bit_exact_capture@{p}", vg.bit_exact)
            record(f"verify_d{D}@{p}", vg.graph.replay, vg.logits)
            del vg
            graphs = DecodeGraphs(model, kv, DECODE_ROWS, GRAPH_MAX_LEN, scratch_slot=BLOCK_SIZE,
                                  batch_sizes=(DECODE_ROWS,), canonical=True, canonical_step=True)
            graphs.capture()
            ids = [(5 * r + 3) % vocab for r in range(DECODE_ROWS)]
            posn, lens = [ctx - 1] * DECODE_ROWS, [ctx] * DECODE_ROWS
            for name, flags in (("split", [0] * DECODE_ROWS), ("canonical", [1] * DECODE_ROWS)):
                logits = graphs.run(ids, posn, lens, dt, flags)
                assert logits is not None
                record(f"decode_b{DECODE_ROWS}_{name}@{p}", lambda: graphs.run(ids, posn, lens, dt, flags), logits)
            del graphs
            torch.cuda.synchronize()
    dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
