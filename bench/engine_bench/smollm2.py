"""Sections on the real SmolLM2: rollback rates per window (smollm2_rollback) and the W x G sweep (wg_sweep)."""
from __future__ import annotations

from typing import Any

from bench.engine_bench.common import Ctx, drive, engine_config, free_memory

# Rollbacks per committed token on SmolLM2 at W=32 (greedy, canonical DVR decode rows, the CUDA default),
# from bench/results/2026-11-29-h200/gpu-bench-rollback.json (H200, 256 prompts: W32-canonical, 0 rollbacks):
# the injected rate when this run did not measure it.
COMMITTED_SMOLLM2_FAULT_RATE = 0.0


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
            config = engine_config(ctx, a.engine_graphs, model=a.gguf, device=ctx.device.type,
                                    dtype="bfloat16", mode="dvr", window=w, group=a.group,
                                    dvr_decode_attention=attn, num_kv_blocks=a.smol_kv_blocks,
                                    max_num_seqs=a.rollback_prompts, max_num_batched_tokens=8192,
                                    cache_dir=a.cache_dir)
            llm = smol_llm(ctx, config)
            prompts = smollm2_prompts(llm.tokenizer, a.rollback_prompts)
            params = SamplingParams(max_tokens=a.rollback_tokens, temperature=0.0, ignore_eos=True,
                                    deterministic=True, seed=1)
            res = {"window": w, "dvr_decode_attention": attn,
                   **drive(ctx, llm.core, prompts, params, a.rollback_cap_s, f"w{w}{attn}")}
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
            free_memory()
            ctx.checkpoint(f"{key}: recompute {res['recompute_pct_of_output']:.2f} %, "
                           f"{res['rollbacks_per_committed_token']:.5f} rollbacks/token, {res['seconds']:.0f}s")
    return out


def smol_llm(ctx: Ctx, config: Any) -> Any:
    """An engine over SmolLM2 loaded once per run (`load_model` of the first config: bfloat16, Triton
    attention; the weights are shared by every config of the run).

    batch_invariant goes through `LLM(config)`: the engine builds that model with its own ops."""
    from engine.config import Mode
    from engine.llm import LLM
    from engine.loading import load_model

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
        config = engine_config(ctx, a.engine_graphs, model=a.gguf, device=ctx.device.type,
                                dtype="bfloat16", mode="dvr", window=w, group=g, dvr_decode_attention=decode_attn,
                                num_kv_blocks=a.smol_kv_blocks, max_num_seqs=a.sweep_requests,
                                max_num_batched_tokens=8192, cache_dir=a.cache_dir)
        llm = smol_llm(ctx, config)
        prompts = smollm2_prompts(llm.tokenizer, a.sweep_requests)
        params = SamplingParams(max_tokens=a.sweep_tokens, temperature=0.0, ignore_eos=True, deterministic=True,
                                seed=1)
        res = {"window": w, "group": g, "dvr_decode_attention": decode_attn,
               **drive(ctx, llm.core, prompts, params, a.sweep_cap_s, f"sw-{key}")}
        committed = max(res["committed_tokens"], 1)
        res["recompute_pct_of_output"] = 100.0 * res["stats"].get("recomputed_tokens", 0) / committed
        out["runs"][key] = res
        del llm
        free_memory()
        ctx.checkpoint(f"{key}: {res['output_tok_per_s']:.0f} tok/s, recompute {res['recompute_pct_of_output']:.2f} %")
    return out
