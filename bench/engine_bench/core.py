"""The core sections on the synthetic 8B: bandwidth, the decode step against the HBM floor and its breakdown,
the generation ceilings (lite, engine, transformers), the verify pass's cost, and batch-invariant numerics."""
from __future__ import annotations

import inspect
import math
import time
import traceback
from dataclasses import replace
from typing import Any

import torch

from bench.engine_bench.common import (
    BLOCK_SIZE,
    Ctx,
    contiguous_tables,
    decode_graphs,
    drive,
    engine_config,
    engine_shape,
    fill_cache_,
    free_memory,
    kv_bytes_per_token,
    sync,
    synthetic,
    time_cuda,
    time_wall,
)
from engine.config import RESERVED_BLOCKS


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
    graphs = decode_graphs(ctx, model, kv, batches, blocks_per_row * BLOCK_SIZE)
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
    graphs = decode_graphs(ctx, model, kv, batches, nb * BLOCK_SIZE)
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
    graphs = decode_graphs(ctx, model, kv, (n_req,), blocks_per_row * BLOCK_SIZE)
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
    config = engine_config(ctx, model="synthetic", device=ctx.device.type, dtype="bfloat16",
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
        run = replace(config, cuda_graphs=graphs, tuning=replace(config.tuning, overlap=overlap))
        llm = LLM.from_parts(run, model, shape, eos_ids=set())
        if graphs:
            out["graph_hook"] = llm.core.runner.graphs_status
        out[label] = drive(ctx, llm.core, prompts, params, ctx.args.engine_cap_s, f"eng-{label}",
                            mem_probe_steps=32)
        del llm
        free_memory()
        ctx.checkpoint(f"{label}: {out[label]['output_tok_per_s']:.0f} tok/s")
    rates = [out[k]["output_tok_per_s"] for k in ("eager", "decode_graphs") if k in out]
    if rates:
        out["output_tok_per_s"] = max(rates)
    return out


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
        free_memory()  # the manager sizes its paged cache from the memory free now
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
    free_memory()
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
        sync()
        t_in = time.perf_counter()
        cap_s = max(0.0, min(cap_s, deadline - t_in))
        manager.add_requests(inputs=prompts, max_new_tokens=n_out)
        while len(done) < len(prompts) and time.perf_counter() - t_in < cap_s:
            r = manager.get_result(timeout=1)
            if r is not None and r.is_finished():
                done[r.request_id] = r
            elif r is None and not manager.is_running():
                break
        sync()
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
