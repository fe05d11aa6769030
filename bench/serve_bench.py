"""The serving benchmark: the real service driven through HTTP by the official `openai` client, beside the
engine alone on the same requests in the same run (issue 25 item 3), and stream smoothness (issue 26).

    python bench/serve_bench.py --model synthetic-8b --out OUT            # H200: synthetic Llama-3.1-8B
    python bench/serve_bench.py --model smollm2 --out OUT                 # the SmolLM2 GGUF ("default")
    python bench/serve_bench.py --model PATH.gguf --quick --out OUT       # any model the engine loads
    python bench/serve_bench.py --model synthetic:tiny:peaked --device cpu --quick --out OUT   # CPU smoke

On the GPU machine `bash bench/h200.sh serve` runs the synthetic 8B (full preset, --deadline-s 290) and SmolLM2
(--quick, --deadline-s 240) in one device call; on an H100 the 8B's run holds some 7,500 transcripts, and
--deadline-s skips the rate points that would not fit (saturation points first, then the rates mode by mode).

--model: synthetic-8b (= synthetic:llama-3.1-8b:peaked, the engine bench's peaked synthetic 8B: no natural
rollbacks), smollm2 (= default), or anything EngineConfig.model takes. --engine-option KEY=JSON passes an
EngineConfig field to both the service and the engine-alone run (default: none, the service's defaults).
Time: --deadline-s bounds the run (ramp points that would pass it are skipped and say so); --quick is a
shorter preset (shorter rate points). One run serves one model.

What a run does, in order:
1. The engine alone, in a child process (`--role engine`) that exits before the service starts, so each has
   the whole device: the engine as the service builds it (auditor.app.load_engine, in that process rather
   than in an engine process of its own, so that its EngineCore can be driven directly), and on it, per
   mode, the saturation set through EngineCore.step ("core": the engine bench's loop; the median of
   --core-repeats runs) and through AsyncEngine
   ("async": the service's engine thread without HTTP), then the issue-26 streams with per-token commit
   times. It also draws the request pool from the model's vocabulary.
2. The service: `python -m auditor keys create` (a client key) and `python -m auditor serve` on a free port,
   a fresh SQLite database and key ring in the work directory, every setting at its default except the
   rate limit (raised so that the bench never meets a 429) and the bootstrap admin key (not needed).
3. Through the API, from --clients worker processes (each one asyncio loop with an AsyncOpenAI client;
   streaming /v1/completions with token-id prompts, extra_body {"deterministic", "ignore_eos": true}):
   a warm-up, the issue-26 streams, then per mode a ramp of Poisson arrival rates and the saturation point
   (the saturation set sent at once, "infinite rate").
4. Checks: every transcript the run wrote (the Verbatim-Transcript-Id header of every request) is fetched
   with its content and verified offline by auditor.verify with the public JWKS (signature, hash-chain
   fields, checkpoint signature, inclusion, prompt / output commitments, window chain, logprob digest); its
   prompt ids, token count, text, deterministic flag and seed must be what was sent and streamed; the final
   checkpoint's signature verifies and its tree size equals the number of transcripts, whose log indices
   are exactly 0 .. size-1.

Requests: the engine bench's ShareGPT-like mix (bench/engine_bench/mixes.py: prompt and output lengths log-uniform,
--set sharegpt = prompts 16..512, outputs 16..128; sharegpt-PxO for other maxima), random token-id prompts,
max_tokens = the drawn output length with ignore_eos, temperature --temperature, top_p --top-p on a random
--top-p-share of the requests, seed = --seed + index. Modes (--det-shares): the share of deterministic
requests, spread evenly (request i is deterministic when floor((i+1)s) > floor(i s), so every prefix of the
pool holds the share). Rates: --rates, or --rate-fractions of the engine-alone "core" saturation req/s of the
first mode; a point sends rate x --point-s requests (clamped to --min/--max-point-requests) at exponential
gaps; the saturation point sends the saturation set, the same requests the engine alone ran:
--saturation-requests, grown in steps of 256 until one engine core run of it in the first mode lasts
--saturation-s (5 s; the faster of two core runs decides), so that admitting the requests and the last ones'
tail are a small part of the figure (the engine alone's "saturation_sizing" entry records the probe). Like the
engine core's, the service's saturation figure is the median of --service-repeats runs of the set (default
--core-repeats; "runs_tok_per_s" lists them), so that neither side's figure is a first run on its engine.

Metrics per point (times on the client, CLOCK_MONOTONIC shared by all processes): output tok/s and req/s
over the span from the first send to the last stream end; TTFT (send to the first chunk with text); the time
to the response's headers (send to headers: the client's send and connection, and the serving process's
authentication, parsing and tokenization, the request's way to the engine, which it is handed to as the headers
go out; the rest of TTFT is the engine's queue and first step and the chunk's way back);
end-to-end latency (send to the stream's end, after the transcript is recorded); TPOT per request (first to
last chunk over tokens - 1); inter-token latency: each chunk's gap to the previous chunk divided evenly over
its tokens (SGLang's convention: --itl-tokens text counts them by re-encoding the chunk's text, exact for the
synthetic word-level tokenizer; logprobs asks for logprobs=0 and counts exactly); chunk gaps: gaps between
consecutive chunks of a stream. Also the CPU the service and each client process used, as cores, and how the
engine's counters moved (the service's /metrics before and after the point; EngineStats around a core run):
steps, prefill / decode / verify passes, committed tokens and step seconds, whose share of the point's span is
"busy" (the engine loop's utilization), and the loop's command and publishing seconds ("commands": requests
added and aborts; "publish": handing out step messages; "idle": the rest of the span); each mode's saturation
entry sets these shares and steps per 100 tokens under the service beside the engine core's.

Streams (issue 26; logprobs=0 so every token's arrival is known): one stream alone (--stream-repeats times
per mode, modes alternating) and --stream-concurrency streams at once, --stream-tokens output tokens each,
deterministic and not. Per stream: the arrival time of every token, TTFT, end-to-end latency, chunk gaps; the
decode step is estimated as the mean per-token gap of the non-deterministic streams of the same run and
concurrency, and gaps are also given in decode steps. The engine alone reports the same with commit times.

Results (the JSON is rewritten after every phase, so a killed run keeps what it measured):
<out>/<name>.json, <out>/<name>.png (throughput against offered rate per mode; TTFT and end-to-end latency
CDFs) and <out>/<name>-streams.png (token arrival time against token index, one stream, both modes).
A phase that fails is recorded under "errors" (and an engine-alone part under its mode) and the others still
run; the exit status is 0 only when no phase failed and every check passed.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import datetime as dt
import inspect
import json
import math
import multiprocessing as mp
import os
import platform
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the source root on the path
    sys.path.insert(0, str(ROOT))

from bench.results import write_result_file  # noqa: E402

MODEL_ALIASES = {"synthetic-8b": "synthetic:llama-3.1-8b:peaked", "smollm2": "default"}
WARMUP_TOKENS = 4          # per request in the warm-ups (kernels compile for the prompt shapes there)
TENANT = "bench"
# Settings fields the bench sets for the service: the environment's own values would otherwise reach it
_SERVICE_ENV = ("MODEL", "DEVICE", "ENGINE_OPTIONS", "RATE_LIMIT_PER_SECOND", "RATE_LIMIT_BURST",
                "BOOTSTRAP_ADMIN", "DATABASE_URL", "DATABASE_SCHEMA", "DATA_DIR", "HOST", "PORT")

# Saturation: this many requests at once, several seconds of engine time, so that admitting them and the
# last requests' tail are a small part of the figure (it is the engine's and the service's steady state).
FULL = {"saturation_requests": 768, "rate_fractions": [0.3, 0.6, 0.9], "point_s": 4.0, "stream_repeats": 3,
        "max_point_requests": 1200}
QUICK = {"saturation_requests": 1024, "rate_fractions": [0.3, 0.6, 0.9], "point_s": 3.0, "stream_repeats": 3,
         "max_point_requests": 1200}


def log(msg: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- arguments ----------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/serve_bench.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="results folder (created)")
    p.add_argument("--name", help="results file stem (default serve-bench-<model>)")
    p.add_argument("--model", default="synthetic-8b", help="synthetic-8b, smollm2, or an EngineConfig.model")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--engine-option", action="append", default=[], metavar="KEY=JSON",
                   help="an EngineConfig field for the service and the engine alone (default: none)")
    p.add_argument("--quick", action="store_true", help=f"shorter preset: {QUICK}")
    p.add_argument("--set", default="sharegpt", help="request mix: sharegpt or sharegpt-PxO (bench.engine_bench.mixes)")
    p.add_argument("--det-shares", type=_floats, default=[0.0, 0.1, 1.0], help="deterministic shares (modes)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--top-p-share", type=float, default=0.5, help="share of requests sent with --top-p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--saturation-requests", type=int, help=f"the saturation set's size at least (default "
                   f"{FULL['saturation_requests']}; grown to last --saturation-s)")
    p.add_argument("--saturation-s", type=float, default=5.0,
                   help="grow the saturation set (in steps of 256 requests) until the engine core's run of it in "
                        "the first mode lasts this long (0: never)")
    p.add_argument("--core-repeats", type=int, default=3,
                   help="runs of the saturation set through the engine core per mode (the median run is the "
                        "figure; all runs' tok/s are recorded)")
    p.add_argument("--service-repeats", type=int, default=None,
                   help="runs of the saturation set through the service per mode, like the engine core's (the "
                        "median run is the figure; all runs' tok/s are recorded; default: --core-repeats)")
    p.add_argument("--rates", type=_floats, default=None, help="request rates (req/s); default: --rate-fractions")
    p.add_argument("--rate-fractions", type=_floats, help="of the engine-alone saturation req/s "
                   f"(default {FULL['rate_fractions']})")
    p.add_argument("--point-s", type=float, help=f"arrival window of a rate point (default {FULL['point_s']})")
    p.add_argument("--min-point-requests", type=int, default=8)
    p.add_argument("--max-point-requests", type=int, help=f"default {FULL['max_point_requests']}")
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--stream-prompt-tokens", type=int, default=128)
    p.add_argument("--stream-repeats", type=int, help=f"single-stream runs per mode (default {FULL['stream_repeats']})")
    p.add_argument("--stream-concurrency", type=int, default=8)
    p.add_argument("--no-streams", dest="streams", action="store_false", help="skip the issue-26 streams")
    p.add_argument("--no-engine-async", dest="engine_async", action="store_false",
                   help="skip the engine-alone runs through AsyncEngine")
    p.add_argument("--itl-tokens", default="text", choices=["text", "logprobs"],
                   help="how the ramp counts the tokens of a chunk (streams always use logprobs)")
    p.add_argument("--clients", type=int, default=max(1, min(8, (os.cpu_count() or 1) // 2)),
                   help="client worker processes")
    p.add_argument("--verify-concurrency", type=int, default=8, help="transcript fetches in flight per client")
    p.add_argument("--deadline-s", type=float, default=480.0, help="the whole run")
    p.add_argument("--ready-timeout-s", type=float, default=300.0, help="service start-up")
    p.add_argument("--work-dir", help="database, keys, logs (default: a temporary folder, removed)")
    p.add_argument("--git-commit", help="the tree's commit, where the copy run has no .git (default: git rev-parse)")
    p.add_argument("--resummarize", metavar="FILE", help="recompute FILE's stream summaries and targets from the "
                   "streams it recorded (this code's summary) and rewrite it; runs nothing")
    p.add_argument("--role", default="bench", choices=["bench", "engine"], help=argparse.SUPPRESS)
    p.add_argument("--plan", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.role == "bench" and not args.out and not args.resummarize:
        raise SystemExit("--out is required")
    for share in args.det_shares:
        if not 0.0 <= share <= 1.0:
            raise SystemExit(f"--det-shares: each share must be in [0, 1], got {share}")
    return args


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def engine_options(pairs: list[str]) -> dict[str, Any]:
    """--engine-option KEY=JSON pairs -> EngineConfig keyword arguments (a bare word is a string)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--engine-option: expected KEY=VALUE, got {pair!r}")
        try:
            out[key] = json.loads(raw)
        except ValueError:
            out[key] = raw
    return out


def mode_name(share: float) -> str:
    return f"dvr_{round(share * 100):g}pct"


def deterministic_flags(n: int, share: float) -> list[bool]:
    """Request i is deterministic when floor((i+1)*share) > floor(i*share): every prefix holds the share."""
    return [math.floor((i + 1) * share + 1e-9) > math.floor(i * share + 1e-9) for i in range(n)]


# ---- the engine alone (child process) -------------------------------------------------------------
def engine_role(plan_path: str, result_path: str) -> int:
    """Load the service's engine, draw the request pool, run the engine-alone figures, write the result."""
    plan = json.loads(Path(plan_path).read_text())
    out_path = Path(result_path)
    from auditor.app import load_engine
    from auditor.settings import Settings
    from engine.placement import place_engine_here

    t0 = time.monotonic()
    cpus = place_engine_here(plan["device"])  # where the service places its engine process
    # in this process (its EngineCore is driven directly); the service runs its engine in a process of its own
    engine = load_engine(Settings(model=plan["model"], device=plan["device"], engine_process=False,
                                  engine_options=plan["engine_options"]))
    core = engine.core
    vocab = min(core.shape.vocab_size, len(engine.tokenizer))
    tokenizer_dir = Path(plan["work_dir"]) / "tokenizer"
    engine.tokenizer.save_pretrained(str(tokenizer_dir))
    result: dict[str, Any] = {
        "load_s": round(time.monotonic() - t0, 2), "device": device_info(core.config), "engine_cpus": cpus,
        "engine_config": config_json(core.config), "graphs": getattr(core.runner, "graphs_status", None),
        "model": model_info_json(engine.model_info), "tokenizer_json": str(tokenizer_dir / "tokenizer.json"),
        "requests": request_pool(plan, vocab), "stream_prompts": stream_prompts(plan, vocab), "modes": {},
    }
    write_result_file(result, out_path)
    log(f"engine loaded in {result['load_s']} s on {result['device']['name']}; graphs {result['graphs']}")
    plan["saturation_requests"] = size_saturation(core, plan, result, vocab)
    write_result_file(result, out_path)
    sat = result["requests"][:plan["saturation_requests"]]
    for share in plan["det_shares"]:
        entry = result["modes"][mode_name(share)] = {"deterministic_share": share}
        det = deterministic_flags(len(sat), share)
        with recorded(entry, "core_error"):
            _warm_core(core, sat, det, plan)
            runs = [core_run(core, sat, det, plan, f"{mode_name(share)}-core-{i}")
                    for i in range(plan["core_repeats"])]
            run = entry["core"] = {**sorted(runs, key=lambda r: r["output_tok_per_s"])[len(runs) // 2],
                                   "runs_tok_per_s": [round(r["output_tok_per_s"], 1) for r in runs]}
            log(f"engine alone {mode_name(share)} (core): {run['output_tok_per_s']:.0f} tok/s, "
                f"{run['req_per_s']:.1f} req/s, {run['seconds']:.2f} s (median of {run['runs_tok_per_s']})")
        write_result_file(result, out_path)
    with recorded(result, "async_error"):
        asyncio.run(_engine_async_phase(engine, plan, result, out_path))
    write_result_file(result, out_path)
    return 0


def size_saturation(core: Any, plan: dict[str, Any], result: dict[str, Any], vocab: int) -> int:
    """The saturation set's size: --saturation-requests, grown in steps of 256 until the first mode's engine
    core run lasts --saturation-s (a run of a second or two is mostly its ramp and tail, and moves by a third
    between runs). Measured by the faster of two core runs of the given set after a warm-up (the first full
    run on a fresh engine is the slowest); the pool grows to fit."""
    n, target = plan["saturation_requests"], plan.get("saturation_s") or 0.0
    if not target:
        result["saturation"] = {"target_s": 0.0, "requests": n}
        return n
    share = plan["det_shares"][0]
    sat = result["requests"][:n]
    det = deterministic_flags(len(sat), share)
    _warm_core(core, sat, det, plan)
    runs = [core_run(core, sat, det, plan, f"sizing-{i}") for i in range(2)]
    probe = min(runs, key=lambda r: r["seconds"])
    sizing = {"mode": mode_name(share), "requests_probed": len(sat), "probe_seconds": probe["seconds"],
              "probe_runs_s": [r["seconds"] for r in runs], "target_s": target, "requests": n}
    if 0 < probe["seconds"] < target and not probe["capped"]:
        n = sizing["requests"] = 256 * math.ceil(n * target / probe["seconds"] / 256)
        if n > len(result["requests"]):
            result["requests"] = request_pool({**plan, "pool_size": n}, vocab)
    result["saturation"] = sizing
    log(f"saturation set: {n} requests (a core run of {len(sat)} took {probe['seconds']:.2f} s; "
        f"target {target:g} s)")
    return n


@contextlib.contextmanager
def recorded(doc: dict[str, Any], key: str) -> Iterator[None]:
    """Run the block; an exception is logged with its traceback and recorded under doc[key], and the run
    goes on (one device call must not lose every figure to one failing part)."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - recorded in the result, reported by the exit status
        traceback.print_exc()
        doc[key] = f"{type(exc).__name__}: {exc}"[:2000]
        log(f"{key}: {doc[key][:300]}")


def device_info(config: Any) -> dict[str, Any]:
    import torch

    device = config.torch_device
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"type": "cuda", "name": torch.cuda.get_device_name(device),
                "total_memory_gib": round(props.total_memory / 2**30, 1), "torch": torch.__version__,
                "cuda": torch.version.cuda}
    from engine.fingerprint import cpu_model

    return {"type": "cpu", "name": cpu_model(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def config_json(config: Any) -> dict[str, Any]:
    return {k: (v.value if hasattr(v, "value") else v) for k, v in dataclasses.asdict(config).items()}


def model_info_json(info: Any) -> dict[str, Any]:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(info).items()}


def request_pool(plan: dict[str, Any], vocab: int) -> list[dict[str, Any]]:
    """The ShareGPT-like mix of the engine benchmark (same length seeds), random prompts, per-request top_p."""
    import torch

    from bench.engine_bench.mixes import MIX_LO, parse_set_spec, sharegpt_like_lengths

    kind, _, nums = parse_set_spec(plan["set"], 128)
    if kind != "mix":
        raise ValueError(f"--set: a ShareGPT-like mix (sharegpt or sharegpt-PxO), got {plan['set']!r}")
    n = plan["pool_size"]
    in_lens, out_lens = sharegpt_like_lengths(n, 11, MIX_LO, nums[0]), sharegpt_like_lengths(n, 13, MIX_LO, nums[1])
    gen = torch.Generator().manual_seed(3 + plan["seed"])
    rng = random.Random(plan["seed"])
    return [{"i": i, "prompt": torch.randint(0, vocab, (p,), generator=gen).tolist(), "max_tokens": o,
             "seed": plan["seed"] + i, "top_p": plan["top_p"] if rng.random() < plan["top_p_share"] else 1.0}
            for i, (p, o) in enumerate(zip(in_lens, out_lens))]


def stream_prompts(plan: dict[str, Any], vocab: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(17 + plan["seed"])
    return [torch.randint(0, vocab, (plan["stream_prompt_tokens"],), generator=gen).tolist()
            for _ in range(max(1, plan["stream_concurrency"]))]


def sampling_params(req: dict[str, Any], det: bool, plan: dict[str, Any], max_tokens: int | None = None,
                    logprobs: int | None = None) -> Any:
    """The SamplingParams the service builds from the same API request (auditor.service.prepare)."""
    from engine.sampling import SamplingParams

    return SamplingParams(max_tokens=max_tokens or req["max_tokens"], temperature=plan["temperature"],
                          top_p=req["top_p"], seed=req["seed"], ignore_eos=True, logprobs=logprobs,
                          deterministic=det)


def _warm_core(core: Any, reqs: list[dict[str, Any]], det: list[bool], plan: dict[str, Any]) -> None:
    seqs = [core.add_request(f"warm-{time.monotonic_ns()}-{k}", r["prompt"],
                             sampling_params(r, d, plan, max_tokens=WARMUP_TOKENS))
            for k, (r, d) in enumerate(zip(reqs, det))]
    while any(not s.is_finished for s in seqs) or core.has_work():
        core.step()


def core_run(core: Any, reqs: list[dict[str, Any]], det: list[bool], plan: dict[str, Any],
             tag: str) -> dict[str, Any]:
    """All requests at once through EngineCore.step (the engine bench's loop): throughput, TTFT, latency."""
    before = dataclasses.asdict(core.stats())
    seqs = [core.add_request(f"{tag}-{k}", r["prompt"], sampling_params(r, d, plan))
            for k, (r, d) in enumerate(zip(reqs, det))]
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    pending = list(seqs)
    t0 = time.monotonic()
    while pending and time.monotonic() - t0 < plan["engine_cap_s"]:
        core.step()
        now = time.monotonic() - t0
        for s in pending:
            if s.tokens and s.request_id not in first:
                first[s.request_id] = now
            if s.is_finished:
                done[s.request_id] = now
        pending = [s for s in pending if not s.is_finished]
    seconds = time.monotonic() - t0
    counters = engine_delta(before, dataclasses.asdict(core.stats()), seconds)
    for s in pending:  # a capped run's leftovers must not ride into the next run
        core.abort(s.request_id)
    while core.has_work():
        core.step()
    tokens = sum(len(s.tokens) for s in seqs)
    return {"requests": len(seqs), "finished": len(done), "seconds": round(seconds, 4), "output_tokens": tokens,
            "output_tok_per_s": tokens / seconds, "req_per_s": len(done) / seconds,
            "ttft_s": dist(list(first.values())), "e2e_s": dist(list(done.values())),
            "capped": bool(pending), "engine": counters}


async def _engine_async_phase(engine: Any, plan: dict[str, Any], result: dict[str, Any], out_path: Path) -> None:
    """The saturation sets and the streams through AsyncEngine.generate (its engine thread, no HTTP)."""
    await engine.start()
    try:
        sat = result["requests"][:plan["saturation_requests"]]
        for share in plan["det_shares"] if plan["engine_async"] else []:
            det = deterministic_flags(len(sat), share)
            specs = [(r["prompt"], sampling_params(r, d, plan)) for r, d in zip(sat, det)]
            records = await _async_records(engine, specs, f"{mode_name(share)}-async")
            point = point_metrics(records)
            point.pop("samples")
            result["modes"][mode_name(share)]["async"] = point
            write_result_file(result, out_path)
            log(f"engine alone {mode_name(share)} (async): {point['output_tok_per_s']:.0f} tok/s")
        if plan["streams"]:
            async def run(prompts: list[list[int]], det: bool, tag: str) -> list[dict[str, Any]]:
                specs = [(p, sampling_params(stream_request(plan, k), det, plan, logprobs=0))
                         for k, p in enumerate(prompts)]
                return await _async_records(engine, specs, tag)

            result["streams"] = await stream_runs(run, result["stream_prompts"], plan)
            write_result_file(result, out_path)
            log(f"engine alone streams: {stream_line(result['streams']['summary'])}")
    finally:
        await engine.shutdown()


async def _async_records(engine: Any, specs: list[tuple[list[int], Any]], tag: str) -> list[dict[str, Any]]:
    """Submit every (prompt, params) at once; one record per request with its commit times."""
    t_send = time.monotonic()

    async def one(k: int, prompt: list[int], params: Any) -> dict[str, Any]:
        chunks: list[list[float]] = []
        count = 0
        async for out in engine.generate(prompt, params, request_id=f"{tag}-{k}-{time.monotonic_ns()}"):
            if len(out.token_ids) > count:
                chunks.append([time.monotonic(), len(out.token_ids) - count])
                count = len(out.token_ids)
        return {"t_send": t_send, "t_end": time.monotonic(), "chunks": chunks, "completion_tokens": count}

    return list(await asyncio.gather(*(one(k, p, params) for k, (p, params) in enumerate(specs))))


# ---- the issue-26 streams (shared by the engine alone and the API) ----------------------------------
def stream_request(plan: dict[str, Any], k: int) -> dict[str, Any]:
    return {"max_tokens": plan["stream_tokens"], "top_p": 1.0, "seed": plan["seed"] + 1_000_000 + k}


StreamRunner = Callable[[list[list[int]], bool, str], Any]


async def stream_runs(run: StreamRunner, prompts: list[list[int]], plan: dict[str, Any]) -> dict[str, Any]:
    """One stream alone (repeats alternate the modes) and N streams at once, each mode; the summary."""
    out: dict[str, Any] = {"stream_tokens": plan["stream_tokens"], "prompt_tokens": plan["stream_prompt_tokens"],
                           "single": {"nondeterministic": [], "deterministic": []},
                           "concurrent": {}, "concurrency": plan["stream_concurrency"]}
    for rep in range(plan["stream_repeats"]):
        for det in (False, True):
            records = await run(prompts[:1], det, f"s1-{rep}-{det}")
            out["single"][_det_key(det)].append(stream_stats(records[0]))
    if plan["stream_concurrency"] > 1:
        for det in (False, True):
            records = await run(prompts[:plan["stream_concurrency"]], det, f"s{plan['stream_concurrency']}-{det}")
            out["concurrent"][_det_key(det)] = [stream_stats(r) for r in records]
    out["summary"] = stream_summary(out)
    return out


def _det_key(det: bool) -> str:
    return "deterministic" if det else "nondeterministic"


def stream_stats(rec: dict[str, Any]) -> dict[str, Any]:
    """One stream: TTFT, end-to-end, chunk gaps, per-token gaps and each token's arrival (s after send)."""
    if rec.get("error") or not rec.get("chunks"):
        return {"error": rec.get("error") or "no tokens"}
    t0 = rec["t_send"]
    times = [t for t, _ in rec["chunks"]]
    gaps = [b - a for a, b in zip(times, times[1:])]
    arrivals = [round(t - t0, 5) for t, n in rec["chunks"] for _ in range(int(n))]
    return {"ttft_s": times[0] - t0, "e2e_s": rec["t_end"] - t0, "last_token_s": times[-1] - t0,
            "tokens": len(arrivals), "chunks": len(times), "max_chunk_gap_s": max(gaps, default=0.0),
            "chunk_gaps_s": [round(g, 5) for g in gaps],
            "token_gaps_s": [round(g / n, 6) for g, (_, n) in zip(gaps, rec["chunks"][1:]) for _ in range(int(n))],
            "token_arrival_s": arrivals}


def stream_summary(runs: dict[str, Any]) -> dict[str, Any]:
    """Issue 26's figures: deterministic against non-deterministic, gaps in decode steps (the step is the
    mean per-token gap of the non-deterministic streams at the same concurrency: each of them takes one token a
    step, and their chunks may arrive bunched, several streams' at once, which takes the median to ~0)."""
    out: dict[str, Any] = {}
    single = {k: [s for s in v if "error" not in s] for k, v in runs["single"].items()}
    if single["nondeterministic"] and single["deterministic"]:
        step = _mean_gap(single["nondeterministic"])
        med = {k: {f: median([s[f] for s in v]) for f in ("ttft_s", "e2e_s", "max_chunk_gap_s", "chunks")}
               for k, v in single.items()}
        out["single"] = {**med, "decode_step_s": step,
                         "e2e_ratio": _ratio(med["deterministic"]["e2e_s"], med["nondeterministic"]["e2e_s"]),
                         "ttft_ratio": _ratio(med["deterministic"]["ttft_s"], med["nondeterministic"]["ttft_s"]),
                         "max_gap_steps": {k: _ratio(max(s["max_chunk_gap_s"] for s in v), step)
                                           for k, v in single.items()}}
    conc = {k: [s for s in v if "error" not in s] for k, v in runs["concurrent"].items()}
    if conc.get("nondeterministic") and conc.get("deterministic"):
        step = _mean_gap(conc["nondeterministic"])
        agg = {k: {"ttft_s": median([s["ttft_s"] for s in v]), "e2e_s": median([s["e2e_s"] for s in v]),
                   "chunk_gap_s": dist([g for s in v for g in s["chunk_gaps_s"]])} for k, v in conc.items()}
        out["concurrent"] = {**agg, "decode_step_s": step,
                             "e2e_ratio": _ratio(agg["deterministic"]["e2e_s"], agg["nondeterministic"]["e2e_s"]),
                             "ttft_ratio": _ratio(agg["deterministic"]["ttft_s"], agg["nondeterministic"]["ttft_s"]),
                             "p99_gap_steps": {k: _ratio(v["chunk_gap_s"]["p99"], step) for k, v in agg.items()},
                             "max_gap_steps": {k: _ratio(v["chunk_gap_s"]["max"], step) for k, v in agg.items()}}
    return out


def _mean_gap(streams: list[dict[str, Any]]) -> float | None:
    gaps = [g for s in streams for g in s["token_gaps_s"]]
    return sum(gaps) / len(gaps) if gaps else None


def stream_line(summary: dict[str, Any]) -> str:
    """The issue-26 figures on one line (deterministic against non-deterministic)."""
    parts = []
    for kind in ("single", "concurrent"):
        s = summary.get(kind)
        if s:
            gaps = s.get("p99_gap_steps") or s["max_gap_steps"]
            parts.append(f"{kind}: e2e x{fmt(s['e2e_ratio'], 3)}, TTFT x{fmt(s['ttft_ratio'], 3)}, step "
                         f"{fmt(s['decode_step_s'] and 1e3 * s['decode_step_s'], 2)} ms, "
                         f"{'p99' if 'p99_gap_steps' in s else 'max'} gap {fmt(gaps['deterministic'], 1)} / "
                         f"{fmt(gaps['nondeterministic'], 1)} steps (det / non-det)")
    return "; ".join(parts) or "-"


# ---- statistics -------------------------------------------------------------------------------------
def pct(values: Sequence[float], p: float) -> float | None:
    """Nearest-rank percentile (the engine benchmark's rule, bench.engine_bench.common.percentile)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def median(values: Sequence[float]) -> float | None:
    return pct(values, 50)


def dist(values: Sequence[float]) -> dict[str, float | int | None]:
    return {"n": len(values), "mean": sum(values) / len(values) if values else None, "p50": pct(values, 50),
            "p90": pct(values, 90), "p99": pct(values, 99), "max": max(values) if values else None}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def point_metrics(records: list[dict[str, Any]]) -> dict[str, Any]:
    """One load point: throughput over the span first send .. last stream end, and the latency figures."""
    ok = [r for r in records if not r.get("error") and r.get("chunks")]
    ttft, e2e, itl, gaps, tpot, headers = [], [], [], [], [], []
    for r in ok:
        times = [t for t, _ in r["chunks"]]
        ttft.append(times[0] - r["t_send"])
        if "t_headers" in r:  # through the API (the engine alone's records have no headers)
            headers.append(r["t_headers"] - r["t_send"])
        e2e.append(r["t_end"] - r["t_send"])
        step_gaps = [b - a for a, b in zip(times, times[1:])]
        gaps += step_gaps
        itl += [g / max(1, n) for g, (_, n) in zip(step_gaps, r["chunks"][1:]) for _ in range(max(1, int(n)))]
        if r["completion_tokens"] > 1:
            tpot.append((times[-1] - times[0]) / (r["completion_tokens"] - 1))
    span = (max(r["t_end"] for r in ok) - min(r["t_send"] for r in records)) if ok else 0.0
    tokens = sum(r["completion_tokens"] for r in ok)
    return {"requests": len(records), "completed": len(ok), "errors": len(records) - len(ok),
            "first_errors": [r["error"] for r in records if r.get("error")][:5],
            "seconds": span, "output_tokens": tokens, "output_tok_per_s": tokens / span if span else 0.0,
            "req_per_s": len(ok) / span if span else 0.0, "ttft_s": dist(ttft), "headers_s": dist(headers),
            "e2e_s": dist(e2e),
            "tpot_s": dist(tpot), "itl_s": dist(itl), "chunk_gap_s": dist(gaps),
            "samples": {"ttft_s": [round(x, 5) for x in ttft], "e2e_s": [round(x, 5) for x in e2e]}}


def poisson_offsets(count: int, rate: float, seed: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process of `rate` req/s; all zero for an infinite rate."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- the service --------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment, the source root first on PYTHONPATH, the service settings the bench owns removed."""
    env = {k: v for k, v in os.environ.items() if k.removeprefix("VERBATIM_") not in _SERVICE_ENV
           or not k.startswith("VERBATIM_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update(extra or {})
    return env


class Service:
    """`python -m auditor serve` in a child process: SQLite and keys in `data_dir`, the log in `log_path`."""

    def __init__(self, data_dir: Path, log_path: Path, model: str, device: str, options: dict[str, Any]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.data_dir, self.log_path = data_dir, log_path
        settings = {"VERBATIM_MODEL": model, "VERBATIM_DEVICE": device, "VERBATIM_BOOTSTRAP_ADMIN": "false",
                    # the bench is one tenant sending hundreds of requests a second: never a 429
                    "VERBATIM_RATE_LIMIT_PER_SECOND": "1000000", "VERBATIM_RATE_LIMIT_BURST": "1000000"}
        if options:
            settings["VERBATIM_ENGINE_OPTIONS"] = json.dumps(options)
        self.env = child_env(settings)
        self.proc: subprocess.Popen[bytes] | None = None
        self.key = ""
        self.settings = {k: v for k, v in settings.items()}

    def create_key(self) -> str:
        done = subprocess.run([sys.executable, "-m", "auditor", "keys", "create", "--tenant", TENANT, "--role",
                               "client", "--name", "serve-bench", "--data-dir", str(self.data_dir)],
                              cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"keys create failed ({done.returncode}): {done.stderr[-2000:]}")
        self.key = done.stdout.strip().splitlines()[-1]
        return self.key

    def start(self, timeout_s: float) -> float:
        """Start and wait for /readyz; returns the seconds it took."""
        t0 = time.monotonic()
        with self.log_path.open("wb") as sink:
            self.proc = subprocess.Popen([sys.executable, "-m", "auditor", "serve", "--data-dir", str(self.data_dir),
                                          "--port", str(self.port)], cwd=ROOT, env=self.env, stdout=sink,
                                         stderr=subprocess.STDOUT)
        while time.monotonic() - t0 < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the service exited with {self.proc.returncode}:\n{self.log_tail()}")
            status, body = http_json(f"{self.url}/readyz")
            if status == 200:
                return time.monotonic() - t0
            if isinstance(body, dict) and body.get("engine_error"):
                raise RuntimeError(f"the service's engine failed: {body['engine_error']}\n{self.log_tail()}")
            time.sleep(0.25)
        raise RuntimeError(f"the service was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def cpu_seconds(self) -> float | None:
        """User + system CPU of the service: its process and every process it started (the engine process, the
        HTTP workers), all their threads."""
        if self.proc is None:
            return None
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return None
        total = 0.0
        for proc in procs:
            try:
                times = proc.cpu_times()
            except psutil.Error:
                continue
            total += times.user + times.system
        return total

    def stop(self) -> int | None:
        """SIGINT (uvicorn's graceful shutdown), then SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=30)

    def environment(self) -> dict[str, str]:
        """The service's settings from its environment: the bench's, and any VERBATIM_* this run inherited."""
        return {**{k: v for k, v in self.env.items() if k.startswith("VERBATIM_")}, **self.settings}

    def workers(self) -> int | None:
        """The HTTP worker processes `serve` started (its start-up line; 1 when it names none)."""
        try:
            head = self.log_path.read_text(errors="replace")[:20000]
        except OSError:
            return None
        found = re.search(r"with (\d+) worker processes", head)
        return int(found.group(1)) if found else 1

    def process_cpus(self) -> list[list[int]] | None:
        """The CPUs each of the service's processes may run on (serve, then the processes it started, sorted):
        with its engine placed, one process (the engine's) has a set of its own."""
        if self.proc is None:
            return None
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            started = sorted(sorted(p.cpu_affinity()) for p in root.children(recursive=True))
            return [sorted(root.cpu_affinity()), *started]
        except (psutil.Error, AttributeError):
            return None

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


ENGINE_COUNTERS = ("steps", "prefill_passes", "decode_passes", "verify_passes", "generated_tokens", "step_seconds",
                   "command_seconds", "publish_seconds")
"""The engine's counters a point and a core run record the change of (EngineStats; the service's /metrics)."""


def engine_delta(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
    """How ENGINE_COUNTERS moved over a run of `seconds`, and the shares of those seconds the engine loop spent in
    its steps ("busy": step_seconds / seconds), on its commands ("commands": requests added, aborts) and handing
    out its steps' outputs ("publish"): the rest ("idle") it waited for work with none, or ran the loop itself.
    The three grow only while the engine has requests to take or to run, so counters read around a run time the
    run alone."""
    delta: dict[str, Any] = {k: after[k] - before[k] for k in ENGINE_COUNTERS if k in before and k in after}
    for counter, share in (("step_seconds", "busy"), ("command_seconds", "commands"), ("publish_seconds", "publish")):
        if counter in delta:
            delta[counter] = round(delta[counter], 4)
            delta[share] = round(delta[counter] / seconds, 4) if seconds > 0 else None
    if all(share in delta for share in ("busy", "commands", "publish")) and seconds > 0:
        delta["idle"] = round(max(0.0, 1.0 - delta["busy"] - delta["commands"] - delta["publish"]), 4)
    return delta


def engine_counters(url: str) -> dict[str, float]:
    """The engine's counters as the service's /metrics gives them (verbatim_engine_<name>_total); {} when it
    does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:  # noqa: S310 - our local service
            text = response.read().decode()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return {}
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = family.name.removeprefix("verbatim_engine_")
        if name in ENGINE_COUNTERS and name != family.name:
            values.update({name: sample.value for sample in family.samples if sample.name == f"{family.name}_total"})
    return values


def http_json(url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> tuple[int, Any]:
    """(status, parsed JSON body or None); (0, None) when nothing answers."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - our local service
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as exc:
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return 0, None


# ---- client worker processes --------------------------------------------------------------------------
class Clients:
    """--clients worker processes; each task is split across them and every worker gets its part."""

    def __init__(self, count: int) -> None:
        ctx = mp.get_context("spawn")  # no inherited locks or event loops; the workers never import torch
        self.conns, self.procs = [], []
        for _ in range(count):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, kind: str, common: dict[str, Any], items: list[Any],
            only_first: bool = False) -> tuple[list[Any], list[dict[str, float]]]:
        """Items dealt round-robin (or all to the first worker); (all results in item order, per-worker CPU)."""
        workers = 1 if only_first else len(self.conns)
        parts = [items[w::workers] for w in range(workers)]
        for w in range(workers):
            self.conns[w].send({"kind": kind, **common, "items": parts[w]})
        replies = [self.conns[w].recv() for w in range(workers)]
        for reply in replies:
            if "error" in reply:
                raise RuntimeError(f"client worker failed: {reply['error']}")
        results: list[Any] = [None] * len(items)
        for w, reply in enumerate(replies):
            results[w::workers] = reply["result"]
        usage = [{"cpu_s": r["cpu_s"], "wall_s": r["wall_s"], "cores": r["cpu_s"] / r["wall_s"] if r["wall_s"] else 0.0}
                 for r in replies]
        return results, usage

    def close(self) -> None:
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a worker already gone (a signal to the process group)
                conn.send(None)
        for proc in self.procs:
            proc.join(timeout=10)


def _worker_main(conn: Any) -> None:
    cache: dict[str, Any] = {}
    while True:
        task = conn.recv()
        if task is None:
            return
        cpu0, wall0 = time.process_time(), time.monotonic()
        try:
            result = asyncio.run(_TASKS[task["kind"]](task, cache))
            reply = {"result": result}
        except Exception as exc:  # noqa: BLE001 - the parent reports it with the run
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        conn.send({**reply, "cpu_s": time.process_time() - cpu0, "wall_s": time.monotonic() - wall0})


def _token_counter(task: dict[str, Any], cache: dict[str, Any]) -> Callable[[Any], int]:
    """Tokens in one streamed choice: exact from logprobs=0, else the chunk's text re-encoded."""
    if task["count"] == "logprobs":
        return lambda choice: len(choice.logprobs.tokens) if choice.logprobs and choice.logprobs.tokens else 0
    path = task["tokenizer_json"]
    if path not in cache:
        from tokenizers import Tokenizer

        cache[path] = Tokenizer.from_file(path)
    tok = cache[path]
    return lambda choice: len(tok.encode(choice.text, add_special_tokens=False).ids) if choice.text else 0


async def _load_task(task: dict[str, Any], cache: dict[str, Any]) -> list[dict[str, Any]]:
    import openai

    count = _token_counter(task, cache)
    client = openai.AsyncOpenAI(base_url=task["base_url"] + "/v1", api_key=task["key"], max_retries=0, timeout=900)
    try:
        return list(await asyncio.gather(*(_stream_one(client, task, spec, count) for spec in task["items"])))
    finally:
        await client.close()


async def _stream_one(client: Any, task: dict[str, Any], spec: dict[str, Any],
                      count: Callable[[Any], int]) -> dict[str, Any]:
    """One streamed completion at its scheduled time: chunk arrival times and token counts, the transcript."""
    delay = spec["t_start"] - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    rec: dict[str, Any] = {"t_sched": spec["t_start"], "t_send": time.monotonic(), "chunks": [], "text": "",
                           "completion_tokens": 0, "transcript_id": None, "log_index": None, "error": None}
    pieces: list[str] = []
    try:
        raw = await client.completions.with_raw_response.create(
            model=task["model"], prompt=spec["prompt"], max_tokens=spec["max_tokens"],
            temperature=task["temperature"], top_p=spec["top_p"], seed=spec["seed"], stream=True,
            **({"logprobs": 0} if task["count"] == "logprobs" else {}),
            extra_body={"deterministic": spec["det"], "ignore_eos": True})
        rec["t_headers"] = time.monotonic()  # the service prepared the request: generation starts now
        rec["transcript_id"] = raw.headers.get("verbatim-transcript-id")
        stream = raw.parse()
        stream = await stream if inspect.isawaitable(stream) else stream
        async for chunk in stream:
            now = time.monotonic()
            for choice in chunk.choices:
                n = count(choice)
                if n or choice.text:
                    rec["chunks"].append([now, n])
                    pieces.append(choice.text)
            extra = chunk.model_extra or {}
            if extra.get("transcript"):
                rec["log_index"] = extra["transcript"]["log_index"]
            if chunk.usage is not None:
                rec["completion_tokens"] = chunk.usage.completion_tokens
    except Exception as exc:  # noqa: BLE001 - recorded per request, counted as an error of the point
        rec["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    rec["t_end"] = time.monotonic()
    rec["text"] = "".join(pieces)
    if rec["error"] is None and rec["log_index"] is None:
        rec["error"] = "the stream ended without its transcript chunk"
    return rec


async def _verify_task(task: dict[str, Any], cache: dict[str, Any]) -> list[dict[str, Any]]:
    """Fetch each transcript with its content and verify it offline (auditor.verify) with the JWKS."""
    import httpx

    gate = asyncio.Semaphore(task["concurrency"])
    headers = {"Authorization": f"Bearer {task['key']}"}
    async with httpx.AsyncClient(base_url=task["base_url"], headers=headers, timeout=120) as http:
        async def one(item: dict[str, Any]) -> dict[str, Any]:
            async with gate:
                response = await http.get(f"/v1/transcripts/{item['id']}", params={"include_content": "true"})
            if response.status_code != 200:
                return {"id": item["id"], "ok": False,
                        "problems": [f"GET {response.status_code}: {response.text[:200]}"]}
            return check_transcript(response.json(), item, task["jwks"])

        return list(await asyncio.gather(*(one(item) for item in task["items"])))


def check_transcript(doc: dict[str, Any], expected: dict[str, Any], jwks: dict[str, Any]) -> dict[str, Any]:
    """auditor.verify's checks, and the content against what the bench sent and received."""
    from auditor.verify import verify_document

    report = verify_document(doc, jwks, source=f"transcript {expected['id']}")
    problems = [f"{c.name}: {c.detail}" for c in report.failures()]
    summary = doc.get("transcript", {})
    wanted = {"prompt_token_ids": (doc.get("prompt_token_ids"), expected["prompt"]),
              "completion_tokens": (len(doc.get("token_ids") or []), expected["completion_tokens"]),
              "deterministic": (summary.get("deterministic"), expected["deterministic"]),
              "seed": (str(summary.get("seed")), str(expected["seed"])),
              "status": (summary.get("status"), "completed")}
    if expected.get("text") is not None:
        wanted["output_text"] = (doc.get("output_text"), expected["text"])
    problems += [f"{name}: transcript has {got!r:.80}, the bench {want!r:.80}"
                 for name, (got, want) in wanted.items() if got != want]
    return {"id": expected["id"], "ok": not problems, "signature_checks": len(report.checks),
            "log_index": summary.get("log_index"), "problems": problems}


_TASKS = {"load": _load_task, "verify": _verify_task}


# ---- the run ------------------------------------------------------------------------------------------
class Run:
    """One benchmark run: its arguments, clock, result document and everything sent through the API."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.t0 = time.monotonic()
        self.model = MODEL_ALIASES.get(args.model, args.model)
        self.options = engine_options(args.engine_option)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        slug = "".join(c if c.isalnum() or c in "-." else "-" for c in args.model.split("/")[-1]).strip("-")
        self.name = args.name or f"serve-bench-{slug}"
        self.json_path = self.out / f"{self.name}.json"
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="serve-bench-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.sent: list[dict[str, Any]] = []   # every request sent to the service: what its transcript must hold
        self.result: dict[str, Any] = {"environment": environment(args), "model": self.model,
                                       "engine_options": self.options, "checks": {}, "errors": {}}
        self.engine: dict[str, Any] = {}
        # the client processes, the database and the API key need no device: made while the engine runs alone
        self.clients = Clients(args.clients)
        self.service = Service(self.work / "data", self.work / "service.log", self.model, args.device, self.options)
        self.key_maker = ThreadPoolExecutor(1)
        self.key_future = self.key_maker.submit(self.service.create_key)

    def left(self) -> float:
        return self.args.deadline_s - (time.monotonic() - self.t0)

    def write(self) -> None:
        write_result_file(self.result, self.json_path)

    def plan(self) -> dict[str, Any]:
        a = self.args
        return {"model": self.model, "device": a.device, "engine_options": self.options, "set": a.set,
                "pool_size": max(a.saturation_requests, a.max_point_requests),
                "saturation_requests": a.saturation_requests, "det_shares": a.det_shares,
                "temperature": a.temperature, "top_p": a.top_p, "top_p_share": a.top_p_share, "seed": a.seed,
                "stream_tokens": a.stream_tokens, "stream_prompt_tokens": a.stream_prompt_tokens,
                "stream_repeats": a.stream_repeats, "stream_concurrency": a.stream_concurrency,
                "streams": a.streams, "engine_async": a.engine_async, "work_dir": str(self.work),
                "engine_cap_s": max(30.0, self.left() / 4), "core_repeats": a.core_repeats,
                "saturation_s": a.saturation_s}

    # -- phases
    def engine_alone(self) -> None:
        plan_path, result_path = self.work / "plan.json", self.work / "engine.json"
        plan = self.plan()
        write_result_file(plan, plan_path)
        log(f"engine alone: {self.model} ({len(self.args.det_shares)} modes)")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--role", "engine", "--plan", str(plan_path),
               "--result", str(result_path)]
        t0 = time.monotonic()
        try:
            code: int | str = subprocess.run(cmd, cwd=ROOT, env=child_env(), timeout=max(60.0, self.left() - 90),
                                             check=False).returncode
        except subprocess.TimeoutExpired as exc:  # what it measured before the limit is kept
            code = f"killed after {exc.timeout:.0f} s"
        if not result_path.is_file():
            raise RuntimeError(f"the engine-alone run wrote nothing (exit {code})")
        self.engine = json.loads(result_path.read_text())
        self.result["environment"]["device"] = self.engine["device"]
        self.place_clients(self.engine.get("engine_cpus"))
        self.result["engine_alone"] = {
            "seconds": round(time.monotonic() - t0, 1), "exit_code": code,
            "load_s": self.engine["load_s"], "engine_config": self.engine["engine_config"],
            "graphs": self.engine["graphs"], "model": self.engine["model"], "modes": self.engine["modes"],
            "streams": self.engine.get("streams")}
        self.result["requests"] = pool_summary(self.engine["requests"], self.args, self.saturation_requests())
        if "saturation" in self.engine:
            self.result["engine_alone"]["saturation_sizing"] = self.engine["saturation"]
        for key in ("async_error",):
            if key in self.engine:
                self.result["engine_alone"][key] = self.engine[key]
        self.write()
        if code != 0:
            self.result["errors"]["engine_alone"] = f"exit {code}"

    def place_clients(self, engine_cpus: list[int] | None) -> None:
        """The client processes stay off the CPUs the service gives its engine process: in use, clients run on
        other hosts."""
        from engine.placement import allowed_cpus, pin_process

        others = [c for c in allowed_cpus() if c not in (engine_cpus or [])]
        self.result["environment"]["engine_cpus"] = engine_cpus
        self.result["environment"]["client_cpus"] = others if engine_cpus else None
        if engine_cpus and others:
            for proc in self.clients.procs:
                pin_process(proc.pid, others)

    def start_service(self) -> None:
        self.key_future.result()
        ready_s = self.service.start(min(self.args.ready_timeout_s, max(30.0, self.left())))
        status, models = http_json(f"{self.service.url}/v1/models",
                                   {"Authorization": f"Bearer {self.service.key}"})
        if status != 200:
            raise RuntimeError(f"GET /v1/models answered {status}: {models}")
        self.served_model = models["data"][0]["id"]
        self.result["service"] = {"command": "python -m auditor serve --data-dir WORK/data --port PORT",
                                  "environment": self.service.environment(), "ready_s": round(ready_s, 2),
                                  "served_model": self.served_model, "workers": self.service.workers(),
                                  "process_cpus": self.service.process_cpus()}
        log(f"service ready in {ready_s:.1f} s at {self.service.url}; {self.args.clients} client processes")
        self.write()

    def send(self, items: list[dict[str, Any]], count: str,
             only_first: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """Send requests (spec dicts with t_start offsets, made absolute here); records and CPU figures."""
        start = time.monotonic() + 0.2 + 0.05 * len(items) / 1000  # every worker is listening before the first
        specs = [{**it, "t_start": start + it["offset"]} for it in items]
        common = {"base_url": self.service.url, "key": self.service.key, "model": self.served_model,
                  "temperature": self.args.temperature, "count": count,
                  "tokenizer_json": self.engine["tokenizer_json"]}
        cpu0 = self.service.cpu_seconds()
        w0 = time.monotonic()
        records, usage = self.clients.run("load", common, specs, only_first)
        wall = time.monotonic() - w0
        cpu1 = self.service.cpu_seconds()
        for spec, rec in zip(specs, records):
            if rec["transcript_id"]:
                self.sent.append({"id": rec["transcript_id"], "prompt": spec["prompt"], "deterministic": spec["det"],
                                  "seed": spec["seed"], "completion_tokens": rec["completion_tokens"],
                                  "text": rec["text"] if rec["error"] is None else None,
                                  "log_index": rec["log_index"], "error": rec["error"]})
        cpu = {"service_cores": (cpu1 - cpu0) / wall if cpu0 is not None and cpu1 is not None else None,
               "client_cores": [round(u["cores"], 3) for u in usage]}
        return records, cpu

    def mode_specs(self, reqs: list[dict[str, Any]], share: float, offsets: list[float],
                   max_tokens: int | None = None) -> list[dict[str, Any]]:
        det = deterministic_flags(len(reqs), share)
        return [{"i": r["i"], "prompt": r["prompt"], "max_tokens": max_tokens or r["max_tokens"], "seed": r["seed"],
                 "top_p": r["top_p"], "det": d, "offset": off} for r, d, off in zip(reqs, det, offsets)]

    def warm_up(self) -> None:
        sat = self.engine["requests"][:self.args.saturation_requests]
        t0 = time.monotonic()
        errors = 0
        for share in self.args.det_shares:
            records, _ = self.send(self.mode_specs(sat, share, [0.0] * len(sat), WARMUP_TOKENS), self.args.itl_tokens)
            errors += sum(1 for r in records if r["error"])
        self.result["warm_up"] = {"requests": len(sat) * len(self.args.det_shares), "max_tokens": WARMUP_TOKENS,
                                  "errors": errors, "seconds": round(time.monotonic() - t0, 2)}
        log(f"warm-up: {self.result['warm_up']}")
        self.write()

    def streams(self) -> None:
        plan = self.plan()
        prompts = self.engine["stream_prompts"]

        async def run(batch: list[list[int]], det: bool, tag: str) -> list[dict[str, Any]]:
            specs = [{"i": -1 - k, "prompt": p, "det": det, "offset": 0.0, **stream_request(plan, k)}
                     for k, p in enumerate(batch)]
            records, _ = await asyncio.to_thread(self.send, specs, "logprobs", True)
            return records

        self.result["streams"] = asyncio.run(stream_runs(run, prompts, plan))
        log(f"streams through the API: {stream_line(self.result['streams']['summary'])}")
        self.write()

    def ramp(self) -> None:
        """Every mode's saturation point first (the service / engine ratios), then the rates per mode, so
        that a run short of time loses rate points, never a saturation figure."""
        a = self.args
        measured = [(k, v["core"]["req_per_s"]) for k, v in self.engine["modes"].items() if "core" in v]
        if not a.rates and not measured:
            raise RuntimeError("no engine-alone saturation figure to set the rates from; give --rates")
        first, base = measured[0] if measured else ("", 0.0)
        rates = a.rates or [round(f * base, 2) for f in a.rate_fractions]
        self.result["ramp"] = {"rates_req_per_s": rates, "rate_source": "--rates" if a.rates else
                               f"--rate-fractions {a.rate_fractions} of {first} core saturation {base:.2f} req/s",
                               "point_s": a.point_s, "itl_tokens": a.itl_tokens,
                               "modes": {mode_name(s): {"deterministic_share": s, "points": {}} for s in a.det_shares}}
        for share in a.det_shares:
            self.ramp_point(share, math.inf, 0)
        for share in a.det_shares:
            for point, rate in enumerate(rates, start=1):
                self.ramp_point(share, rate, point)

    def ramp_point(self, share: float, rate: float, point: int) -> None:
        a, pool = self.args, self.engine["requests"]
        name = mode_name(share)
        points = self.result["ramp"]["modes"][name]["points"]
        inf = math.isinf(rate)
        count = self.saturation_requests() if inf else min(a.max_point_requests, len(pool),
                                                      max(a.min_point_requests, round(rate * a.point_s)))
        key = "inf" if inf else f"{rate:g}"
        need = (0 if inf else 1.5 * a.point_s) + 10 + self.verify_reserve_s(count)
        if self.left() < need:
            points[key] = {"skipped": f"{self.left():.0f} s left < {need:.0f} s needed"}
            log(f"{name} rate {key}: skipped ({points[key]['skipped']})")
            return
        specs = self.mode_specs(pool[:count], share, poisson_offsets(count, rate, a.seed * 1000 + point))
        m = points[key] = {"offered_req_per_s": None if inf else rate}
        with recorded(m, "error"):
            runs = [self.measure(specs)]
            repeats = (a.service_repeats or a.core_repeats) if inf else 1
            while len(runs) < repeats:  # each further run needs what the last took, and the checks' time
                need = runs[-1]["seconds"] + 10 + self.verify_reserve_s(count)
                if self.left() < need:
                    m["repeats_skipped"] = (f"{repeats - len(runs)} of {repeats} ({self.left():.0f} s left < "
                                            f"{need:.0f} s)")
                    break
                runs.append(self.measure(specs))
            m.update(sorted(runs, key=lambda r: r["output_tok_per_s"])[len(runs) // 2])
            if inf:  # like the engine core's figure: the median run, every run's tok/s beside it
                m["runs_tok_per_s"] = [round(r["output_tok_per_s"], 1) for r in runs]
            self.result["ramp"]["modes"][name]["saturation"] = self.saturation(name)
            log(f"{name} rate {key}: {m['completed']}/{m['requests']} done, {m['output_tok_per_s']:.0f} tok/s"
                f"{' (median of ' + str(m['runs_tok_per_s']) + ')' if 'runs_tok_per_s' in m else ''}, "
                f"{m['req_per_s']:.1f} req/s, TTFT p50 {fmt(m['ttft_s']['p50'])} (headers p50 "
                f"{fmt(m['headers_s']['p50'])} max {fmt(m['headers_s']['max'])}), ITL p50 {fmt(m['itl_s']['p50'])}, "
                f"service {fmt(m['service_cores'], 2)} cores, clients {m['client_cores']}, "
                f"engine busy {fmt(m['engine'].get('busy'), 3)} commands {fmt(m['engine'].get('commands'), 3)} "
                f"publish {fmt(m['engine'].get('publish'), 3)} idle {fmt(m['engine'].get('idle'), 3)} over "
                f"{m['engine'].get('steps')} steps")
        self.write()

    def measure(self, specs: list[dict[str, Any]]) -> dict[str, Any]:
        """One run of a point's requests: its metrics, the CPU used and how the engine's counters moved."""
        before = engine_counters(self.service.url)
        records, cpu = self.send(specs, self.args.itl_tokens)
        m = {**point_metrics(records), **cpu}
        time.sleep(0.3)  # the engine's last counters reach the workers with its idle step message
        m["engine"] = engine_delta(before, engine_counters(self.service.url), m["seconds"])
        return m

    def saturation_requests(self) -> int:
        """The saturation set's size the engine-alone run settled on (``size_saturation``)."""
        return int(self.engine.get("saturation", {}).get("requests", self.args.saturation_requests))

    def saturation(self, name: str) -> dict[str, Any]:
        """The service at the infinite rate against the engine alone on the same requests."""
        point = self.result["ramp"]["modes"][name]["points"].get("inf", {})
        engine = self.engine["modes"].get(name, {})
        out: dict[str, Any] = {"service_tok_per_s": point.get("output_tok_per_s")}
        # where the difference goes: the engine's busy share under the service and alone, and its steps per token
        served, alone = point.get("engine", {}), engine.get("core", {}).get("engine", {})
        out["service_engine_busy"], out["core_engine_busy"] = served.get("busy"), alone.get("busy")
        for share in ("commands", "publish", "idle"):
            out[f"service_engine_{share}"] = served.get(share)
        for side, counters in (("service", served), ("core", alone)):
            tokens = counters.get("generated_tokens")
            out[f"{side}_steps_per_100_tokens"] = round(100 * counters["steps"] / tokens, 2) \
                if tokens and "steps" in counters else None
        for kind in ("core", "async"):
            if kind in engine:
                out[f"engine_{kind}_tok_per_s"] = engine[kind]["output_tok_per_s"]
                out[f"ratio_to_engine_{kind}"] = _ratio(point.get("output_tok_per_s"), engine[kind]["output_tok_per_s"])
        return out

    def verify_reserve_s(self, more: int) -> float:
        """Time to keep for the checks: fetching and verifying every transcript (a guess: 200 a second)."""
        return 15 + (len(self.sent) + more) / 200

    def verify(self) -> None:
        t0 = time.monotonic()
        status, jwks = http_json(f"{self.service.url}/.well-known/jwks.json")
        if status != 200:
            raise RuntimeError(f"GET /.well-known/jwks.json answered {status}")
        items = [{k: s[k] for k in ("id", "prompt", "deterministic", "seed", "completion_tokens", "text")}
                 for s in self.sent if s["error"] is None]
        common = {"base_url": self.service.url, "key": self.service.key, "jwks": jwks,
                  "concurrency": self.args.verify_concurrency}
        results, _ = self.clients.run("verify", common, items)
        failed = [r for r in results if not r["ok"]]
        tamper = self.tamper_control(items[0], jwks) if items else None
        checkpoint = self.final_checkpoint(jwks, len(self.sent))
        indices = sorted(r["log_index"] for r in results if r.get("log_index") is not None)
        self.result["checks"] = {
            "transcripts_sent": len(self.sent), "requests_failed": sum(1 for s in self.sent if s["error"]),
            "transcripts_verified": len(results) - len(failed), "transcripts_failed": len(failed),
            "first_failures": failed[:5], "tamper_control": tamper, "checkpoint": checkpoint,
            "tree_size_equals_transcripts": checkpoint.get("tree_size") == len(self.sent),
            "log_indices_are_0_to_size": indices == list(range(checkpoint.get("tree_size") or 0)),
            "seconds": round(time.monotonic() - t0, 2)}
        c = self.result["checks"]
        c["all_ok"] = (c["transcripts_failed"] == 0 and c["requests_failed"] == 0 and c["tree_size_equals_transcripts"]
                       and c["log_indices_are_0_to_size"] and checkpoint.get("signature_ok") is True
                       and bool(tamper and tamper["detected"]))
        log(f"checks: {c['transcripts_verified']}/{len(items)} transcripts verify, tree size "
            f"{checkpoint.get('tree_size')} for {len(self.sent)} transcripts, all ok: {c['all_ok']} "
            f"({c['seconds']} s)")
        self.write()

    def tamper_control(self, item: dict[str, Any], jwks: dict[str, Any]) -> dict[str, Any]:
        """The checks must be able to fail: one transcript passes as served, fails the signature check with
        its signature altered, and fails the output commitment with its first output token altered."""
        status, doc = http_json(f"{self.service.url}/v1/transcripts/{item['id']}?include_content=true",
                                {"Authorization": f"Bearer {self.service.key}"})
        if status != 200 or not doc.get("token_ids"):
            return {"detected": False, "error": f"GET answered {status}"}
        signed, token = copy.deepcopy(doc), copy.deepcopy(doc)
        sig = signed["envelope"]["signatures"][0]
        sig["sig"] = ("B" if sig["sig"][0] == "A" else "A") + sig["sig"][1:]
        token["token_ids"][0] ^= 1
        clean, bad_sig, bad_token = (check_transcript(d, item, jwks) for d in (doc, signed, token))
        detected = (clean["ok"] and any(p.startswith("signature") for p in bad_sig["problems"])
                    and any(p.startswith("output_commitment") for p in bad_token["problems"]))
        return {"detected": detected, "transcript": item["id"],
                "problems": bad_sig["problems"][:2] + bad_token["problems"][:2]}

    def final_checkpoint(self, jwks: dict[str, Any], expected: int) -> dict[str, Any]:
        """The latest checkpoint once it covers `expected` leaves (a batching ledger may sign it later)."""
        from auditor.checkpoint import CheckpointError, verify_checkpoint

        deadline = time.monotonic() + 30
        while True:
            status, body = http_json(f"{self.service.url}/v1/log/checkpoint")
            if status != 200:
                return {"error": f"GET /v1/log/checkpoint answered {status}"}
            if body["tree_size"] >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        try:
            verified = verify_checkpoint(body["note"], jwks)
            signature_ok, detail = verified.tree_size == body["tree_size"], None
        except CheckpointError as exc:
            signature_ok, detail = False, str(exc)
        return {"tree_size": body["tree_size"], "root_hash": body["root_hash"], "signature_ok": signature_ok,
                **({"signature_error": detail} if detail else {})}

    def summary(self) -> None:
        """One row per mode for the README: the saturation figures and the latencies at the highest rate."""
        rows = {}
        for name, mode in self.result.get("ramp", {}).get("modes", {}).items():
            points = mode["points"]
            finite = sorted((p["offered_req_per_s"], k) for k, p in points.items() if k != "inf" and "ttft_s" in p)
            sat, top = points.get("inf", {}), points.get(finite[-1][1], {}) if finite else {}
            rows[name] = {**mode.get("saturation", {}), "service_req_per_s": sat.get("req_per_s"),
                          **{f"saturation_{m}_{q}": (sat.get(m) or {}).get(q)
                             for m in ("ttft_s", "headers_s", "itl_s", "e2e_s") for q in ("p50", "p99")},
                          "highest_rate_req_per_s": finite[-1][0] if finite else None,
                          **{f"highest_rate_{m}_{q}": (top.get(m) or {}).get(q) for m in ("ttft_s", "itl_s", "e2e_s")
                             for q in ("p50", "p99")}}
            log(f"{name}: service {fmt(rows[name].get('service_tok_per_s'), 0)} tok/s at saturation = "
                f"x{fmt(rows[name].get('ratio_to_engine_core'), 3)} of the engine alone (core), "
                f"x{fmt(rows[name].get('ratio_to_engine_async'), 3)} (async)")
        self.result["summary"] = rows

    def targets(self) -> None:
        """Issue 25's and 26's targets, read off this run's figures."""
        self.result["targets"] = targets_of(self.result)

    def close(self) -> None:
        self.clients.close()
        self.key_maker.shutdown()
        cpu = self.service.cpu_seconds()
        code = self.service.stop()
        if code is not None:
            log(f"service stopped (exit {code})")
            self.result.setdefault("service", {}).update({"exit_code": code, "cpu_s_total": cpu,
                                                          "log_tail": self.service.log_tail(1500)})
        if not self.args.work_dir:
            shutil.rmtree(self.work, ignore_errors=True)


def _ge(a: float | None, b: float) -> bool | None:
    return None if a is None else a >= b


def _le(a: float | None, b: float) -> bool | None:
    return None if a is None else a <= b


def fmt(x: float | None, digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def pool_summary(pool: list[dict[str, Any]], args: argparse.Namespace, saturation_requests: int) -> dict[str, Any]:
    sat = pool[:saturation_requests]
    return {"set": args.set, "pool": len(pool), "saturation_requests": len(sat),
            "prompt_len_mean": sum(len(r["prompt"]) for r in sat) / len(sat),
            "output_len_mean": sum(r["max_tokens"] for r in sat) / len(sat),
            "temperature": args.temperature, "top_p": args.top_p,
            "top_p_share": sum(r["top_p"] < 1 for r in sat) / len(sat), "ignore_eos": True}


def environment(args: argparse.Namespace) -> dict[str, Any]:
    def git(*cmd: str) -> str | None:
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    commit = git("rev-parse", "HEAD")
    return {"command": " ".join(["python", *sys.orig_argv[1:]]),
            "git_commit": args.git_commit or commit, "git_commit_source": "--git-commit" if args.git_commit else "git",
            "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")) if commit else None,
            "date_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "host": platform.node(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
            "args": {k: v for k, v in vars(args).items() if k not in ("role", "plan", "result")}}


# ---- plots ------------------------------------------------------------------------------------------------
def plot(result: dict[str, Any], out: Path, name: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    written = []
    if result.get("ramp"):
        path = out / f"{name}.png"
        _plot_ramp(result, path)
        written.append(str(path))
    if (result.get("streams") or {}).get("single"):
        path = out / f"{name}-streams.png"
        _plot_streams(result, path)
        written.append(str(path))
    return written


def _title(result: dict[str, Any]) -> str:
    env = result["environment"]
    device = (env.get("device") or {}).get("name")
    return f"{result['model']} — {device} — {env['date_utc']} — {(env.get('git_commit') or '')[:10]}"


def _plot_ramp(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    modes = result["ramp"]["modes"]
    rates = result["ramp"]["rates_req_per_s"]
    x_inf = max(rates, default=1.0) * 1.25  # where the all-at-once point is drawn
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    for i, (name, mode) in enumerate(modes.items()):
        pts = sorted((x_inf if k == "inf" else p["offered_req_per_s"], p["output_tok_per_s"])
                     for k, p in mode["points"].items() if "output_tok_per_s" in p)
        ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", color=f"C{i}", label=f"{name}: service")
        engine = result.get("engine_alone", {}).get("modes", {}).get(name, {}).get("core")
        if engine:
            ax.plot([x_inf], [engine["output_tok_per_s"]], "*", color=f"C{i}", markersize=13,
                    label=f"{name}: engine alone")
    ax.set_xticks([*rates, x_inf], [f"{r:g}" for r in rates] + ["all at\nonce"])
    ax.set_xlabel("offered request rate (req/s)")
    ax.set_ylabel("output tok/s")
    ax.set_ylim(bottom=0)
    ax.set_title("throughput against request rate", fontsize=10)
    ax.legend(fontsize=7)
    cdfs = ((axes[1], "ttft_s", "time to first token (s)"), (axes[2], "e2e_s", "end-to-end latency (s)"))
    for ax, metric, label in cdfs:
        for i, (name, mode) in enumerate(modes.items()):
            finite = sorted((p["offered_req_per_s"], k) for k, p in mode["points"].items()
                            if k != "inf" and "samples" in p)
            for key, style in ((finite[-1][1] if finite else None, "--"), ("inf", "-")):
                samples = sorted(mode["points"].get(key, {}).get("samples", {}).get(metric, [])) if key else []
                if samples:
                    ys = [(j + 1) / len(samples) for j in range(len(samples))]
                    ax.step(samples, ys, style, color=f"C{i}", where="post",
                            label=f"{name} @ {'all at once' if key == 'inf' else key + ' req/s'}")
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{label.split(' (')[0]} CDF", fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _plot_streams(result: dict[str, Any], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    sources = (("API arrival", result.get("streams") or {}, "-"),
               ("engine commit", (result.get("engine_alone") or {}).get("streams") or {}, ":"))
    for ax, kind in zip(axes, ("single", "concurrent")):
        for label, streams, style in sources:
            for i, det in enumerate(("nondeterministic", "deterministic")):
                runs = streams.get(kind, {}).get(det) or []
                run = next((r for r in runs if "token_arrival_s" in r), None)
                if run:
                    ax.plot(range(len(run["token_arrival_s"])), run["token_arrival_s"], style, color=f"C{i}",
                            drawstyle="steps-post", label=f"{det}, {label}")
        n = (result.get("streams") or {}).get("concurrency")
        ax.set_title("one stream alone" if kind == "single" else f"one of {n} concurrent streams", fontsize=10)
        ax.set_xlabel("token index")
        ax.set_ylabel("seconds after the request was sent")
        ax.legend(fontsize=7)
    fig.suptitle(_title(result), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main -------------------------------------------------------------------------------------------------
def run_bench(args: argparse.Namespace) -> dict[str, Any]:
    run = Run(args)
    log(f"{run.model} -> {run.json_path} (deadline {args.deadline_s:.0f} s)")
    phases: list[tuple[str, Callable[[], None]]] = [("warm_up", run.warm_up), ("ramp", run.ramp),
                                                     ("verify", run.verify), ("summary", run.summary),
                                                     ("targets", run.targets)]
    if args.streams:
        phases.insert(1, ("streams", run.streams))
    try:
        with recorded(run.result["errors"], "start"):
            run.engine_alone()
            run.start_service()
            for name, phase in phases:  # each on its own: a failed one leaves the others their figures
                with recorded(run.result["errors"], name):
                    phase()
    except BaseException as exc:  # an interrupt (SIGTERM from `timeout`): the JSON says where it stopped
        run.result["errors"]["interrupted"] = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        run.close()
        run.result["seconds"] = round(time.monotonic() - run.t0, 1)
        with recorded(run.result, "plot_error"):
            run.result["plots"] = plot(run.result, run.out, run.name)
        run.write()
    log(f"done in {run.result['seconds']} s: {run.json_path}; errors: {run.result['errors'] or 'none'}")
    return run.result


def targets_of(result: dict[str, Any]) -> dict[str, Any]:
    """Issue 25's and 26's targets, read off a run's figures."""
    out: dict[str, Any] = {}
    sat = {k: v.get("saturation", {}) for k, v in result.get("ramp", {}).get("modes", {}).items()}
    out["service_over_engine_core_ge_0.90"] = {k: _ge(v.get("ratio_to_engine_core"), 0.90) for k, v in sat.items()}
    out["checks_all_ok"] = result["checks"].get("all_ok")
    summary = (result.get("streams") or {}).get("summary", {})
    if "single" in summary:
        s = summary["single"]
        out["single_e2e_ratio_le_1.15"] = _le(s["e2e_ratio"], 1.15)
        out["single_ttft_ratio_le_1.10"] = _le(s["ttft_ratio"], 1.10)
        out["single_max_gap_le_16_steps"] = _le(s["max_gap_steps"]["deterministic"], 16)
    if "concurrent" in summary:
        out["concurrent_p99_gap_le_24_steps"] = _le(summary["concurrent"]["p99_gap_steps"]["deterministic"], 24)
    return out


def resummarize(path: str) -> None:
    """Recompute a result file's stream summaries (the API's and the engine alone's) and targets from the
    streams it recorded, with this code's summary, and rewrite it."""
    doc = json.loads(Path(path).read_text())
    for holder in (doc, doc.get("engine_alone") or {}):
        streams = holder.get("streams")
        if streams and "single" in streams:
            streams["summary"] = stream_summary(streams)
    doc["targets"] = targets_of(doc)
    write_result_file(doc, path)
    log(f"{path}: {stream_line(doc['streams']['summary'])}; targets {doc['targets']}")


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role == "engine":
        return engine_role(args.plan, args.result)
    if args.resummarize:
        resummarize(args.resummarize)
        return 0
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` must not leave the service holding the device
    result = run_bench(args)
    return 0 if result["checks"].get("all_ok") and not result["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
