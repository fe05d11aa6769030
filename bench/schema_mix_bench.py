"""What constrained decoding costs the engine: a request mix with a share of requests under a JSON schema,
against the same mix without schemas.

    python bench/schema_mix_bench.py --out DIR [--models smollm2,synthetic] [--schema-share 0.25]
        [--modes nondeterministic,dvr_10pct,dvr_100pct] [--requests 64] [--max-prompt 512] [--max-output 128]
        [--repeats 3] [--gguf PATH] [--device cuda]

For each model and mode, the same requests run twice on a warm engine, once plain and once with every
round(1 / schema_share)-th request (an evenly spread share, offset from the deterministic ones) constrained by
SCHEMA, and the output tokens per second of both are reported with their ratio (the median of --repeats runs
each). The mix: ShareGPT-like log-uniform prompt lengths in [16, max_prompt] and output lengths in
[16, max_output], greedy, EOS ignored (a constrained row that completes its JSON is held to the stop token up to
its length), so both runs commit the same number of tokens.
- smollm2: the real SmolLM2-135M-Instruct (bfloat16 on CUDA), chat prompts asking for JSON records.
- synthetic: the synthetic Llama-3.1-8B shape (peaked random logits, rollbacks injected at --fault-rate). It has
  no tokenizer whose tokens spell JSON, so its grammar runs over SmolLM2's tokenizer padded to the 8B vocabulary
  (128256 ids; ids past SmolLM2's 49152 are never allowed): the masks cost what SmolLM2's vocabulary costs,
  their bitmask and the device work are the 8B's size.
Also per run: the host seconds spent in the processors (engine.processors.apply_processors: penalties, mask
filling and the device launches) and the engine's pass counts. Writes DIR/NAME.json (--name, default
schema-mix-bench) after each model.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the source root on the path
    sys.path.insert(0, str(ROOT))

from bench.results import write_result  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["person", "place", "thing", "event"]},
        "year": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "facts": {"type": "array", "items": {"type": "object", "properties": {
            "label": {"type": "string"}, "value": {"type": "string"}, "confidence": {"type": "number"}},
            "required": ["label", "value", "confidence"], "additionalProperties": False}},
    },
    "required": ["name", "kind", "year", "tags", "facts"], "additionalProperties": False,
}
TOPICS = ["the Eiffel Tower", "Ada Lovelace", "the Moon landing", "a bicycle", "Tokyo", "the printing press",
          "Marie Curie", "the Amazon river", "a violin", "the Olympic games", "Mount Everest", "the telephone"]
MODES = {"nondeterministic": ("nondeterministic", 0.0), "dvr_2pct": ("dvr", 0.02), "dvr_10pct": ("dvr", 0.10),
         "dvr_50pct": ("dvr", 0.5), "dvr_100pct": ("dvr", 1.0)}
SMOLLM2_VOCAB = 49152


def log_uniform(n: int, seed: int, lo: int, hi: int) -> list[int]:
    """Log-uniform lengths in [lo, hi] (the ShareGPT-like shape of engine/bench_gpu.py's mixes)."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return [int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))))) for x in u.tolist()]


def spread(n: int, share: float, offset: int = 0) -> set[int]:
    """An evenly spread `share` of range(n), starting at `offset`."""
    count = round(share * n)
    if not count:
        return set()
    step = n / count
    return {(offset + int(i * step)) % n for i in range(count)}


def smollm2_prompts(tokenizer: Any, lengths: list[int]) -> list[list[int]]:
    """Chat prompts asking for a JSON record, padded with a description of the topic to about `lengths`."""
    prompts = []
    for i, n in enumerate(lengths):
        topic = TOPICS[i % len(TOPICS)]
        text = f"Describe {topic} as a JSON record with a name, kind, year, tags and facts."
        filler = f" Some context about {topic}: it is well known and often discussed."
        msgs = [{"role": "user", "content": text}]
        ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False))
        while len(ids) < n:
            text += filler
            msgs = [{"role": "user", "content": text}]
            ids = list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False))
        prompts.append(ids)
    return prompts


class ProcessorTimer:
    """Host seconds spent in the engine's processors (engine.core calls engine.processors.apply_processors), and
    of those, in following the outputs and filling the masks (engine.processors.fill_masks), waiting for a staging
    buffer (MaskStaging.take) and in the library's mask kernel (xgrammar.apply_token_bitmask_inplace: on CUDA its
    launch, on the CPU the kernel itself)."""

    def __init__(self) -> None:
        import xgrammar

        import engine.core
        import engine.processors

        self.targets = [(engine.core, "apply_processors"), (engine.processors, "fill_masks"),
                        (engine.processors.MaskStaging, "take"), (xgrammar, "apply_token_bitmask_inplace")]
        self.originals = [getattr(owner, name) for owner, name in self.targets]
        self.times = {name: 0.0 for _, name in self.targets}
        self.calls = {name: 0 for _, name in self.targets}

    @property
    def seconds(self) -> float:
        return self.times["apply_processors"]

    def breakdown(self) -> dict[str, Any]:
        return {"calls": self.calls["apply_processors"], "fill_masks_s": round(self.times["fill_masks"], 4),
                "staging_take_s": round(self.times["take"], 4),
                "mask_kernel_s": round(self.times["apply_token_bitmask_inplace"], 4)}

    def __enter__(self) -> ProcessorTimer:
        def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def timed(*args: Any, **kw: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return original(*args, **kw)
                finally:
                    self.times[name] += time.perf_counter() - t0
                    self.calls[name] += 1
            return timed

        for (owner, name), original in zip(self.targets, self.originals):
            setattr(owner, name, wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for (owner, name), original in zip(self.targets, self.originals):
            setattr(owner, name, original)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_run(llm: Any, prompts: list[list[int]], out_lens: list[int], det: set[int], constrained: set[int],
              tag: str, cap_s: float) -> dict[str, Any]:
    """One timed run on a warm engine: output tok/s, host seconds in the processors, the run's pass counts."""
    from engine.grammar import GrammarSpec
    from engine.sampling import SamplingParams

    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    before = dict(vars(llm.core.stats()))
    seqs = [llm.core.add_request(f"{tag}-{i}", p, SamplingParams(
        max_tokens=m, temperature=0.0, ignore_eos=True, deterministic=i in det, seed=i,
        grammar=spec if i in constrained else None)) for i, (p, m) in enumerate(zip(prompts, out_lens))]
    with ProcessorTimer() as timer:
        _sync()
        t0 = time.perf_counter()
        while any(not s.is_finished for s in seqs) and time.perf_counter() - t0 < cap_s:
            llm.core.step()
        _sync()
        seconds = time.perf_counter() - t0
    finished = sum(s.is_finished for s in seqs)
    for s in seqs:
        if not s.is_finished:
            llm.core.abort(s.request_id)
    while llm.core.has_work():
        llm.core.step()
    tokens = sum(len(s.tokens) for s in seqs)
    after = vars(llm.core.stats())
    stats = {k: after[k] - before.get(k, 0) for k in ("prefill_passes", "decode_passes", "verify_passes",
                                                      "rollbacks", "recomputed_tokens") if k in after}
    return {"seconds": round(seconds, 4), "output_tok_per_s": round(tokens / seconds, 2), "committed_tokens": tokens,
            "finished": finished, "requests": len(seqs), "processor_host_s": round(timer.seconds, 4),
            "processors": timer.breakdown(), "stats": stats}


def run_model(make: Callable[[str], Any], prompts: list[list[int]], out_lens: list[int], a: argparse.Namespace,
              tag: str) -> dict[str, Any]:
    n = len(prompts)
    constrained = spread(n, a.schema_share, offset=1)
    out: dict[str, Any] = {"requests": n, "constrained_requests": len(constrained),
                           "prompt_len_mean": sum(map(len, prompts)) / n, "output_len_mean": sum(out_lens) / n,
                           "modes": {}}
    for name in a.modes:
        mode, share = MODES[name]
        det = spread(n, share)
        llm = make(mode)
        warm = [4] * n  # compile / warm both variants on these prompt shapes, untimed
        timed_run(llm, prompts, warm, det, constrained, f"{tag}-{name}-warm", a.cap_s)
        entry: dict[str, Any] = {"mode": mode, "deterministic_requests": len(det)}
        for variant, rows in (("plain", set()), ("schema", constrained)):
            runs = [timed_run(llm, prompts, out_lens, det, rows, f"{tag}-{name}-{variant}-{r}", a.cap_s)
                    for r in range(a.repeats)]
            med = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
            entry[variant] = {**med, "runs_tok_per_s": [r["output_tok_per_s"] for r in runs]}
        entry["ratio_schema_to_plain"] = round(entry["schema"]["output_tok_per_s"]
                                               / entry["plain"]["output_tok_per_s"], 4)
        out["modes"][name] = entry
        print(f"{tag} {name}: plain {entry['plain']['output_tok_per_s']:.0f} tok/s, schema "
              f"{entry['schema']['output_tok_per_s']:.0f} tok/s, ratio {entry['ratio_schema_to_plain']:.3f}, "
              f"processors {entry['schema']['processor_host_s']:.2f}s of {entry['schema']['seconds']:.2f}s",
              flush=True)
        del llm
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def smollm2_section(a: argparse.Namespace, device: str) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.loading import load_model

    base = dict(model=a.gguf, device=device, max_num_seqs=a.requests, max_num_batched_tokens=8192,
                num_kv_blocks=a.kv_blocks, window=a.window, group=a.group)
    if device == "cuda":
        base.update(dtype="bfloat16", attention_backend="triton")
    loaded = load_model(EngineConfig(**base))

    def make(mode: str) -> Any:
        config = EngineConfig(**{**base, "mode": mode})
        return LLM.from_parts(config, loaded.model, loaded.shape, set(loaded.info.eos_token_ids), loaded.tokenizer)

    in_lens = log_uniform(a.requests, 11, 16, a.max_prompt)
    out_lens = log_uniform(a.requests, 13, 16, a.max_output)
    prompts = smollm2_prompts(loaded.tokenizer, in_lens)
    return {"model": "SmolLM2-135M-Instruct", **run_model(make, prompts, out_lens, a, "smol")}


def synthetic_section(a: argparse.Namespace, device: str) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.loader import load_model_source
    from engine.model_runner import ModelShape
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    hf = synthetic_hf_config(a.preset, **({"num_hidden_layers": a.layers} if a.layers else {}))
    model = build_synthetic_model(hf, torch.bfloat16 if device == "cuda" else torch.float32, torch.device(device),
                                  seed=0, attention_backend="triton" if device == "cuda" else "torch", peaked=True)
    arch = model.arch
    shape = ModelShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size, 8192)
    tokenizer = load_model_source(a.gguf).tokenizer  # SmolLM2's, padded to the 8B vocabulary by the engine
    eos = {int(tokenizer.eos_token_id)}
    base = dict(model="synthetic", device=device, max_num_seqs=a.requests, max_num_batched_tokens=8192,
                max_model_len=8192, num_kv_blocks=a.kv_blocks, window=a.window, group=a.group,
                fault_rate=a.fault_rate, fault_seed=5)
    if device == "cuda":
        base.update(dtype="bfloat16", attention_backend="triton")

    def make(mode: str) -> Any:
        return LLM.from_parts(EngineConfig(**{**base, "mode": mode}), model, shape, eos, tokenizer)

    gen = torch.Generator().manual_seed(3)
    in_lens = log_uniform(a.requests, 11, 16, a.max_prompt)
    out_lens = log_uniform(a.requests, 13, 16, a.max_output)
    prompts = [torch.randint(0, SMOLLM2_VOCAB, (m,), generator=gen).tolist() for m in in_lens]
    return {"model": f"synthetic {a.preset} (peaked logits), SmolLM2 tokenizer for the grammar",
            "fault_rate": a.fault_rate, **run_model(make, prompts, out_lens, a, "syn")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="schema-mix-bench", help="file stem of the JSON")
    ap.add_argument("--models", default="smollm2,synthetic")
    ap.add_argument("--modes", default="nondeterministic,dvr_10pct,dvr_100pct")
    ap.add_argument("--schema-share", type=float, default=0.25)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-prompt", type=int, default=512)
    ap.add_argument("--max-output", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cap-s", type=float, default=120.0, help="per timed run")
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--kv-blocks", type=int, default=None, help="None: sized from the device (CUDA)")
    ap.add_argument("--gguf", default="default")
    ap.add_argument("--preset", default="llama-3.1-8b")
    ap.add_argument("--layers", type=int, default=0, help="override the 8B's layer count (quick runs)")
    ap.add_argument("--fault-rate", type=float, default=0.0, help="synthetic: injected rollback rate")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    a.modes = [m for m in a.modes.split(",") if m]
    unknown = [m for m in a.modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: unknown {unknown}; known {sorted(MODES)}")
    if not 0.0 < a.schema_share <= 1.0:
        ap.error(f"--schema-share must be in (0, 1], got {a.schema_share}")
    if a.kv_blocks is None and a.device != "cuda":
        a.kv_blocks = 2 + a.requests * -(-(a.max_prompt + a.max_output + 64) // 16)
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if a.device == "cuda" else platform.processor() or platform.machine(),
        "schema_share": a.schema_share, "schema": SCHEMA, "window": a.window, "group": a.group, "sections": {},
    }
    if a.device != "cuda":
        torch.set_num_threads(1)  # a shared CPU: OpenMP barriers stall on busy sibling cores
    else:
        from engine.placement import place_engine_here

        result["engine_cpus"] = place_engine_here()  # where the service runs its engine process
    a.out.mkdir(parents=True, exist_ok=True)
    sections = {"smollm2": smollm2_section, "synthetic": synthetic_section}
    for name in a.models.split(","):
        result["sections"][name] = sections[name](a, a.device)
        write_result(result, a.out, a.name)
    ratios = [m["ratio_schema_to_plain"] for s in result["sections"].values() for m in s["modes"].values()]
    print(f"schema / plain throughput ratios: {ratios} (min {min(ratios):.3f}, median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
