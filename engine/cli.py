"""Command line: `generate`, mounted in the `verbatim` command (auditor.cli) and runnable alone as
`python -m engine generate ...`. The benchmarks are tools of the source tree: `python -m bench`.

`generate` builds its EngineConfig from, highest first: its flags, `--engine-options`, the environment
(VERBATIM_MODEL, VERBATIM_DEVICE, VERBATIM_SERVED_MODEL_NAME, VERBATIM_ENGINE_OPTIONS: the service's
variables, so the offline engine runs what `verbatim serve` would), then EngineConfig's defaults.
"""
from __future__ import annotations

import argparse
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
                  "threads": "num_threads", "tensor_parallel_size": "tensor_parallel_size",
                  "tp_reduction": "tp_reduction"}


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
    p.add_argument("--tensor-parallel-size", type=int,
                   help="shard the model over this many ranks, one process each (CUDA: one GPU each; default 1)")
    p.add_argument("--tp-reduction", choices=["gather_sum", "nccl"],
                   help="tensor parallel all-reduce: gather_sum (default; all-gather, float32 sum in rank order) or "
                   "nccl (NCCL all_reduce, NCCL_ALGO / NCCL_PROTO pinned to Ring / Simple unless set)")
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
    """EngineConfig.from_options(options): EngineConfig and DvrTuning fields by name; ValueError naming unknown
    ones."""
    from engine.config import EngineConfig

    return EngineConfig.from_options(options)


COMMANDS: list[Command] = [
    ("generate", "generate a completion and print text and DVR statistics", configure_generate),
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
    with LLM(cfg) as llm:
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = build_parser().parse_args(argv)
    try:
        return int(a.run(a) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
