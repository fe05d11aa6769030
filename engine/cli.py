"""Command line: `generate` and `bench`, mounted in the `verbatim` command (auditor.cli) and runnable alone
as `python -m engine generate ...` / `python -m engine bench ...`.

`generate` builds its EngineConfig from, highest first: its flags, `--engine-options`, the environment
(VERBATIM_MODEL, VERBATIM_DEVICE, VERBATIM_SERVED_MODEL_NAME, VERBATIM_ENGINE_OPTIONS: the service's
variables, so the offline engine runs what `verbatim serve` would), then EngineConfig's defaults. `bench`
reads no environment: its results must follow from the command recorded beside them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None]]
ENV_PREFIX = "VERBATIM_"
# generate flag -> EngineConfig field (flags left out keep the environment's or EngineConfig's value)
_ENGINE_FIELDS = {"device": "device", "dtype": "dtype", "mode": "mode", "window": "window", "group": "group",
                  "kv_blocks": "num_kv_blocks", "attention_backend": "attention_backend",
                  "cuda_graphs": "cuda_graphs", "fault_rate": "fault_rate", "fault_seed": "fault_seed",
                  "threads": "num_threads"}


def configure_generate(gen: argparse.ArgumentParser) -> None:
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
    engine_flags(gen)
    gen.set_defaults(run=cmd_generate)


def engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine's flags; left out, each keeps the environment's or EngineConfig's value."""
    p.add_argument("--model", help="'default' (SmolLM2 GGUF), a model folder, a .gguf file or a Hugging Face id "
                   "ORG/NAME[@REVISION] (env VERBATIM_MODEL; default 'default')")
    p.add_argument("--served-model-name", help="the model's name in the output (env VERBATIM_SERVED_MODEL_NAME; "
                   "default: the name given to --model)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], help="env VERBATIM_DEVICE; default auto")
    p.add_argument("--dtype", help="auto (float32 on the CPU, bfloat16 on CUDA) / float32 / bfloat16 / float16")
    p.add_argument("--mode", help="dvr (default) / nondeterministic / batch_invariant")
    p.add_argument("--window", type=int, help="verify window W")
    p.add_argument("--group", type=int, help="verify group G")
    p.add_argument("--kv-blocks", type=int,
                   help="KV budget in blocks (default: 514 on the CPU, 90%% of free memory on CUDA)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton", "flash"],
                   help="auto: triton on CUDA, torch on the CPU")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction,
                   help="CUDA only: graph-captured decode (and verify); default on for CUDA")
    p.add_argument("--fault-rate", type=float, help="fast-path fault injection rate")
    p.add_argument("--fault-seed", type=int)
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--engine-options", type=json_object,
                   help="any other EngineConfig fields as a JSON object, e.g. '{\"verify_packing\": \"packed\"}' "
                   "(env VERBATIM_ENGINE_OPTIONS)")


def json_object(raw: str) -> dict[str, Any]:
    """A JSON object from a flag or variable; argparse.ArgumentTypeError (argparse names the flag) otherwise."""
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {type(value).__name__}")
    return value


def engine_config_options(a: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """EngineConfig keyword arguments: flags over --engine-options over the environment."""
    options: dict[str, Any] = {}
    if a.engine_options is not None:
        options.update(a.engine_options)
    elif env.get(ENV_PREFIX + "ENGINE_OPTIONS"):
        try:
            options.update(json_object(env[ENV_PREFIX + "ENGINE_OPTIONS"]))
        except argparse.ArgumentTypeError as exc:
            raise ValueError(f"{ENV_PREFIX}ENGINE_OPTIONS {exc}") from None
    for name, var in (("model", "MODEL"), ("device", "DEVICE")):
        if env.get(ENV_PREFIX + var):
            options[name] = env[ENV_PREFIX + var]
    if a.model is not None:
        options["model"] = a.model
    options.update({field: getattr(a, flag) for flag, field in _ENGINE_FIELDS.items() if getattr(a, flag) is not None})
    return options


def engine_config(options: Mapping[str, Any]) -> Any:
    """EngineConfig(**options); ValueError naming unknown fields (a dataclass would raise TypeError)."""
    from engine.config import EngineConfig

    known = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"engine options: unknown EngineConfig fields {unknown}; known: {sorted(known)}")
    return EngineConfig(**options)


def configure_bench(bench: argparse.ArgumentParser) -> None:
    bench.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                       help="cuda: the GPU benchmark, with its own flags (bench --device cuda --help)")
    bench.add_argument("--replay", action="store_true", help="replay N transcripts together vs generating them")
    bench.add_argument("--num-prompts", type=int, default=16)
    bench.add_argument("--max-tokens", type=int, default=64)
    bench.add_argument("--det-shares", default="0,0.1,0.5,1", help="comma-separated deterministic shares")
    bench.add_argument("--hf-batch1-prompts", type=int, default=4)
    bench.add_argument("--replay-transcripts", type=int, default=32)
    bench.add_argument("--replay-tokens", type=int, default=256)
    bench.add_argument("--out-dir", default="bench/results")
    bench.add_argument("--tag", default="", help="suffix for the result file name")
    bench.add_argument("--model", default="default",
                       help="'default', a model folder, a .gguf file or a Hugging Face id (no env default)")
    bench.add_argument("--window", type=int, default=32)
    bench.add_argument("--group", type=int, default=8)
    bench.add_argument("--kv-blocks", type=int, default=514)
    bench.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    bench.set_defaults(run=cmd_bench)


COMMANDS: list[Command] = [
    ("generate", "generate a completion and print text and DVR statistics", configure_generate),
    ("bench", "throughput benchmark (or --replay) -> bench/results/*.json", configure_bench),
]


def build_parser(prog: str = "python -m engine") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Verbatim engine (DVR) on this machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, configure in COMMANDS:
        configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def cmd_generate(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    from engine import progress
    from engine.llm import LLM
    from engine.sampling import SamplingParams

    env = os.environ if env is None else env
    progress.log_to_stderr()
    cfg = engine_config(engine_config_options(a, env))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=a.stop, stop_token_ids=a.stop_token_id, ignore_eos=a.ignore_eos,
                            logprobs=a.logprobs, deterministic=a.deterministic)
    llm = LLM(cfg)
    name = a.served_model_name or env.get(ENV_PREFIX + "SERVED_MODEL_NAME") or llm.model_info.name
    if a.chat:
        out = llm.chat([{"role": "user", "content": a.prompt}], params)[0]
    else:
        out = llm.generate([a.prompt], params)[0]
    if a.json:
        print(json.dumps({"model": name, **vars(out)}, default=str))
        return 0
    print(out.text)
    print(f"--- model={name!r}, {len(out.token_ids)} tokens, finish={out.finish_reason}, seed={out.seed}, "
          f"mode={cfg.mode.value}, deterministic={out.deterministic}, windows={out.windows}, "
          f"(G, W)={out.window_shape}, verify_passes={out.verify_passes}, rollbacks={out.rollbacks}, "
          f"recomputed_tokens={out.recomputed_tokens}", file=sys.stderr)
    return 0


def cmd_bench(a: argparse.Namespace) -> int:
    from engine import progress
    from engine.bench import BenchArgs, format_table, run_bench

    progress.log_to_stderr()
    args = BenchArgs(model=a.model, num_prompts=a.num_prompts, max_tokens=a.max_tokens,
                     det_shares=tuple(float(x) for x in a.det_shares.split(",")), window=a.window, group=a.group,
                     num_kv_blocks=a.kv_blocks, threads=a.threads, hf_batch1_prompts=a.hf_batch1_prompts,
                     out_dir=a.out_dir, replay=a.replay, replay_transcripts=a.replay_transcripts,
                     replay_tokens=a.replay_tokens, tag=a.tag)
    result, path = run_bench(args)
    print(format_table(result))
    print(f"written: {path}")
    return 0


def wants_cuda_bench(argv: list[str]) -> bool:
    """`bench --device cuda ...`, or `bench --compare-modes` (a GPU benchmark) unless --device cpu is given."""
    if argv[:1] != ["bench"]:
        return False
    pairs = list(zip(argv, argv[1:]))
    if "--device=cuda" in argv or ("--device", "cuda") in pairs:
        return True
    return "--compare-modes" in argv and "--device=cpu" not in argv and ("--device", "cpu") not in pairs


def cuda_bench(argv: list[str]) -> int:
    """`bench --device cuda ...`: the GPU benchmarks live in their own modules (triton imports stay lazy)."""
    if "--replay" in argv:
        from engine.bench_replay_gpu import main as replay_main

        return replay_main(argv[1:])
    from engine.bench_gpu import main as gpu_main

    return gpu_main(argv[1:])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if wants_cuda_bench(argv):
        return cuda_bench(argv)
    a = build_parser().parse_args(argv)
    try:
        return int(a.run(a) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
