"""The engine process's per-step message: what it costs to build, encode, decode and apply (host only).

    python bench/wire_bench.py --out FILE [--requests 64 256] [--context 0 512] [--steps 400] [--logprobs 0]
                               [--repeats 3]

For each count of running requests, every step commits one token per request (and, every `--window`-th
step of each request, staggered across requests, a verify window), then times, per step:
- build_us: the engine process turning the touched sequences into the step's deltas;
- encode_us: those deltas into the bytes sent on the pipe;
- decode_us: the serving process's reader thread turning the bytes back into deltas;
- apply_us: appending them to the serving process's request table (what EngineProcess._apply does on the
  event loop; here on a table of requests with no event loop).
Each request has `--context` committed tokens (and their windows) when the warm-up steps start.

Variants:
- `msgpack` (engine.engine_process as it is): `_Publisher.delta` builds `Delta` Structs holding the windows
  added since the last delta, `encode_step` / `decode_message` (msgpack after a tag byte), `EngineProcess._apply`.
- `pickle_dataclass`: a frozen dataclass delta holding every window of the request, the tuple
  ("step", deltas, stats) pickled as Connection.send pickles it, unpickled, applied by the same loop.
- `pickle_tuple` (build / encode / decode only): the msgpack variant's fields as a plain tuple, pickled.

Each variant runs `--repeats` times, the variants interleaved (the machine may be shared: its load average at
the start is recorded). Writes FILE (JSON: command, machine, date; per variant and request count, each run's
median and p90 per step in microseconds, the median over the runs of their medians, and the message size).
The reconstructed tokens and windows are checked against the sequences at the end of each run.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import pickle
import shlex
import statistics
import sys
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the source root on the path
    sys.path.insert(0, str(ROOT))

from bench.results import git_commit, machine, write_result_file  # noqa: E402
from engine.engine_process import (  # noqa: E402
    EngineProcess,
    _Publisher,
    _Request,
    decode_message,
    encode_step,
)
from engine.sampling import SamplingParams  # noqa: E402
from engine.sequence import Sequence, SeqKind, SeqStatus  # noqa: E402


@dataclass(frozen=True)
class PickledDelta:
    """The dataclass delta of the `pickle_dataclass` variant: every window of the request, each step."""

    request_id: str
    start: int
    token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    windows: list[tuple[int, int]]
    finished: bool
    finish_reason: str | None
    seed: int
    deterministic: bool
    verify_passes: int
    rollbacks: int
    recomputed_tokens: int
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None


def pickled_delta(published: dict[str, int], seq: Sequence) -> PickledDelta | None:
    rid, start = seq.request_id, published[seq.request_id]
    n = len(seq.tokens)
    if n == start and not seq.is_finished:
        return None
    published[rid] = n
    return PickledDelta(rid, start, seq.tokens[start:n], seq.logprobs[start:n],
                        [dict(t) for t in seq.top_logprobs[start:n]] if seq.params.logprobs else None,
                        list(seq.windows), seq.is_finished, None, seq.seed, True, seq.verify_passes, seq.rollbacks,
                        seq.recomputed_tokens)


def apply_pickled(requests: dict[str, _Request], deltas: list[PickledDelta]) -> None:
    """The delta loop of EngineProcess._apply for deltas that hold every window (windows read from the last)."""
    for d in deltas:
        req = requests.get(d.request_id)
        if req is None or req.loop is not None:
            continue
        if d.start == len(req.tokens):
            req.tokens.extend(d.token_ids)
            req.logprobs.extend(d.token_logprobs)
            req.top.extend(d.top_logprobs or ())
        req.last = d  # type: ignore[assignment]
        if req.queue is not None:
            req.queue.put_nowait(True)


def tuple_delta(published: dict[str, tuple[int, int]], seq: Sequence) -> tuple[Any, ...] | None:
    rid = seq.request_id
    start, windows_from = published[rid]
    n, w = len(seq.tokens), len(seq.windows)
    if n == start and w == windows_from and not seq.is_finished:
        return None
    published[rid] = (n, w)
    return (rid, start, seq.tokens[start:n], seq.logprobs[start:n],
            seq.top_logprobs[start:n] if seq.params.logprobs else None, windows_from, seq.windows[windows_from:w],
            seq.is_finished, None, seq.seed, True, seq.verify_passes, seq.rollbacks, seq.recomputed_tokens,
            None, None)


def make_seqs(count: int, context: int, window: int, logprobs: int | None) -> list[Sequence]:
    seqs = []
    for i in range(count):
        params = SamplingParams(max_tokens=1 << 20, deterministic=True, logprobs=logprobs, ignore_eos=True)
        seq = Sequence(f"req-{i:032x}", list(range(100, 164)), params, (1 << 63) + i, SeqKind.DVR, i,
                       status=SeqStatus.RUNNING)
        for _ in range(context):
            commit(seq, window, i)
        seqs.append(seq)
    return seqs


def commit(seq: Sequence, window: int, stagger: int) -> None:
    """One committed token (a logprob of full float64 precision); a window closes every `window` tokens."""
    n = len(seq.tokens)
    seq.tokens.append(1000 + (n * 7919 + stagger) % 40000)
    seq.logprobs.append(-((n * 0.6180339887498949 + stagger) % 13.0) - 1e-9)
    if seq.params.logprobs:
        seq.top_logprobs.append({1000 + (n + k) % 40000: -0.5 * k - 1e-7 * n for k in range(seq.params.logprobs)})
    if (n + 1 + stagger) % window == 0:
        seq.windows.append((seq.windows[-1][1] if seq.windows else 1, n + 1))
        seq.verify_passes += 1


def serving_table(seqs: list[Sequence]) -> EngineProcess:
    """An EngineProcess with no process: only the request table that _apply reads and writes."""
    engine = EngineProcess.__new__(EngineProcess)
    engine._requests = {s.request_id: _Request(list(s.prompt), s.params, None, asyncio.Queue()) for s in seqs}
    engine._last = OrderedDict()
    engine._detokenize = None
    engine._window_shape = (4, 8)
    return engine


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: dict[str, list[float]], sizes: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for phase, values in samples.items():
        if values:
            out[f"{phase}_us"] = {"median": round(statistics.median(values), 2),
                                  "p90": round(percentile(values, 0.9), 2)}
    per_step = [sum(v[i] for v in samples.values() if v) for i in range(len(sizes))]
    out["total_us"] = {"median": round(statistics.median(per_step), 2), "p90": round(percentile(per_step, 0.9), 2)}
    out["message_bytes_median"] = int(statistics.median(sizes))
    return out


def run_variant(name: str, count: int, context: int, args: argparse.Namespace) -> dict[str, Any]:
    seqs = make_seqs(count, context, args.window, args.logprobs or None)
    samples: dict[str, list[float]] = {"build": [], "encode": [], "decode": [], "apply": []}
    sizes: list[int] = []
    clock = time.perf_counter_ns
    if name == "msgpack":
        publisher = _Publisher()
        for s in seqs:
            publisher.sent[s.request_id] = (len(s.tokens), len(s.windows))
        engine = serving_table(seqs)
        for req, s in zip(engine._requests.values(), seqs):
            req.tokens, req.logprobs, req.windows = list(s.tokens), list(s.logprobs), list(s.windows)
            req.top = list(s.top_logprobs)
        build: Callable[[Sequence], Any] = publisher.delta
        encode: Callable[[list[Any]], bytes] = lambda deltas: encode_step(deltas, None)  # noqa: E731
        decode: Callable[[bytes], list[Any]] = lambda data: decode_message(data)[1][0]  # noqa: E731
        apply: Callable[[list[Any]], None] | None = (
            lambda deltas: engine._apply(deltas, None, None, None, None))  # noqa: E731
        requests = engine._requests
    elif name == "pickle_dataclass":
        published = {s.request_id: len(s.tokens) for s in seqs}
        engine = serving_table(seqs)
        for req, s in zip(engine._requests.values(), seqs):
            req.tokens, req.logprobs, req.top = list(s.tokens), list(s.logprobs), list(s.top_logprobs)
        build = lambda seq: pickled_delta(published, seq)  # noqa: E731
        encode = lambda deltas: bytes(ForkingPickler.dumps(("step", deltas, None)))  # noqa: E731
        decode = lambda data: pickle.loads(data)[1]  # noqa: E731
        apply = lambda deltas: apply_pickled(engine._requests, deltas)  # noqa: E731
        requests = engine._requests
    else:
        published2 = {s.request_id: (len(s.tokens), len(s.windows)) for s in seqs}
        build = lambda seq: tuple_delta(published2, seq)  # noqa: E731
        encode = lambda deltas: pickle.dumps(("step", deltas, None), protocol=pickle.HIGHEST_PROTOCOL)  # noqa: E731
        decode = lambda data: pickle.loads(data)[1]  # noqa: E731
        apply, requests = None, {}
    for step in range(args.warmup + args.steps):
        for i, s in enumerate(seqs):
            commit(s, args.window, i)
        t0 = clock()
        deltas = [d for d in (build(s) for s in seqs) if d is not None]
        t1 = clock()
        data = encode(deltas)
        t2 = clock()
        received = decode(data)
        t3 = clock()
        if apply is not None:
            apply(received)
        t4 = clock()
        for req in requests.values():
            assert req.queue is not None
            while not req.queue.empty():
                req.queue.get_nowait()
        if step >= args.warmup:
            samples["build"].append((t1 - t0) / 1e3)
            samples["encode"].append((t2 - t1) / 1e3)
            samples["decode"].append((t3 - t2) / 1e3)
            if apply is not None:
                samples["apply"].append((t4 - t3) / 1e3)
            sizes.append(len(data))
    for s in seqs:  # the serving side rebuilt what the engine committed
        req = requests.get(s.request_id)
        if req is not None:
            assert req.tokens == s.tokens and req.logprobs == s.logprobs, s.request_id
            if name == "msgpack":
                assert req.windows == s.windows and engine._output(req).windows == s.windows, s.request_id
            else:
                assert req.last is not None and req.last.windows == s.windows, s.request_id
    return {"variant": name, "requests": count, "context": context, **summary(samples, sizes)}


VARIANTS = ("pickle_dataclass", "pickle_tuple", "msgpack")


def medians(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per "context <c>, <requests> requests, <variant>": the median over its runs of each phase's per-step
    median."""
    out: dict[str, dict[str, float]] = {}
    for key in sorted({(r["context"], r["requests"], r["variant"]) for r in runs}):
        mine = [r for r in runs if (r["context"], r["requests"], r["variant"]) == key]
        phases = [k for k in mine[0] if k.endswith("_us")]
        out["context {}, {} requests, {}".format(*key)] = {
            k: round(statistics.median(r[k]["median"] for r in mine), 2) for k in phases}
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, nargs="+", default=[64, 256], help="running requests")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--context", type=int, nargs="+", default=[0, 512],
                        help="committed tokens per request before the steps")
    parser.add_argument("--window", type=int, default=8, help="tokens per verify window")
    parser.add_argument("--logprobs", type=int, default=0, help="top logprobs per token (0: none asked)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, interleaved")
    parser.add_argument("--out", required=True, help="write the JSON result here")
    args = parser.parse_args(argv)
    import msgspec

    result = {
        "benchmark": "wire_bench",
        "command": shlex.join(["python", "bench/wire_bench.py", *argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "git_commit": git_commit(), "machine": machine(), "msgspec": msgspec.__version__,
        "per_step": {"window": args.window, "logprobs": args.logprobs,
                     "tokens_per_request": 1, "steps": args.steps, "warmup": args.warmup},
        "runs": [run_variant(name, count, context, args) for _ in range(args.repeats) for context in args.context
                 for count in args.requests for name in VARIANTS],
    }
    result["medians_us"] = medians(result["runs"])
    for key, phases in result["medians_us"].items():
        print(key, phases)
    write_result_file(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
