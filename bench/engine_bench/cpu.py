"""`python -m bench cpu`: throughput of the engine (nondeterministic and DVR at several deterministic
shares) against transformers `generate`, rollback / recompute rates, peak RSS and KV-cache size; and
`--replay`: replaying N transcripts together against the time it took to generate them.
Results go to bench/results/<date>-<machine>[-replay].json and a table on stdout."""
from __future__ import annotations

import argparse
import gc
import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, TypeVar

import torch

from bench.results import write_result
from engine.config import EngineConfig, Mode
from engine.fingerprint import cpu_model, runtime_fingerprint
from engine.llm import LLM
from engine.loading import load_model
from engine.model_runner import LoadedModel
from engine.replay import ReplayRequest
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput

T = TypeVar("T")

PROMPTS = [
    "The capital of France is", "Write a short poem about the sea.", "List three prime numbers and explain why.",
    "Once upon a time, in a small village near the mountains, there lived", "Explain what a CPU cache is.",
    "Translate to German: good morning, how are you?", "The quick brown fox", "Explain photosynthesis.",
    "def fibonacci(n):", "My favourite colour is", "Q: What is the boiling point of water? A:",
    "In 1969, the first humans", "Roses are red,", "The three laws of robotics are",
    "A recipe for pancakes needs", "Summarize the plot of Hamlet.",
]


@dataclass(frozen=True)
class BenchArgs:
    model: str = "default"
    num_prompts: int = 16
    max_tokens: int = 64
    det_shares: tuple[float, ...] = (0.0, 0.1, 0.5, 1.0)
    window: int = 32
    group: int = 8
    num_kv_blocks: int = 514
    threads: int | None = None
    hf_batch1_prompts: int = 4
    out_dir: str = "bench/results"
    replay: bool = False
    replay_transcripts: int = 32
    replay_tokens: int = 256
    tag: str = ""


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _params(n: int, share: float, max_tokens: int) -> list[SamplingParams]:
    det = round(share * n)
    return [SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=1000 + i, ignore_eos=True,
                           deterministic=i < det) for i in range(n)]


def _engine(loaded: LoadedModel, cfg: EngineConfig) -> LLM:
    return LLM.from_parts(cfg, loaded.model, loaded.shape, set(loaded.info.eos_token_ids), loaded.tokenizer)


def _measure(loaded: LoadedModel, cfg: EngineConfig, label: str, prompts: list[list[int]],
             params: list[SamplingParams]) -> dict[str, Any]:
    """One engine (its own KV cache, freed before the next is built) over the shared weights."""
    llm = _engine(loaded, cfg)
    outs, secs = _timed(lambda: llm.generate(prompts, params))
    row = engine_row(label, llm, outs, secs)
    del llm, outs
    gc.collect()
    return row


def _timed(fn: Callable[[], T]) -> tuple[T, float]:
    """(fn(), wall-clock seconds)."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def engine_row(label: str, llm: LLM, outs: list[RequestOutput], seconds: float) -> dict[str, Any]:
    tokens = sum(len(o.token_ids) for o in outs)
    det = [o for o in outs if o.deterministic]
    det_tokens = sum(len(o.token_ids) for o in det)
    st = llm.core.stats()
    return {
        "run": label, "output_tokens": tokens, "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 2),
        "verify_passes": st.verify_passes, "verify_seconds": round(st.verify_seconds, 3),
        "verify_rows": sum(o.verify_passes for o in det),
        "rollback_rate": round(sum(o.rollbacks for o in det) / max(1, sum(o.verify_passes for o in det)), 4),
        "recompute_rate": round(sum(o.recomputed_tokens for o in det) / max(1, det_tokens), 4),
        "preemptions": st.preemptions, "kv_cache_mb": round(llm.core.runner.kv.nbytes / 2**20, 1),
    }


def hf_rows(args: BenchArgs, loaded: LoadedModel, prompts: list[list[int]]) -> list[dict[str, Any]]:
    """transformers generate (greedy, fixed length) on the same prompts: batch 1 and batched."""
    from transformers import AutoModelForCausalLM

    from engine.loader import load_model_source

    source = load_model_source(args.model, torch.float32)
    model = AutoModelForCausalLM.from_pretrained(source.folder, dtype=torch.float32).eval()
    pad = loaded.tokenizer.pad_token_id if loaded.tokenizer.pad_token_id is not None else 0
    gen = dict(max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False, pad_token_id=pad)
    rows = []
    with torch.inference_mode():
        model.generate(torch.tensor([prompts[0]]), **{**gen, "max_new_tokens": 4, "min_new_tokens": 4})
        t0 = time.perf_counter()
        for p in prompts[: args.hf_batch1_prompts]:
            model.generate(torch.tensor([p]), **gen)
        secs = time.perf_counter() - t0
        n = args.hf_batch1_prompts * args.max_tokens
        rows.append({"run": "transformers batch 1", "output_tokens": n, "seconds": round(secs, 3),
                     "tokens_per_s": round(n / secs, 2)})
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, **gen)
        secs = time.perf_counter() - t0
        n = len(prompts) * args.max_tokens
        rows.append({"run": f"transformers batch {len(prompts)}", "output_tokens": n, "seconds": round(secs, 3),
                     "tokens_per_s": round(n / secs, 2)})
    return rows


def run_throughput(args: BenchArgs) -> dict[str, Any]:
    base = EngineConfig(model=args.model, window=args.window, group=args.group, num_kv_blocks=args.num_kv_blocks,
                        max_num_seqs=max(32, args.num_prompts), num_threads=args.threads)
    loaded = _load(base)
    prompts = [list(loaded.tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(args.num_prompts)]
    _measure(loaded, base, "warm-up", prompts[:2], _params(2, 1.0, 4))
    runs = [("engine nondeterministic", replace(base, mode=Mode.NONDETERMINISTIC), 0.0)]
    runs += [(f"engine dvr {round(s * 100)}% det", base, s) for s in args.det_shares]
    rows = [_measure(loaded, cfg, label, prompts, _params(args.num_prompts, share, args.max_tokens))
            for label, cfg, share in runs]
    engine_rss = peak_rss_mb()
    rows += hf_rows(args, loaded, prompts)
    hf1 = next(r for r in rows if r["run"] == "transformers batch 1")["tokens_per_s"]
    return {"kind": "throughput", "rows": rows, "engine_peak_rss_mb": round(engine_rss, 1),
            "process_peak_rss_mb": round(peak_rss_mb(), 1),
            "nondeterministic_vs_hf_batch1": round(rows[0]["tokens_per_s"] / hf1, 2),
            "kv_cache_mb": rows[0]["kv_cache_mb"], **_common(args, base, loaded)}


def run_replay(args: BenchArgs) -> dict[str, Any]:
    """Generate N deterministic transcripts of T tokens together, then replay them together."""
    base = EngineConfig(model=args.model, window=args.window, group=args.group, num_kv_blocks=args.num_kv_blocks,
                        max_num_seqs=max(32, args.replay_transcripts), num_threads=args.threads)
    loaded = _load(base)
    llm = _engine(loaded, base)
    n, t = args.replay_transcripts, args.replay_tokens
    prompts = [list(loaded.tokenizer.encode(PROMPTS[i % len(PROMPTS)])) for i in range(n)]
    params = [replace(p, temperature=0.7 if i % 2 else 0.0) for i, p in enumerate(_params(n, 1.0, t))]
    outs, gen_secs = _timed(lambda: llm.generate(prompts, params))
    gen_row = engine_row("generate (dvr, 100% det)", llm, outs, gen_secs)
    reqs = [ReplayRequest(f"r{i}", p, o.token_ids, replace(sp, seed=o.seed), o.windows, o.window_shape)
            for i, (p, sp, o) in enumerate(zip(prompts, params, outs))]
    del llm
    gc.collect()
    rep = _engine(loaded, base)
    results, rep_secs = _timed(lambda: rep.replay(reqs))
    matches = sum(r.first_mismatch is None and r.token_logprobs == o.token_logprobs for r, o in zip(results, outs))
    replayed = sum(len(r.token_ids) for r in results)
    row = {"run": "replay (teacher-forced)", "output_tokens": replayed,
           "seconds": round(rep_secs, 3), "tokens_per_s": round(replayed / rep_secs, 2),
           "verify_passes": rep.core.stats().verify_passes, "matches": matches}
    return {"kind": "replay", "rows": [gen_row, row], "replay_over_generation": round(rep_secs / gen_secs, 3),
            "transcripts": n, "tokens_per_transcript": t, "all_match": matches == n,
            "engine_peak_rss_mb": round(peak_rss_mb(), 1), **_common(args, base, loaded)}


def _load(cfg: EngineConfig) -> LoadedModel:
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    return load_model(cfg)


def _common(args: BenchArgs, cfg: EngineConfig, loaded: LoadedModel) -> dict[str, Any]:
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_name(),
            "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()},
            "fingerprint": runtime_fingerprint(cfg.resolve(model_max_len=loaded.shape.max_model_len)),
            "torch_threads": torch.get_num_threads()}


def machine_name() -> str:
    return f"{platform.node() or 'host'}-{cpu_model().replace(' ', '_')}-{torch.get_num_threads()}t"


def format_table(result: dict[str, Any]) -> str:
    cols = ["run", "output_tokens", "seconds", "tokens_per_s", "verify_passes", "rollback_rate", "recompute_rate"]
    lines = [" | ".join(f"{c:>14}" if i else f"{c:<26}" for i, c in enumerate(cols))]
    for row in result["rows"]:
        lines.append(" | ".join(f"{str(row.get(c, '-')):>14}" if i else f"{str(row.get(c, '-')):<26}"
                                for i, c in enumerate(cols)))
    extras = {k: v for k, v in result.items() if k not in ("rows", "args", "fingerprint")}
    lines += [f"{k}: {v}" for k, v in extras.items()]
    return "\n".join(lines)


def run_bench(args: BenchArgs) -> tuple[dict[str, Any], Path]:
    result = run_replay(args) if args.replay else run_throughput(args)
    day = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    name = f"{day}-cpu-{machine_name()}{'-replay' if args.replay else ''}{'-' + args.tag if args.tag else ''}"
    return result, write_result(result, args.out_dir, name)


def parse_args(argv: list[str]) -> BenchArgs:
    p = argparse.ArgumentParser(prog="python -m bench cpu", description=__doc__.split("\n")[0])
    p.add_argument("--replay", action="store_true", help="replay N transcripts together vs generating them")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--det-shares", default="0,0.1,0.5,1", help="comma-separated deterministic shares")
    p.add_argument("--hf-batch1-prompts", type=int, default=4)
    p.add_argument("--replay-transcripts", type=int, default=32)
    p.add_argument("--replay-tokens", type=int, default=256)
    p.add_argument("--out-dir", default="bench/results")
    p.add_argument("--tag", default="", help="suffix for the result file name")
    p.add_argument("--model", default="default",
                   help="'default', a model folder, a .gguf file or a Hugging Face id (no env default)")
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--kv-blocks", type=int, default=514)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    a = p.parse_args(argv)
    return BenchArgs(model=a.model, num_prompts=a.num_prompts, max_tokens=a.max_tokens,
                     det_shares=tuple(float(x) for x in a.det_shares.split(",")), window=a.window, group=a.group,
                     num_kv_blocks=a.kv_blocks, threads=a.threads, hf_batch1_prompts=a.hf_batch1_prompts,
                     out_dir=a.out_dir, replay=a.replay, replay_transcripts=a.replay_transcripts,
                     replay_tokens=a.replay_tokens, tag=a.tag)


def main(argv: list[str] | None = None) -> int:
    from engine import progress

    args = parse_args(sys.argv[1:] if argv is None else argv)
    progress.log_to_stderr()
    result, path = run_bench(args)
    print(format_table(result))
    print(f"written: {path}")
    return 0
