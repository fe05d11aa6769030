"""`python -m engine bench --device cuda` (also `python -m engine.bench_gpu`): the GPU benchmark.

Sections (each recorded on its own; a failing section records its error and the run goes on):
  bandwidth        device-to-device copy, bytes read + written per second (the roofline's ceiling)
  decode_step      synthetic Llama-3.1-8B decode step (CUDA graph) at batch 1/16/64 vs weights+KV bytes / BW
  lite_generate    64 requests 128-in/128-out through our model + kernels + graphs, greedy on the GPU
                   (no scheduler, no host sampler: the ceiling the engine core can approach)
  engine_generate  the same requests through the engine core (mode nondeterministic)
  hf_generate      the same requests through Hugging Face transformers (static batch `generate`)
  verify_cost      verify pass G x W in {1x32, 8x32, 16x32, 8x64}: time per pass and per token
  smollm2_rollback real SmolLM2 (GGUF): rollback / recompute rates at W = 16/32/64 (engine, mode dvr)
  compare_modes    issue 6: nondeterministic / dvr at 2-100 % deterministic / batch_invariant
Results: <out>/gpu-bench.json (written after every section) and <out>/gpu-bench.png.
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
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

SYNTHETIC_SECTIONS = ("bandwidth", "decode_step", "decode_breakdown", "lite_generate", "verify_cost",
                      "engine_generate", "hf_generate")
ALL_SECTIONS = SYNTHETIC_SECTIONS + ("smollm2_rollback", "compare_modes", "compare_modes_synthetic", "wg_sweep")
BLOCK_SIZE = 16


@dataclass
class Ctx:
    """What the sections share: arguments, the synthetic model (built once), the measured bandwidth."""

    args: argparse.Namespace
    device: torch.device
    result: dict[str, Any]
    model: Any = None
    hf_config: Any = None
    weight_bytes: int = 0
    bandwidth: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)


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
        "command": "python -m engine.bench_gpu " + " ".join(argv),
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
        from engine.models.synthetic import build_synthetic_model, synthetic_hf_config, weight_bytes

        overrides = {"num_hidden_layers": ctx.args.layers} if ctx.args.layers else {}
        ctx.hf_config = synthetic_hf_config(ctx.args.preset, **overrides)
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


def kv_bytes_per_token(model: Any) -> int:
    a = model.arch
    return a.num_layers * 2 * a.num_kv_heads * a.head_dim * model.dtype.itemsize


def contiguous_tables(rows: int, blocks_per_row: int, first_block: int = 2) -> list[list[int]]:
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
    from engine.cuda_graphs import DecodeGraphs
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
    used = 2 + max(batches) * blocks_per_row
    for t in kv.k + kv.v:  # random finite K/V where the rows live (timing on zeros can flatter kernels)
        t[2:used].normal_(0.0, 0.5)
    graphs = DecodeGraphs(model, kv, max(batches), blocks_per_row * BLOCK_SIZE, scratch_slot=BLOCK_SIZE,
                          batch_sizes=batches)
    t0 = time.perf_counter()
    graphs.capture()
    capture_s = time.perf_counter() - t0
    out: dict[str, Any] = {
        "context": context, "capture_s": round(capture_s, 2), "batches": {},
        "memory": {"free_after_weights_bytes": free_after_weights, "kv_share": DEFAULT_KV_SHARE,
                   "kv_blocks": num_blocks, "kv_cache_bytes": kv.nbytes,
                   "kv_fraction_of_free": kv.nbytes / free_after_weights,
                   "kv_tokens": num_blocks * BLOCK_SIZE},
    }
    for b in batches:
        tables = contiguous_tables(b, blocks_per_row)
        ids = [(7 * r + 1) % a.vocab_size for r in range(b)]
        pos = [context - 1] * b

        def step() -> None:
            graphs.run(ids, pos, [context] * b, tables)

        for _ in range(5):
            step()
        torch.cuda.synchronize()
        stats_before = torch.cuda.memory_stats()
        t = time_cuda(step, reps=ctx.args.reps, warmup=0)
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
        }
    out["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
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
    fused = [(torch.cat([l.self_attn.q_proj.weight, l.self_attn.k_proj.weight, l.self_attn.v_proj.weight]),
              l.self_attn.o_proj.weight, torch.cat([l.mlp.gate_proj.weight, l.mlp.up_proj.weight]),
              l.mlp.down_proj.weight) for l in layers]
    for b in (1, max(ctx.args.batches)):
        x_h = torch.randn(b, model.arch.hidden_size, dtype=model.dtype, device=ctx.device)
        x_i = torch.randn(b, model.arch.intermediate_size, dtype=model.dtype, device=ctx.device)

        def unfused() -> None:
            for l in layers:
                for lin in (l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj, l.self_attn.o_proj,
                            l.mlp.gate_proj, l.mlp.up_proj):
                    torch.nn.functional.linear(x_h, lin.weight)
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
    """Graphed decode step with the model's ops vs cuBLAS GEMMs + the one-kernel Triton RMSNorm / SwiGLU
    of engine.kernels (a weight-sharing view): how much the row-op kernel count costs."""
    from engine.cuda_graphs import DecodeGraphs
    from engine.kernels import TORCH_OPS, BatchInvariantOps

    class RowKernelOps(type(TORCH_OPS)):  # GEMMs stay cuBLAS; norms and SwiGLU one Triton kernel each
        name = "torch+triton-rows"
        _bi = BatchInvariantOps("triton")

        def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            return self._bi.rms_norm(x, weight, eps)

        def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            return self._bi.silu_mul(gate, up)

    context, batches = ctx.args.context, (1, max(ctx.args.batches))
    nb = -(-(context + 16) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(2 + max(batches) * nb, BLOCK_SIZE)
    fill_cache_(kv, seed=2)
    out: dict[str, Any] = {}
    for label, m in (("model_ops", model), ("triton_row_ops", model.with_numerics(RowKernelOps(), model.attention))):
        graphs = DecodeGraphs(m, kv, max(batches), nb * BLOCK_SIZE, scratch_slot=BLOCK_SIZE, batch_sizes=batches)
        graphs.capture()
        for b in batches:
            tables = contiguous_tables(b, nb)
            ids = [(5 * r + 3) % model.arch.vocab_size for r in range(b)]
            t = time_cuda(lambda: graphs.run(ids, [context - 1] * b, [context] * b, tables), reps=ctx.args.reps)
            out[f"{label}_b{b}_ms"] = t["median_ms"]
        del graphs
    del kv
    return out


def _profile_decode_kernels(ctx: Ctx, model: Any) -> dict[str, Any]:
    """GPU kernels of one eager batch-1 decode step (count, and device time by kernel name)."""
    from torch.profiler import ProfilerActivity, profile

    from engine.attention import PassKind, RowSpec, build_metadata, positions_of

    context = ctx.args.context
    nb = -(-(context + 16) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(2 + nb, BLOCK_SIZE)
    rows = [RowSpec(list(range(2, 2 + nb)), context - 1, 1)]
    meta = build_metadata(PassKind.DECODE, rows, BLOCK_SIZE, ctx.device)
    ids = torch.tensor([11], device=ctx.device)
    pos = positions_of(rows, ctx.device)
    with torch.inference_mode():
        for _ in range(2):
            model.compute_logits(model(ids, pos, meta, kv))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model.compute_logits(model(ids, pos, meta, kv))
            torch.cuda.synchronize()
    by_name: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            by_name.setdefault(ev.name[:80], []).append(ev.device_time_total if hasattr(ev, "device_time_total")
                                                         else ev.cuda_time_total)
    total = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv_: -sum(kv_[1]))[:15]
    del kv
    return {"kernels": sum(len(v) for v in by_name.values()), "device_us": total,
            "top": [{"name": k, "count": len(v), "us": round(sum(v), 1)} for k, v in top]}


def _eager_decode_ms(model: Any, kv: Any, tables: list[list[int]], ids: list[int], pos: list[int],
                     context: int) -> float:
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of

    rows = [RowSpec(t, context - 1, 1) for t in tables]
    meta = build_metadata(PassKind.DECODE, rows, BLOCK_SIZE, ctx_device(model))
    inp = torch.tensor(ids, dtype=torch.long, device=ctx_device(model))
    positions = positions_of(rows, ctx_device(model))
    with torch.inference_mode():
        return time_cuda(lambda: model.compute_logits(model(inp, positions, meta, kv)), reps=5)["median_ms"]


def ctx_device(model: Any) -> torch.device:
    return model.device


def bench_lite_generate(ctx: Ctx) -> dict[str, Any]:
    """64 x (128 in, 128 out): one batched prefill, then graph decode with argmax on the GPU."""
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of
    from engine.cuda_graphs import DecodeGraphs

    model = synthetic(ctx)
    n_req, n_in, n_out = ctx.args.requests, ctx.args.prompt_len, ctx.args.new_tokens
    blocks_per_row = -(-(n_in + n_out) // BLOCK_SIZE)
    kv = model.allocate_kv_cache(2 + n_req * blocks_per_row, BLOCK_SIZE)
    graphs = DecodeGraphs(model, kv, n_req, blocks_per_row * BLOCK_SIZE, scratch_slot=BLOCK_SIZE,
                          batch_sizes=(n_req,))
    graphs.capture()
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
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.model_runner import ModelShape
    from engine.sampling import SamplingParams

    model = synthetic(ctx)
    n_req, n_in, n_out = ctx.args.requests, ctx.args.prompt_len, ctx.args.new_tokens
    blocks = 2 + n_req * (-(-(n_in + n_out) // BLOCK_SIZE) + 1)
    config = _engine_config(EngineConfig, model="synthetic", device=ctx.device.type, dtype="bfloat16",
                            mode="nondeterministic", num_kv_blocks=blocks, max_num_seqs=n_req,
                            max_num_batched_tokens=n_req * n_in, max_model_len=4096)
    shape = ModelShape(model.arch.num_layers, model.arch.num_kv_heads, model.arch.head_dim,
                       model.arch.vocab_size, 4096)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.arch.vocab_size, (n_req, n_in), generator=gen).tolist()
    params = SamplingParams(max_tokens=n_out, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {}
    for label, graphs in (("eager", False), ("decode_graphs", True)):
        llm = LLM.from_parts(replace(config, cuda_graphs=graphs), model, shape, eos_ids=set())
        if graphs:
            out["graph_hook"] = llm.core.runner.graphs_status
        out[label] = _drive(llm.core, prompts, params, ctx.args.engine_cap_s, f"eng-{label}")
        del llm
        _free()
    out["output_tok_per_s"] = max(out[k]["output_tok_per_s"] for k in ("eager", "decode_graphs"))
    return out


def _engine_config(cls: Any, graphs: bool = True, **kw: Any) -> Any:
    """EngineConfig for a CUDA bench run: Triton attention (batch_invariant keeps its own) and, with
    `graphs`, the model runner's CUDA graphs (decode; verify when bit-exact)."""
    if kw.get("mode") != "batch_invariant":
        kw.setdefault("attention_backend", "triton")
    return cls(cuda_graphs=graphs, **kw)


def _free() -> None:
    """Drop an engine's KV cache and graph pools (its decode hook closes a reference cycle)."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _drive(core: Any, prompts: list[list[int]], params: Any, cap_s: float, tag: str) -> dict[str, Any]:
    seqs = [core.add_request(f"{tag}-{i}", p, params) for i, p in enumerate(prompts)]
    _sync()
    t0 = time.perf_counter()
    steps = 0
    while any(not s.is_finished for s in seqs) and time.perf_counter() - t0 < cap_s:
        core.step()
        steps += 1
    _sync()
    total = time.perf_counter() - t0
    tokens = sum(len(s.tokens) for s in seqs)
    stats = vars(core.stats())
    return {"seconds": total, "steps": steps, "committed_tokens": tokens, "output_tok_per_s": tokens / total,
            "finished": sum(s.is_finished for s in seqs), "requests": len(seqs), "capped": total >= cap_s,
            "stats": {k: v for k, v in stats.items() if isinstance(v, (int, float))}}


def bench_hf_generate(ctx: Ctx) -> dict[str, Any]:
    """transformers on the same weights: static-batch greedy `generate` (and continuous batching if cheap)."""
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
    missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, model.arch.vocab_size, (n_req, n_in), generator=gen).to(ctx.device)
    out: dict[str, Any] = {"missing_keys": missing[:5], "unexpected_keys": unexpected[:5]}

    def static(new_tokens: int = n_out) -> torch.Tensor:
        with torch.inference_mode():
            return hf.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                               max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)

    with torch.inference_mode():  # parity of the prefill logits on the same weights
        ours = _our_prefill_logits(model, prompts[:2])
        theirs = hf(input_ids=prompts[:2]).logits[:, -1].float()
        out["prefill_logits_max_abs_diff"] = (ours - theirs).abs().max().item()
        out["prefill_top1_agree"] = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    static(4)  # warm-up
    seqs, total = time_wall(static)
    out["static_batch"] = {"seconds": total, "output_tok_per_s": n_req * n_out / total,
                           "generated": int(seqs.shape[1] - n_in)}
    del hf
    torch.cuda.empty_cache()
    return out


def _our_prefill_logits(model: Any, prompts: torch.Tensor) -> torch.Tensor:
    from engine.attention import PassKind, RowSpec, build_metadata, positions_of

    n, length = prompts.shape
    blocks = -(-length // BLOCK_SIZE)
    kv = model.allocate_kv_cache(2 + n * blocks, BLOCK_SIZE)
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
    kv = model.allocate_kv_cache(2 + max_g * blocks_per_row, BLOCK_SIZE)
    fill_cache_(kv, seed=1)
    tables = contiguous_tables(max_g, blocks_per_row)
    out: dict[str, Any] = {"context": context, "shapes": {}}
    for g, w in shapes:
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
    from engine.config import EngineConfig
    from engine.sampling import SamplingParams

    a = ctx.args
    out: dict[str, Any] = {"prompts": a.rollback_prompts, "new_tokens": a.rollback_tokens, "windows": {}}
    for w in a.rollback_windows:
        config = _engine_config(EngineConfig, a.engine_graphs, model=a.gguf, device=ctx.device.type, dtype="bfloat16", mode="dvr", window=w, group=a.group,
                                num_kv_blocks=a.smol_kv_blocks, max_num_seqs=a.rollback_prompts,
                                max_num_batched_tokens=8192, cache_dir=a.cache_dir)
        llm = smol_llm(ctx, config)
        prompts = smollm2_prompts(llm.tokenizer, a.rollback_prompts)
        params = SamplingParams(max_tokens=a.rollback_tokens, temperature=0.0, ignore_eos=True,
                                deterministic=True, seed=1)
        res = _drive(llm.core, prompts, params, a.rollback_cap_s, f"w{w}")
        res["graphs"] = llm.bench_graphs
        st = res["stats"]
        committed = max(res["committed_tokens"], 1)
        res["recompute_pct_of_output"] = 100.0 * st.get("recomputed_tokens", 0) / committed
        res["rollbacks_per_verify_pass"] = st.get("rollbacks", 0) / max(st.get("verify_passes", 1), 1)
        res["rollbacks_per_committed_token"] = st.get("rollbacks", 0) / committed
        if w == 32:
            ctx.extras["smollm2_rollbacks_per_token_w32"] = res["rollbacks_per_committed_token"]
        out["windows"][str(w)] = res
        out["prompt_len_min_max"] = [min(map(len, prompts)), max(map(len, prompts))]
        del llm
        _free()
    return out


def smol_llm(ctx: Ctx, config: Any) -> Any:
    """An engine over SmolLM2 loaded once per run (weights shared by every config of the run).

    batch_invariant goes through `LLM(config)`: the engine may build that model differently."""
    from engine.config import Mode
    from engine.llm import LLM

    if config.mode == Mode.BATCH_INVARIANT:
        llm = LLM(config)
    else:
        if "smol" not in ctx.extras:
            from engine.loader import load_model_source
            from engine.model_runner import ModelShape
            from engine.models import arch_from_hf, build_model

            cache = Path(config.cache_dir) if config.cache_dir else None
            source = load_model_source(config.model, torch.bfloat16, cache)
            model = build_model(source.hf_config, torch.bfloat16, ctx.device, "triton")
            model.load_weights(source.weights())
            arch = arch_from_hf(source.hf_config)
            shape = ModelShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size,
                               source.info.max_model_len)
            ctx.extras["smol"] = (source, model, shape)
        source, model, shape = ctx.extras["smol"]
        llm = LLM.from_parts(config, model, shape, set(source.info.eos_token_ids), source.tokenizer)
    llm.bench_graphs = llm.core.runner.graphs_status
    return llm


def bench_wg_sweep(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 sweep on SmolLM2: W in 16/32/64 x G in 4/8/16/32, every request deterministic (greedy):
    output tok/s and recompute rate per (W, G)."""
    from engine.config import EngineConfig
    from engine.sampling import SamplingParams

    a = ctx.args
    out: dict[str, Any] = {"requests": a.sweep_requests, "new_tokens": a.sweep_tokens, "runs": {}}
    for w in (16, 32, 64):
        for g in (4, 8, 16, 32):
            config = _engine_config(EngineConfig, a.engine_graphs, model=a.gguf, device=ctx.device.type, dtype="bfloat16", mode="dvr",
                                    window=w, group=g, num_kv_blocks=a.smol_kv_blocks,
                                    max_num_seqs=a.sweep_requests, max_num_batched_tokens=8192, cache_dir=a.cache_dir)
            llm = smol_llm(ctx, config)
            prompts = smollm2_prompts(llm.tokenizer, a.sweep_requests)
            params = SamplingParams(max_tokens=a.sweep_tokens, temperature=0.0, ignore_eos=True, deterministic=True,
                                    seed=1)
            res = _drive(llm.core, prompts, params, a.compare_cap_s, f"sw{w}x{g}")
            st = res["stats"]
            res["recompute_pct_of_output"] = 100.0 * st.get("recomputed_tokens", 0) / max(res["committed_tokens"], 1)
            out["runs"][f"W{w}xG{g}"] = res
            del llm
            _free()
    if a.sweep_canonical_decode:  # same runs at G=8 with the fast path's attention = the verifier's kernel
        from engine.attention.triton_paged import TritonPagedAttention

        model = ctx.extras["smol"][1]
        model.attention = TritonPagedAttention(decode="canonical")
        try:
            for w in (16, 32, 64):
                config = _engine_config(EngineConfig, a.engine_graphs, model=a.gguf, device=ctx.device.type, dtype="bfloat16",
                                        mode="dvr", window=w, group=8, num_kv_blocks=a.smol_kv_blocks,
                                        max_num_seqs=a.sweep_requests, max_num_batched_tokens=8192,
                                        cache_dir=a.cache_dir)
                llm = smol_llm(ctx, config)
                prompts = smollm2_prompts(llm.tokenizer, a.sweep_requests)
                params = SamplingParams(max_tokens=a.sweep_tokens, temperature=0.0, ignore_eos=True,
                                        deterministic=True, seed=1)
                res = _drive(llm.core, prompts, params, a.compare_cap_s, f"swc{w}")
                res["recompute_pct_of_output"] = (100.0 * res["stats"].get("recomputed_tokens", 0)
                                                  / max(res["committed_tokens"], 1))
                out["runs"][f"W{w}xG8-canonical-decode"] = res
                del llm
                _free()
        finally:
            model.attention = TritonPagedAttention()
    return out


MODES: list[tuple[str, str, float]] = [("nondeterministic", "nondeterministic", 0.0)] + [
    (f"dvr_{p}pct", "dvr", p / 100) for p in (2, 10, 50, 100)] + [("batch_invariant", "batch_invariant", 1.0)]


def sharegpt_like_lengths(n: int, seed: int, lo: int, hi: int) -> list[int]:
    """Log-uniform lengths in [lo, hi]: many short, a long tail (the shape of ShareGPT's outputs)."""
    rng = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=rng, dtype=torch.float64)
    return [int(round(math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))))) for x in u.tolist()]


def _run_modes(make_llm: Callable[[str, float], Any], prompts: list[list[int]], out_lens: list[int],
               cap_s: float, tag: str) -> dict[str, Any]:
    """Each mode on the same requests (the first `share` of them deterministic); tok/s, p50/p99 latency."""
    from engine.sampling import SamplingParams

    modes: dict[str, Any] = {}
    for name, mode, share in MODES:
        try:
            llm = make_llm(mode, share)
        except Exception as exc:  # e.g. a mode this build refuses: record it, measure the other modes
            modes[name] = {"error": repr(exc)[:400]}
            continue
        n_det = round(share * len(prompts))
        det_ids = set(range(0, len(prompts), max(1, round(len(prompts) / n_det)))[:n_det]) if n_det else set()
        seqs = [llm.core.add_request(f"{tag}-{name}-{i}", p, SamplingParams(
            max_tokens=m, temperature=0.0, ignore_eos=True, deterministic=i in det_ids, seed=i))
            for i, (p, m) in enumerate(zip(prompts, out_lens))]
        _sync()
        t0 = time.perf_counter()
        done: dict[str, float] = {}
        while len(done) < len(seqs) and time.perf_counter() - t0 < cap_s:
            llm.core.step()
            for s in seqs:
                if s.is_finished and s.request_id not in done:
                    done[s.request_id] = time.perf_counter() - t0
        total = time.perf_counter() - t0
        lat = sorted(done.values())
        tokens = sum(len(s.tokens) for s in seqs)
        modes[name] = {"mode": mode, "graphs": getattr(llm, "bench_graphs", None),
                       "attention": getattr(llm.core.runner.model.attention, "name", None),
                       "deterministic_share": share, "deterministic_requests": len(det_ids),
                       "seconds": total, "output_tok_per_s": tokens / total, "committed_tokens": tokens,
                       "finished": len(done), "requests": len(seqs), "capped": len(done) < len(seqs),
                       "p50_latency_s": _pct(lat, 50), "p99_latency_s": _pct(lat, 99),
                       "stats": {k: v for k, v in vars(llm.core.stats()).items() if isinstance(v, (int, float))}}
        del llm
        _free()
    base = modes.get("nondeterministic", {}).get("output_tok_per_s")
    for entry in modes.values():
        if base and "output_tok_per_s" in entry:
            entry["ratio_to_nondeterministic"] = entry["output_tok_per_s"] / base
    return modes


def bench_compare_modes(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 on SmolLM2 (natural rollbacks): ShareGPT-like output lengths, varied prompts."""
    from engine.config import EngineConfig

    a = ctx.args

    def make(mode: str, share: float) -> Any:
        config = _engine_config(EngineConfig, a.engine_graphs, model=a.gguf, device=ctx.device.type, dtype="bfloat16", mode=mode, window=32,
                                group=a.group, num_kv_blocks=a.smol_kv_blocks, max_num_seqs=a.compare_requests,
                                max_num_batched_tokens=8192, cache_dir=a.cache_dir)
        return smol_llm(ctx, config)

    probe = make("nondeterministic", 0.0)
    prompts = smollm2_prompts(probe.tokenizer, a.compare_requests)
    del probe
    out_lens = sharegpt_like_lengths(len(prompts), 7, 16, a.compare_tokens)
    return {"model": "SmolLM2-135M-Instruct (GGUF)", "requests": len(prompts), "output_len_mean":
            sum(out_lens) / len(out_lens), "window": 32, "group": a.group,
            "modes": _run_modes(make, prompts, out_lens, a.compare_cap_s, "smol")}


def bench_compare_modes_synthetic(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 on the synthetic 8B (peaked logits: no natural rollbacks), rollbacks injected at the rate
    measured on SmolLM2 (rollbacks per committed token at W=32) when that section ran first."""
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.model_runner import ModelShape
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    a = ctx.args
    overrides = {"num_hidden_layers": a.layers} if a.layers else {}
    model = build_synthetic_model(synthetic_hf_config(a.preset, **overrides), torch.bfloat16, ctx.device, seed=0,
                                  attention_backend="triton", peaked=True)
    shape = ModelShape(model.arch.num_layers, model.arch.num_kv_heads, model.arch.head_dim,
                       model.arch.vocab_size, 8192)
    fault_rate = ctx.extras.get("smollm2_rollbacks_per_token_w32", a.synthetic_fault_rate)
    n = a.compare_requests
    gen = torch.Generator().manual_seed(3)
    in_lens = sharegpt_like_lengths(n, 11, 16, 512)
    prompts = [torch.randint(0, model.arch.vocab_size, (m,), generator=gen).tolist() for m in in_lens]
    out_lens = sharegpt_like_lengths(n, 13, 16, a.compare_tokens)
    blocks = 2 + max(sum(-(-(i + o + 64) // BLOCK_SIZE) for i, o in zip(in_lens, out_lens)),
                     *(int(c) * -(-(int(p) + int(o) + 64) // BLOCK_SIZE)
                       for c, p, o in (spec.split("x") for spec in a.fixed_sets)))

    def make(mode: str, share: float) -> Any:
        config = _engine_config(EngineConfig, a.engine_graphs, model="synthetic", device=ctx.device.type,
                                dtype="bfloat16", mode=mode, window=32, group=a.group, num_kv_blocks=blocks, max_num_seqs=n,
                                max_num_batched_tokens=8192, max_model_len=8192, fault_rate=fault_rate,
                                fault_seed=5)
        llm = LLM.from_parts(config, model, shape, eos_ids=set())
        llm.bench_graphs = llm.core.runner.graphs_status
        return llm

    res = {"model": f"synthetic {a.preset} (peaked logits)", "requests": n, "fault_rate": fault_rate,
           "fault_rate_source": "SmolLM2 W=32" if "smollm2_rollbacks_per_token_w32" in ctx.extras else "default",
           "prompt_len_mean": sum(in_lens) / n, "output_len_mean": sum(out_lens) / n,
           "modes": _run_modes(make, prompts, out_lens, a.compare_cap_s, "syn")}
    for spec in a.fixed_sets:  # e.g. "16x1024x256": requests x prompt length x output length
        count, p_len, o_len = (int(x) for x in spec.split("x"))
        fixed = [torch.randint(0, model.arch.vocab_size, (p_len,), generator=gen).tolist() for _ in range(count)]
        res[f"fixed_{spec}"] = {"requests": count, "prompt_len": p_len, "output_len": o_len,
                                "modes": _run_modes(make, fixed, [o_len] * count, a.compare_cap_s, f"fx{spec}")}
    del model
    torch.cuda.empty_cache()
    return res


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    return values[min(len(values) - 1, math.ceil(p / 100 * len(values)) - 1)]


SECTIONS: dict[str, Callable[[Ctx], dict[str, Any]]] = {
    "bandwidth": bench_bandwidth, "decode_step": bench_decode_step, "decode_breakdown": bench_decode_breakdown,
    "lite_generate": bench_lite_generate,
    "verify_cost": bench_verify_cost, "engine_generate": bench_engine_generate, "hf_generate": bench_hf_generate,
    "smollm2_rollback": bench_smollm2_rollback, "compare_modes": bench_compare_modes,
    "compare_modes_synthetic": bench_compare_modes_synthetic, "wg_sweep": bench_wg_sweep,
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
    import textwrap

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
    rb = {w: v for w, v in result.get("smollm2_rollback", {}).get("windows", {}).items()
          if "recompute_pct_of_output" in v}
    if ax is None or not rb:
        return bool(rb)
    ax.bar([f"W={w}" for w in rb], [v["recompute_pct_of_output"] for v in rb.values()])
    ax.axhline(7.0, color="k", ls="--", lw=0.8, label="target at W=32 (7 %)")
    ax.set_ylabel("recomputed tokens, % of output")
    ax.legend(fontsize=8)
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
    for sec, label in (("compare_modes", "SmolLM2 (natural rollbacks)"),
                       ("compare_modes_synthetic", "synthetic 8B (injected rollbacks)")):
        modes = result.get(sec, {}).get("modes", {})
        vals = {k: v["ratio_to_nondeterministic"] for k, v in modes.items() if "ratio_to_nondeterministic" in v}
        if vals:
            series[label] = vals
    if ax is None or not series:
        return bool(series)
    names = [n for n, _, _ in MODES]
    width = 0.8 / len(series)
    for k, (label, vals) in enumerate(series.items()):
        ax.bar([i + k * width for i in range(len(names))], [vals.get(n, 0) for n in names], width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_ylabel("output tok/s ÷ nondeterministic")
    ax.set_title("determinism strategies (same requests per model)", fontsize=10)
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    ax.legend(fontsize=7)
    return True


# ---- main ----------------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine bench --device cuda", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", choices=["cuda"], help="accepted for `python -m engine bench`")
    p.add_argument("--sections", default=",".join(SYNTHETIC_SECTIONS),
                   help=f"comma list from {','.join(ALL_SECTIONS)} or 'all'")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default="gpu-bench", help="file stem of the JSON/PNG")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count (quick runs)")
    p.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    p.add_argument("--context", type=int, default=256, help="keys per row in decode_step / verify_cost")
    p.add_argument("--decode-attention", default="split", choices=["split", "canonical"],
                   help="synthetic model's decode attention: split-KV kernel or the verifier's kernel")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--engine-cap-s", type=float, default=60.0)
    p.add_argument("--gguf", default="default", help="SmolLM2 model for the smollm2 sections")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rollback-windows", type=lambda s: [int(x) for x in s.split(",")], default=[16, 32, 64])
    p.add_argument("--rollback-prompts", type=int, default=256)
    p.add_argument("--rollback-tokens", type=int, default=256)
    p.add_argument("--rollback-cap-s", type=float, default=120.0)
    p.add_argument("--smol-kv-blocks", type=int, default=12000)
    p.add_argument("--compare-requests", type=int, default=128)
    p.add_argument("--compare-tokens", type=int, default=128)
    p.add_argument("--compare-cap-s", type=float, default=60.0)
    p.add_argument("--sweep-requests", type=int, default=128)
    p.add_argument("--sweep-tokens", type=int, default=128)
    p.add_argument("--no-sweep-canonical-decode", dest="sweep_canonical_decode", action="store_false",
                   help="skip the W x G=8 runs whose fast path uses the verifier's attention kernel")
    p.add_argument("--compare-modes", action="store_true", help="add the compare_modes sections")
    p.add_argument("--fixed-sets", type=lambda s: [x for x in s.split(",") if x], default=["16x1024x256"],
                   help="extra fixed request sets for compare_modes_synthetic, REQUESTSxPROMPTxOUTPUT "
                        "(the issue's 4k/1k set: 8x4096x1024)")
    p.add_argument("--synthetic-fault-rate", type=float, default=0.01,
                   help="injected rollbacks per token on the synthetic 8B when SmolLM2 was not measured first")
    p.add_argument("--no-engine-graphs", dest="engine_graphs", action="store_false",
                   help="SmolLM2 engine runs without the decode-graph hook")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench --device cuda: no CUDA device", file=sys.stderr)
        return 2
    names = list(ALL_SECTIONS) if args.sections == "all" else [s for s in args.sections.split(",") if s]
    if args.compare_modes:
        names += [n for n in ("compare_modes", "compare_modes_synthetic") if n not in names]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; known: {list(SECTIONS)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"environment": environment(argv)}
    ctx = Ctx(args=args, device=torch.device("cuda"), result=result)
    json_path, png_path = out_dir / f"{args.name}.json", out_dir / f"{args.name}.png"
    for name in names:
        t0 = time.perf_counter()
        try:
            result[name] = SECTIONS[name](ctx)
        except Exception:  # a benchmark section's failure is a result to record, not a reason to stop
            result[name] = {"error": traceback.format_exc(limit=8)}
        result[name]["section_s"] = round(time.perf_counter() - t0, 2)
        print(f"[bench] {name}: {json.dumps(result[name], default=str)[:600]}", flush=True)
        json_path.write_text(json.dumps(result, indent=1, default=str))
    try:
        chart(result, png_path)
    except Exception:  # the JSON is the result; a chart failure must not lose it
        result["chart_error"] = traceback.format_exc(limit=4)
        json_path.write_text(json.dumps(result, indent=1, default=str))
    print(summary(result), flush=True)
    return 0


def summary(result: dict[str, Any]) -> str:
    lines = [f"== {result['environment']['device']} {result['environment']['date_utc']}"]
    bw = result.get("bandwidth", {})
    if "tb_per_s" in bw:
        lines.append(f"copy bandwidth {bw['tb_per_s']} TB/s")
    for b, v in result.get("decode_step", {}).get("batches", {}).items():
        lines.append(f"decode b={b}: {v['median_ms']:.2f} ms (floor {v['floor_ms']:.2f}, x{v['ratio_to_floor']:.2f}) "
                     f"eager {v['eager_median_ms']} allocs {v['device_allocations_during_timed_steps']}")
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
    mem = result.get("decode_step", {}).get("memory")
    if mem:
        lines.append(f"kv cache {mem['kv_cache_bytes'] / 2**30:.1f} GiB = {mem['kv_fraction_of_free']:.3f} of "
                     f"{mem['free_after_weights_bytes'] / 2**30:.1f} GiB free after weights; peak allocated "
                     f"{result['decode_step'].get('peak_allocated_bytes', 0) / 2**30:.1f} GiB")
    v = result.get("lite_generate", {})
    if "output_tok_per_s" in v:
        lines.append(f"lite_generate: {v['output_tok_per_s']:.0f} tok/s (limit {v['bandwidth_limit_tok_per_s']:.0f})")
    for k in ("eager", "decode_graphs"):
        v = result.get("engine_generate", {}).get(k, {})
        if "output_tok_per_s" in v:
            lines.append(f"engine {k}: {v['output_tok_per_s']:.0f} tok/s ({v['committed_tokens']} tokens, "
                         f"capped={v['capped']})")
    hf = result.get("hf_generate", {}).get("static_batch")
    if hf:
        lines.append(f"hf static batch: {hf['output_tok_per_s']:.0f} tok/s")
    for k, v in result.get("verify_cost", {}).get("shapes", {}).items():
        lines.append(f"verify {k}: {v['median_ms']:.2f} ms ({v['ms_per_token']:.4f} ms/tok) graph "
                     f"{v['graph_median_ms']:.2f} ms bit_exact={v['graph_bit_exact']}")
    for w, v in result.get("smollm2_rollback", {}).get("windows", {}).items():
        lines.append(f"smollm2 W={w}: recompute {v['recompute_pct_of_output']:.2f}% of {v['committed_tokens']} "
                     f"tokens, {v['seconds']:.0f}s capped={v['capped']}")
    fixed = {f"compare_modes_synthetic.{k}": v for k, v in result.get("compare_modes_synthetic", {}).items()
             if k.startswith("fixed_") and isinstance(v, dict)}
    for sec, sec_res in [(s_, result.get(s_, {})) for s_ in ("compare_modes", "compare_modes_synthetic")] + list(fixed.items()):
        for k, v in sec_res.get("modes", {}).items():
            ratio = v.get("ratio_to_nondeterministic")
            lines.append(f"{sec} {k}: {v.get('output_tok_per_s', 0):.0f} tok/s ratio "
                         f"{'-' if ratio is None else f'{ratio:.3f}'} p50 {v.get('p50_latency_s')} "
                         f"p99 {v.get('p99_latency_s')} {v.get('error', '')[:120]}")
    for k, v in result.get("wg_sweep", {}).get("runs", {}).items():
        lines.append(f"sweep {k}: {v['output_tok_per_s']:.0f} tok/s, recompute {v['recompute_pct_of_output']:.2f}%, "
                     f"{v['stats'].get('verify_passes')} verify passes, capped={v['capped']}")
    errors = [k for k, v in result.items() if isinstance(v, dict) and "error" in v]
    if errors:
        lines.append(f"sections with errors: {errors}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
