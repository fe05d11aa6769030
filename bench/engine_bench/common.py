"""What the engine benchmark's sections share: the run context and its clock, CUDA timing, the environment
record, the synthetic model and engines built on it."""
from __future__ import annotations

import argparse
import datetime as dt
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.results import write_result
from engine.config import RESERVED_BLOCKS, EngineConfig, resolve_decode_cublaslt_min_rows

BLOCK_SIZE = EngineConfig.block_size  # the engine's default: the bench sizes num_kv_blocks in it too


@dataclass
class Ctx:
    """What the sections share: arguments, the synthetic model (built once), the measured bandwidth, and
    the clock: `left()` is the time to the earlier of the run's deadline and the section's budget."""

    args: argparse.Namespace
    device: torch.device
    result: dict[str, Any]
    model: Any = None
    hf_config: Any = None
    weight_bytes: int = 0
    bandwidth: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    t_start: float = field(default_factory=time.perf_counter)
    deadline: float = math.inf          # perf_counter seconds: the whole run
    out_dir: Path | None = None         # where `write` puts <name>.json (None: nothing written)
    name: str = "gpu-bench"
    section: str = ""
    section_deadline: float = math.inf  # perf_counter seconds: min(run deadline, section start + budget)
    truncated: bool = False
    live: dict[str, Any] | None = None  # the running section's result, filled in place

    def begin(self, name: str, budget_s: float | None) -> None:
        self.section, self.truncated, self.live = name, False, None
        end = time.perf_counter() + budget_s if budget_s is not None else math.inf
        self.section_deadline = min(self.deadline, end)
        self.log(f"start ({self.left():.0f}s left)")

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def left(self) -> float:
        return self.section_deadline - time.perf_counter()

    def log(self, msg: str) -> None:
        print(f"[bench +{self.elapsed():6.1f}s] {self.section}: {msg}", flush=True)

    def has_time(self, need_s: float, what: str) -> bool:
        """False (and the section marked truncated) when fewer than `need_s` seconds are left."""
        if self.left() >= need_s:
            return True
        self.truncated = True
        self.log(f"skipped {what}: {self.left():.0f}s left < {need_s:.0f}s needed")
        return False

    def cap(self, cap_s: float) -> float:
        """A subsection's wall-clock cap: its own, or less when the budget ends sooner."""
        return max(0.0, min(cap_s, self.left()))

    def open(self, out: dict[str, Any]) -> dict[str, Any]:
        """Register the section's result dict: checkpoints write it as it fills."""
        self.live = out
        return out

    def checkpoint(self, what: str) -> None:
        """One progress line, and the JSON rewritten with the section's partial result."""
        if self.live is not None:
            self.result[self.section] = {**self.live, "in_progress": True}
            self.write()
        self.log(what)

    def write(self) -> None:
        if self.out_dir is not None:
            write_result(self.result, self.out_dir, self.name)


def time_cuda(fn: Callable[[], Any], reps: int, warmup: int = 2) -> dict[str, float]:
    """Median / min / max milliseconds of `fn` over `reps` runs, each timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times), "reps": reps}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_wall(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), wall-clock seconds), the device synchronized before and after."""
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


def environment(argv: list[str]) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    env = {
        "device": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
        "total_memory_gib": round(props.total_memory / 2**30, 1),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        # the command line as typed (`python -m bench engine ...`)
        "command": " ".join(["python", *sys.orig_argv[1:]]) if sys.orig_argv else " ".join(argv),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
    }
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


def synthetic(ctx: Ctx) -> Any:
    if ctx.model is None:
        from engine.models.synthetic import build_synthetic_model, weight_bytes

        ctx.hf_config = synthetic_config(ctx.args.preset, ctx.args.layers)
        t0 = time.perf_counter()
        ctx.model = build_synthetic_model(ctx.hf_config, torch.bfloat16, ctx.device, seed=0,
                                          attention_backend="triton", kernels=ctx.args.kernels)
        if ctx.args.decode_attention != "split":
            from engine.attention.triton_backend import TritonPagedAttention

            ctx.model.attention = TritonPagedAttention(decode=ctx.args.decode_attention, settings=ctx.args.kernels)
        sync()
        ctx.weight_bytes = weight_bytes(ctx.model)
        ctx.result["synthetic_model"] = {
            "preset": ctx.args.preset, "layers": ctx.hf_config.num_hidden_layers,
            "decode_attention": ctx.args.decode_attention,
            "weight_bytes": ctx.weight_bytes, "build_s": round(time.perf_counter() - t0, 2),
        }
    return ctx.model


def synthetic_config(preset: str, layers: int) -> Any:
    """The preset's HF config, its layer count overridden when `layers` > 0 (quick runs)."""
    from engine.models.synthetic import synthetic_hf_config

    return synthetic_hf_config(preset, **({"num_hidden_layers": layers} if layers else {}))


def engine_shape(model: Any, max_model_len: int) -> Any:
    """The engine's ModelShape of a built model (a synthetic model has no loader to report one)."""
    from engine.model_runner import ModelShape

    a = model.arch
    return ModelShape(a.num_layers, a.num_kv_heads, a.head_dim, a.vocab_size, max_model_len)


def kv_bytes_per_token(model: Any) -> int:
    a = model.arch
    return a.num_layers * 2 * a.num_kv_heads * a.head_dim * model.dtype.itemsize


def contiguous_tables(rows: int, blocks_per_row: int, first_block: int = RESERVED_BLOCKS) -> list[list[int]]:
    """Row r owns blocks [first + r*n, first + (r+1)*n): blocks 0/1 stay reserved (zero / scratch)."""
    return [list(range(first_block + r * blocks_per_row, first_block + (r + 1) * blocks_per_row))
            for r in range(rows)]


def fill_cache_(kv: Any, seed: int = 0) -> None:
    """Random finite K/V (timing on zeros can flatter kernels); block 0 back to zero."""
    gen = torch.Generator(device=kv.k[0].device).manual_seed(seed)
    for t in kv.k + kv.v:
        t.normal_(0.0, 0.5, generator=gen)
        t[0].zero_()


def engine_config(ctx: Ctx, graphs: bool = True, **kw: Any) -> Any:
    """EngineConfig for a CUDA bench run: Triton attention (batch_invariant keeps its own) under the run's
    kernel settings, the bench's --decode-cublaslt-min-rows and, with `graphs`, the model runner's CUDA
    graphs (decode; verify when bit-exact)."""
    kw.setdefault("kernels", ctx.args.kernels)
    if kw.get("mode") != "batch_invariant":
        kw.setdefault("attention_backend", "triton")
    kw.setdefault("verify_decode_rows", ctx.args.verify_decode_rows)  # None: the engine's default (0 off dvr)
    kw.setdefault("canonical_prefill_min_tokens", ctx.args.canonical_prefill_min_tokens)  # None: the engine's
    kw.setdefault("canonical_prefill_chunk_tokens", ctx.args.canonical_prefill_chunk_tokens)  # None: the engine's
    if ctx.args.verify_early_decode is not None:
        kw.setdefault("verify_early_decode", ctx.args.verify_early_decode == "on")
    if ctx.args.chained_verify is not None:
        kw.setdefault("chained_verify", ctx.args.chained_verify == "on")
    if ctx.args.verify_packing is not None and kw.get("mode", "dvr") == "dvr":
        kw.setdefault("verify_packing", ctx.args.verify_packing)
    if ctx.args.verify_trigger is not None and kw.get("mode", "dvr") == "dvr":
        kw.setdefault("verify_trigger", ctx.args.verify_trigger)
    return EngineConfig.from_options({"cuda_graphs": graphs,
                                      "decode_cublaslt_min_rows": ctx.args.decode_cublaslt_min_rows, **kw})


def cublaslt_min_rows(args: argparse.Namespace) -> int:
    """--decode-cublaslt-min-rows as the bench's decode graphs use it (None: the engine's default for CUDA
    graphs)."""
    return resolve_decode_cublaslt_min_rows(args.decode_cublaslt_min_rows, True)


def decode_graphs(ctx: Ctx, model: Any, kv: Any, batches: Sequence[int], max_seq_len: int) -> Any:
    """Captured decode graphs of `model` for a bench section (scratch slot in block 1, the bench's
    --decode-cublaslt-min-rows)."""
    from engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(model, kv, max(batches), max_seq_len, scratch_slot=BLOCK_SIZE, batch_sizes=batches,
                          cublaslt_min_rows=cublaslt_min_rows(ctx.args))
    graphs.capture()
    return graphs


def free_memory() -> None:
    """Drop an engine's KV cache and graph pools (its decode hook closes a reference cycle)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


PROBE_FIRST_STEP = 4  # memory probe from this engine step: prefill done, every request decoding


def drive(ctx: Ctx, core: Any, prompts: list[list[int]], params: Any, cap_s: float, tag: str,
           mem_probe_steps: int = 0) -> dict[str, Any]:
    """Add the requests, step the engine until all finish or the cap (or the budget) ends; with
    `mem_probe_steps`, the device memory that many steady-state steps leave allocated and their peak."""
    seqs = [core.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    cap = ctx.cap(cap_s)
    probe: dict[str, Any] = {}
    sync()
    t0 = time.perf_counter()
    steps = 0
    decoding_at: tuple[float, int] | None = None  # (seconds, committed tokens) once every request has a token
    while any(not s.is_finished for s in seqs) and time.perf_counter() - t0 < cap:
        core.step()
        steps += 1
        if decoding_at is None and all(s.tokens for s in seqs):
            decoding_at = (time.perf_counter() - t0, sum(len(s.tokens) for s in seqs))
        if mem_probe_steps and torch.cuda.is_available():
            if steps == PROBE_FIRST_STEP:  # allocator counters are host-side: no device sync here
                probe = {"steps": mem_probe_steps, "allocated_before": torch.cuda.memory_allocated()}
                torch.cuda.reset_peak_memory_stats()
            elif steps == PROBE_FIRST_STEP + mem_probe_steps and probe:
                probe["memory_allocated_delta_bytes"] = torch.cuda.memory_allocated() - probe["allocated_before"]
                probe["peak_allocated_delta_bytes"] = torch.cuda.max_memory_allocated() - probe["allocated_before"]
    sync()
    total = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for s in seqs)
    finished = sum(s.is_finished for s in seqs)
    stats = vars(core.stats())
    res = {"seconds": total, "steps": steps, "committed_tokens": tokens, "output_tok_per_s": tokens / total,
           # the decode phase: from the step after which every request holds a token (all prompts
           # prefilled) to the end; what the weight+KV bandwidth limit bounds
           "decode_phase_s": None if decoding_at is None else total - decoding_at[0],
           "decode_phase_tok_per_s": None if decoding_at is None or total <= decoding_at[0]
           else (tokens - decoding_at[1]) / (total - decoding_at[0]),
           "finished": finished, "requests": len(seqs), "capped": finished < len(seqs), "cap_s": round(cap, 1),
           "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}
    if finished < len(seqs) and cap < cap_s:
        res["capped_by_budget"] = True
        ctx.truncated = True
    if "peak_allocated_delta_bytes" in probe:
        probe["note"] = ("engine decode steps (logits copied out of the graph, sampled): what stays allocated "
                         "after them, and their transient peak")
        res["steady_state_memory"] = probe
    return res


def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, math.ceil(p / 100 * len(values)) - 1)]
