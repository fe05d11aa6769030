"""`python -m bench replay`: replay cost on the GPU (issue 4's H200 target, <= 0.2x).

Generates N deterministic transcripts of T tokens with DVR on a synthetic model (default: the
Llama-3.1-8B shape, seeded random weights made on the device), then replays all of them together
(canonical prefill + one teacher-forced G x W verify pass per recorded window, replays sharing passes)
and reports replay time / generation time. Every replay must reproduce token ids and logprobs bit for bit.

Random weights give flat logits, so rollbacks would be far more frequent than with a trained model: the
synthetic model here is built with peaked logits (`peaked=True`), and `--fault-rate` sets the fast-path
flip rate to a chosen, realistic rollback rate instead (e.g. the one measured on SmolLM2).
"""
from __future__ import annotations

import argparse
import json
import time
from datetime import datetime, timezone
from typing import Any

import torch

from bench.engine_bench.common import BLOCK_SIZE, engine_shape, synthetic_config, time_wall
from bench.results import write_result
from engine.config import RESERVED_BLOCKS


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke run only")
    p.add_argument("--preset", default="llama-3.1-8b")
    p.add_argument("--layers", type=int, default=0, help="override the preset's layer count (quick runs)")
    p.add_argument("--transcripts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--fault-rate", type=float, default=0.0, help="fast-path candidate flip rate")
    p.add_argument("--dvr-decode-attention", default="canonical", choices=["canonical", "split"],
                   help="DvrTuning.dvr_decode_attention: DVR decode rows with the verifier's attention or split-KV")
    p.add_argument("--logit-scale", type=float, default=8.0, help="peaked synthetic logits' scale")
    p.add_argument("--no-graphs", action="store_true", help="eager decode/verify instead of CUDA graphs")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--name", default="gpu-replay")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[Any, Any]:
    from engine.models.synthetic import build_synthetic_model

    cuda = args.device == "cuda"
    model = build_synthetic_model(synthetic_config(args.preset, args.layers), torch.bfloat16 if cuda else torch.float32,
                                  args.device, seed=0, attention_backend="triton" if cuda else "torch",
                                  logit_scale=args.logit_scale, peaked=True)
    return model, engine_shape(model, 4096)


def make_llm(args: argparse.Namespace, model: Any, shape: Any) -> Any:
    from engine.config import DvrTuning, EngineConfig
    from engine.llm import LLM

    per_seq = -(-(args.prompt_len + args.tokens + args.window) // BLOCK_SIZE) + 1
    cuda = args.device == "cuda"
    config = EngineConfig(model="synthetic", device=args.device, dtype="bfloat16" if cuda else "float32", mode="dvr",
                          window=args.window, group=args.group, attention_backend="triton" if cuda else "torch",
                          cuda_graphs=cuda and not args.no_graphs,
                          num_kv_blocks=RESERVED_BLOCKS + args.transcripts * per_seq, max_num_seqs=args.transcripts,
                          max_num_batched_tokens=max(4096, args.prompt_len), max_model_len=4096,
                          fault_rate=args.fault_rate, fault_seed=1,
                          tuning=DvrTuning(dvr_decode_attention=args.dvr_decode_attention))
    return LLM.from_parts(config, model, shape, eos_ids=set())


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import ReplayRequest
    from engine.sampling import SamplingParams

    t0 = time.perf_counter()

    def progress(what: str) -> None:
        print(f"[bench-replay +{time.perf_counter() - t0:6.1f}s] {what}", flush=True)

    model, shape = build(args)
    llm = make_llm(args, model, shape)
    progress(f"model and engine built ({llm.core.runner.graphs_status})")
    gen = torch.Generator().manual_seed(3)
    prompts = torch.randint(0, shape.vocab_size, (args.transcripts, args.prompt_len), generator=gen).tolist()
    params = [SamplingParams(max_tokens=args.tokens, temperature=0.0 if i % 2 == 0 else 0.8, seed=1000 + i,
                             ignore_eos=True, deterministic=True) for i in range(args.transcripts)]
    llm.generate(prompts[:2], params[:2])  # warm-up: Triton compiles, graphs' first replays
    progress("warm-up done")
    outs, gen_s = time_wall(lambda: llm.generate(prompts, params))
    progress(f"generated {args.transcripts} transcripts in {gen_s:.1f}s")
    requests = [ReplayRequest(f"r{i}", o.prompt_token_ids, o.token_ids, p, o.windows, o.window_shape)
                for i, (o, p) in enumerate(zip(outs, params))]
    results, replay_s = time_wall(lambda: llm.replay(requests))
    progress(f"replayed them in {replay_s:.1f}s")
    matches = sum(r.first_mismatch is None and r.token_ids == o.token_ids and r.token_logprobs == o.token_logprobs
                  for r, o in zip(results, outs))
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "environment": {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                        "torch": torch.__version__,
                        "date_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                        "graphs": llm.core.runner.graphs_status,
                        "dvr_decode_attention": llm.config.tuning.dvr_decode_attention.value},
        "args": vars(args),
        "transcripts": args.transcripts, "tokens_per_transcript": args.tokens, "output_tokens": tokens,
        "generation_s": round(gen_s, 3), "replay_s": round(replay_s, 3),
        "replay_over_generation": round(replay_s / gen_s, 4),
        "request_verify_passes": sum(o.verify_passes for o in outs),  # per request, summed
        "rollbacks": sum(o.rollbacks for o in outs),
        "recomputed_tokens": sum(o.recomputed_tokens for o in outs),
        "windows": sum(len(o.windows) for o in outs),
        "matches": matches, "all_match": matches == len(outs),
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    result = run(args)
    result["command"] = "python -m bench replay " + " ".join(argv)
    path = write_result(result, args.out, args.name)
    print(json.dumps({k: v for k, v in result.items() if k != "args"}, indent=1))
    print(f"written: {path}")
    return 0 if result["all_match"] else 1
