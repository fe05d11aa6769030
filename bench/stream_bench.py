"""Stream smoothness of deterministic requests against the verify cadence (DvrTuning.verify_cadence_steps),
through the engine alone (EngineCore.step, the loop the service's engine thread runs), with the commit time
of every token.

    python bench/stream_bench.py --out bench/results/DATE-cpu                    # CPU: SmolLM2, 64 tokens
    python bench/stream_bench.py --device cuda --model synthetic:llama-3.1-8b --max-tokens 256 --out OUT
    python bench/stream_bench.py --device cuda --model default --max-tokens 256 --out OUT    # SmolLM2 GGUF

For each cadence in --cadences (0 = off) and each concurrency in --concurrency (1 = one stream alone), the
same greedy requests (ignore_eos, --max-tokens outputs) run deterministic, and once non-deterministic (which
the cadence does not touch). One engine serves every setting: the cadence is scheduler policy only, so its
config is swapped between runs (same KV cache, same CUDA graphs, same compiled kernels). Single streams run
--repeats times, the settings interleaved, and report the median.

Per stream: TTFT (first commit), end-to-end (last commit), chunks (steps that committed tokens of it), chunk
gaps in seconds and in decode steps (engine decode passes between two commits of the stream), and the commit
time of every token. Per run: the same aggregated (p99 over all gaps of all streams), with the engine's verify
and decode pass counts. Results: <out>/<name>.json and <out>/<name>-streams.png (commit time against token
index, one stream alone, non-deterministic and deterministic at each cadence).
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: the source root on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.results import write_result  # noqa: E402
from bench.serve_bench import dist, median  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core import EngineCore  # noqa: E402
from engine.fingerprint import cpu_model  # noqa: E402
from engine.loading import load_model  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

TEXTS = ["Write a short story about a lighthouse keeper.", "Explain how a CPU cache works.",
         "Describe the water cycle.", "Give advice for a first marathon.", "What is a hash function?",
         "Summarize the plot of Hamlet.", "Tell me about the history of Rome.", "How do bees make honey?"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default="default", help="EngineConfig.model (default: the SmolLM2 GGUF)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of a model without a tokenizer")
    p.add_argument("--cadences", default="0,8,16,20", help="verify_cadence_steps values, comma-separated (0: off)")
    p.add_argument("--max-rows", type=int, help="verify_cadence_max_rows (default: the engine's, G)")
    p.add_argument("--concurrency", default="1,8", help="streams at once, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="runs of each single-stream setting (median)")
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=JSON",
                   help="another EngineConfig field, e.g. window=16 (repeatable)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (CPU; default: torch's)")
    p.add_argument("--out", default="bench/results/stream")
    p.add_argument("--name", default="stream-bench")
    return p


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def engine_options(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise SystemExit(f"--engine-option: KEY=JSON expected, got {pair!r}")
        out[key] = json.loads(value)
    return out


def prompts_for(tokenizer: Any, vocab: int, n: int, length: int) -> list[list[int]]:
    """Chat-templated TEXTS with a tokenizer; else seeded random ids of `length`."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [list(tokenizer.apply_chat_template([{"role": "user", "content": TEXTS[i % len(TEXTS)]}],
                                                   add_generation_prompt=True, tokenize=True, return_dict=False))
                for i in range(n)]
    gen = torch.Generator().manual_seed(26)
    return [torch.randint(2, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def use_cadence(core: EngineCore, steps: int, max_rows: int | None) -> None:
    """Swap the scheduler's cadence (the engine must be idle): the rest of the config is unchanged."""
    assert not core.has_work(), "cadence swapped with requests in the engine"
    rows = max_rows if max_rows is not None else core.config.group
    tuning = dataclasses.replace(core.config.tuning, verify_cadence_steps=steps, verify_cadence_max_rows=rows)
    config = dataclasses.replace(core.config, tuning=tuning)
    core.config = core.scheduler.config = config


_ids = itertools.count()


def run_streams(core: EngineCore, prompts: list[list[int]], det: bool, max_tokens: int) -> dict[str, Any]:
    """The prompts at once; every commit's time and decode-pass count, per stream."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, seed=7, deterministic=det, ignore_eos=True)
    stats0 = core.stats()
    t0 = time.perf_counter()
    seqs = [core.add_request(f"stream-{next(_ids)}", p, params) for p in prompts]
    c0 = time.process_time()
    # per commit: (s after submit, process CPU s after submit, decode passes since submit, tokens)
    chunks: list[list[tuple[float, float, int, int]]] = [[] for _ in seqs]
    seen = [0] * len(seqs)
    while any(not s.is_finished for s in seqs):
        core.step()
        now, cpu = time.perf_counter() - t0, time.process_time() - c0
        passes = core.totals.decode_passes - stats0.decode_passes
        for i, s in enumerate(seqs):
            if len(s.tokens) > seen[i]:
                chunks[i].append((now, cpu, passes, len(s.tokens) - seen[i]))
                seen[i] = len(s.tokens)
    while core.has_work():  # a decode step still in flight (overlap) past the last commit
        core.step()
    stats = core.stats()
    return {"streams": [stream_stats(c) for c in chunks],
            "verify_passes": stats.verify_passes - stats0.verify_passes,
            "decode_passes": stats.decode_passes - stats0.decode_passes,
            "rollbacks": stats.rollbacks - stats0.rollbacks}


def stream_stats(chunks: list[tuple[float, float, int, int]]) -> dict[str, Any]:
    """One stream's figures. `*_cpu_s`: process CPU time (all threads) instead of wall time: on a shared CPU
    it hides other processes' load (one torch thread), on CUDA it is only the host's share."""
    times = [t for t, _, _, _ in chunks]
    steps = [k for _, _, k, _ in chunks]
    return {"ttft_s": times[0], "e2e_s": times[-1], "ttft_cpu_s": chunks[0][1], "e2e_cpu_s": chunks[-1][1],
            "chunks": len(chunks), "tokens": sum(n for *_, n in chunks),
            "chunk_gaps_s": [round(b - a, 5) for a, b in zip(times, times[1:])],
            "chunk_gaps_steps": [b - a for a, b in zip(steps, steps[1:])],
            "commit_s": [round(t, 5) for t, _, _, n in chunks for _ in range(n)],
            "commit_cpu_s": [round(c, 5) for _, c, _, n in chunks for _ in range(n)]}


def summarize(run: dict[str, Any]) -> dict[str, Any]:
    streams = run["streams"]
    gaps_s = [g for s in streams for g in s["chunk_gaps_s"]]
    gaps_steps = [g for s in streams for g in s["chunk_gaps_steps"]]
    return {"e2e_s": median([s["e2e_s"] for s in streams]), "e2e_max_s": max(s["e2e_s"] for s in streams),
            "ttft_s": median([s["ttft_s"] for s in streams]), "e2e_cpu_s": median([s["e2e_cpu_s"] for s in streams]),
            "ttft_cpu_s": median([s["ttft_cpu_s"] for s in streams]), "chunks_min": min(s["chunks"] for s in streams),
            "chunks": median([s["chunks"] for s in streams]),
            "gap_steps": dist(gaps_steps), "gap_s": dist(gaps_s),
            "verify_passes": run["verify_passes"], "decode_passes": run["decode_passes"],
            "rollbacks": run["rollbacks"]}


def measure(core: EngineCore, args: argparse.Namespace, prompts: list[list[int]]) -> dict[str, Any]:
    """Every setting: {"nondeterministic" | "cadence_<k>": {"c<n>": summary, ...}} and the raw single runs."""
    settings = [("nondeterministic", False, 0)] + [(f"cadence_{k}", True, k) for k in ints(args.cadences)]
    results: dict[str, Any] = {name: {} for name, _, _ in settings}
    raw: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in settings}
    for n in ints(args.concurrency):
        for rep in range(args.repeats if n == 1 else 1):
            for name, det, k in settings:
                use_cadence(core, k, args.max_rows)
                run = run_streams(core, prompts[:n], det, args.max_tokens)
                summary = summarize(run)
                log(f"c{n} rep {rep} {name:17s} e2e {summary['e2e_s']:.3f}s ({summary['e2e_cpu_s']:.3f} CPU s) "
                    f"ttft {summary['ttft_s']:.3f}s "
                    f"chunks {summary['chunks_min']} max gap {summary['gap_steps']['max']} steps "
                    f"verify {run['verify_passes']}")
                results[name].setdefault(f"c{n}", []).append(summary)
                if n == 1:
                    raw[name].append(run["streams"][0])
    merged = {name: {c: merge(runs) for c, runs in by_c.items()} for name, by_c in results.items()}
    return {"settings": merged, "single_streams": raw}


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Repeats of one setting: the median of each figure (the worst chunk count and gap), and every run."""
    if len(runs) == 1:
        return runs[0]
    return {"e2e_s": median([r["e2e_s"] for r in runs]), "ttft_s": median([r["ttft_s"] for r in runs]),
            "e2e_cpu_s": median([r["e2e_cpu_s"] for r in runs]), "ttft_cpu_s": median([r["ttft_cpu_s"] for r in runs]),
            "chunks_min": min(r["chunks_min"] for r in runs), "chunks": median([r["chunks"] for r in runs]),
            "max_gap_steps": max(r["gap_steps"]["max"] or 0 for r in runs),
            "max_gap_s": max(r["gap_s"]["max"] or 0.0 for r in runs), "runs": runs}


def ratios(settings: dict[str, Any]) -> dict[str, Any]:
    """Deterministic at each cadence against non-deterministic, per concurrency."""
    out: dict[str, Any] = {}
    nd = settings["nondeterministic"]
    for name, by_c in settings.items():
        if name == "nondeterministic":
            continue
        out[name] = {c: {"e2e": s["e2e_s"] / nd[c]["e2e_s"], "ttft": s["ttft_s"] / nd[c]["ttft_s"],
                         "e2e_cpu": s["e2e_cpu_s"] / nd[c]["e2e_cpu_s"]} for c, s in by_c.items()}
    return out


def table(settings: dict[str, Any]) -> str:
    lines = [f"{'setting':18s} {'streams':>7s} {'e2e s':>8s} {'CPU s':>8s} {'TTFT s':>8s} {'chunks':>6s} "
             f"{'max gap':>8s} {'p99 gap':>8s}  (gaps in decode steps)"]
    for name, by_c in settings.items():
        for c, s in by_c.items():
            runs = s.get("runs", [s])
            gmax = max(r["gap_steps"]["max"] or 0 for r in runs)
            p99 = max(r["gap_steps"]["p99"] or 0 for r in runs)
            lines.append(f"{name:18s} {c[1:]:>7s} {s['e2e_s']:8.3f} {s['e2e_cpu_s']:8.3f} {s['ttft_s']:8.3f} "
                         f"{s['chunks_min']:6d} "
                         f"{gmax:8d} {p99:8d}")
    return "\n".join(lines)


def plot(raw: dict[str, list[dict[str, Any]]], path: Path, title: str, cpu: bool) -> None:
    """Tokens committed against commit time, one stream alone per setting; on the CPU also against the
    process's CPU time (which other processes' load does not stretch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clocks = [("commit_s", "commit time (s after submit)")]
    clocks += [("commit_cpu_s", "process CPU time at commit (s after submit)")] if cpu else []
    fig, axes = plt.subplots(1, len(clocks), figsize=(7 * len(clocks), 5), squeeze=False)
    for ax, (key, label) in zip(axes[0], clocks):
        for name, streams in raw.items():
            if streams:
                commit = streams[0][key]
                ax.step(commit, range(1, len(commit) + 1), where="post", label=name.replace("_", " "))
        ax.set_xlabel(label)
        ax.set_ylabel("tokens committed")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def git_commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.CalledProcessError):
        return None
    return done.stdout.strip()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    options = engine_options(args.engine_option)
    config = EngineConfig.from_options({"model": args.model, "device": args.device, **options})
    started = time.perf_counter()
    loaded = load_model(config)
    core = EngineCore(config, loaded.model, loaded.shape, set(getattr(loaded.info, "eos_token_ids", ()) or ()))
    log(f"loaded {args.model} on {args.device} in {time.perf_counter() - started:.1f}s")
    prompts = prompts_for(loaded.tokenizer, loaded.shape.vocab_size, max(ints(args.concurrency)), args.prompt_tokens)
    default_cadence = core.config.tuning.verify_cadence_steps
    use_cadence(core, 0, args.max_rows)
    for det in (False, True):  # warm-up: first calls, allocator, graphs
        run_streams(core, prompts[:2], det, min(args.max_tokens, 2 * config.window))
    result = measure(core, args, prompts)
    cfg = core.config
    device = torch.cuda.get_device_name(0) if cfg.torch_device.type == "cuda" else cpu_model()
    doc = {"command": shlex.join([Path(sys.argv[0]).as_posix(), *(argv if argv is not None else sys.argv[1:])]),
           "git_commit": git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
           "environment": {"device": device, "torch": torch.__version__, "python": platform.python_version(),
                           "torch_threads": torch.get_num_threads()},
           "model": args.model, "max_tokens": args.max_tokens, "prompt_tokens": [len(p) for p in prompts],
           "engine": {"window": cfg.window, "group": cfg.group, "verify_decode_rows": cfg.tuning.verify_decode_rows,
                      "verify_packing": cfg.tuning.verify_packing.value, "overlap": cfg.tuning.overlap,
                      "dvr_lookahead": cfg.tuning.dvr_lookahead,
                      "verify_cadence_max_rows": cfg.tuning.verify_cadence_max_rows,
                      "default_verify_cadence_steps": default_cadence,
                      "canonical_prefill_min_tokens": cfg.tuning.canonical_prefill_min_tokens,
                      "canonical_prefill_chunk_tokens": cfg.tuning.canonical_prefill_chunk_tokens,
                      "engine_options": options},
           "settings": result["settings"], "ratios_to_nondeterministic": ratios(result["settings"]),
           "single_streams": result["single_streams"]}
    path = write_result(doc, args.out, args.name)
    plot(result["single_streams"], path.with_name(f"{args.name}-streams.png"),
         f"{args.model}, {args.device}, one stream of {args.max_tokens} tokens (W={cfg.window}, G={cfg.group})",
         cfg.torch_device.type == "cpu")
    print(table(result["settings"]))
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
