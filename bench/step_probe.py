"""Where the 8B decode step and the verify pass spend their time, and what would hide the verify pass
(H200 diagnostic).

    python bench/step_probe.py --out DIR [--context 256] [--reps 30]

1. GEMMs of every 8B linear shape at M = 1 / 64 / 256 / 320 / 384 (`GEMM_ROWS`), cuBLAS (torch's default)
   against cuBLASLt (`torch.backends.cuda.preferred_blas_library`): median ms, TB/s of weight traffic, TFLOP/s.
2. Captured decode steps (batch 1 and 64, plain split-KV graphs) and the captured 8 x 32 verify pass:
   median ms, and each one's kernels under the profiler (count, device time by kernel, and the time
   between kernels = replay time - summed kernel time).
3. Concurrency: the verify graph on a side stream while the main stream replays k decode steps, against
   the same work one after the other (k = 1, 2, 3).
4. With --split-sweep: the captured decode step at batch 16 / 32 / 64 for
   each split-KV split size 64 / 128 / 256 / 512, and for the default split at other warps / pipeline
   stages of the split kernel (`KernelSettings.decode_num_warps` / `decode_num_stages`), cuBLASLt from the
   engine's default row count as the engine captures it, with the split kernel's device time: whether
   the split table and launch leave time at the batches of the core throughput runs.
   `--only-split-sweep` skips 1-3.
Writes step-probe.json to DIR.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.engine_bench.common import BLOCK_SIZE, contiguous_tables, environment, fill_cache_, time_cuda  # noqa: E402
from bench.engine_bench.core import kernel_times  # noqa: E402
from bench.results import write_result  # noqa: E402
from engine.config import RESERVED_BLOCKS  # noqa: E402


# M = 1 / 64: decode; 256: the 8 x 32 verify pass; 320 / 384: a verify pass carrying a decode step's 64 / 128
# rows beside its 256 tokens (one weight read for both)
GEMM_ROWS = (1, 64, 256, 320, 384)


def gemm_table(model: Any, reps: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for lib in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(lib)
        for n, k in model.linear_shapes():
            w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
            for m in GEMM_ROWS:
                x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                ms = time_cuda(lambda: torch.nn.functional.linear(x, w), reps=reps)["median_ms"]
                out[f"{lib} n{n} k{k} m{m}"] = {
                    "ms": round(ms, 4), "weight_tb_s": round(n * k * 2 / ms / 1e9, 3),
                    "tflops": round(2 * m * n * k / ms / 1e9, 1)}
                print(lib, n, k, m, out[f"{lib} n{n} k{k} m{m}"], flush=True)
            del w
    torch.backends.cuda.preferred_blas_library("cublas")
    return out


def profile_replays(fn: Any, n: int = 5) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    by_name = kernel_times(prof, name_len=90)
    total = sum(sum(v) for v in by_name.values()) / n
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:25]
    return {"kernels_per_replay": sum(len(v) for v in by_name.values()) / n, "kernel_us_per_replay": round(total, 1),
            "top": [{"name": k, "count": len(v) / n, "us": round(sum(v) / n, 1)} for k, v in top]}


def stage_decode(graphs: Any, model: Any, rows: int, nb: int, context: int) -> Any:
    """Run the captured decode step of `rows` rows once at `context` keys (contiguous tables of `nb` blocks)
    and return its graph: replays reuse the staged inputs."""
    graphs.run([(5 * r + 3) % model.arch.vocab_size for r in range(rows)], [context - 1] * rows,
               [context] * rows, contiguous_tables(rows, nb))
    return graphs.graphs[rows]


def split_sweep(model: Any, kv: Any, nb: int, context: int, reps: int,
                batches: tuple[int, ...] = (16, 32, 64),
                sizes: tuple[int, ...] = (64, 128, 256, 512)) -> dict[str, Any]:
    """Median replay ms of the captured decode step per (variant, batch) and the split kernel's device µs per
    replay. Variants: each split size at the default launch, and the default split (by rows) at 4 or 8 warps
    and 2-4 pipeline stages, each a backend of its own on the model's weights."""
    from dataclasses import replace

    from engine.attention import triton_paged as tp
    from engine.attention.triton_backend import TritonPagedAttention
    from engine.config import DEFAULT_DECODE_CUBLASLT_MIN_ROWS
    from engine.cuda_graphs import DecodeGraphs

    base = model.attention.settings
    out: dict[str, Any] = {"context": context, "default_split": {b: tp.decode_split_for_rows(b) for b in batches},
                           "default_warps_stages": [base.decode_num_warps, base.decode_num_stages],
                           "cublaslt_min_rows": DEFAULT_DECODE_CUBLASLT_MIN_ROWS, "runs": {}}
    # each split size at the default launch; then the default split (by rows) at other warps / stages
    variants = [(size, base, f"split{size}") for size in sizes] + [
        (None, replace(base, decode_num_warps=w, decode_num_stages=st), f"w{w}s{st}")
        for w, st in ((4, 3), (4, 4), (8, 2), (8, 3))]
    for size, settings, tag in variants:
        view = model.with_numerics(model.ops, TritonPagedAttention(split_size=size, settings=settings))
        graphs = DecodeGraphs(view, kv, max(batches), nb * BLOCK_SIZE, scratch_slot=BLOCK_SIZE,
                              batch_sizes=batches, cublaslt_min_rows=DEFAULT_DECODE_CUBLASLT_MIN_ROWS)
        graphs.capture()
        for b in batches:
            step = stage_decode(graphs, view, b, nb, context)
            prof = profile_replays(step.replay)
            attn = sum(k["us"] for k in prof["top"] if "decode_split" in k["name"])
            out["runs"][f"{tag}_b{b}"] = {"median_ms": time_cuda(step.replay, reps=reps)["median_ms"],
                                          "split_kernel_us": round(attn, 1)}
            print(tag, "b", b, out["runs"][f"{tag}_b{b}"], flush=True)
        del graphs
        torch.cuda.synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--skip-gemm", action="store_true")
    ap.add_argument("--split-sweep", action="store_true", help="part 4: decode step time per split size")
    ap.add_argument("--only-split-sweep", action="store_true", help="part 4 alone")
    a = ap.parse_args()
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of
    from engine.cuda_graphs import DecodeGraphs, VerifyGraph
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    result: dict[str, Any] = {"environment": environment(sys.argv), "context": a.context}

    def dump() -> None:
        write_result(result, a.out, "step-probe")

    model = build_synthetic_model(synthetic_hf_config("llama-3.1-8b"), torch.bfloat16, "cuda", seed=0,
                                  attention_backend="triton")
    if not (a.skip_gemm or a.only_split_sweep):
        result["gemm"] = gemm_table(model, a.reps)
        dump()
    g, w = 8, 32
    batches = (1, 64)
    nb = -(-(a.context + w + 1) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(RESERVED_BLOCKS + (max(batches) + g) * nb, BLOCK_SIZE)
    fill_cache_(kv)
    if a.split_sweep or a.only_split_sweep:
        result["split_sweep"] = split_sweep(model, kv, nb, a.context, a.reps)
        dump()
    for lib in (() if a.only_split_sweep else ("cublas", "cublaslt")):
        torch.backends.cuda.preferred_blas_library(lib)
        res: dict[str, Any] = {}
        graphs = DecodeGraphs(model, kv, max(batches), nb * BLOCK_SIZE, scratch_slot=BLOCK_SIZE,
                              batch_sizes=batches)
        graphs.capture()
        vtables = contiguous_tables(g, nb, RESERVED_BLOCKS + max(batches) * nb)
        rows = [RowSpec(vtables[r], a.context, w) for r in range(g)]
        meta = build_metadata(PassKind.VERIFY, rows, BLOCK_SIZE, torch.device("cuda"))
        ids = torch.randint(0, model.arch.vocab_size, (g * w,), device="cuda")
        pos = positions_of(rows, torch.device("cuda"))
        vg = VerifyGraph(model, kv, g, w, nb * BLOCK_SIZE)
        vg.stage(ids.tolist(), pos.tolist(), meta.slot_mapping.tolist(), meta.seq_lens.tolist(), vtables)
        vg.capture()
        res["verify_bit_exact"] = vg.bit_exact
        steps = {}
        for b in batches:
            steps[b] = stage_decode(graphs, model, b, nb, a.context)
            t = time_cuda(steps[b].replay, reps=a.reps)
            res[f"decode_b{b}_ms"] = t["median_ms"]
            res[f"decode_b{b}_profile"] = profile_replays(steps[b].replay)
            print(lib, "decode", b, t["median_ms"], res[f"decode_b{b}_profile"]["kernel_us_per_replay"], flush=True)
        t = time_cuda(vg.graph.replay, reps=a.reps)
        res["verify_8x32_ms"] = t["median_ms"]
        res["verify_8x32_profile"] = profile_replays(vg.graph.replay)
        print(lib, "verify", t["median_ms"], res["verify_8x32_profile"]["kernel_us_per_replay"], flush=True)
        # concurrency: verify on a side stream beside k decode steps (b64) on the main stream
        side = torch.cuda.Stream()
        main_s = torch.cuda.current_stream()
        for k in (1, 2, 3):
            def serial() -> None:
                vg.graph.replay()
                for _ in range(k):
                    steps[64].replay()

            def concurrent() -> None:
                side.wait_stream(main_s)
                with torch.cuda.stream(side):
                    vg.graph.replay()
                for _ in range(k):
                    steps[64].replay()
                main_s.wait_stream(side)

            res[f"serial_k{k}_ms"] = time_cuda(serial, reps=a.reps)["median_ms"]
            res[f"concurrent_k{k}_ms"] = time_cuda(concurrent, reps=a.reps)["median_ms"]
            print(lib, "k", k, res[f"serial_k{k}_ms"], res[f"concurrent_k{k}_ms"], flush=True)
        result[lib] = res
        dump()
        del graphs, vg, steps
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    torch.backends.cuda.preferred_blas_library("cublas")
    dump()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
