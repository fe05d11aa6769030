"""The mode comparison: each mode's engine warmed, timed and (optionally) profiled on one request set;
SmolLM2 (compare_modes) and the synthetic 8B (compare_modes_synthetic)."""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from bench.engine_bench.common import (
    BLOCK_SIZE,
    Ctx,
    engine_config,
    engine_shape,
    free_memory,
    percentile,
    sync,
    synthetic_config,
)
from bench.engine_bench.mixes import MIX_LO, MODES, mix_params, parse_set_spec, sharegpt_like_lengths
from bench.engine_bench.smollm2 import smol_llm, smollm2_prompts
from engine.config import RESERVED_BLOCKS
from engine.cuda_graphs import GRAPH_MAX_LEN

WARMUP_TOKENS = 4  # per request, in each mode's untimed warm-up


def _run_modes(ctx: Ctx, make_llm: Callable[[str, float], Any], prompts: list[list[int]], out_lens: list[int],
               cap_s: float, tag: str, modes: dict[str, Any]) -> dict[str, Any]:
    """Each mode on the same requests (an evenly spread `share` of them deterministic): tok/s, p50/p99
    request latency, filled into `modes` (part of the section's live result) one mode at a time."""

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
                       "dvr_decode_attention": llm.config.tuning.dvr_decode_attention.value,
                       "dvr_lookahead": llm.config.tuning.dvr_lookahead, "overlap": llm.config.tuning.overlap,
                       "warmup_tokens_per_request": WARMUP_TOKENS,
                       "canonical_prefill_min_tokens": llm.config.tuning.canonical_prefill_min_tokens,
                       "canonical_prefill_chunk_tokens": llm.config.tuning.canonical_prefill_chunk_tokens,
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
        free_memory()
        base = modes.get("nondeterministic", {}).get("output_tok_per_s")
        for entry in modes.values():
            if base and "output_tok_per_s" in entry:
                entry["ratio_to_nondeterministic"] = entry["output_tok_per_s"] / base
        ctx.checkpoint(f"{tag} {name}: {modes[name]['output_tok_per_s']:.0f} tok/s, ratio "
                       f"{modes[name].get('ratio_to_nondeterministic', float('nan')):.3f}, "
                       f"{done}/{len(prompts)} done, median of {len(runs)} runs "
                       f"{[round(r['seconds'], 3) for r in runs]} s")
    return modes


def _timed_mode_run(ctx: Ctx, llm: Any, prompts: list[list[int]], out_lens: list[int], det_ids: set[int],
                    cap_s: float, tag: str) -> dict[str, Any]:
    """One timed run of the requests on a warm engine: tok/s, p50/p99 latency, this run's engine stats."""

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
        sync()
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
        sync()
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
            "p50_latency_s": percentile(lat, 50), "p99_latency_s": percentile(lat, 99), "stats": stats,
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
        config = engine_config(ctx, a.engine_graphs, model=a.gguf, device=ctx.device.type,
                                dtype="bfloat16", mode=mode, window=a.window, group=a.group,
                                dvr_decode_attention=a.dvr_decode_attention, num_kv_blocks=a.smol_kv_blocks,
                                max_num_seqs=a.compare_requests, max_num_batched_tokens=8192, cache_dir=a.cache_dir,
                                dvr_lookahead=a.dvr_lookahead)
        return smol_llm(ctx, config)

    probe = make("nondeterministic", 0.0)
    prompts = smollm2_prompts(probe.tokenizer, a.compare_requests)
    del probe
    free_memory()
    out_lens = sharegpt_like_lengths(len(prompts), 7, 16, a.compare_tokens)
    out = ctx.open({"model": "SmolLM2-135M-Instruct (GGUF)", "requests": len(prompts),
                    "output_len_mean": sum(out_lens) / len(out_lens), "window": a.window, "group": a.group,
                    "dvr_decode_attention": a.dvr_decode_attention, "modes": {}})
    _run_modes(ctx, make, prompts, out_lens, a.compare_cap_s, "smol", out["modes"])
    return out


def bench_compare_modes_synthetic(ctx: Ctx) -> dict[str, Any]:
    """Issue 6 on the synthetic 8B: the ShareGPT-like mix and the fixed sets of --synthetic-sets."""
    return synthetic_modes(ctx, ctx.args.synthetic_sets)


def synthetic_modes(ctx: Ctx, sets: list[str]) -> dict[str, Any]:
    """The synthetic 8B with peaked logits (no natural rollbacks), rollbacks injected at the rate measured
    on SmolLM2 in this run (W=32, canonical DVR decode rows) when smollm2_rollback ran first, else
    --fault-rate. Set "sharegpt" = the mix (log-uniform prompt and output lengths, results under "modes");
    "NxPxO" = N requests of P prompt tokens and O output tokens (results under "fixed_NxPxO")."""
    from engine.llm import LLM
    from engine.models.synthetic import build_synthetic_model

    a = ctx.args
    model = build_synthetic_model(synthetic_config(a.preset, a.layers), torch.bfloat16, ctx.device, seed=0,
                                  attention_backend="triton", peaked=True, kernels=a.kernels)
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
        config = engine_config(ctx, a.engine_graphs, model="synthetic", device=ctx.device.type,
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
    free_memory()
    return res
