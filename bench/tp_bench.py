"""Tensor parallelism against one GPU on the synthetic Llama-3.1-8B (peaked logits), same machine, same run.

    python bench/tp_bench.py run --tp 1 --engine-mode nondeterministic --out DIR    # one engine per process
    python bench/tp_bench.py report DIR --out DIR --name tp-bench                   # -> tp-bench.json / .png

`run` builds one engine (`--tp` ranks, `--reduction`, EngineConfig defaults for CUDA: bfloat16, Triton
attention, CUDA graphs, overlap) and measures on it:
  nondeterministic   64 x 128 in / 128 out, every request non-deterministic: output tok/s; and the decode
                     step at batch 1 (one request decoding alone: the median wall time between decode steps)
  dvr                the same 64 requests with 10 % and with 100 % of them deterministic: output tok/s
  batch_invariant    the same 64 requests: output tok/s
and writes tp-bench-tp<N>-<engine mode>.json. A process holds one tensor-parallel engine, so each engine
runs in its own `run` (bench/h200.sh stage `tp` runs the six). `report` joins them: throughput at TP = 2
over TP = 1 (target >= 1.6), decode step TP = 2 over TP = 1 (target <= 0.65), each mode's tok/s over
nondeterministic at both sizes and their difference (target within 0.02).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the source root on the path
    sys.path.insert(0, str(ROOT))

from bench.results import write_result  # noqa: E402

MODEL = "synthetic:llama-3.1-8b:peaked"
REQUESTS, PROMPT_LEN, OUTPUT_LEN = 64, 128, 128
SHARES = {"nondeterministic": {"nondeterministic": 0.0}, "dvr": {"dvr_10pct": 0.1, "dvr_100pct": 1.0},
          "batch_invariant": {"batch_invariant": 1.0}}
TARGETS = {"throughput_ratio_min": 1.6, "decode_step_ratio_max": 0.65, "mode_ratio_delta_max": 0.02}


def build(args: argparse.Namespace) -> Any:
    from engine.config import EngineConfig
    from engine.llm import LLM

    blocks = 2 + REQUESTS * -(-(PROMPT_LEN + OUTPUT_LEN + 64) // 16) + 64
    return LLM(EngineConfig(model=MODEL, device="cuda", mode=args.engine_mode, tensor_parallel_size=args.tp,
                            tp_reduction=args.reduction, max_num_seqs=REQUESTS, num_kv_blocks=blocks,
                            max_model_len=4096, fault_rate=args.fault_rate, fault_seed=5))


def prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (PROMPT_LEN,), generator=gen).tolist() for _ in range(REQUESTS)]


def timed_run(llm: Any, batch: list[list[int]], share: float, tag: str, max_tokens: int = OUTPUT_LEN) -> dict[str, Any]:
    """All of `batch` at once, an evenly spread `share` deterministic: wall time and output tok/s."""
    from engine.sampling import SamplingParams

    n_det = round(share * len(batch))
    det = set(range(0, len(batch), max(1, round(len(batch) / n_det)))[:n_det]) if n_det else set()
    before = vars(llm.core.stats()).copy()
    seqs = [llm.core.add_request(f"{tag}-{i}", p, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i,
                                                                 deterministic=i in det))
            for i, p in enumerate(batch)]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while llm.core.has_work():
        llm.core.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for s in seqs)
    after = vars(llm.core.stats())
    stats = {k: after[k] - before[k] for k in ("verify_passes", "rollbacks", "decode_passes", "prefill_passes")}
    return {"seconds": seconds, "output_tok_per_s": tokens / seconds, "committed_tokens": tokens,
            "deterministic_requests": len(det), "stats": stats}


def decode_step_batch1(llm: Any, prompt: list[int], steps: int = 160) -> dict[str, Any]:
    """One request decoding alone: the wall time between consecutive decode steps (with overlap the host
    launches a step while the previous runs, so in steady state this is the device's step time)."""
    from engine.sampling import SamplingParams

    llm.core.add_request("batch1", prompt, SamplingParams(max_tokens=steps, ignore_eos=True, seed=1))
    totals = llm.core.totals
    walls = []
    while llm.core.has_work():
        before, t0 = totals.decode_passes, time.perf_counter()
        llm.core.step()
        if totals.decode_passes > before:
            walls.append(time.perf_counter() - t0)
    steady = walls[16:-4] or walls
    return {"decode_step_ms": 1e3 * statistics.median(steady), "decode_step_ms_mean": 1e3 * statistics.mean(steady),
            "steps_timed": len(steady)}


def cmd_run(args: argparse.Namespace) -> int:
    from engine.fingerprint import runtime_fingerprint

    started = time.perf_counter()
    llm = build(args)
    try:
        result: dict[str, Any] = {
            "tp": args.tp, "reduction": args.reduction, "engine_mode": args.engine_mode, "model": MODEL,
            "requests": REQUESTS, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "fault_rate": args.fault_rate,
            "startup_s": time.perf_counter() - started, "graphs": llm.core.runner.graphs_status,
            "fingerprint": runtime_fingerprint(llm.config), "environment": environment(), "modes": {}}
        batch = prompts(llm.core.shape.vocab_size)
        timed_run(llm, batch, 0.0, "warm", max_tokens=8)  # Triton compiles for these shapes here, untimed
        for name, share in SHARES[args.engine_mode].items():
            if share:
                timed_run(llm, batch, share, f"warm-{name}", max_tokens=8)
            result["modes"][name] = timed_run(llm, batch, share, name)
            print(f"tp={args.tp} {name}: {result['modes'][name]['output_tok_per_s']:.0f} tok/s", flush=True)
        if args.engine_mode == "nondeterministic":
            result["batch1"] = decode_step_batch1(llm, batch[0])
            print(f"tp={args.tp} decode step at batch 1: {result['batch1']['decode_step_ms']:.3f} ms", flush=True)
    finally:
        llm.close()
    out = write_result(result, args.out, f"tp-bench-tp{args.tp}-{args.engine_mode}")
    print(f"written: {out}")
    return 0


def environment() -> dict[str, Any]:
    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "command": " ".join(["python", *sys.orig_argv[1:]]),
                           "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    if torch.cuda.is_available():
        env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    return env


def cmd_report(args: argparse.Namespace) -> int:
    folder = Path(args.results)
    runs: dict[int, dict[str, Any]] = {}
    for path in sorted(folder.glob("tp-bench-tp*-*.json")):
        data = json.loads(path.read_text())
        entry = runs.setdefault(int(data["tp"]), {"modes": {}, "reduction": data["reduction"]})
        entry["modes"].update(data["modes"])
        entry.setdefault("runs", {})[data["engine_mode"]] = {k: data[k] for k in ("startup_s", "graphs", "fingerprint",
                                                                                   "environment")}
        if "batch1" in data:
            entry["batch1"] = data["batch1"]
    for entry in runs.values():
        base = entry["modes"].get("nondeterministic", {}).get("output_tok_per_s")
        entry["ratios"] = {name: m["output_tok_per_s"] / base for name, m in entry["modes"].items() if base}
    report: dict[str, Any] = {"model": MODEL, "targets": TARGETS, "by_tp": runs}
    if 1 in runs and 2 in runs:
        one, two = runs[1], runs[2]
        tput = [r["modes"].get("nondeterministic", {}).get("output_tok_per_s") for r in (one, two)]
        step = [r.get("batch1", {}).get("decode_step_ms") for r in (one, two)]
        report["throughput_ratio_tp2_over_tp1"] = tput[1] / tput[0] if all(tput) else None
        report["decode_step_ratio_tp2_over_tp1"] = step[1] / step[0] if all(step) else None
        report["mode_ratio_delta_tp2_minus_tp1"] = {name: two["ratios"][name] - one["ratios"][name]
                                                     for name in one["ratios"] if name in two["ratios"]}
        report["targets_met"] = {
            "throughput": _at_least(report["throughput_ratio_tp2_over_tp1"], TARGETS["throughput_ratio_min"]),
            "decode_step": _at_most(report["decode_step_ratio_tp2_over_tp1"], TARGETS["decode_step_ratio_max"]),
            "mode_ratios": all(abs(d) <= TARGETS["mode_ratio_delta_max"]
                               for d in report["mode_ratio_delta_tp2_minus_tp1"].values()),
        }
    path = write_result(report, args.out, args.name)
    chart(report, path.with_suffix(".png"))
    print(json.dumps({k: v for k, v in report.items() if k != "by_tp"}, indent=1))
    return 0


def _at_least(value: float | None, bound: float) -> bool | None:
    return None if value is None else value >= bound


def _at_most(value: float | None, bound: float) -> bool | None:
    return None if value is None else value <= bound


def chart(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = report["by_tp"]
    sizes = sorted(runs)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    tput = [runs[t]["modes"].get("nondeterministic", {}).get("output_tok_per_s", 0) for t in sizes]
    axes[0].bar([f"TP={t}" for t in sizes], tput, color="#4c72b0")
    axes[0].set_title(f"{REQUESTS} x {PROMPT_LEN}/{OUTPUT_LEN} non-deterministic")
    axes[0].set_ylabel("output tokens / s")
    step = [runs[t].get("batch1", {}).get("decode_step_ms", 0) for t in sizes]
    axes[1].bar([f"TP={t}" for t in sizes], step, color="#55a868")
    axes[1].set_title("decode step at batch 1")
    axes[1].set_ylabel("ms")
    names = ["dvr_10pct", "dvr_100pct", "batch_invariant"]
    width = 0.8 / max(1, len(sizes))
    for k, t in enumerate(sizes):
        values = [runs[t]["ratios"].get(n, 0) for n in names]
        axes[2].bar([i + k * width for i in range(len(names))], values, width, label=f"TP={t}")
    axes[2].set_xticks([i + width * (len(sizes) - 1) / 2 for i in range(len(names))], names)
    axes[2].axhline(1.0, color="grey", lw=0.8)
    axes[2].set_title("tok/s over nondeterministic")
    axes[2].legend()
    fig.suptitle(f"tensor parallelism, synthetic Llama-3.1-8B, reduction {runs[sizes[-1]]['reduction']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python bench/tp_bench.py", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one engine: --tp ranks, one --engine-mode")
    run.add_argument("--tp", type=int, required=True)
    run.add_argument("--engine-mode", required=True, choices=sorted(SHARES))
    run.add_argument("--reduction", default="gather_sum", choices=["gather_sum", "nccl"])
    run.add_argument("--fault-rate", type=float, default=0.0, help="injected fast-path rollback rate (dvr)")
    run.add_argument("--out", default="bench/results")
    run.set_defaults(run=cmd_run)
    rep = sub.add_parser("report", help="join the runs found in RESULTS into one JSON and a plot")
    rep.add_argument("results")
    rep.add_argument("--out", default="bench/results")
    rep.add_argument("--name", default="tp-bench")
    rep.set_defaults(run=cmd_report)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return int(args.run(args))


if __name__ == "__main__":
    sys.exit(main())
