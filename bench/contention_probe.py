"""The engine core's step under CPU load from other processes on the host, with and without CPU placement.

    python bench/contention_probe.py --model PATH.gguf --out OUT        # GPU machine: `bash bench/h200.sh contention`

A model small enough for its step to be host-bound (SmolLM2) spends its step in the engine's Python thread, so
the service's other processes on the same host (HTTP workers, clients) can slow it. This runs the serving
benchmark's saturation set (bench/serve_bench.py's request pool, every request at once through EngineCore.step,
non-deterministic) on one engine under these conditions, each a warm-up and --repeats runs:

    quiet           nothing else running
    busy            --busy processes spinning (Python: JSON round trips), placed by the kernel
    busy-placed     the same, kept off the engine's CPUs (engine.placement.plan_cpus: one physical core, all its
                    hardware threads), the engine's threads on them

each with torch's intra-op threads at torch's default and at 1. Reports output tok/s and the engine's seconds
per step (step_seconds / steps), and the host's CPU topology (logical CPU -> core, hardware-thread siblings).
Writes <out>/<name>.json.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.serve_bench import _warm_core, core_run, request_pool  # noqa: E402
from engine.placement import cpu_topology, pin_self, plan_cpus  # noqa: E402


def _burn(cpus: list[int] | None, stop: Any) -> None:
    if cpus:
        os.sched_setaffinity(0, cpus)
    doc = {"id": "x" * 32, "choices": [{"text": "word " * 20, "index": i} for i in range(4)]}
    while not stop.is_set():
        for _ in range(200):
            doc = json.loads(json.dumps(doc))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--busy", type=int, default=12)
    p.add_argument("--out", required=True)
    p.add_argument("--name", default="contention-probe")
    a = p.parse_args(argv)
    import torch

    from auditor.app import load_engine
    from auditor.settings import Settings

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    topo = cpu_topology()
    engine_cpus = plan_cpus(topo)
    doc: dict[str, Any] = {"command": "python bench/contention_probe.py " + " ".join(argv or sys.argv[1:]),
                           "cpu_count": os.cpu_count(), "topology": topo, "engine_cpus": engine_cpus,
                           "lscpu": subprocess.run(["lscpu"], capture_output=True, text=True).stdout,
                           "default_threads": torch.get_num_threads(), "runs": {}}
    engine = load_engine(Settings(model=a.model, device=a.device, engine_process=False))
    core = engine.core
    doc["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    vocab = min(core.shape.vocab_size, len(engine.tokenizer))
    plan = {"set": "sharegpt", "pool_size": a.requests, "seed": 0, "top_p": 0.95, "top_p_share": 0.5,
            "temperature": 0.8, "engine_cap_s": 60.0}
    reqs = request_pool(plan, vocab)
    det = [False] * len(reqs)
    all_cpus = sorted(os.sched_getaffinity(0))
    others = [c for c in all_cpus if c not in (engine_cpus or [])]
    ctx = mp.get_context("spawn")
    default_threads = torch.get_num_threads()

    def run(name: str, busy: int, placed: bool, threads: int) -> None:
        torch.set_num_threads(threads)
        pin_self(engine_cpus if placed and engine_cpus else all_cpus)
        stop = ctx.Event()
        procs = [ctx.Process(target=_burn, args=(others if placed else None, stop), daemon=True) for _ in range(busy)]
        for proc in procs:
            proc.start()
        time.sleep(1.0 if busy else 0.0)
        try:
            _warm_core(core, reqs, det, plan)
            runs = [core_run(core, reqs, det, plan, f"{name}-{i}") for i in range(a.repeats)]
        finally:
            stop.set()
            for proc in procs:
                proc.join(5)
        best = max(runs, key=lambda r: r["output_tok_per_s"])
        entry = {"busy": busy, "placed": placed, "threads": threads,
                 "tok_per_s": [round(r["output_tok_per_s"]) for r in runs],
                 "ms_per_step": [round(1000 * r["engine"]["step_seconds"] / max(1, r["engine"]["steps"]), 3)
                                 for r in runs],
                 "busy_share": [r["engine"].get("busy") for r in runs],
                 "steps": [r["engine"]["steps"] for r in runs]}
        doc["runs"][name] = entry
        print(f"{name}: {entry['tok_per_s']} tok/s, {entry['ms_per_step']} ms/step "
              f"(best {best['output_tok_per_s']:.0f})", flush=True)
        (out / f"{a.name}.json").write_text(json.dumps(doc, indent=1))

    for threads in (default_threads, 1):
        t = "default" if threads == default_threads else "1"
        run(f"quiet-threads-{t}", 0, False, threads)
        run(f"busy-threads-{t}", a.busy, False, threads)
        if engine_cpus:
            run(f"busy-placed-threads-{t}", a.busy, True, threads)
    doc["summary"] = {k: statistics.median(v["tok_per_s"]) for k, v in doc["runs"].items()}
    (out / f"{a.name}.json").write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc["summary"]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
