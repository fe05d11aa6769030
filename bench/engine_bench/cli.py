"""`python -m bench engine`: the sections by name or preset, each under the run's deadline and its own budget;
the result JSON and chart rewritten after every section (bench.engine_bench has the section list)."""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import engine_bench
from bench.engine_bench.common import Ctx, cublaslt_min_rows, environment
from bench.engine_bench.core import (
    bench_bandwidth,
    bench_bi_breakdown,
    bench_decode_breakdown,
    bench_decode_step,
    bench_engine_generate,
    bench_hf_generate,
    bench_lite_generate,
    bench_verify_cost,
)
from bench.engine_bench.long import bench_compare_modes_synthetic_long
from bench.engine_bench.mixes import SAMPLING_PRESETS
from bench.engine_bench.modes import bench_compare_modes, bench_compare_modes_synthetic
from bench.engine_bench.report import chart, summary
from bench.engine_bench.smollm2 import COMMITTED_SMOLLM2_FAULT_RATE, bench_smollm2_rollback, bench_wg_sweep
from engine.config import DEFAULT_VERIFY_DECODE_ROWS, QUERY_TILES, KernelSettings

SYNTHETIC_SECTIONS = ("bandwidth", "decode_step", "decode_breakdown", "lite_generate", "verify_cost",
                      "engine_generate", "hf_generate")


ALL_SECTIONS = SYNTHETIC_SECTIONS + ("bi_breakdown", "smollm2_rollback", "compare_modes",
                                     "compare_modes_synthetic", "compare_modes_synthetic_long", "wg_sweep")


# Each preset is sized to finish well inside one 10-minute device call (estimates from the 2026-11-29 runs).
SECTION_PRESETS: dict[str, tuple[str, ...]] = {
    "core": ("bandwidth", "decode_step", "decode_breakdown", "lite_generate", "engine_generate", "hf_generate",
             "verify_cost"),                                                    # ~4 min
    "modes": ("smollm2_rollback", "compare_modes", "compare_modes_synthetic"),  # ~6 min
    "sweep": ("wg_sweep",),                                                     # ~4 min
    "bi": ("bi_breakdown",),                                                    # ~1 min
    "long": ("compare_modes_synthetic_long",),                                  # ~6 min
    # the whole mode comparison in one run (--compare-modes): ~20 min, more than one 10-minute device call,
    # so a device call runs it as the presets modes, long and sweep
    "compare": ("smollm2_rollback", "compare_modes", "compare_modes_synthetic", "compare_modes_synthetic_long",
                "wg_sweep"),
    "all": ALL_SECTIONS,
}


SECTIONS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "bandwidth": bench_bandwidth, "decode_step": bench_decode_step, "decode_breakdown": bench_decode_breakdown,
    "lite_generate": bench_lite_generate,
    "verify_cost": bench_verify_cost, "bi_breakdown": bench_bi_breakdown,
    "engine_generate": bench_engine_generate, "hf_generate": bench_hf_generate,
    "smollm2_rollback": bench_smollm2_rollback, "compare_modes": bench_compare_modes,
    "compare_modes_synthetic": bench_compare_modes_synthetic,
    "compare_modes_synthetic_long": bench_compare_modes_synthetic_long, "wg_sweep": bench_wg_sweep,
}


def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: list[str]) -> argparse.Namespace:
    presets = "; ".join(f"{k} = {','.join(v)}" for k, v in SECTION_PRESETS.items() if k != "all")
    p = argparse.ArgumentParser(prog="python -m bench engine", description=engine_bench.__doc__.split("\n")[0],
                                epilog=f"presets: {presets}")
    p.add_argument("--sections", default="core",
                   help=f"comma list of sections ({','.join(ALL_SECTIONS)}) and presets ({','.join(SECTION_PRESETS)})")
    p.add_argument("--compare-modes", action="store_true",
                   help="the determinism-strategy comparison (preset 'compare'): nondeterministic, dvr at "
                        "2/10/50/100 %% and batch_invariant on SmolLM2 and the synthetic 8B, every request set, "
                        "SmolLM2 rollback rates and the W/G sweep; replaces --sections")
    p.add_argument("--deadline-s", type=float, default=480.0,
                   help="whole-run limit from start: later work is skipped/capped and marked truncated "
                        "(keep it under the device call's limit)")
    p.add_argument("--budget-s", default="",
                   help="per-section limits: SECONDS for every section, or SECTION=SECONDS[,SECTION=SECONDS]")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default="gpu-bench", help="file stem of the JSON/PNG")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count (quick runs)")
    p.add_argument("--batches", type=_csv_ints, default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256, help="keys per row in decode_step / verify_cost")
    p.add_argument("--decode-attention", default="split", choices=["split", "canonical"],
                   help="synthetic model's decode attention in the core sections: split-KV kernel or the verifier's")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--engine-cap-s", type=float, default=60.0)
    p.add_argument("--hf-cb-cap-s", type=float, default=90.0, help="transformers continuous batching, timed part")
    p.add_argument("--gguf", default="default", help="SmolLM2 model for the smollm2 sections")
    p.add_argument("--sampling", default="greedy", choices=sorted(SAMPLING_PRESETS),
                   help="compare_modes sections: the sampling parameters of every request")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--dvr-decode-attention", default="auto",
                   choices=["auto", "canonical", "canonical_step", "canonical_step_short", "split"],
                   help="DvrTuning.dvr_decode_attention in the compare_modes sections")
    p.add_argument("--decode-cublaslt-min-rows", type=int, default=None,
                   help="DvrTuning.decode_cublaslt_min_rows for every engine and decode graph the bench "
                        "builds (graphs of at least this many padded rows capture their GEMMs with cuBLASLt; "
                        "0 = never; default: the engine's, DEFAULT_DECODE_CUBLASLT_MIN_ROWS)")
    p.add_argument("--fuse-rope-canonical", choices=["on", "off"], default=None,
                   help="KernelSettings.fuse_rope_canonical of every engine and model of the run (RoPE and the "
                        "K/V store inside the canonical decode kernel: dvr's and batch_invariant's decode "
                        "steps); default: KernelSettings'")
    p.add_argument("--query-tile", type=int, choices=list(QUERY_TILES), default=None,
                   help="KernelSettings.query_tile of the run: the canonical kernels' query-tile rows "
                        "(prefill, verify, canonical decode; another kernel id, other committed bits); "
                        "default: KernelSettings' (16)")
    p.add_argument("--concurrent-carried", choices=["on", "off"], default=None,
                   help="KernelSettings.concurrent_carried of the run (a verify pass's carried decode rows on a "
                        "second stream beside its verify rows); default: KernelSettings'")
    p.add_argument("--profile-modes", type=_csv, default=[],
                   help="modes (nondeterministic, dvr_100pct, ...) that get one more run under torch.profiler "
                        "after their timed runs: GPU busy time, kernels, gaps (a diagnostic; not timed)")
    p.add_argument("--profile-host", action="store_true",
                   help="the --profile-modes runs record host activity too: CUDA runtime calls and torch ops by "
                        "host time (the profiler's own host overhead slows those runs)")
    p.add_argument("--chunk-programs", type=int, default=None,
                   help="KernelSettings.chunk_programs of the run (the canonical decode kernel's programs per "
                        "launch it aims at; 0 = one program per key chunk of the table; the bits do not depend on "
                        "it); default: KernelSettings'")
    p.add_argument("--prefill-pass-tile", type=int, choices=list(QUERY_TILES), default=None,
                   help="KernelSettings.prefill_pass_tile of the run: the query tile of plain prefill passes (dvr "
                        "and nondeterministic; batch_invariant keeps the canonical tile); default: the canonical "
                        "tile")
    p.add_argument("--verify-decode-rows", type=int, default=None,
                   help="DvrTuning.verify_decode_rows for every dvr engine of the run: the decode rows each "
                        "verify pass carries (0 = off; another value, other committed bits); default: the "
                        f"engine's ({DEFAULT_VERIFY_DECODE_ROWS} on the triton backend)")
    p.add_argument("--canonical-prefill-min-tokens", type=int, default=None,
                   help="DvrTuning.canonical_prefill_min_tokens for every engine of the run (the smallest "
                        "canonical prefill pass of a deterministic prompt; another value, other committed "
                        "bits); default: the engine's")
    p.add_argument("--canonical-prefill-chunk-tokens", type=int, default=None,
                   help="DvrTuning.canonical_prefill_chunk_tokens for every engine of the run (C > 0: every GEMM "
                        "of a canonical prefill pass runs on C rows and the pass takes the size of its content, "
                        "rounded up to a multiple of C; 0 = off; another value, other committed bits); default: "
                        "the engine's")
    p.add_argument("--verify-early-decode", choices=["on", "off"], default=None,
                   help="DvrTuning.verify_early_decode for every engine of the run (a verify pass launches the "
                        "next decode step before reading its samples); default: the engine's (on for CUDA)")
    p.add_argument("--chained-verify", choices=["on", "off"], default=None,
                   help="DvrTuning.chained_verify for every engine of the run (a verify pass due while a decode "
                        "step is in flight is launched behind it); default: the engine's")
    p.add_argument("--verify-packing", choices=["padded", "packed"], default=None,
                   help="DvrTuning.verify_packing for every dvr engine of the run (packed: a verify pass lays "
                        "its windows back to back and takes as many as fit in G*W tokens); default: the engine's")
    p.add_argument("--verify-trigger", choices=["tokens", "windows"], default=None,
                   help="DvrTuning.verify_trigger for every dvr engine of the run (packed passes: due at G*W "
                        "tokens of windows, or at G windows); default: the engine's")
    p.add_argument("--modes", type=_csv, default=[],
                   help="compare_modes sections: run only these modes (nondeterministic, dvr_2pct, dvr_10pct, "
                        "dvr_50pct, dvr_100pct, batch_invariant); default: all")
    p.add_argument("--window", type=int, default=32, help="W of the compare_modes sections' engines")
    p.add_argument("--rollback-windows", type=_csv_ints, default=[16, 32, 64])
    p.add_argument("--rollback-decode-attention", type=_csv, default=["canonical", "split"],
                   help="DvrTuning.dvr_decode_attention values smollm2_rollback runs per window")
    p.add_argument("--rollback-prompts", type=int, default=256)
    p.add_argument("--rollback-tokens", type=int, default=256)
    p.add_argument("--rollback-cap-s", type=float, default=60.0)
    p.add_argument("--smol-kv-blocks", type=int, default=12000)
    p.add_argument("--compare-requests", type=int, default=96)
    p.add_argument("--compare-tokens", type=int, default=128)
    p.add_argument("--compare-cap-s", type=float, default=30.0, help="per mode, ShareGPT-like mixes")
    p.add_argument("--dvr-lookahead", type=int, default=None,
                   help="DvrTuning.dvr_lookahead in the compare_modes sections (default: the engine's)")
    p.add_argument("--mode-repeats", type=int, default=3,
                   help="timed runs per mode on its warm engine; the median run (by time) is reported")
    p.add_argument("--fixed-cap-s", type=float, default=80.0, help="per mode, fixed request sets")
    p.add_argument("--synthetic-sets", type=_csv, default=["sharegpt", "16x1024x256", "sharegpt-896x640"],
                   help="compare_modes_synthetic request sets: 'sharegpt' (outputs <= --compare-tokens), "
                        "'sharegpt-PxO' (prompts <= P, outputs <= O) and/or REQUESTSxPROMPTxOUTPUT")
    p.add_argument("--long-sets", type=_csv, default=["16x4096x1024"],
                   help="compare_modes_synthetic_long request sets (the issue's 4k-in/1k-out)")
    p.add_argument("--fault-rate", type=float, default=COMMITTED_SMOLLM2_FAULT_RATE,
                   help="injected rollbacks per token on the synthetic 8B when this run did not measure SmolLM2 "
                        "W=32 canonical first (default: the committed SmolLM2 W=32 measurement)")
    p.add_argument("--no-measured-fault-rate", dest="use_measured_fault_rate", action="store_false",
                   help="inject --fault-rate even when smollm2_rollback measured W=32 canonical in this run")
    p.add_argument("--sweep-requests", type=int, default=128)
    p.add_argument("--sweep-tokens", type=int, default=128)
    p.add_argument("--sweep-cap-s", type=float, default=30.0)
    p.add_argument("--sweep-decode-attention", default="canonical", choices=["canonical", "split"])
    p.add_argument("--no-sweep-other-decode", dest="sweep_other_decode", action="store_false",
                   help="skip the G=8 runs with the other DVR decode attention")
    p.add_argument("--no-engine-graphs", dest="engine_graphs", action="store_false",
                   help="engine runs without CUDA graphs")
    args = p.parse_args(argv)
    if args.compare_modes:
        args.sections = "compare"
    try:
        args.section_names = expand_sections(args.sections)
        args.budgets = parse_budgets(args.budget_s)
        args.kernels = kernel_settings(args)
    except ValueError as exc:
        p.error(str(exc))
    return args


def kernel_settings(args: argparse.Namespace) -> KernelSettings:
    """The run's KernelSettings: KernelSettings' defaults, the kernel flags given over them."""
    given = {"query_tile": args.query_tile, "prefill_pass_tile": args.prefill_pass_tile,
             "chunk_programs": args.chunk_programs,
             "fuse_rope_canonical": None if args.fuse_rope_canonical is None else args.fuse_rope_canonical == "on",
             "concurrent_carried": None if args.concurrent_carried is None else args.concurrent_carried == "on"}
    return KernelSettings(**{k: v for k, v in given.items() if v is not None})


def expand_sections(spec: str) -> list[str]:
    """'core,wg_sweep' -> the preset's sections then wg_sweep, each once, in order; unknown names raise."""
    names: list[str] = []
    for item in _csv(spec):
        expanded = SECTION_PRESETS.get(item, (item,))
        unknown = [n for n in expanded if n not in ALL_SECTIONS]
        if unknown:
            raise ValueError(f"unknown sections {unknown}; known: {list(ALL_SECTIONS)}, "
                             f"presets: {list(SECTION_PRESETS)}")
        names += [n for n in expanded if n not in names]
    return names


def parse_budgets(spec: str) -> dict[str, float]:
    """'120' -> every section 120 s; 'wg_sweep=200,hf_generate=90' -> those sections."""
    spec = spec.strip()
    if not spec:
        return {}
    if "=" not in spec:
        return {name: float(spec) for name in ALL_SECTIONS}
    budgets = {}
    for item in _csv(spec):
        name, _, seconds = item.partition("=")
        if name not in ALL_SECTIONS:
            raise ValueError(f"--budget-s: unknown section {name!r}")
        budgets[name] = float(seconds)
    return budgets


def packed_matches_8b(kernels: KernelSettings) -> bool:
    """triton_canonical_decode.packed_matches_prefill at Llama-3.1-8B heads (GQA group 4, head_dim 128, bf16)."""
    from engine.attention import triton_canonical_decode

    return triton_canonical_decode.packed_matches_prefill(torch.device("cuda"), torch.bfloat16, 4, 128, kernels)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench engine: no CUDA device (the GPU benchmarks, --compare-modes included, need one; "
              "the CPU benchmark is `python -m bench cpu`)", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    from engine.placement import place_engine_here

    result: dict[str, Any] = {"environment": {**environment(argv), "engine_cpus": place_engine_here()}}
    kernels = args.kernels
    result["plan"] = {"sections": args.section_names, "sampling": args.sampling, "deadline_s": args.deadline_s, "budgets_s": args.budgets,
                      # the rows from which decode graphs use cuBLASLt, in every engine and graph of this run
                      "decode_cublaslt_min_rows": cublaslt_min_rows(args),
                      "fuse_rope_canonical": kernels.fuse_rope_canonical,
                      "concurrent_carried": kernels.concurrent_carried,
                      "chunk_programs": kernels.chunk_programs,
                      "prefill_pass_tile": args.prefill_pass_tile,  # None: the query tile
                      "query_tile": kernels.query_tile,
                      # decode rows a dvr verify pass carries (None: the engine's default)
                      "verify_decode_rows": (DEFAULT_VERIFY_DECODE_ROWS if args.verify_decode_rows is None
                                             else args.verify_decode_rows),
                      "attention_kernel": kernels.kernel_id(),
                      "canonical_prefill_min_tokens": args.canonical_prefill_min_tokens,  # None: the engine's
                      "canonical_prefill_chunk_tokens": args.canonical_prefill_chunk_tokens,  # None: the engine's
                      "modes": args.modes or "all", "window": args.window,
                      "verify_early_decode": args.verify_early_decode or "engine default (on)",
                      "chained_verify": args.chained_verify or "engine default",
                      "verify_packing": args.verify_packing or "engine default (packed)",
                      "verify_trigger": args.verify_trigger or "engine default (tokens when packed)",
                      # whether the GQA-packed canonical decode kernel gives the prefill kernel's bits at the
                      # 8B heads here (else canonical rows fall back to the prefill kernel, one head a program)
                      "packed_canonical_decode_8b": packed_matches_8b(kernels)}
    ctx = Ctx(args=args, device=torch.device("cuda"), result=result, out_dir=out_dir, name=args.name)
    ctx.deadline = ctx.t_start + args.deadline_s
    png_path = out_dir / f"{args.name}.png"
    for name in args.section_names:
        ctx.begin(name, args.budgets.get(name))
        t0 = time.perf_counter()
        if ctx.left() <= 0:
            result[name] = {"skipped": "run deadline reached before the section", "truncated": True}
        else:
            try:
                result[name] = SECTIONS[name](ctx)
            except Exception:  # a benchmark section's failure is a result to record, not a reason to stop
                result[name] = {**(ctx.live or {}), "error": traceback.format_exc(limit=8)}
            result[name].pop("in_progress", None)
            if ctx.truncated:
                result[name]["truncated"] = True
        result[name]["section_s"] = round(time.perf_counter() - t0, 2)
        ctx.log(f"done in {result[name]['section_s']:.1f}s: {json.dumps(result[name], default=str)[:400]}")
        ctx.write()
        try:
            chart(result, png_path)
        except Exception:  # the JSON is the result; a chart failure must not lose it
            result["chart_error"] = traceback.format_exc(limit=4)
            ctx.write()
    print(summary(result), flush=True)
    return 0
