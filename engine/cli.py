"""Command line: `python -m engine generate ...` and `python -m engine bench ...`."""
from __future__ import annotations

import argparse
import json
import sys

from engine.config import EngineConfig, Mode


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Verbatim engine (DVR) on this machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a completion and print text and DVR statistics")
    gen.add_argument("prompt", help="prompt text (with --chat: the user message)")
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to the prompt")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None, help="unsigned 64-bit seed (drawn when omitted)")
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--stop-token-id", type=int, action="append", default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--logprobs", type=int, default=None, help="also return N top logprobs per token")
    gen.add_argument("--deterministic", action="store_true",
                     help="bit-exact via decode-verify-rollback (--mode batch_invariant: every request is)")
    gen.add_argument("--json", action="store_true", help="print the full RequestOutput as JSON")
    _engine_flags(gen)
    bench = sub.add_parser("bench", help="throughput benchmark (or --replay) -> bench/results/*.json")
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="cuda: the GPU benchmark, with its own flags (python -m engine bench --device cuda --help)")
    bench.add_argument("--replay", action="store_true", help="replay N transcripts together vs generating them")
    bench.add_argument("--num-prompts", type=int, default=16)
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--det-shares", default="0,0.1,0.5,1", help="comma-separated deterministic shares")
    bench.add_argument("--hf-batch1-prompts", type=int, default=4)
    bench.add_argument("--replay-transcripts", type=int, default=32)
    bench.add_argument("--replay-tokens", type=int, default=256)
    bench.add_argument("--out-dir", default="bench/results")
    bench.add_argument("--tag", default="", help="suffix for the result file name")
    bench.add_argument("--model", default="default")
    bench.add_argument("--window", type=int, default=32)
    bench.add_argument("--group", type=int, default=8)
    bench.add_argument("--kv-blocks", type=int, default=514)
    bench.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    return parser


def _engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="default", help="'default', a HF model folder or a .gguf file")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--mode", default="dvr", choices=[m.value for m in Mode])
    p.add_argument("--window", type=int, default=32, help="verify window W")
    p.add_argument("--group", type=int, default=8, help="verify group G")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV budget in blocks (default: 514 on the CPU, 90%% of free memory on CUDA)")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "flash"],
                   help="auto: triton on CUDA, torch on the CPU")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="CUDA only: graph-captured decode (and verify); default on for CUDA")
    p.add_argument("--fault-rate", type=float, default=0.0, help="fast-path fault injection rate")
    p.add_argument("--fault-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")


def cmd_generate(a: argparse.Namespace) -> int:
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    cfg = EngineConfig(model=a.model, device=a.device, dtype=a.dtype, mode=a.mode, window=a.window, group=a.group,
                       num_kv_blocks=a.kv_blocks, fault_rate=a.fault_rate, fault_seed=a.fault_seed,
                       num_threads=a.threads, attention_backend=a.attention_backend, cuda_graphs=a.cuda_graphs)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop, stop_token_ids=a.stop_token_id, ignore_eos=a.ignore_eos,
                            logprobs=a.logprobs, deterministic=a.deterministic)
    llm = LLM(cfg)
    if a.chat:
        out = llm.chat([{"role": "user", "content": a.prompt}], params)[0]
    else:
        out = llm.generate([a.prompt], params)[0]
    if a.json:
        print(json.dumps(vars(out), default=str))
        return 0
    print(out.text)
    print(f"--- {len(out.token_ids)} tokens, finish={out.finish_reason}, seed={out.seed}, mode={cfg.mode.value}, "
          f"deterministic={out.deterministic}, windows={out.windows}, (G, W)={out.window_shape}, "
          f"verify_passes={out.verify_passes}, rollbacks={out.rollbacks}, "
          f"recomputed_tokens={out.recomputed_tokens}", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from engine.bench import BenchArgs, format_table, run_bench

    args = BenchArgs(model=a.model, num_prompts=a.num_prompts, max_tokens=a.max_tokens,
                     det_shares=tuple(float(x) for x in a.det_shares.split(",")), window=a.window, group=a.group,
                     num_kv_blocks=a.kv_blocks, threads=a.threads, hf_batch1_prompts=a.hf_batch1_prompts,
                     out_dir=a.out_dir, replay=a.replay, replay_transcripts=a.replay_transcripts,
                     replay_tokens=a.replay_tokens, tag=a.tag)
    result, path = run_bench(args)
    print(format_table(result))
    print(f"written: {path}")
    return 0


def _wants_cuda_bench(argv: list[str]) -> bool:
    """`bench --device cuda ...`, or `bench --compare-modes` (a GPU benchmark) unless --device cpu is given."""
    if argv[:1] != ["bench"]:
        return False
    pairs = list(zip(argv, argv[1:]))
    if "--device=cuda" in argv or ("--device", "cuda") in pairs:
        return True
    return "--compare-modes" in argv and "--device=cpu" not in argv and ("--device", "cpu") not in pairs


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if _wants_cuda_bench(argv):  # GPU benchmarks live in their own modules (triton imports stay lazy)
        if "--replay" in argv:
            from engine.bench_replay_gpu import main as replay_main

            return replay_main(argv[1:])
        from engine.bench_gpu import main as gpu_main

        return gpu_main(argv[1:])
    a = build_parser().parse_args(argv)
    try:
        return {"generate": cmd_generate, "bench": cmd_bench}[a.command](a)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
