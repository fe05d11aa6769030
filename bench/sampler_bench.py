"""What sampling parameters cost on the device: the sampler alone, and the real SmolLM2 engine end to end.

    python bench/sampler_bench.py --out DIR [--gguf PATH] [--requests 256] [--tokens 128]

1. Kernel: `engine.sampling.sample_rows` on random float32 logits [rows, vocab] for SmolLM2's and Llama-3's
   vocabularies, per preset (plain temperature, top_p=0.95, top_k=50, min_p=0.05, logprobs=5, a mixed batch
   with every row its own parameters): median milliseconds per call over repeated calls, and on CUDA the
   kernels alone (`device_ms`, between CUDA events).
2. Engine: `LLM(EngineConfig(model=GGUF))` with its defaults (on CUDA: graphs, overlap, device-sized
   budgets), REQUESTS prompts x TOKENS output tokens (ignore_eos), warm, per preset and mode
   (nondeterministic, dvr with every request deterministic), best of 3 rounds taken over the presets in
   turn: output tokens per second, and each preset's ratio to plain temperature sampling.
3. Detok: the host's text work per engine step for KERNEL_ROWS requests of TOKENS ids, through
   `tokenizer.decode` and through `engine.detokenize.Detokenizer`.
Writes DIR/sampler-bench.json (with the command, device and date).
"""
from __future__ import annotations

import argparse
import datetime as dt
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the source root on the path
    sys.path.insert(0, str(ROOT))

# the mode comparison's presets; top logprobs added below
from bench.engine_bench.mixes import SAMPLING_PRESETS  # noqa: E402
from bench.results import write_result  # noqa: E402

PRESETS: dict[str, dict[str, Any]] = {**{k: v for k, v in SAMPLING_PRESETS.items() if k != "greedy"},
                                      "logprobs": {"temperature": 0.8, "logprobs": 5}}
ROUNDS = 3  # engine section: timed runs per preset, taken in turn
MIXED = [{"temperature": 0.0}, {"temperature": 0.8}, {"temperature": 0.8, "top_p": 0.95},
         {"temperature": 1.0, "top_k": 50}, {"temperature": 0.7, "min_p": 0.05},
         {"temperature": 0.9, "top_p": 0.9, "top_k": 40}, {"temperature": 0.8, "logprobs": 3}]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def kernel_section(device: str, rows: int, repeats: int) -> dict[str, Any]:
    from engine.sampling import SamplingParams, sample_rows

    out: dict[str, Any] = {}
    for vocab in (49152, 128256):
        x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)).mul_(3).to(device)
        entry: dict[str, Any] = {}
        presets = {**PRESETS, "mixed": None}
        for name, kw in presets.items():
            specs = [(SamplingParams(**(kw if kw is not None else MIXED[i % len(MIXED)])), 1000 + i, 50 + i)
                     for i in range(rows)]
            sample_rows(x, specs)  # compile
            times = []
            for _ in range(repeats):
                _sync()
                t0 = time.perf_counter()
                sample_rows(x, specs)
                _sync()
                times.append(time.perf_counter() - t0)
            entry[name] = {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times)}
            if device == "cuda":
                entry[name]["device_ms"] = _device_ms(x, specs, repeats)
        out[str(vocab)] = entry
        print(f"kernel vocab {vocab}: " + ", ".join(f"{k} {v['median_ms']:.3f} ms" for k, v in entry.items()),
              flush=True)
        if device == "cuda":
            print(f"kernel vocab {vocab} on the device: "
                  + ", ".join(f"{k} {v['device_ms']:.3f} ms" for k, v in entry.items()), flush=True)
    return out


def _device_ms(x: torch.Tensor, specs: list, repeats: int) -> float:
    """The kernels alone: `sample_packed` launched back to back on parameters packed and staged once, mean
    milliseconds per call between CUDA events (no host packing, no copies back)."""
    from engine.kernels.triton_sampler import sample_packed
    from engine.sampling import pack_specs

    packed, top_n, filtered = pack_specs(specs, list(range(len(specs))))
    staged = torch.from_numpy(packed).to(x.device)
    sample_packed(x, staged, max(top_n), filtered)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        sample_packed(x, staged, max(top_n), filtered)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / repeats


def engine_section(gguf: str, device: str, n_req: int, n_tok: int) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    result: dict[str, Any] = {}
    for mode, det in (("nondeterministic", False), ("dvr", True)):
        llm = LLM(EngineConfig(model=gguf, device=device, mode="dvr" if det else "nondeterministic"))
        tok = llm.tokenizer
        prompts = [tok.encode(f"Request {i}: write a short story about a {['cat', 'ship', 'tree', 'city'][i % 4]} "
                              f"and the number {i}.") for i in range(n_req)]
        entry: dict[str, Any] = {"graphs": llm.core.runner.graphs_status,
                                 "max_num_seqs": llm.core.config.max_num_seqs}
        def run(kw: dict[str, Any], tokens: int, tag: str) -> float:
            seqs = [llm.core.add_request(f"{tag}-{i}", p, SamplingParams(
                max_tokens=tokens, ignore_eos=True, deterministic=det, seed=i, **kw))
                for i, p in enumerate(prompts)]
            _sync()
            t0 = time.perf_counter()
            while llm.core.has_work():
                llm.core.step()
            _sync()
            assert all(s.is_finished for s in seqs)
            return time.perf_counter() - t0

        for name, kw in PRESETS.items():
            run(kw, 8, f"{mode}-{name}-warm")
        # rounds over the presets in turn, so a drift of the machine reaches every preset alike; best of ROUNDS
        times: dict[str, list[float]] = {name: [] for name in PRESETS}
        for r in range(ROUNDS):
            for name, kw in PRESETS.items():
                times[name].append(run(kw, n_tok, f"{mode}-{name}-r{r}"))
        for name, secs in times.items():
            entry[name] = {"seconds": min(secs), "output_tok_per_s": n_req * n_tok / min(secs), "runs_s": secs}
        base = entry["temperature"]["output_tok_per_s"]
        for name in PRESETS:
            entry[name]["ratio_to_temperature"] = entry[name]["output_tok_per_s"] / base
        print(f"engine {mode}: " + ", ".join(f"{k} {entry[k]['output_tok_per_s']:.0f} tok/s "
                                             f"({entry[k]['ratio_to_temperature']:.3f})" for k in PRESETS), flush=True)
        result[mode] = entry
        del llm
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return result


def detok_section(gguf: str, rows: int, tokens: int, repeats: int) -> dict[str, Any]:
    """The host's text work per engine step: every running request's committed ids decoded, through
    `tokenizer.decode` and through `engine.detokenize.Detokenizer` (median ms for `rows` requests)."""
    import random

    from engine.detokenize import Detokenizer
    from engine.loader import load_model_source

    tok = load_model_source(gguf, torch.float32, None).tokenizer
    detok = Detokenizer(tok)
    rng = random.Random(0)
    seqs = [[rng.randrange(len(tok)) for _ in range(tokens)] for _ in range(rows)]

    def median_ms(decode: Any) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for ids in seqs:
                decode(ids)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    out = {"rows": rows, "tokens": tokens, "byte_table": detok.uses_table,
           "tokenizer_decode_ms": median_ms(lambda ids: tok.decode(ids, skip_special_tokens=True)),
           "detokenizer_ms": median_ms(detok)}
    print(f"detok {rows} x {tokens}: tokenizer {out['tokenizer_decode_ms']:.1f} ms, "
          f"byte table {out['detokenizer_ms']:.1f} ms", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--gguf", default="default", help="the SmolLM2 model (a .gguf file, a folder or 'default')")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--kernel-rows", type=int, default=256)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--git-commit", help="the tree's commit where the run's copy has no .git or an older one "
                                        "(default: git rev-parse)")
    p.add_argument("--sections", default="kernel,engine,detok",
                   help="comma list of kernel, engine, detok (the host's per-step text work; runs on the CPU too)")
    a = p.parse_args(argv)
    commit = a.git_commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                            text=True).stdout.strip()
    result: dict[str, Any] = {
        "command": "python bench/sampler_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "git_commit": commit or None,
        "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
    }
    sections = a.sections.split(",")
    if "kernel" in sections:
        result["kernel"] = kernel_section(a.device, a.kernel_rows, a.repeats)
    if "detok" in sections:
        result["detok"] = detok_section(a.gguf, a.kernel_rows, a.tokens, a.repeats)
    if "engine" in sections:
        result["engine"] = engine_section(a.gguf, a.device, a.requests, a.tokens)
    write_result(result, a.out, "sampler-bench")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
