"""`python -m engine bench --device cuda` (also `python -m engine.bench_gpu`): the GPU benchmark.

Sections (each recorded on its own; a failing section records its error and the run goes on):
  bandwidth        device-to-device copy, bytes read + written per second (the roofline's ceiling)
  decode_step      synthetic Llama-3.1-8B decode step (CUDA graph) at batch 1/16/64 vs weights+KV bytes / BW,
                   and the device memory a steady-state graphed step allocates (expected: 0 bytes)
  decode_breakdown the same GEMMs alone, fused vs unfused; graphed step by row-op kernels; eager profile
  lite_generate    64 requests 128-in/128-out through our model + kernels + graphs, greedy on the GPU
                   (no scheduler, no host sampler: the ceiling the engine core can approach)
  engine_generate  the same requests through the engine core (mode nondeterministic), eager and graphed
  hf_generate      the same requests through Hugging Face transformers: static-batch `generate` and
                   continuous batching (`continuous_batching_context_manager`, the engine of `generate_batch`)
  verify_cost      verify pass G x W in {1x32, 8x32, 16x32, 8x64}: time per pass and per token
  smollm2_rollback real SmolLM2 (GGUF): rollback / recompute rates at W = 16/32/64, DVR decode rows with the
                   verifier's attention ("canonical") and with the split-KV kernel ("split")
  compare_modes    issue 6 on SmolLM2: nondeterministic / dvr at 2-100 % deterministic / batch_invariant
  compare_modes_synthetic       the same on the synthetic 8B at an injected rollback rate: ShareGPT-like
                   mix and fixed 1k-in/256-out
  compare_modes_synthetic_long  the same, fixed 4k-in/1k-out (few requests: six modes in one call)
  wg_sweep         SmolLM2, all deterministic: W in 16/32/64 x G in 4/8/16/32, throughput and recompute
  bi_breakdown     batch_invariant numerics vs the model's on the 8B: graphed decode, 4096-token prefill,
                   kernel profiles
Presets for --sections: core, modes, sweep, bi, long, all (SECTION_PRESETS).
Time: --deadline-s bounds the whole run, --budget-s single sections; work that would pass them is
skipped or capped and its section says "truncated": true. One progress line per subsection.
Results: <out>/<name>.json and <out>/<name>.png, both rewritten after every section (and the JSON after
every subsection), so a run killed by a time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import inspect
import json
import math
import platform
import statistics
import sys
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from engine.config import (DEFAULT_VERIFY_DECODE_ROWS, RESERVED_BLOCKS, EngineConfig,
                           resolve_decode_cublaslt_min_rows)
from engine.cuda_graphs import GRAPH_MAX_LEN

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
BLOCK_SIZE = EngineConfig.block_size  # the engine's default: the bench sizes num_kv_blocks in it too
# Rollbacks per committed token on SmolLM2 at W=32 (greedy, canonical DVR decode rows, the CUDA default),
# from bench/results/2026-11-29-h200/gpu-bench-rollback.json (H200, 256 prompts: W32-canonical, 0 rollbacks):
# the injected rate when this run did not measure it.
COMMITTED_SMOLLM2_FAULT_RATE = 0.0


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
    json_path: Path | None = None
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
        if self.json_path is not None:
            self.json_path.write_text(json.dumps(self.result, indent=1, default=str))


# ---- timing helpers ------------------------------------------------------------------------------
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_wall(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(fn(), wall-clock seconds), the device synchronized before and after."""
    _sync()
    t0 = time.perf_counter()
    out = fn()
    _sync()
    return out, time.perf_counter() - t0


def environment(argv: list[str]) -> dict[str, Any]:
    props = torch.cuda.get_device_properties(0)
    env = {
        "device": torch.cuda.get_device_name(0), "sm_count": props.multi_processor_count,
        "total_memory_gib": round(props.total_memory / 2**30, 1),
        "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        # the command line as typed (`python -m engine bench ...` or `python -m engine.bench_gpu ...`)
        "command": " ".join(["python", *sys.orig_argv[1:]]) if sys.orig_argv else " ".join(argv),
        "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
    }
    for mod in ("triton", "transformers"):
        try:
            env[mod] = __import__(mod).__version__
        except ImportError:
            env[mod] = None
    return env


# ---- synthetic model -----------------------------------------------------------------------------
def synthetic(ctx: Ctx) -> Any:
    if ctx.model is None:
        from engine.models.synthetic import build_synthetic_model, weight_bytes

        ctx.hf_config = synthetic_config(ctx.args.preset, ctx.args.layers)
        t0 = time.perf_counter()
        ctx.model = build_synthetic_model(ctx.hf_config, torch.bfloat16, ctx.device, seed=0,
                                          attention_backend="triton")
        if ctx.args.decode_attention != "split":
            from engine.attention.triton_paged import TritonPagedAttention

            ctx.model.attention = TritonPagedAttention(decode=ctx.args.decode_attention)
        _sync()
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


# ---- sections ------------------------------------------------------------------------------------
def bench_bandwidth(ctx: Ctx) -> dict[str, Any]:
    n = 2 * 2**30 // 2  # 2 GiB of bf16 per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device=ctx.device)
    dst = torch.empty_like(src)
    t = time_cuda(lambda: dst.copy_(src), reps=20)
    ctx.bandwidth = 2 * src.numel() * 2 / (t["median_ms"] / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_per_s": ctx.bandwidth, "tb_per_s": round(ctx.bandwidth / 1e12, 3), **t}


def _bandwidth(ctx: Ctx) -> float:
    if ctx.bandwidth is None:
        bench_bandwidth(ctx)
    assert ctx.bandwidth is not None
    return ctx.bandwidth


def bench_decode_step(ctx: Ctx) -> dict[str, Any]:
    """Graph-replayed decode step at each batch size with `context` keys per row, vs the byte floor.

    The KV cache is sized as the engine would size it: 90 % of the memory free after the weights.
    """
    from engine.gpu_memory import DEFAULT_KV_SHARE, kv_blocks_for_free_memory, kv_bytes_per_block

    model = synthetic(ctx)
    bw = _bandwidth(ctx)
    a = model.arch
    batches, context = ctx.args.batches, ctx.args.context
    blocks_per_row = -(-(context + 64) // BLOCK_SIZE)
    torch.cuda.empty_cache()
    free_after_weights = torch.cuda.mem_get_info()[0]
    per_block = kv_bytes_per_block(a.num_layers, a.num_kv_heads, a.head_dim, BLOCK_SIZE, model.dtype)
    num_blocks = kv_blocks_for_free_memory(per_block, DEFAULT_KV_SHARE)
    kv = model.allocate_kv_cache(num_blocks, BLOCK_SIZE)
    used = RESERVED_BLOCKS + max(batches) * blocks_per_row
    for t in kv.k + kv.v:  # random finite K/V where the rows live (timing on zeros can flatter kernels)
        t[RESERVED_BLOCKS:used].normal_(0.0, 0.5)
    t0 = time.perf_counter()
    graphs = _decode_graphs(ctx, model, kv, batches, blocks_per_row * BLOCK_SIZE)
    capture_s = time.perf_counter() - t0
    out: dict[str, Any] = ctx.open({
        "context": context, "capture_s": round(capture_s, 2), "batches": {},
        "memory": {"free_after_weights_bytes": free_after_weights, "kv_share": DEFAULT_KV_SHARE,
                   "kv_blocks": num_blocks, "kv_cache_bytes": kv.nbytes,
                   "kv_fraction_of_free": kv.nbytes / free_after_weights,
                   "kv_tokens": num_blocks * BLOCK_SIZE},
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(),  # weights + KV + graph pools, this process
    })
    for b in batches:
        if not ctx.has_time(15, f"batch {b}"):
            break
        tables = contiguous_tables(b, blocks_per_row)
        ids = [(7 * r + 1) % a.vocab_size for r in range(b)]
        pos = [context - 1] * b

        def step() -> None:
            graphs.run(ids, pos, [context] * b, tables)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        stats_before = torch.cuda.memory_stats()
        allocated_before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()  # the peak from here on: what the timed replays allocate
        t = time_cuda(step, reps=ctx.args.reps, warmup=0)
        allocated_after = torch.cuda.memory_allocated()
        peak_delta = torch.cuda.max_memory_allocated() - allocated_before
        stats_after = torch.cuda.memory_stats()
        floor_bytes = ctx.weight_bytes + b * context * kv_bytes_per_token(model)
        floor_ms = floor_bytes / bw * 1e3
        eager = _eager_decode_ms(model, kv, tables, ids, pos, context) if b in (1, max(batches)) else None
        out["batches"][str(b)] = {
            **t, "floor_ms": floor_ms, "ratio_to_floor": t["median_ms"] / floor_ms,
            "achieved_tb_per_s": floor_bytes / (t["median_ms"] / 1e3) / 1e12,
            "eager_median_ms": eager,
            "device_allocations_during_timed_steps":
                stats_after["allocation.all.allocated"] - stats_before["allocation.all.allocated"],
            "memory_allocated_delta_bytes": allocated_after - allocated_before,
            "peak_allocated_delta_bytes": peak_delta,
        }
        ctx.checkpoint(f"batch {b}: {t['median_ms']:.2f} ms, floor {floor_ms:.2f} ms, "
                       f"allocated +{allocated_after - allocated_before} B, peak +{peak_delta} B")
    measured = out["batches"].values()
    out["steady_state_zero_alloc"] = bool(measured) and all(
        v["device_allocations_during_timed_steps"] == 0 and v["memory_allocated_delta_bytes"] == 0
        and v["peak_allocated_delta_bytes"] == 0 for v in measured)
    del graphs, kv
    torch.cuda.empty_cache()
    return out


def bench_decode_breakdown(ctx: Ctx) -> dict[str, Any]:
    """Where a decode step's time goes: the same GEMMs alone (graphed), unfused and with fused QKV /
    gate-up weights, against the full graphed step (batch 1 and the largest batch)."""
    model = synthetic(ctx)
    bw = _bandwidth(ctx)
    layers = model.model.layers
    out: dict[str, Any] = {}
    fused = [(l.self_attn.qkv_proj.weight, l.self_attn.o_proj.weight, l.mlp.gate_up_proj.weight,
              l.mlp.down_proj.weight) for l in layers]
    hf_w = model.hf_weights()  # HF names -> tensors (row views of the fused weights)
    split = [[hf_w[f"model.layers.{i}.{n}.weight"] for n in ("self_attn.q_proj", "self_attn.k_proj",
                                                               "self_attn.v_proj", "self_attn.o_proj",
                                                               "mlp.gate_proj", "mlp.up_proj")]
             for i in range(len(layers))]
    for b in (1, max(ctx.args.batches)):
        x_h = torch.randn(b, model.arch.hidden_size, dtype=model.dtype, device=ctx.device)
        x_i = torch.randn(b, model.arch.intermediate_size, dtype=model.dtype, device=ctx.device)

        def unfused() -> None:
            for l, weights in zip(layers, split):
                for w in weights:
                    torch.nn.functional.linear(x_h, w)
                torch.nn.functional.linear(x_i, l.mlp.down_proj.weight)
            torch.nn.functional.linear(x_h, model.lm_head.weight)

        def fused_gemms() -> None:
            for qkv, o, gate_up, down in fused:
                torch.nn.functional.linear(x_h, qkv)
                torch.nn.functional.linear(x_h, o)
                torch.nn.functional.linear(x_h, gate_up)
                torch.nn.functional.linear(x_i, down)
            torch.nn.functional.linear(x_h, model.lm_head.weight)

        entry = {"weights_floor_ms": ctx.weight_bytes / bw * 1e3}
        for name, fn in (("gemms_unfused", unfused), ("gemms_fused_qkv_gateup", fused_gemms)):
            with torch.inference_mode():
                fn()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    fn()
            entry[f"{name}_ms"] = time_cuda(graph.replay, reps=ctx.args.reps)["median_ms"]
            del graph
        out[str(b)] = entry
    del fused
    try:
        out["graphed_step_by_ops"] = _step_by_ops(ctx, model)
    except Exception as exc:  # an A/B diagnostic: keep the other figures if it fails
        out["graphed_step_by_ops"] = {"error": repr(exc)}
    try:
        out["profile_batch1"] = _profile_decode_kernels(ctx, model)
    except Exception as exc:  # the profiler is a diagnostic: keep the GEMM figures if it fails
        out["profile_batch1"] = {"error": repr(exc)}
    torch.cuda.empty_cache()
    return out


def _step_by_ops(ctx: Ctx, model: Any) -> dict[str, Any]:
    """Graphed decode step with the model's ops (fused Triton row kernels on CUDA) vs the same model with
    torch row ops (TorchOps(row_kernels="torch"), a weight-sharing view): what the row-kernel fusion buys."""
    from engine.kernels import TorchOps

    context, batches = ctx.args.context, (1, max(ctx.args.batches))
    nb = -(-(context + 16) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(RESERVED_BLOCKS + max(batches) * nb, BLOCK_SIZE)
    fill_cache_(kv, seed=2)
    out: dict[str, Any] = {}
    for label, m in (("model_ops", model), ("torch_row_ops", model.with_numerics(TorchOps("torch"), model.attention))):
        for b, ms in _graphed_decode_ms(ctx, m, kv, batches, nb).items():
            out[f"{label}_b{b}_ms"] = ms
    del kv
    return out


def _graphed_decode_ms(ctx: Ctx, model: Any, kv: Any, batches: tuple[int, ...], nb: int) -> dict[int, float]:
    """Median ms of a captured decode step of `model` at each batch size (rows at --context, `nb` blocks
    of table each, contiguous tables over `kv`)."""
    context = ctx.args.context
    graphs = _decode_graphs(ctx, model, kv, batches, nb * BLOCK_SIZE)
    out: dict[int, float] = {}
    for b in batches:
        tables = contiguous_tables(b, nb)
        ids = [(5 * r + 3) % model.arch.vocab_size for r in range(b)]
        out[b] = time_cuda(lambda: graphs.run(ids, [context - 1] * b, [context] * b, tables),
                           reps=ctx.args.reps)["median_ms"]
    del graphs
    return out


def kernel_times(prof: Any, name_len: int = 80) -> dict[str, list[float]]:
    """Device microseconds of every CUDA kernel a torch.profiler run recorded, by kernel name (cut to
    `name_len` characters)."""
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by_name.setdefault(ev.name[:name_len], []).append(
                ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total)
    return by_name


def _profile_decode_kernels(ctx: Ctx, model: Any, batch: int = 1, prefill_tokens: int = 0) -> dict[str, Any]:
    """GPU kernels of one eager decode step of `batch` rows at --context (or, prefill_tokens > 0, of one
    prefill pass of that many tokens in rows of 256): count, and device time by kernel name."""
    from torch.profiler import ProfilerActivity, profile

    from engine.attention import PassKind, RowSpec, build_metadata, positions_of

    context = ctx.args.context
    nb = -(-(max(context, 256) + 16) // BLOCK_SIZE)
    n_rows = -(-prefill_tokens // 256) if prefill_tokens else batch
    kv = model.allocate_kv_cache(RESERVED_BLOCKS + n_rows * nb, BLOCK_SIZE)
    tables = contiguous_tables(n_rows, nb)
    if prefill_tokens:
        rows = [RowSpec(t, 0, 256) for t in tables]
        kind = PassKind.PREFILL
    else:
        rows = [RowSpec(t, context - 1, 1) for t in tables]
        kind = PassKind.DECODE
    meta = build_metadata(kind, rows, BLOCK_SIZE, ctx.device)
    ids = torch.full((sum(r.num_tokens for r in rows),), 11, device=ctx.device)
    pos = positions_of(rows, ctx.device)
    with torch.inference_mode():
        for _ in range(2):
            model.compute_logits(model(ids, pos, meta, kv))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.compute_logits(model(ids, pos, meta, kv))
            torch.cuda.synchronize()
    by_name = kernel_times(prof)
    total = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv_: -sum(kv_[1]))[:15]
    del kv
    return {"kernels": sum(len(v) for v in by_name.values()), "device_us": total,
            "top": [{"name": k, "count": len(v), "us": round(sum(v), 1)} for k, v in top]}


def bench_bi_breakdown(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 diagnostic: the batch_invariant numerics (BatchInvariantOps + BatchInvariantAttention, a
    weight-sharing view of the synthetic 8B) against the model's own: graphed decode steps at batch 1 and
    the largest batch, an eager 4096-token prefill pass, and the kernels of the BI decode / prefill."""
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of
    from engine.attention.batch_invariant import BatchInvariantAttention
    from engine.kernels import BatchInvariantOps

    model = synthetic(ctx)
    bi = model.with_numerics(BatchInvariantOps(), BatchInvariantAttention())
    context, batches = ctx.args.context, (1, max(ctx.args.batches))
    nb = -(-(max(context, 256) + 16) // BLOCK_SIZE)
    rows_needed = max(max(batches), 16)
    kv = model.allocate_kv_cache(RESERVED_BLOCKS + rows_needed * nb, BLOCK_SIZE)
    fill_cache_(kv, seed=2)
    out: dict[str, Any] = {"context": context}
    for label, m in (("model", model), ("batch_invariant", bi)):
        for b, ms in _graphed_decode_ms(ctx, m, kv, batches, nb).items():
            out[f"{label}_decode_b{b}_ms"] = ms
        tables = contiguous_tables(16, nb)
        rows = [RowSpec(t, 0, 256) for t in tables]
        meta = build_metadata(PassKind.PREFILL, rows, BLOCK_SIZE, ctx.device)
        ids_t = torch.full((16 * 256,), 7, device=ctx.device)
        pos = positions_of(rows, ctx.device)
        with torch.inference_mode():
            t = time_cuda(lambda: m.compute_logits(m(ids_t, pos, meta, kv)[-16:]), reps=5)
        out[f"{label}_prefill_4096_ms"] = t["median_ms"]
    del kv
    for key in ("decode_b%d" % max(batches), "prefill_4096"):
        out[f"ratio_{key}"] = out[f"model_{key}_ms"] / out[f"batch_invariant_{key}_ms"]
    for name, kwargs in (("profile_bi_decode", {"batch": max(batches)}), ("profile_bi_prefill", {"prefill_tokens": 4096})):
        try:
            out[name] = _profile_decode_kernels(ctx, bi, **kwargs)
        except Exception as exc:  # a diagnostic: keep the timings if the profiler fails
            out[name] = {"error": repr(exc)}
    torch.cuda.empty_cache()
    return out


def _eager_decode_ms(model: Any, kv: Any, tables: list[list[int]], ids: list[int], pos: list[int],
                     context: int) -> float:
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of

    rows = [RowSpec(t, context - 1, 1) for t in tables]
    meta = build_metadata(PassKind.DECODE, rows, BLOCK_SIZE, model.device)
    inp = torch.tensor(ids, dtype=torch.long, device=model.device)
    positions = positions_of(rows, model.device)
    with torch.inference_mode():
        return time_cuda(lambda: model.compute_logits(model(inp, positions, meta, kv)), reps=5)["median_ms"]


def bench_lite_generate(ctx: Ctx) -> dict[str, Any]:
    """64 x (128 in, 128 out): one batched prefill, then graph decode with argmax on the GPU."""
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of

    model = synthetic(ctx)
    n_req, n_in, n_out = ctx.args.requests, ctx.args.prompt_len, ctx.args.new_tokens
    blocks_per_row = -(-(n_in + n_out) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(RESERVED_BLOCKS + n_req * blocks_per_row, BLOCK_SIZE)
    graphs = _decode_graphs(ctx, model, kv, (n_req,), blocks_per_row * BLOCK_SIZE)
    tables = contiguous_tables(n_req, blocks_per_row)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.arch.vocab_size, (n_req, n_in), generator=gen)
    rows = [RowSpec(t, 0, n_in) for t in tables]

    def run() -> tuple[float, float, list[list[int]]]:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            meta = build_metadata(PassKind.PREFILL, rows, BLOCK_SIZE, ctx.device)
            hidden = model(prompts.flatten().to(ctx.device), positions_of(rows, ctx.device), meta, kv)
            last = meta.query_start_loc[1:].long() - 1
            nxt = model.compute_logits(hidden[last]).argmax(-1).tolist()
        t_prefill = time.perf_counter() - t0
        outs = [[t] for t in nxt]
        for i in range(n_out - 1):
            p = n_in + i
            logits = graphs.run(nxt, [p] * n_req, [p + 1] * n_req, tables)
            nxt = logits.argmax(-1).tolist()
            for o, t in zip(outs, nxt):
                o.append(t)
        torch.cuda.synchronize()
        return t_prefill, time.perf_counter() - t0, outs

    run()  # warm-up (prefill kernels compile)
    t_prefill, total, outs = run()
    tokens = n_req * n_out
    bw = _bandwidth(ctx)
    mean_ctx = n_in + n_out / 2
    floor_step = (ctx.weight_bytes + n_req * mean_ctx * kv_bytes_per_token(model)) / bw
    res = {"requests": n_req, "prompt_len": n_in, "new_tokens": n_out, "seconds": total,
           "prefill_s": t_prefill, "output_tok_per_s": tokens / total,
           "decode_only_tok_per_s": n_req * (n_out - 1) / (total - t_prefill),
           "bandwidth_limit_tok_per_s": n_req / floor_step,
           "first_request_first_tokens": outs[0][:8]}
    del graphs, kv
    torch.cuda.empty_cache()
    return res


def bench_engine_generate(ctx: Ctx) -> dict[str, Any]:
    """The same requests through the engine core (nondeterministic), eager, then with decode graphs."""
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    model = synthetic(ctx)
    n_req, n_in, n_out = ctx.args.requests, ctx.args.prompt_len, ctx.args.new_tokens
    blocks = RESERVED_BLOCKS + n_req * (-(-(n_in + n_out) // BLOCK_SIZE) + 1)
    config = _engine_config(ctx, model="synthetic", device=ctx.device.type, dtype="bfloat16",
                            mode="nondeterministic", num_kv_blocks=blocks, max_num_seqs=n_req,
                            max_num_batched_tokens=n_req * n_in, max_model_len=4096)
    shape = engine_shape(model, 4096)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.arch.vocab_size, (n_req, n_in), generator=gen).tolist()
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = ctx.open({})
    # decode_graphs = the default engine (overlap on); decode_graphs_no_overlap: the host reads every
    # step's tokens before planning the next (the engine before overlap)
    for label, graphs, overlap in (("eager", False, True), ("decode_graphs_no_overlap", True, False),
                                   ("decode_graphs", True, True)):
        if not ctx.has_time(20, label):
            break
        llm = LLM.from_parts(replace(config, cuda_graphs=graphs, overlap=overlap), model, shape, eos_ids=set())
        if graphs:
            out["graph_hook"] = llm.core.runner.graphs_status
        out[label] = _drive(ctx, llm.core, prompts, params, ctx.args.engine_cap_s, f"eng-{label}",
                            mem_probe_steps=32)
        del llm
        _free()
        ctx.checkpoint(f"{label}: {out[label]['output_tok_per_s']:.0f} tok/s")
    rates = [out[k]["output_tok_per_s"] for k in ("eager", "decode_graphs") if k in out]
    if rates:
        out["output_tok_per_s"] = max(rates)
    return out


def _engine_config(ctx: Ctx, graphs: bool = True, **kw: Any) -> Any:
    """EngineConfig for a CUDA bench run: Triton attention (batch_invariant keeps its own), the bench's
    --decode-cublaslt-min-rows and, with `graphs`, the model runner's CUDA graphs (decode; verify when
    bit-exact)."""
    if kw.get("mode") != "batch_invariant":
        kw.setdefault("attention_backend", "triton")
    kw.setdefault("verify_decode_rows", ctx.args.verify_decode_rows)  # None: the engine's default (0 off dvr)
    kw.setdefault("canonical_prefill_min_tokens", ctx.args.canonical_prefill_min_tokens)  # None: the engine's
    if ctx.args.verify_early_decode is not None:
        kw.setdefault("verify_early_decode", ctx.args.verify_early_decode == "on")
    if ctx.args.chained_verify is not None:
        kw.setdefault("chained_verify", ctx.args.chained_verify == "on")
    if ctx.args.verify_packing is not None and kw.get("mode", "dvr") == "dvr":
        kw.setdefault("verify_packing", ctx.args.verify_packing)
    if ctx.args.verify_trigger is not None and kw.get("mode", "dvr") == "dvr":
        kw.setdefault("verify_trigger", ctx.args.verify_trigger)
    return EngineConfig(cuda_graphs=graphs, decode_cublaslt_min_rows=ctx.args.decode_cublaslt_min_rows, **kw)


def cublaslt_min_rows(args: argparse.Namespace) -> int:
    """--decode-cublaslt-min-rows as the bench's decode graphs use it (None: the engine's default for CUDA
    graphs)."""
    return resolve_decode_cublaslt_min_rows(args.decode_cublaslt_min_rows, True)


def _decode_graphs(ctx: Ctx, model: Any, kv: Any, batches: Sequence[int], max_seq_len: int) -> Any:
    """Captured decode graphs of `model` for a bench section (scratch slot in block 1, the bench's
    --decode-cublaslt-min-rows)."""
    from engine.cuda_graphs import DecodeGraphs

    graphs = DecodeGraphs(model, kv, max(batches), max_seq_len, scratch_slot=BLOCK_SIZE, batch_sizes=batches,
                          cublaslt_min_rows=cublaslt_min_rows(ctx.args))
    graphs.capture()
    return graphs


def _free() -> None:
    """Drop an engine's KV cache and graph pools (its decode hook closes a reference cycle)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


PROBE_FIRST_STEP = 4  # memory probe from this engine step: prefill done, every request decoding


def _drive(ctx: Ctx, core: Any, prompts: list[list[int]], params: Any, cap_s: float, tag: str,
           mem_probe_steps: int = 0) -> dict[str, Any]:
    """Add the requests, step the engine until all finish or the cap (or the budget) ends; with
    `mem_probe_steps`, the device memory that many steady-state steps leave allocated and their peak."""
    seqs = [core.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    cap = ctx.cap(cap_s)
    probe: dict[str, Any] = {}
    _sync()
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
    _sync()
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


def bench_hf_generate(ctx: Ctx) -> dict[str, Any]:
    """transformers on the same weights and requests: static-batch greedy `generate`, then continuous
    batching (each guarded: an API this transformers lacks, or an error, is recorded and the run goes on)."""
    import transformers

    model = synthetic(ctx)
    n_req, n_in, n_out = ctx.args.requests, ctx.args.prompt_len, ctx.args.new_tokens
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(ctx.device):
            hf = transformers.LlamaForCausalLM(ctx.hf_config).eval()
    finally:
        torch.set_default_dtype(default)
    missing, unexpected = hf.load_state_dict(model.hf_weights(), strict=False)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.arch.vocab_size, (n_req, n_in), generator=gen).to(ctx.device)
    out: dict[str, Any] = ctx.open({"missing_keys": missing[:5], "unexpected_keys": unexpected[:5],
                                    "attn_implementation": getattr(hf.config, "_attn_implementation", None)})

    def static(new_tokens: int = n_out, max_time: float | None = None) -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_time=max_time,
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    with torch.inference_mode():  # parity of the prefill logits on the same weights
        ours = _our_prefill_logits(model, prompts[:2])
        theirs = hf(input_ids=prompts[:2]).logits[:, -1].float()
        out["prefill_logits_max_abs_diff"] = (ours - theirs).abs().max().item()
        out["prefill_top1_agree"] = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    static_first: list[int] = []
    if ctx.has_time(30, "static batch"):
        static(4)  # warm-up
        seqs, total = time_wall(lambda: static(max_time=max(5.0, ctx.left() - 60)))  # 60 s kept for the rest
        generated = int(seqs.shape[1] - n_in)
        static_first = seqs[0, n_in:].tolist()
        out["static_batch"] = {"seconds": total, "output_tok_per_s": n_req * generated / total,
                               "generated": generated, "capped": generated < n_out}
        ctx.checkpoint(f"static batch: {out['static_batch']['output_tok_per_s']:.0f} tok/s")
    if ctx.has_time(45, "continuous batching"):
        _free()  # the manager sizes its paged cache from the memory free now
        try:
            out["continuous_batching"] = hf_continuous_batching(hf, prompts.tolist(), n_out, ctx.args.hf_cb_cap_s,
                                                                static_first, ctx.section_deadline)
        except Exception:  # an API this transformers lacks or refuses: record it, keep the static figure
            out["continuous_batching"] = {"error": traceback.format_exc(limit=6)}
        cb = out["continuous_batching"]
        if cb.get("capped"):
            ctx.truncated = ctx.truncated or cb["cap_s"] < ctx.args.hf_cb_cap_s
        ctx.checkpoint(f"continuous batching: {cb.get('output_tok_per_s', cb.get('error', '')[-200:])}")
    rates = [out[k]["output_tok_per_s"] for k in ("static_batch", "continuous_batching")
             if "output_tok_per_s" in out.get(k, {})]
    if rates:
        out["output_tok_per_s"] = max(rates)
    del hf
    _free()
    return out


def hf_continuous_batching(hf: Any, prompts: list[list[int]], n_out: int, cap_s: float,
                           reference: list[int] | None = None, deadline: float = math.inf) -> dict[str, Any]:
    """Greedy continuous batching of `prompts` through transformers' manager (what `generate_batch` runs),
    timed from the first request in, after the manager's warm-up (CUDA-graph capture), capped at `cap_s`
    and at `deadline` (perf_counter seconds).

    EOS is off (eos_token_id None: the manager sets -1), so every request runs `n_out` tokens as in the
    static batch. `reference`: request 0's static-batch tokens, to count how far the two agree."""
    from transformers import GenerationConfig

    if not hasattr(hf, "continuous_batching_context_manager"):
        raise RuntimeError(f"transformers {__import__('transformers').__version__} has no continuous batching")
    gen_config = GenerationConfig(max_new_tokens=n_out, do_sample=False, pad_token_id=0, eos_token_id=None)
    kwargs: dict[str, Any] = {"generation_config": gen_config, "block": True, "timeout": 10.0, "warmup": True}
    accepted = inspect.signature(hf.continuous_batching_context_manager).parameters
    try:  # sizing hints as generate_batch passes them (absent in some versions)
        from transformers.generation.continuous_batching.utils import WorkloadHints

        if "workload_hints" in accepted:
            kwargs["workload_hints"] = WorkloadHints(max_prompt_length=max(map(len, prompts)),
                                                     max_generated_length=n_out)
    except (ImportError, TypeError):
        pass
    kwargs = {k: v for k, v in kwargs.items() if k in accepted}
    done: dict[str, Any] = {}
    t0 = time.perf_counter()
    with hf.continuous_batching_context_manager(**kwargs) as manager:
        _sync()
        t_in = time.perf_counter()
        cap_s = max(0.0, min(cap_s, deadline - t_in))
        manager.add_requests(inputs=prompts, max_new_tokens=n_out)
        while len(done) < len(prompts) and time.perf_counter() - t_in < cap_s:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = r
            elif r is None and not manager.is_running():
                break
        _sync()
        total = time.perf_counter() - t_in
        running = manager.is_running()
        attn = getattr(hf.config, "_attn_implementation", None)  # the manager's paged variant while it runs
        if len(done) < len(prompts) and hasattr(manager, "cancel_request"):
            for i in range(len(prompts)):  # capped: stop the rest, or stop() would wait for them
                if f"req_{i}" not in done:
                    manager.cancel_request(f"req_{i}")
    lengths = [len(r.generated_tokens) for r in done.values()]
    errors = [str(r.error)[:200] for r in done.values() if getattr(r, "error", None)]
    first = done.get("req_0")
    agree = None
    if first is not None and reference:
        agree = next((i for i, (x, y) in enumerate(zip(first.generated_tokens, reference)) if x != y),
                     min(len(first.generated_tokens), len(reference)))
    return {"api": "continuous_batching_context_manager + add_requests/get_result",
            "warmup_s": round(t_in - t0, 2), "seconds": total, "output_tok_per_s": sum(lengths) / total,
            "finished": len(done), "requests": len(prompts), "capped": len(done) < len(prompts),
            "cap_s": round(cap_s, 1), "generated_min_max": [min(lengths), max(lengths)] if lengths else None,
            "errors": errors[:3], "manager_running_at_end": running,
            "attn_implementation": attn, "first_request_tokens_equal_static": agree}


def _our_prefill_logits(model: Any, prompts: torch.Tensor) -> torch.Tensor:
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of

    n, length = prompts.shape
    blocks = -(-length // BLOCK_SIZE)
    kv = model.allocate_kv_cache(RESERVED_BLOCKS + n * blocks, BLOCK_SIZE)
    rows = [RowSpec(t, 0, length) for t in contiguous_tables(n, blocks)]
    meta = build_metadata(PassKind.PREFILL, rows, BLOCK_SIZE, model.device)
    hidden = model(prompts.flatten(), positions_of(rows, model.device), meta, kv)
    return model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1])


def bench_verify_cost(ctx: Ctx) -> dict[str, Any]:
    """A verify pass (eager, and CUDA-graphed when that is bit-exact) per G x W, each row on `context` keys."""
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of
    from engine.cuda_graphs import VerifyGraph

    model = synthetic(ctx)
    context = ctx.args.context
    shapes = [(1, 32), (8, 32), (16, 32), (8, 64)]
    max_g, max_w = max(g for g, _ in shapes), max(w for _, w in shapes)
    blocks_per_row = -(-(context + max_w) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(RESERVED_BLOCKS + max_g * blocks_per_row, BLOCK_SIZE)
    fill_cache_(kv, seed=1)
    tables = contiguous_tables(max_g, blocks_per_row)
    out: dict[str, Any] = ctx.open({"context": context, "shapes": {}})
    for g, w in shapes:
        if not ctx.has_time(10, f"G x W {g}x{w}"):
            break
        rows = [RowSpec(tables[r], context, w) for r in range(g)]
        meta = build_metadata(PassKind.VERIFY, rows, BLOCK_SIZE, ctx.device)
        ids = torch.randint(0, model.arch.vocab_size, (g * w,), device=ctx.device)
        pos = positions_of(rows, ctx.device)
        with torch.inference_mode():
            t = time_cuda(lambda: model.compute_logits(model(ids, pos, meta, kv)), reps=ctx.args.reps // 2)
        entry = {**t, "tokens": g * w, "ms_per_token": t["median_ms"] / (g * w)}
        vg = VerifyGraph(model, kv, g, w, blocks_per_row * BLOCK_SIZE)
        vg.stage(ids.tolist(), pos.tolist(), meta.slot_mapping.tolist(), meta.seq_lens.tolist(),
                 [tables[r] for r in range(g)])
        vg.capture()
        tg = time_cuda(vg.replay, reps=ctx.args.reps // 2)
        entry.update({"graph_bit_exact": vg.bit_exact, "graph_median_ms": tg["median_ms"],
                      "graph_ms_per_token": tg["median_ms"] / (g * w)})
        out["shapes"][f"{g}x{w}"] = entry
        del vg
        ctx.checkpoint(f"verify {g}x{w}: eager {t['median_ms']:.2f} ms, graph {tg['median_ms']:.2f} ms")
    del kv
    torch.cuda.empty_cache()
    return out


# ---- SmolLM2 -------------------------------------------------------------------------------------
TOPICS = ["photosynthesis", "the French Revolution", "black holes", "sourdough bread", "the stock market",
          "climate change", "the human heart", "Shakespeare's sonnets", "quantum computing", "volcanoes",
          "the Roman Empire", "machine learning", "honeybees", "the Pythagorean theorem", "jazz music",
          "the immune system", "electric cars", "the Great Wall of China", "coral reefs", "chess openings",
          "the water cycle", "ancient Egypt", "vaccines", "the internet", "plate tectonics", "coffee",
          "the Moon landing", "recycling", "the printing press", "marathon training", "DNA", "tea ceremonies",
          "the Renaissance", "solar panels", "octopuses", "inflation", "the Olympic Games", "glaciers",
          "origami", "public libraries"]
TASKS = ["Explain {t} to a ten-year-old.", "Write a short poem about {t}.",
         "List five surprising facts about {t}.", "What are the main arguments for and against {t}?",
         "Write a detailed essay introduction about {t}, with a thesis statement and an outline of three "
         "supporting paragraphs, then continue with the first paragraph.",
         "Summarize the history of {t} in a few sentences.", "Give me a step-by-step guide related to {t}.",
         "Imagine you are a tour guide. Describe {t} to a group of curious visitors who know nothing about "
         "it, using vivid language and at least one analogy."]


def smollm2_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """n chat prompts, topics x tasks, varied in length and subject (deterministic order)."""
    prompts = []
    for i in range(n):
        text = TASKS[i % len(TASKS)].format(t=TOPICS[(i * 7 + i // len(TASKS)) % len(TOPICS)])
        msgs = [{"role": "user", "content": text}]
        ids = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        prompts.append(list(ids))
    return prompts


def bench_smollm2_rollback(ctx: Ctx) -> dict[str, Any]:
    """Natural rollbacks on SmolLM2, all requests deterministic (greedy): per W, DVR decode rows with the
    verifier's attention numerics ("canonical") and with the split-KV kernel ("split")."""
    from engine.sampling import SamplingParams

    a = ctx.args
    out = ctx.open({"prompts": a.rollback_prompts, "new_tokens": a.rollback_tokens, "group": a.group, "runs": {}})
    for w in a.rollback_windows:
        for attn in a.rollback_decode_attention:
            key = f"W{w}-{attn}"
            if not ctx.has_time(15, key):
                continue
            config = _engine_config(ctx, a.engine_graphs, model=a.gguf, device=ctx.device.type,
                                    dtype="bfloat16", mode="dvr", window=w, group=a.group,
                                    dvr_decode_attention=attn, num_kv_blocks=a.smol_kv_blocks,
                                    max_num_seqs=a.rollback_prompts, max_num_batched_tokens=8192,
                                    cache_dir=a.cache_dir)
            llm = smol_llm(ctx, config)
            prompts = smollm2_prompts(llm.tokenizer, a.rollback_prompts)
            params = SamplingParams(max_tokens=a.rollback_tokens, temperature=0.0, ignore_eos=True,
                                    deterministic=True, seed=1)
            res = {"window": w, "dvr_decode_attention": attn,
                   **_drive(ctx, llm.core, prompts, params, a.rollback_cap_s, f"w{w}{attn}")}
            res["graphs"] = llm.bench_graphs
            st = res["stats"]
            committed = max(res["committed_tokens"], 1)
            res["recompute_pct_of_output"] = 100.0 * st.get("recomputed_tokens", 0) / committed
            res["rollbacks_per_verify_pass"] = st.get("rollbacks", 0) / max(st.get("verify_passes", 1), 1)
            res["rollbacks_per_committed_token"] = st.get("rollbacks", 0) / committed
            if w == 32 and attn == "canonical":
                ctx.extras["smollm2_rollbacks_per_token_w32"] = res["rollbacks_per_committed_token"]
            out["runs"][key] = res
            out["prompt_len_min_max"] = [min(map(len, prompts)), max(map(len, prompts))]
            del llm
            _free()
            ctx.checkpoint(f"{key}: recompute {res['recompute_pct_of_output']:.2f} %, "
                           f"{res['rollbacks_per_committed_token']:.5f} rollbacks/token, {res['seconds']:.0f}s")
    return out


def smol_llm(ctx: Ctx, config: Any) -> Any:
    """An engine over SmolLM2 loaded once per run (`load_model` of the first config: bfloat16, Triton
    attention; the weights are shared by every config of the run).

    batch_invariant goes through `LLM(config)`: the engine builds that model with its own ops."""
    from engine.config import Mode
    from engine.llm import LLM
    from engine.model_runner import load_model

    if config.mode == Mode.BATCH_INVARIANT:
        llm = LLM(config)
    else:
        if "smol" not in ctx.extras:
            ctx.extras["smol"] = load_model(config)
        loaded = ctx.extras["smol"]
        llm = LLM.from_parts(config, loaded.model, loaded.shape, set(loaded.info.eos_token_ids), loaded.tokenizer)
    llm.bench_graphs = llm.core.runner.graphs_status
    return llm


def bench_wg_sweep(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 sweep on SmolLM2: W in 16/32/64 x G in 4/8/16/32, every request deterministic (greedy):
    output tok/s and recompute rate per (W, G), DVR decode rows as --sweep-decode-attention says; then
    the G=8 runs again with the other decode attention ("W32xG8-split-decode")."""
    from engine.sampling import SamplingParams

    a = ctx.args
    attn = a.sweep_decode_attention
    other = "split" if attn == "canonical" else "canonical"
    out = ctx.open({"requests": a.sweep_requests, "new_tokens": a.sweep_tokens, "dvr_decode_attention": attn,
                    "runs": {}})
    runs = [(w, g, attn, f"W{w}xG{g}") for w in (16, 32, 64) for g in (4, 8, 16, 32)]
    if a.sweep_other_decode:
        runs += [(w, 8, other, f"W{w}xG8-{other}-decode") for w in (16, 32, 64)]
    for w, g, decode_attn, key in runs:
        if not ctx.has_time(10, key):
            continue
        config = _engine_config(ctx, a.engine_graphs, model=a.gguf, device=ctx.device.type,
                                dtype="bfloat16", mode="dvr", window=w, group=g, dvr_decode_attention=decode_attn,
                                num_kv_blocks=a.smol_kv_blocks, max_num_seqs=a.sweep_requests,
                                max_num_batched_tokens=8192, cache_dir=a.cache_dir)
        llm = smol_llm(ctx, config)
        prompts = smollm2_prompts(llm.tokenizer, a.sweep_requests)
        params = SamplingParams(max_tokens=a.sweep_tokens, temperature=0.0, ignore_eos=True, deterministic=True,
                                seed=1)
        res = {"window": w, "group": g, "dvr_decode_attention": decode_attn,
               **_drive(ctx, llm.core, prompts, params, a.sweep_cap_s, f"sw-{key}")}
        committed = max(res["committed_tokens"], 1)
        res["recompute_pct_of_output"] = 100.0 * res["stats"].get("recomputed_tokens", 0) / committed
        out["runs"][key] = res
        del llm
        _free()
        ctx.checkpoint(f"{key}: {res['output_tok_per_s']:.0f} tok/s, recompute {res['recompute_pct_of_output']:.2f} %")
    return out


MODES: list[tuple[str, str, float]] = [("nondeterministic", "nondeterministic", 0.0)] + [
    (f"dvr_{p}pct", "dvr", p / 100) for p in (2, 10, 50, 100)] + [("batch_invariant", "batch_invariant", 1.0)]


def sharegpt_like_lengths(n: int, seed: int, lo: int, hi: int) -> list[int]:
    """Log-uniform lengths in [lo, hi]: many short, a long tail (the shape of ShareGPT's outputs)."""
    rng = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=rng, dtype=torch.float64)
    return [int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))))) for x in u.tolist()]


def log_uniform_mean(lo: int, hi: int) -> float:
    """The mean of the log-uniform distribution on [lo, hi] (what `sharegpt_like_lengths` draws from)."""
    return (hi - lo) / math.log(hi / lo)


# Synthetic request-set specs of compare_modes_synthetic(_long):
#   "sharegpt"            the mix: prompts log-uniform in [16, 512], outputs in [16, --compare-tokens]
#   "sharegpt-PxO"        the mix with prompts in [16, P] and outputs in [16, O]. "sharegpt-896x640": its 96
#                         requests average 226 prompt and 201 output tokens, the per-request means of ShareGPT
#                         (ShareGPT_V3_unfiltered_cleaned_split) as SGLang's serving benchmark samples it: 3000
#                         prompts, 676,842 input and 613,123 generated tokens = 226 / 204 (the SGLang author's
#                         published run, gist.github.com/merrymercy/e3041f0029db232adbe845cf995b3290). The plain
#                         "sharegpt" mix (outputs <= 128: mean 59) is ShareGPT's shape with outputs 3.4x shorter.
#   "NxPxO"               N requests of exactly P prompt and O output tokens
MIX_LO = 16


def parse_set_spec(spec: str, compare_tokens: int) -> tuple[str, str, tuple[int, ...]]:
    """A set spec -> (kind "mix" | "fixed", result key, numbers): ("mix", "modes", (512, compare_tokens)) for
    "sharegpt", ("mix", "mix_PxO", (P, O)) for "sharegpt-PxO", ("fixed", "fixed_NxPxO", (N, P, O))."""
    def ints(text: str, count: int) -> tuple[int, ...]:
        parts = text.split("x")
        if len(parts) != count or not all(x.isdigit() and int(x) > 0 for x in parts):
            raise ValueError(f"request set {spec!r}: expected {count} positive integers joined by 'x'")
        return tuple(int(x) for x in parts)

    if spec == "sharegpt":
        return "mix", "modes", (512, compare_tokens)
    if spec.startswith("sharegpt-"):
        p_max, o_max = ints(spec[len("sharegpt-"):], 2)
        if min(p_max, o_max) <= MIX_LO:
            raise ValueError(f"request set {spec!r}: the maxima must exceed the minimum length {MIX_LO}")
        return "mix", f"mix_{p_max}x{o_max}", (p_max, o_max)
    return "fixed", f"fixed_{spec}", ints(spec, 3)


def request_sets(sec_res: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(result key, modes) of a mode-comparison section's request sets below its top level (the top level
    holds the "sharegpt" mix's modes): "mix_PxO" and "fixed_NxPxO" entries, in result order."""
    return [(k, v.get("modes", {})) for k, v in sec_res.items()
            if k.startswith(("fixed_", "mix_")) and isinstance(v, dict)]


WARMUP_TOKENS = 4  # per request, in each mode's untimed warm-up


def _run_modes(ctx: Ctx, make_llm: Callable[[str, float], Any], prompts: list[list[int]], out_lens: list[int],
               cap_s: float, tag: str, modes: dict[str, Any]) -> dict[str, Any]:
    """Each mode on the same requests (an evenly spread `share` of them deterministic): tok/s, p50/p99
    request latency, filled into `modes` (part of the section's live result) one mode at a time."""
    from engine.sampling import SamplingParams

    for name, mode, share in MODES:
        if ctx.args.modes and name not in ctx.args.modes:
            continue
        if not ctx.has_time(15, f"{tag} {name}"):
            modes[name] = {"skipped": "time budget"}
            continue
        try:
            llm = make_llm(mode, share)
        except Exception as exc:  # e.g. a mode this build refuses: record it, measure the other modes
            modes[name] = {"error": repr(exc)[:400]}
            continue
        n_det = round(share * len(prompts))
        det_ids = set(range(0, len(prompts), max(1, round(len(prompts) / n_det)))[:n_det]) if n_det else set()
        # untimed warm-up on the same prompts (a few tokens each): Triton compiles this mode's kernels for
        # these prompt shapes here, not inside the timed run (a cold first mode runs about 2.7x slower than
        # a warm one)
        warm = [llm.core.add_request(f"{tag}-{name}-warm-{i}", p, mix_params(
            ctx.args.sampling, WARMUP_TOKENS, i in det_ids, i)) for i, p in enumerate(prompts)]
        while any(not s.is_finished for s in warm) or llm.core.has_work():
            llm.core.step()
        del warm
        runs = [_timed_mode_run(ctx, llm, prompts, out_lens, det_ids, cap_s, f"{tag}-{name}-r{rep}")
                for rep in range(max(1, ctx.args.mode_repeats))]
        run = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]  # the median run (by time)
        profiled = None
        if name in ctx.args.profile_modes:  # one more run under the profiler: where the GPU idles
            profiled = _profiled_mode_run(ctx, llm, prompts, out_lens, det_ids, cap_s, f"{tag}-{name}-prof")
        modes[name] = {"mode": mode, "graphs": getattr(llm, "bench_graphs", None),
                       "attention": getattr(llm.core.runner.model.attention, "name", None),
                       "dvr_decode_attention": llm.config.dvr_decode_attention,
                       "dvr_lookahead": llm.config.dvr_lookahead, "overlap": llm.config.overlap,
                       "warmup_tokens_per_request": WARMUP_TOKENS,
                       "canonical_prefill_min_tokens": llm.config.canonical_prefill_min_tokens,
                       "deterministic_share": share, "deterministic_requests": len(det_ids),
                       "repeats": len(runs), "runs_seconds": [r["seconds"] for r in runs],
                       **run}
        if profiled is not None:
            modes[name]["profiled_run"] = profiled
        done, cap = run["finished"], run["cap_s"]
        if done < len(prompts) and cap < cap_s:
            modes[name]["capped_by_budget"] = True
            ctx.truncated = True
        del llm
        _free()
        base = modes.get("nondeterministic", {}).get("output_tok_per_s")
        for entry in modes.values():
            if base and "output_tok_per_s" in entry:
                entry["ratio_to_nondeterministic"] = entry["output_tok_per_s"] / base
        ctx.checkpoint(f"{tag} {name}: {modes[name]['output_tok_per_s']:.0f} tok/s, ratio "
                       f"{modes[name].get('ratio_to_nondeterministic', float('nan')):.3f}, "
                       f"{done}/{len(prompts)} done, median of {len(runs)} runs "
                       f"{[round(r['seconds'], 3) for r in runs]} s")
    return modes


# --sampling presets of the compare_modes sections: what each request asks of the sampler
SAMPLING_PRESETS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0}, "temperature": {"temperature": 0.8},
    "top_p": {"temperature": 0.8, "top_p": 0.95}, "top_k": {"temperature": 0.8, "top_k": 50},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
}


def mix_params(preset: str, max_tokens: int, deterministic: bool, seed: int) -> Any:
    """A mix request's SamplingParams under the --sampling preset."""
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, deterministic=deterministic, seed=seed,
                          **SAMPLING_PRESETS[preset])


def _timed_mode_run(ctx: Ctx, llm: Any, prompts: list[list[int]], out_lens: list[int], det_ids: set[int],
                    cap_s: float, tag: str) -> dict[str, Any]:
    """One timed run of the requests on a warm engine: tok/s, p50/p99 latency, this run's engine stats."""
    from engine.sampling import SamplingParams

    def counters() -> dict[str, int | float]:
        return {k: v for k, v in vars(llm.core.stats()).items() if isinstance(v, (int, float))}

    before = counters()
    seqs = [llm.core.add_request(f"{tag}-{i}", p, mix_params(ctx.args.sampling, m, i in det_ids, i))
            for i, (p, m) in enumerate(zip(prompts, out_lens))]
    cap = ctx.cap(cap_s)
    totals = llm.core.totals
    walls: dict[str, list[float]] = {}  # step kind -> [steps, host wall seconds, of which waiting on events]
    previous = "prefill"
    waited = [0.0]
    with _timed_event_waits(waited):
        _sync()
        t0 = time.perf_counter()
        done: dict[str, float] = {}
        while len(done) < len(seqs) and time.perf_counter() - t0 < cap:
            passes = (totals.prefill_passes, totals.verify_passes, totals.decode_passes)
            ts, w0 = time.perf_counter(), waited[0]
            llm.core.step()
            wall = time.perf_counter() - ts
            kind = step_kind(passes, (totals.prefill_passes, totals.verify_passes, totals.decode_passes), previous)
            previous = kind
            entry = walls.setdefault(kind, [0, 0.0, 0.0])
            entry[0] += 1
            entry[1] += wall
            entry[2] += waited[0] - w0
            for s in seqs:
                if s.is_finished and s.request_id not in done:
                    done[s.request_id] = time.perf_counter() - t0
        _sync()
        total = time.perf_counter() - t0
    for s in seqs:  # a capped run's leftovers must not ride into the next run
        if not s.is_finished:
            llm.core.abort(s.request_id)
    while llm.core.has_work():
        llm.core.step()
    lat = sorted(done.values())
    tokens = sum(len(s.tokens) for s in seqs)
    after = counters()
    stats = {k: (v if k in ("running", "waiting") else v - before.get(k, 0)) for k, v in after.items()}
    return {"seconds": total, "output_tok_per_s": tokens / total, "committed_tokens": tokens,
            "finished": len(done), "requests": len(seqs), "capped": len(done) < len(seqs), "cap_s": round(cap, 1),
            "p50_latency_s": _pct(lat, 50), "p99_latency_s": _pct(lat, 99), "stats": stats,
            # host wall time of each step() by kind (the loop's bookkeeping between steps is not counted), and
            # of it the time spent waiting in CUDA event synchronizes (the rest is host work)
            "step_wall_s": {k: {"steps": n, "seconds": round(t, 4), "mean_ms": round(1e3 * t / n, 3),
                                "waiting_s": round(wt, 4)}
                            for k, (n, t, wt) in sorted(walls.items())}}


@contextlib.contextmanager
def _timed_event_waits(total: list[float]) -> Iterator[None]:
    """Add the seconds spent in torch.cuda.Event.synchronize (the engine's waits for the device: sampled
    tokens read, staging buffers free) to total[0] while inside; a no-op without CUDA."""
    if not torch.cuda.is_available():
        yield
        return
    original = torch.cuda.Event.synchronize

    def timed(self: Any) -> None:
        t = time.perf_counter()
        original(self)
        total[0] += time.perf_counter() - t

    torch.cuda.Event.synchronize = timed  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.Event.synchronize = original  # type: ignore[method-assign]


def _profiled_mode_run(ctx: Ctx, llm: Any, prompts: list[list[int]], out_lens: list[int], det_ids: set[int],
                       cap_s: float, tag: str) -> dict[str, Any]:
    """One more run of the requests under torch.profiler (CUDA activity only; not a timed run): the GPU's
    busy time (union of kernel intervals) against the run's span, its kernels by device time, and the largest
    gaps between kernels with the kernels on either side (where the GPU waits for the host)."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU  # CPU: no kernels
    host = getattr(ctx.args, "profile_host", False)
    activities = [activity] + ([ProfilerActivity.CPU] if host and activity != ProfilerActivity.CPU else [])
    with profile(activities=activities) as prof:
        run = _timed_mode_run(ctx, llm, prompts, out_lens, det_ids, cap_s, tag)
    host_api: dict[str, list[float]] = {}
    if host:  # host side: CUDA runtime calls and torch ops by host time (where the host waits or stalls)
        for ev in prof.key_averages():
            if ev.key.startswith(("cuda", "aten::", "Memcpy")) and ev.self_cpu_time_total > 0:
                host_api[ev.key[:60]] = [ev.count, round(ev.self_cpu_time_total / 1e3, 2)]
        host_api = dict(sorted(host_api.items(), key=lambda kv: -kv[1][1])[:30])
    spans = sorted((ev.time_range.start, ev.time_range.end, ev.name[:70]) for ev in prof.events()
                   if ev.device_type.name == "CUDA" and ev.time_range.end > ev.time_range.start)
    busy, gaps, end, last = 0.0, [], None, ""
    for start, stop, name in spans:
        if end is None or start > end:
            if end is not None:
                gaps.append((start - end, last, name))
            busy, end, last = busy + stop - start, stop, name
        elif stop > end:
            busy, end, last = busy + stop - end, stop, name
    by_name: dict[str, float] = {}
    for start, stop, name in spans:
        by_name[name] = by_name.get(name, 0.0) + stop - start
    span = (spans[-1][1] - spans[0][0]) if spans else 0.0
    gap_total = sum(g for g, _, _ in gaps)
    by_pair: dict[str, list[float]] = {}
    for g, before, after in gaps:
        entry = by_pair.setdefault(f"{before[:40]} -> {after[:40]}", [0, 0.0])
        entry[0] += 1
        entry[1] += g
    return {"wall_s": run["seconds"], "kernel_span_s": span / 1e6, "gpu_busy_s": busy / 1e6,
            "gaps_s": gap_total / 1e6, "gaps_over_20us_s": sum(g for g, _, _ in gaps if g > 20) / 1e6,
            "step_wall_s": run["step_wall_s"],
            "top_kernels_ms": {k: round(v / 1e3, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])[:20]},
            "gaps_by_neighbours_ms": {k: [n, round(t / 1e3, 2)] for k, (n, t)
                                      in sorted(by_pair.items(), key=lambda kv: -kv[1][1])[:15]},
            **({"host_calls_count_ms": host_api} if host else {})}


def step_kind(before: tuple[int, int, int], after: tuple[int, int, int], previous: str) -> str:
    """The kind of one engine step from its (prefill, verify, decode) pass counters before and after:
    prefill, verify, decode (a decode step after a decode step: the overlapped steady state),
    decode_after_other (the first decode step after a prefill or verify pass, which restarts the overlap),
    or idle."""
    prefill, verify, decode = (b - a for a, b in zip(before, after))
    if prefill:
        return "prefill"
    if verify:
        return "verify"
    if decode:
        return "decode" if previous in ("decode", "decode_after_other") else "decode_after_other"
    return "idle"


def bench_compare_modes(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 on SmolLM2 (natural rollbacks): ShareGPT-like output lengths, varied prompts."""
    a = ctx.args

    def make(mode: str, share: float) -> Any:
        config = _engine_config(ctx, a.engine_graphs, model=a.gguf, device=ctx.device.type,
                                dtype="bfloat16", mode=mode, window=a.window, group=a.group,
                                dvr_decode_attention=a.dvr_decode_attention, num_kv_blocks=a.smol_kv_blocks,
                                max_num_seqs=a.compare_requests, max_num_batched_tokens=8192, cache_dir=a.cache_dir,
                                dvr_lookahead=a.dvr_lookahead)
        return smol_llm(ctx, config)

    probe = make("nondeterministic", 0.0)
    prompts = smollm2_prompts(probe.tokenizer, a.compare_requests)
    del probe
    _free()
    out_lens = sharegpt_like_lengths(len(prompts), 7, 16, a.compare_tokens)
    out = ctx.open({"model": "SmolLM2-135M-Instruct (GGUF)", "requests": len(prompts),
                    "output_len_mean": sum(out_lens) / len(out_lens), "window": a.window, "group": a.group,
                    "dvr_decode_attention": a.dvr_decode_attention, "modes": {}})
    _run_modes(ctx, make, prompts, out_lens, a.compare_cap_s, "smol", out["modes"])
    return out


def bench_compare_modes_synthetic(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 on the synthetic 8B: the ShareGPT-like mix and the fixed sets of --synthetic-sets."""
    return _synthetic_modes(ctx, ctx.args.synthetic_sets)


def bench_compare_modes_synthetic_long(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 on the synthetic 8B, the long fixed set(s) of --long-sets (4k in / 1k out)."""
    return _synthetic_modes(ctx, ctx.args.long_sets)


def _synthetic_modes(ctx: Ctx, sets: list[str]) -> dict[str, Any]:
    """The synthetic 8B with peaked logits (no natural rollbacks), rollbacks injected at the rate measured
    on SmolLM2 in this run (W=32, canonical DVR decode rows) when smollm2_rollback ran first, else
    --fault-rate. Set "sharegpt" = the mix (log-uniform prompt and output lengths, results under "modes");
    "NxPxO" = N requests of P prompt tokens and O output tokens (results under "fixed_NxPxO")."""
    from engine.llm import LLM
    from engine.models.synthetic import build_synthetic_model

    a = ctx.args
    model = build_synthetic_model(synthetic_config(a.preset, a.layers), torch.bfloat16, ctx.device, seed=0,
                                  attention_backend="triton", peaked=True)
    shape = engine_shape(model, 8192)
    measured = a.use_measured_fault_rate and "smollm2_rollbacks_per_token_w32" in ctx.extras
    fault_rate = ctx.extras["smollm2_rollbacks_per_token_w32"] if measured else a.fault_rate
    n = a.compare_requests
    gen = torch.Generator().manual_seed(3)
    parsed = [(spec, *parse_set_spec(spec, a.compare_tokens)) for spec in sets]
    # every mix draws its prompt and output lengths from the same seeds (so "sharegpt" keeps the requests
    # of earlier runs) and its prompt tokens from `gen` in set order
    mixes = {spec: (sharegpt_like_lengths(n, 11, MIX_LO, nums[0]), sharegpt_like_lengths(n, 13, MIX_LO, nums[1]))
             for spec, kind, _, nums in parsed if kind == "mix"}
    shapes = [nums for _, kind, _, nums in parsed if kind == "fixed"]
    blocks = RESERVED_BLOCKS + max([sum(-(-(i + o + 64) // BLOCK_SIZE) for i, o in zip(ins, outs))
                                    for ins, outs in mixes.values()]
                                   + [c * -(-(p + o + 64) // BLOCK_SIZE) for c, p, o in shapes])
    max_seqs = max(([n] if mixes else []) + [c for c, _, _ in shapes])

    def make(mode: str, share: float) -> Any:
        config = _engine_config(ctx, a.engine_graphs, model="synthetic", device=ctx.device.type,
                                dtype="bfloat16", mode=mode, window=a.window, group=a.group,
                                dvr_decode_attention=a.dvr_decode_attention, num_kv_blocks=blocks,
                                max_num_seqs=max_seqs, max_num_batched_tokens=8192, max_model_len=8192,
                                fault_rate=fault_rate, fault_seed=5, dvr_lookahead=a.dvr_lookahead)
        llm = LLM.from_parts(config, model, shape, eos_ids=set())
        llm.bench_graphs = llm.core.runner.graphs_status
        return llm

    res = ctx.open({"model": f"synthetic {a.preset} (peaked logits)", "sets": sets, "fault_rate": fault_rate,
                    "fault_rate_source": ("SmolLM2 W=32 canonical, this run" if measured
                                          else "--fault-rate (default: committed SmolLM2 W=32 measurement)"),
                    "dvr_decode_attention": a.dvr_decode_attention, "window": a.window, "group": a.group})
    for spec, kind, key, nums in parsed:
        if kind == "mix":
            in_lens, out_lens = mixes[spec]
            prompts = [torch.randint(0, model.arch.vocab_size, (m,), generator=gen).tolist() for m in in_lens]
            info = {"requests": n, "prompt_len_range": [MIX_LO, nums[0]], "output_len_range": [MIX_LO, nums[1]],
                    "prompt_len_mean": sum(in_lens) / n, "output_len_mean": sum(out_lens) / n}
            if key == "modes":  # "sharegpt" keeps its place at the section's top level
                res.update(info)
                entry = res
            else:
                entry = res[key] = {"spec": spec, **info}
            entry["modes"] = {}
            _run_modes(ctx, make, prompts, out_lens, a.compare_cap_s, "syn" if key == "modes" else key,
                       entry["modes"])
            continue
        count, p_len, o_len = nums
        prompts = [torch.randint(0, model.arch.vocab_size, (p_len,), generator=gen).tolist() for _ in range(count)]
        entry = res[key] = {"requests": count, "prompt_len": p_len, "output_len": o_len, "modes": {}}
        if p_len + o_len > GRAPH_MAX_LEN:
            entry["note"] = (f"{count} requests, kept few so that the six modes fit one device call; rows longer "
                             f"than {GRAPH_MAX_LEN} tokens decode through the second decode-graph family "
                             f"(captured up to max_model_len; eagerly before commit 'long decode graphs')")
        _run_modes(ctx, make, prompts, [o_len] * count, a.fixed_cap_s, f"fx{spec}", entry["modes"])
    del model
    _free()
    return res


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, math.ceil(p / 100 * len(values)) - 1)]


SECTIONS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "bandwidth": bench_bandwidth, "decode_step": bench_decode_step, "decode_breakdown": bench_decode_breakdown,
    "lite_generate": bench_lite_generate,
    "verify_cost": bench_verify_cost, "bi_breakdown": bench_bi_breakdown,
    "engine_generate": bench_engine_generate, "hf_generate": bench_hf_generate,
    "smollm2_rollback": bench_smollm2_rollback, "compare_modes": bench_compare_modes,
    "compare_modes_synthetic": bench_compare_modes_synthetic,
    "compare_modes_synthetic_long": bench_compare_modes_synthetic_long, "wg_sweep": bench_wg_sweep,
}


# ---- chart ---------------------------------------------------------------------------------------
def chart(result: dict[str, Any], path: Path) -> None:
    """One PNG: a panel per section that has data, titled with device, date and command."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in (_panel_decode, _panel_throughput, _panel_verify, _panel_rollback, _panel_modes, _panel_sweep)
              if p(None, result)]
    if not panels:
        return
    cols = min(2, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.5 * rows), squeeze=False)
    env = result.get("environment", {})
    command = "\n".join(textwrap.wrap(str(env.get("command")), 160))
    fig.suptitle(f"Verbatim GPU bench — {env.get('device')} — {env.get('date_utc')}\n{command}", fontsize=8)
    for ax, panel in zip(axes.flat, panels):
        panel(ax, result)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _panel_decode(ax: Any, result: dict[str, Any]) -> bool:
    ds = result.get("decode_step", {}).get("batches", {})
    if ax is None or not ds:
        return bool(ds)
    bs = list(ds)
    x = range(len(bs))
    ax.bar([i - 0.2 for i in x], [ds[b]["median_ms"] for b in bs], 0.4, label="measured (CUDA graph)")
    ax.bar([i + 0.2 for i in x], [ds[b]["floor_ms"] for b in bs], 0.4, label="weights+KV / bandwidth")
    ax.set_xticks(list(x), [f"batch {b}" for b in bs])
    ax.set_ylabel("ms per decode step")
    ax.legend(fontsize=8)
    ax.set_title("synthetic Llama-3.1-8B decode step", fontsize=10)
    return True


def _panel_throughput(ax: Any, result: dict[str, Any]) -> bool:
    eng = result.get("engine_generate", {})
    bars = {}
    for label, val in (("model+graphs\n(no scheduler)", result.get("lite_generate", {}).get("output_tok_per_s")),
                       ("engine\neager", eng.get("eager", {}).get("output_tok_per_s")),
                       ("engine\n+decode graphs", eng.get("decode_graphs", {}).get("output_tok_per_s")),
                       ("HF transformers\nstatic batch",
                        result.get("hf_generate", {}).get("static_batch", {}).get("output_tok_per_s")),
                       ("HF transformers\ncontinuous batching",
                        result.get("hf_generate", {}).get("continuous_batching", {}).get("output_tok_per_s")),
                       ("bandwidth\nlimit", result.get("lite_generate", {}).get("bandwidth_limit_tok_per_s"))):
        if val:
            bars[label] = val
    if ax is None or not bars:
        return bool(bars)
    ax.bar(list(bars), list(bars.values()), color=[f"C{i}" for i in range(len(bars))])
    ax.set_ylabel("output tokens/s")
    ax.set_title("64 concurrent, 128 in / 128 out (synthetic 8B)", fontsize=10)
    ax.tick_params(axis="x", labelsize=7)
    return True


def _panel_verify(ax: Any, result: dict[str, Any]) -> bool:
    vc = result.get("verify_cost", {}).get("shapes", {})
    if ax is None or not vc:
        return bool(vc)
    ax.bar([i - 0.2 for i in range(len(vc))], [v["ms_per_token"] for v in vc.values()], 0.4, label="eager")
    ax.bar([i + 0.2 for i in range(len(vc))], [v.get("graph_ms_per_token", 0) for v in vc.values()], 0.4,
           label="CUDA graph")
    ax.set_xticks(range(len(vc)), [f"G×W {k}" for k in vc])
    ax.set_ylabel("ms per verified token")
    ax.legend(fontsize=8)
    ax.set_title("verify-pass cost (synthetic 8B)", fontsize=10)
    return True


def _panel_rollback(ax: Any, result: dict[str, Any]) -> bool:
    runs = {k: v for k, v in result.get("smollm2_rollback", {}).get("runs", {}).items()
            if "recompute_pct_of_output" in v}
    if ax is None or not runs:
        return bool(runs)
    windows = sorted({v["window"] for v in runs.values()})
    attns = sorted({v["dvr_decode_attention"] for v in runs.values()})
    width = 0.8 / len(attns)
    for k, attn in enumerate(attns):
        ys = [runs.get(f"W{w}-{attn}", {}).get("recompute_pct_of_output", 0) for w in windows]
        ax.bar([i + k * width for i in range(len(windows))], ys, width, label=f"DVR decode rows: {attn}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(windows))], [f"W={w}" for w in windows])
    ax.axhline(7.0, color="k", ls="--", lw=0.8, label="target at W=32 (7 %)")
    ax.set_ylabel("recomputed tokens, % of output")
    ax.legend(fontsize=7)
    ax.set_title("SmolLM2 recompute rate (DVR, greedy)", fontsize=10)
    return True


def _panel_sweep(ax: Any, result: dict[str, Any]) -> bool:
    runs = result.get("wg_sweep", {}).get("runs", {})
    if ax is None or not runs:
        return bool(runs)
    groups = (4, 8, 16, 32)
    for k, g in enumerate(groups):
        xs, ys, tps = [], [], []
        for i, w in enumerate((16, 32, 64)):
            run = runs.get(f"W{w}xG{g}")
            if run and "recompute_pct_of_output" in run:
                xs.append(i + k * 0.2)
                ys.append(run["recompute_pct_of_output"])
                tps.append(run["output_tok_per_s"])
        bars = ax.bar(xs, ys, 0.2, label=f"G={g}")
        for bar, tp in zip(bars, tps):
            ax.annotate(f"{tp:.0f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=6)
    ax.set_xticks([0.3, 1.3, 2.3], ["W=16", "W=32", "W=64"])
    ax.set_ylabel("recomputed tokens, % of output (labels: tok/s)")
    ax.set_title("SmolLM2 all-deterministic: W x G sweep", fontsize=10)
    ax.legend(fontsize=7)
    return True


def _panel_modes(ax: Any, result: dict[str, Any]) -> bool:
    series = {}
    for sec, label in (("compare_modes", "SmolLM2 mix (natural rollbacks)"),
                       ("compare_modes_synthetic", "synthetic 8B mix"),
                       ("compare_modes_synthetic_long", "synthetic 8B")):
        sec_res = result.get(sec, {})
        groups = [(label, sec_res.get("modes", {}))] + [
            (f"synthetic 8B {k.split('_', 1)[1]}{' mix' if k.startswith('mix_') else ''}", modes)
            for k, modes in request_sets(sec_res)]
        for name, modes in groups:
            vals = {k: v["ratio_to_nondeterministic"] for k, v in modes.items() if "ratio_to_nondeterministic" in v}
            if vals:
                series[name] = vals
    if ax is None or not series:
        return bool(series)
    names = [n for n, _, _ in MODES]
    width = 0.8 / len(series)
    for k, (label, vals) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(names))], [vals.get(n, 0) for n in names], width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("output tok/s ÷ nondeterministic")
    ax.set_title("determinism strategies (same requests per set; synthetic: injected rollbacks)", fontsize=9)
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.legend(fontsize=6)
    return True


# ---- main ----------------------------------------------------------------------------------------
def _csv_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def parse_args(argv: list[str]) -> argparse.Namespace:
    presets = "; ".join(f"{k} = {','.join(v)}" for k, v in SECTION_PRESETS.items() if k != "all")
    p = argparse.ArgumentParser(prog="python -m engine bench --device cuda", description=__doc__.split("\n")[0],
                                epilog=f"presets: {presets}")
    p.add_argument("--device", default="cuda", choices=["cuda"], help="accepted for `python -m engine bench`")
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
                   help="EngineConfig.dvr_decode_attention in the compare_modes sections")
    p.add_argument("--decode-cublaslt-min-rows", type=int, default=None,
                   help="EngineConfig.decode_cublaslt_min_rows for every engine and decode graph the bench "
                        "builds (graphs of at least this many padded rows capture their GEMMs with cuBLASLt; "
                        "0 = never; default: the engine's, DEFAULT_DECODE_CUBLASLT_MIN_ROWS)")
    p.add_argument("--fuse-rope-canonical", choices=["on", "off"], default=None,
                   help="set engine.attention.triton_paged.FUSE_ROPE_CANONICAL for the whole run (RoPE and the "
                        "K/V store inside the canonical decode kernel: dvr's and batch_invariant's decode "
                        "steps); default: the module's value")
    p.add_argument("--query-tile", type=int, choices=[16, 32, 64], default=None,
                   help="triton_paged.set_query_tile for the whole run: the canonical kernels' query-tile rows "
                        "(prefill, verify, canonical decode; a different KERNEL_ID, other committed bits); "
                        "default: triton_paged.DEFAULT_QUERY_TILE (16)")
    p.add_argument("--concurrent-carried", choices=["on", "off"], default=None,
                   help="set engine.attention.triton_paged.CONCURRENT_CARRIED for the whole run (a verify pass's "
                        "carried decode rows on a second stream beside its verify rows); default: the module's")
    p.add_argument("--profile-modes", type=_csv, default=[],
                   help="modes (nondeterministic, dvr_100pct, ...) that get one more run under torch.profiler "
                        "after their timed runs: GPU busy time, kernels, gaps (a diagnostic; not timed)")
    p.add_argument("--profile-host", action="store_true",
                   help="the --profile-modes runs record host activity too: CUDA runtime calls and torch ops by "
                        "host time (the profiler's own host overhead slows those runs)")
    p.add_argument("--chunk-programs", type=int, default=None,
                   help="set engine.attention.triton_canonical_decode.CHUNK_PROGRAMS for the whole run (the canonical "
                        "decode kernel's programs per launch it aims at; 0 = one program per key chunk of the "
                        "table; the bits do not depend on it); default: the module's")
    p.add_argument("--prefill-pass-tile", type=int, choices=[16, 32, 64], default=None,
                   help="triton_paged.set_prefill_pass_tile for the whole run: the query tile of plain prefill "
                        "passes (dvr and nondeterministic; batch_invariant keeps the canonical tile); default: "
                        "the canonical tile")
    p.add_argument("--verify-decode-rows", type=int, default=None,
                   help="EngineConfig.verify_decode_rows for every dvr engine of the run: the decode rows each "
                        "verify pass carries (0 = off; another value, other committed bits); default: the "
                        f"engine's ({DEFAULT_VERIFY_DECODE_ROWS} on the triton backend)")
    p.add_argument("--canonical-prefill-min-tokens", type=int, default=None,
                   help="EngineConfig.canonical_prefill_min_tokens for every engine of the run (the smallest "
                        "canonical prefill pass of a deterministic prompt; another value, other committed "
                        "bits); default: the engine's")
    p.add_argument("--verify-early-decode", choices=["on", "off"], default=None,
                   help="EngineConfig.verify_early_decode for every engine of the run (a verify pass launches the "
                        "next decode step before reading its samples); default: the engine's (on for CUDA)")
    p.add_argument("--chained-verify", choices=["on", "off"], default=None,
                   help="EngineConfig.chained_verify for every engine of the run (a verify pass due while a decode "
                        "step is in flight is launched behind it); default: the engine's")
    p.add_argument("--verify-packing", choices=["padded", "packed"], default=None,
                   help="EngineConfig.verify_packing for every dvr engine of the run (packed: a verify pass lays "
                        "its windows back to back and takes as many as fit in G*W tokens); default: the engine's")
    p.add_argument("--verify-trigger", choices=["tokens", "windows"], default=None,
                   help="EngineConfig.verify_trigger for every dvr engine of the run (packed passes: due at G*W "
                        "tokens of windows, or at G windows); default: the engine's")
    p.add_argument("--modes", type=_csv, default=[],
                   help="compare_modes sections: run only these modes (nondeterministic, dvr_2pct, dvr_10pct, "
                        "dvr_50pct, dvr_100pct, batch_invariant); default: all")
    p.add_argument("--window", type=int, default=32, help="W of the compare_modes sections' engines")
    p.add_argument("--rollback-windows", type=_csv_ints, default=[16, 32, 64])
    p.add_argument("--rollback-decode-attention", type=_csv, default=["canonical", "split"],
                   help="EngineConfig.dvr_decode_attention values smollm2_rollback runs per window")
    p.add_argument("--rollback-prompts", type=int, default=256)
    p.add_argument("--rollback-tokens", type=int, default=256)
    p.add_argument("--rollback-cap-s", type=float, default=60.0)
    p.add_argument("--smol-kv-blocks", type=int, default=12000)
    p.add_argument("--compare-requests", type=int, default=96)
    p.add_argument("--compare-tokens", type=int, default=128)
    p.add_argument("--compare-cap-s", type=float, default=30.0, help="per mode, ShareGPT-like mixes")
    p.add_argument("--dvr-lookahead", type=int, default=None,
                   help="EngineConfig.dvr_lookahead in the compare_modes sections (default: the engine's)")
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
    except ValueError as exc:
        p.error(str(exc))
    return args


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


def packed_matches_8b() -> bool:
    """triton_canonical_decode.packed_matches_prefill at Llama-3.1-8B heads (GQA group 4, head_dim 128, bf16)."""
    from engine.attention import triton_canonical_decode

    return triton_canonical_decode.packed_matches_prefill(torch.device("cuda"), torch.bfloat16, 4, 128)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench --device cuda: no CUDA device (the GPU benchmarks, --compare-modes included, need one; "
              "the CPU benchmark is `python -m engine bench --device cpu`)", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(argv)}
    from engine.attention import triton_paged

    if args.fuse_rope_canonical is not None:
        triton_paged.FUSE_ROPE_CANONICAL = args.fuse_rope_canonical == "on"
    if args.query_tile is not None:
        triton_paged.set_query_tile(args.query_tile)
    if args.prefill_pass_tile is not None:
        triton_paged.set_prefill_pass_tile(args.prefill_pass_tile)
    if args.concurrent_carried is not None:
        triton_paged.CONCURRENT_CARRIED = args.concurrent_carried == "on"
    from engine.attention import triton_canonical_decode

    if args.chunk_programs is not None:
        triton_canonical_decode.CHUNK_PROGRAMS = args.chunk_programs
    result["plan"] = {"sections": args.section_names, "sampling": args.sampling, "deadline_s": args.deadline_s, "budgets_s": args.budgets,
                      # the rows from which decode graphs use cuBLASLt, in every engine and graph of this run
                      "decode_cublaslt_min_rows": cublaslt_min_rows(args),
                      "fuse_rope_canonical": triton_paged.FUSE_ROPE_CANONICAL,
                      "concurrent_carried": triton_paged.CONCURRENT_CARRIED,
                      "chunk_programs": triton_canonical_decode.CHUNK_PROGRAMS,
                      "prefill_pass_tile": triton_paged.PREFILL_PASS_BLOCK_M,
                      # decode rows a dvr verify pass carries (None: the engine's default)
                      "verify_decode_rows": (DEFAULT_VERIFY_DECODE_ROWS if args.verify_decode_rows is None
                                             else args.verify_decode_rows),
                      "attention_kernel": triton_paged.KERNEL_ID,
                      "canonical_prefill_min_tokens": args.canonical_prefill_min_tokens,  # None: the engine's
                      "modes": args.modes or "all", "window": args.window,
                      "verify_early_decode": args.verify_early_decode or "engine default (on)",
                      "chained_verify": args.chained_verify or "engine default",
                      "verify_packing": args.verify_packing or "engine default (packed)",
                      "verify_trigger": args.verify_trigger or "engine default (tokens when packed)",
                      # whether the GQA-packed canonical decode kernel gives the prefill kernel's bits at the
                      # 8B heads here (else canonical rows fall back to the prefill kernel, one head a program)
                      "packed_canonical_decode_8b": packed_matches_8b()}
    ctx = Ctx(args=args, device=torch.device("cuda"), result=result, json_path=out_dir / f"{args.name}.json")
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


def summary(result: dict[str, Any]) -> str:
    """The run's figures, one line each (what the lead reads in the call's output tail)."""
    try:
        lines = _summary_lines(result)
    except Exception:  # the JSON holds the figures; a summary bug must not hide them
        lines = ["summary failed: " + traceback.format_exc(limit=3)]
    errors = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    truncated = [k for k, v in result.items() if isinstance(v, dict) and v.get("truncated")]
    if errors:
        lines.append(f"sections with errors: {errors}")
    if truncated:
        lines.append(f"sections truncated by the time budget: {truncated}")
    return "\n".join(lines)


def _summary_lines(result: dict[str, Any]) -> list[str]:
    env = result.get("environment", {})
    lines = [f"== {env.get('device')} {env.get('date_utc')}"]
    bw = result.get("bandwidth", {})
    if "tb_per_s" in bw:
        lines.append(f"copy bandwidth {bw['tb_per_s']} TB/s")
    ds = result.get("decode_step", {})
    for b, v in ds.get("batches", {}).items():
        lines.append(f"decode b={b}: {v['median_ms']:.2f} ms (floor {v['floor_ms']:.2f}, x{v['ratio_to_floor']:.2f}) "
                     f"eager {v['eager_median_ms']} allocs {v['device_allocations_during_timed_steps']} "
                     f"allocated +{v.get('memory_allocated_delta_bytes')} B "
                     f"peak +{v.get('peak_allocated_delta_bytes')} B")
    if "steady_state_zero_alloc" in ds:
        lines.append(f"graphed decode steady state allocates 0 bytes: {ds['steady_state_zero_alloc']}")
    for b, v in result.get("decode_breakdown", {}).items():
        if isinstance(v, dict) and "weights_floor_ms" in v:
            lines.append(f"breakdown b={b}: gemms {v.get('gemms_unfused_ms', 0):.2f} ms, fused "
                         f"{v.get('gemms_fused_qkv_gateup_ms', 0):.2f} ms, weights floor {v['weights_floor_ms']:.2f} ms")
    ab = result.get("decode_breakdown", {}).get("graphed_step_by_ops")
    if isinstance(ab, dict):
        lines.append("graphed step by ops: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}"
                                                         for k, v in ab.items()))
    prof = result.get("decode_breakdown", {}).get("profile_batch1")
    if isinstance(prof, dict) and "kernels" in prof:
        lines.append(f"eager b=1 step: {prof['kernels']} kernels, {prof['device_us'] / 1e3:.2f} ms of kernel time; "
                     + ", ".join(f"{t['name'][:40]} x{t['count']} {t['us'] / 1e3:.2f}ms" for t in prof["top"][:5]))
    mem = ds.get("memory")
    if mem:
        lines.append(f"kv cache {mem['kv_cache_bytes'] / 2**30:.1f} GiB = {mem['kv_fraction_of_free']:.3f} of "
                     f"{mem['free_after_weights_bytes'] / 2**30:.1f} GiB free after weights; peak allocated "
                     f"{ds.get('peak_allocated_bytes', 0) / 2**30:.1f} GiB")
    v = result.get("lite_generate", {})
    if "output_tok_per_s" in v:
        lines.append(f"lite_generate: {v['output_tok_per_s']:.0f} tok/s (limit {v['bandwidth_limit_tok_per_s']:.0f})")
    for k in ("eager", "decode_graphs"):
        v = result.get("engine_generate", {}).get(k, {})
        if "output_tok_per_s" in v:
            dp = v.get("decode_phase_tok_per_s")
            lines.append(f"engine {k}: {v['output_tok_per_s']:.0f} tok/s ({v['committed_tokens']} tokens, "
                         f"capped={v['capped']}; decode phase {'-' if dp is None else f'{dp:.0f}'} tok/s) "
                         f"steady-state memory {v.get('steady_state_memory')}")
    hf = result.get("hf_generate", {})
    for k in ("static_batch", "continuous_batching"):
        v = hf.get(k, {})
        if "output_tok_per_s" in v:
            lines.append(f"hf {k}: {v['output_tok_per_s']:.0f} tok/s ({v['seconds']:.1f}s, capped={v.get('capped')}, "
                         f"warm-up {v.get('warmup_s', '-')}s)")
        elif "error" in v:
            lines.append(f"hf {k}: error {v['error'].strip().splitlines()[-1][:200]}")
    for k, v in result.get("verify_cost", {}).get("shapes", {}).items():
        lines.append(f"verify {k}: {v['median_ms']:.2f} ms ({v['ms_per_token']:.4f} ms/tok) graph "
                     f"{v['graph_median_ms']:.2f} ms bit_exact={v['graph_bit_exact']}")
    for k, v in result.get("smollm2_rollback", {}).get("runs", {}).items():
        lines.append(f"smollm2 {k}: recompute {v['recompute_pct_of_output']:.2f}% of {v['committed_tokens']} tokens, "
                     f"{v['rollbacks_per_committed_token']:.5f} rollbacks/token, {v['seconds']:.0f}s "
                     f"capped={v['capped']}")
    for sec in ("compare_modes", "compare_modes_synthetic", "compare_modes_synthetic_long"):
        sec_res = result.get(sec, {})
        if "fault_rate" in sec_res:
            lines.append(f"{sec}: fault rate {sec_res['fault_rate']:.5f} ({sec_res.get('fault_rate_source')})")
        groups = [(sec, sec_res.get("modes", {}))] + [(f"{sec}.{k}", modes) for k, modes in request_sets(sec_res)]
        for label, modes in groups:
            for k, v in modes.items():
                ratio = v.get("ratio_to_nondeterministic")
                lines.append(f"{label} {k}: {v.get('output_tok_per_s', 0):.0f} tok/s ratio "
                             f"{'-' if ratio is None else f'{ratio:.3f}'} p50 {v.get('p50_latency_s')} "
                             f"p99 {v.get('p99_latency_s')} {v.get('finished', '-')}/{v.get('requests', '-')} "
                             f"{v.get('error', v.get('skipped', ''))[:120]}")
    for k, v in result.get("wg_sweep", {}).get("runs", {}).items():
        lines.append(f"sweep {k}: {v['output_tok_per_s']:.0f} tok/s, recompute {v['recompute_pct_of_output']:.2f}%, "
                     f"{v['stats'].get('verify_passes')} verify passes, capped={v['capped']}")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
