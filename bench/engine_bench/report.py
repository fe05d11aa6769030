"""The engine benchmark's chart (one PNG, a panel per section) and its one-line-per-figure summary."""
from __future__ import annotations

import textwrap
import traceback
from pathlib import Path
from typing import Any

from bench.engine_bench.mixes import MODES, request_sets


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
