"""The engine benchmark on a CUDA GPU: `python -m bench engine [--sections ...]`.

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

Modules: `cli` (sections, presets, the run loop), `common` (the run context, timing, the synthetic model),
`core`, `smollm2`, `modes`, `long` (the sections), `mixes` (request sets and sampling presets), `report`
(chart and summary), `results` (the one results writer); beside them `replay` (replay cost), `cpu` (CPU
throughput) and `bi_matmul` (the batch-invariant GEMM probe), each its own `python -m bench` command.
"""
