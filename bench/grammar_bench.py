"""Grammar libraries on the default model's vocabulary: what a JSON schema costs to compile and per token.

    python bench/grammar_bench.py --out DIR [--repeats 5] [--threads 1]

llguidance, the library compared against, is not among the service's requirements: `pip install llguidance`.

For xgrammar and llguidance, on SmolLM2's tokenizer (49152 ids), host only:
- tokenizer_s: building the library's vocabulary structure (once per engine);
- compile_s per grammar (median of cold compiles: no cache): two JSON schemas (a small object, a nested order
  with arrays, enums and bounds) and any JSON object;
- per token, along a valid instance (separators ", " and ": ", no other whitespace) tokenized as the model
  would emit it (then EOS): the time to fill the
  next-token bitmask (mask_us: mean, p50, p99, max) and to accept the token (accept_us);
- verify_walk_us: a DVR verify window of 8 candidates: roll back 8 tokens, then fill a mask and accept a
  token 8 times (what the library does per verified row).
And the engine's own path (engine.grammar.GrammarState and fill_masks, xgrammar) along the same instances: a
fast-path mask per token and, after every 8, the verify window of those 8 slots in one fill_masks call
(verify_window_8_us), with the masks the fast path filled kept (`kept`, the engine) and dropped first
(`refilled`).
And the engine's processors per decode step (engine_steps, on --rows rows constrained by
bench/schema_mix_bench.py's SCHEMA among a batch of 64, each along a JSON instance of it, compact or indented,
then EOS to --steps outputs, as ignore_eos holds a completed row): apply_processors on CPU logits (the whole
CPU path: masks filled, then the library's CPU kernel) and fill_masks alone (the host work the CUDA path shares:
following the outputs, filling the masks, the kept masks), for non-deterministic rows and for DVR rows (masks
kept, a verify pass of every row's window of 32 after each 32 steps: verify_pass_us); and the library's batch
fill of B masks with one thread and with the engine's thread count (batch_fill_us).
Writes DIR/NAME.json (--name, default grammar-bench; command, versions, machine, commit, date).

    python bench/grammar_bench.py --out DIR --parts steps --name grammar-steps   # the per-step part alone
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the source root on the path
    sys.path.insert(0, str(ROOT))

from bench.results import git_commit, machine, write_result  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
                   "email": {"type": "string"}},
    "required": ["name", "age", "email"], "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string"},
        "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "vip": {"type": "boolean"},
            "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"},
                                                         "zip": {"type": "string"}},
                        "required": ["street", "city", "zip"], "additionalProperties": False}},
            "required": ["name", "vip", "address"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
            "price": {"type": "number"}}, "required": ["sku", "quantity", "price"], "additionalProperties": False}},
        "notes": {"type": ["string", "null"]},
    },
    "required": ["order_id", "status", "customer", "items", "notes"], "additionalProperties": False,
}
INSTANCES = {
    "person": {"name": "Ada Lovelace", "age": 36, "email": "ada@example.com"},
    "order": {"order_id": "A-1029", "status": "shipped",
              "customer": {"name": "Grace Hopper", "vip": True,
                           "address": {"street": "1 Navy Way", "city": "Arlington", "zip": "22201"}},
              "items": [{"sku": "KB-77", "quantity": 2, "price": 49.5}, {"sku": "MS-3", "quantity": 1, "price": 19.99}],
              "notes": None},
}
SCHEMAS = {"person": PERSON, "order": ORDER}


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def summary_us(samples: list[float]) -> dict[str, float]:
    us = sorted(s * 1e6 for s in samples)
    return {"mean": round(statistics.fmean(us), 2), "p50": round(us[len(us) // 2], 2),
            "p99": round(us[min(len(us) - 1, int(len(us) * 0.99))], 2), "max": round(us[-1], 2), "n": len(us)}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int], threads: int) -> None:
        import xgrammar as xgr

        self.xgr = xgr
        self.tokenizer_s, self.info = timed(lambda: xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab, stop_token_ids=eos))
        self.threads = threads
        self.bitmask = xgr.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        if schema is None:
            return compiler.compile_builtin_json_grammar()
        return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "),
                                            strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)

    def fill(self, m: Any) -> None:
        m.fill_next_token_bitmask(self.bitmask, 0)

    def accept(self, m: Any, token: int) -> None:
        assert m.accept_token(token), token

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int], threads: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.fill_fn = llguidance.torch.fill_next_token_bitmask
        self.tokenizer_s, self.info = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab,
                                                                                 eos_token=eos[0]))
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)

    def compile(self, schema: dict[str, Any] | None) -> Any:
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            schema if schema is not None else {"type": "object"},
            defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        # llguidance compiles lazily: building the matcher is the compile step (the first mask pays the rest)
        m = self.llg.LLMatcher(self.info, grammar)
        assert not m.is_error(), m.get_error()
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.info, compiled)
        assert not m.is_error(), m.get_error()
        return m

    def fill(self, m: Any) -> None:
        self.fill_fn(m, self.bitmask, 0)

    def accept(self, m: Any, token: int) -> None:
        assert m.consume_token(token), (token, m.get_error())

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)


def measure(lib: Any, tokenizer: Any, eos: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"tokenizer_s": round(lib.tokenizer_s, 4), "grammars": {}}
    for name, schema in [*SCHEMAS.items(), ("json_object", None)]:
        compiles = [timed(lambda: lib.compile(schema))[0] for _ in range(repeats)]
        compiled = lib.compile(schema)
        instance = INSTANCES.get(name, INSTANCES["order"])
        tokens = list(tokenizer.encode(json.dumps(instance), add_special_tokens=False)) + [eos]
        masks: list[float] = []
        accepts: list[float] = []
        first_mask: list[float] = []
        for _ in range(repeats):
            m = lib.matcher(compiled)
            for i, t in enumerate(tokens):
                dt_mask, _ = timed(lambda: lib.fill(m))
                (first_mask if i == 0 else masks).append(dt_mask)
                accepts.append(timed(lambda: lib.accept(m, t))[0])
        walks: list[float] = []
        body = tokens[:-1]
        for _ in range(repeats):
            m = lib.matcher(compiled)
            for t in body:
                lib.accept(m, t)
            for _ in range(len(body) // 8):
                t0 = time.perf_counter()
                lib.rollback(m, 8)
                for t in body[-8:]:
                    lib.fill(m)
                    lib.accept(m, t)
                walks.append(time.perf_counter() - t0)
        out["grammars"][name] = {
            "compile_s": {"median": round(statistics.median(compiles), 5), "max": round(max(compiles), 5)},
            "instance_tokens": len(tokens),
            "first_mask_us": summary_us(first_mask), "mask_us": summary_us(masks), "accept_us": summary_us(accepts),
            "verify_walk_8_us": summary_us(walks),
        }
    return out


def engine_walk(source: Any, vocab: int, eos: list[int], repeats: int) -> dict[str, Any]:
    import random

    from engine.grammar import GrammarSpec, GrammarState, compile_grammar, fill_masks, tokenizer_info

    info = tokenizer_info(source.tokenizer, vocab, eos)
    out: dict[str, Any] = {}
    for name, schema in SCHEMAS.items():
        compiled = compile_grammar(GrammarSpec("json_schema", json.dumps(schema)), info)
        body = list(source.tokenizer.encode(json.dumps(INSTANCES[name]), add_special_tokens=False))
        entry: dict[str, Any] = {"instance_tokens": len(body)}
        runs = [kept for kept in (True, False) for _ in range(repeats)]
        random.Random(0).shuffle(runs)  # the two variants interleaved
        walks: dict[bool, list[float]] = {True: [], False: []}
        for kept in runs:
            state = GrammarState(compiled, info)
            one = torch.zeros((1, info.words), dtype=torch.int32)
            window = torch.zeros((8, info.words), dtype=torch.int32)
            for n in range(len(body)):
                state.fill(body, n, one, 0)  # the fast path: the slot after body[:n]
                if (n + 1) % 8 == 0:  # the verify pass of the 8 slots ending here
                    if not kept:
                        state.masks.clear()
                    start = n + 1 - 8
                    t0 = time.perf_counter()
                    fill_masks([(state, body, start + j, start, j) for j in range(8)], window)
                    walks[kept].append(time.perf_counter() - t0)
        entry["verify_window_8_us"] = {"kept": summary_us(walks[True]), "refilled": summary_us(walks[False])}
        out[name] = entry
    return out


def engine_steps(source: Any, vocab: int, eos: list[int], repeats: int, rows: int, steps: int,
                 window: int = 32, batch: int = 64) -> dict[str, Any]:
    """Host time of the processors per decode step of `rows` constrained rows (see the module docstring)."""
    import xgrammar as xgr

    from engine.grammar import PARALLEL_THREADS, GrammarState, fill_masks
    from engine.processors import Slot, apply_processors
    from engine.sampling import SamplingParams

    spec, compiled, info, outputs, at = step_rows(source, vocab, eos, rows, steps, batch)
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, grammar=spec)
    prompt = [1, 2, 3]
    logits = torch.zeros((batch, vocab))
    window_logits = torch.zeros((rows * window, vocab))
    bitmask = torch.zeros((batch, info.words), dtype=torch.int32)
    window_mask = torch.zeros((rows * window, info.words), dtype=torch.int32)

    def walk(dvr: bool, whole: bool) -> tuple[list[float], list[float]]:
        """One pass of `steps` decode steps; the seconds of each step and of each verify pass."""
        states = [GrammarState(compiled, info, keep_masks=dvr) for _ in range(rows)]
        per_step: list[float] = []
        per_verify: list[float] = []
        for n in range(steps):
            committed = (n // window) * window if dvr else n
            t0 = time.perf_counter()
            if whole:
                apply_processors(logits, at, [Slot(params, prompt, out, n, s, committed)
                                              for out, s in zip(outputs, states)])
            else:
                fill_masks([(s, out, n, committed, r) for out, s, r in zip(outputs, states, at)], bitmask)
            per_step.append(time.perf_counter() - t0)
            if dvr and (n + 1) % window == 0:  # the verify pass of every row's window ending here
                start = n + 1 - window
                t0 = time.perf_counter()
                if whole:
                    apply_processors(window_logits, list(range(rows * window)),
                                     [Slot(params, prompt, out, start + i, s, start)
                                      for out, s in zip(outputs, states) for i in range(window)])
                else:
                    fill_masks([(s, out, start + i, start, j * window + i)
                                for j, (out, s) in enumerate(zip(outputs, states)) for i in range(window)],
                               window_mask)
                per_verify.append(time.perf_counter() - t0)
        return per_step, per_verify

    out: dict[str, Any] = {"rows": rows, "batch": batch, "steps": steps, "window": window,
                           "instance_tokens": [min(len(step_instance(source.tokenizer, j)) + 1, steps)
                                               for j in range(rows)]}
    for mode, dvr in (("nondeterministic", False), ("dvr", True)):
        entry: dict[str, Any] = {}
        for part, whole in (("apply_processors_cpu_us", True), ("fill_masks_us", False)):
            walk(dvr, whole)  # warm
            step_s: list[float] = []
            verify_s: list[float] = []
            for _ in range(repeats):
                a, b = walk(dvr, whole)
                step_s += a
                verify_s += b
            entry[part] = {"step": summary_us(step_s), **({"verify_pass": summary_us(verify_s)} if dvr else {})}
        out[mode] = entry
    fills: dict[str, Any] = {}
    for size in (16, 64, 128, 256):
        matchers = [xgr.GrammarMatcher(compiled, max_rollback_tokens=-1) for _ in range(size)]
        for j, m in enumerate(matchers):  # spread along the instances: a mix of grammar positions
            for t in outputs[j % rows][: (j * 7) % 60]:
                m.accept_token(t)
        masks = torch.zeros((size, info.words), dtype=torch.int32)
        entry = {}
        for t in sorted({1, PARALLEL_THREADS}):
            batcher = xgr.BatchGrammarMatcher(max_threads=t)
            batcher.batch_fill_next_token_bitmask(matchers, masks)
            samples = [timed(lambda: batcher.batch_fill_next_token_bitmask(matchers, masks))[0]
                       for _ in range(20 * repeats)]
            entry[f"threads_{t}"] = summary_us(samples)
        fills[str(size)] = entry
    out["batch_fill_us"] = fills
    return out


def step_rows(source: Any, vocab: int, eos: list[int], rows: int, steps: int, batch: int
              ) -> tuple[Any, Any, Any, list[list[int]], list[int]]:
    """engine_steps' rows: SCHEMA's spec and its grammar compiled for the model, each row's outputs (an instance,
    then EOS to `steps`), and the logits rows of the `rows` constrained rows among `batch`."""
    from bench.schema_mix_bench import SCHEMA, spread
    from engine.grammar import GrammarSpec, compile_request_grammar

    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    compiled, info = compile_request_grammar(spec, source.tokenizer, vocab, eos)
    outputs = [(step_instance(source.tokenizer, j) + [eos[0]] * steps)[:steps] for j in range(rows)]
    return spec, compiled, info, outputs, sorted(spread(batch, rows / batch, offset=1))


def grammar_at(rev: str) -> ModuleType:
    """engine/grammar.py as it is at git revision `rev`, loaded as a module of its own."""
    code = subprocess.run(["git", "show", f"{rev}:engine/grammar.py"], cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout
    module = ModuleType(f"engine_grammar_at_{rev}")
    sys.modules[module.__name__] = module  # its dataclasses look their module up
    exec(compile(code, f"{rev}:engine/grammar.py", "exec"), module.__dict__)
    return module


def steps_against(source: Any, vocab: int, eos: list[int], rev: str, rows: int, steps: int, walks: int,
                  batch: int = 64) -> dict[str, Any]:
    """fill_masks per decode step of engine_steps' rows, this tree's engine.grammar against `rev`'s, the walks of
    the two taken in turn (on a shared VM the speed drifts between runs more than a change moves it): per mode,
    each side's mean µs per step of every walk, their fastest and median, and that both gave the same masks and
    states (the other tree's module runs on this tree's compiled grammar and vocabulary)."""
    import engine.grammar as here

    there = grammar_at(rev)
    _, compiled, info, outputs, at = step_rows(source, vocab, eos, rows, steps, batch)

    def walk(module: ModuleType, dvr: bool) -> tuple[float, list[torch.Tensor], list[list[int]]]:
        states = [module.GrammarState(compiled, info, keep_masks=dvr) for _ in range(rows)]
        masks, seconds = [], 0.0
        for n in range(steps):
            bitmask = torch.zeros((batch, info.words), dtype=torch.int32)
            committed = (n // 32) * 32 if dvr else n
            requests = [(s, out, n, committed, r) for out, s, r in zip(outputs, states, at)]
            t0 = time.perf_counter()
            module.fill_masks(requests, bitmask)
            seconds += time.perf_counter() - t0
            masks.append(bitmask)
        return seconds / steps * 1e6, masks, [s.ids for s in states]

    out: dict[str, Any] = {"against": rev, "rows": rows, "batch": batch, "steps": steps, "walks": walks}
    for mode, dvr in (("nondeterministic", False), ("dvr", True)):
        us: dict[str, list[float]] = {"this": [], "against": []}
        for i in range(walks + 1):  # the first of each side warms it
            order = [("this", here), ("against", there)][:: 1 if i % 2 else -1]
            for side, module in order:
                mean_us, _, _ = walk(module, dvr)
                if i:
                    us[side].append(round(mean_us, 2))
        (_, a_masks, a_ids), (_, b_masks, b_ids) = walk(here, dvr), walk(there, dvr)
        same = a_ids == b_ids and all(torch.equal(a, b) for a, b in zip(a_masks, b_masks))
        out[mode] = {"same_masks_and_states": same,
                     **{side: {"fastest_us": min(v), "median_us": statistics.median(v), "walks_us": v}
                        for side, v in us.items()}}
    return out


def step_instance(tokenizer: Any, j: int) -> list[int]:
    """Row j's output under schema_mix_bench.SCHEMA: a valid instance, indented for odd j, tokenized."""
    kinds = ["person", "place", "thing", "event"]
    record = {"name": f"Record {j}", "kind": kinds[j % 4], "year": 1800 + 13 * j,
              "tags": [f"tag {i}" for i in range(1 + j % 3)],
              "facts": [{"label": f"fact {i}", "value": f"value {i} of {j}", "confidence": round(0.1 * (i + j % 7), 2)}
                        for i in range(1 + j % 3)]}
    return list(tokenizer.encode(json.dumps(record, indent=2 if j % 2 else None), add_special_tokens=False))


PARTS = ("libraries", "window", "steps")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--name", default="grammar-bench", help="file stem of the JSON")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {list(PARTS)}")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="xgrammar compile threads (llguidance compiles lazily)")
    ap.add_argument("--rows", type=int, default=16, help="steps: constrained rows")
    ap.add_argument("--steps", type=int, default=96, help="steps: decode steps (outputs per row)")
    ap.add_argument("--against", metavar="REV", help="also time the steps' fill_masks against engine/grammar.py at git "
                    "revision REV, walks taken in turn (engine_steps_against)")
    ap.add_argument("--walks", type=int, default=40, help="--against: walks of each side per mode")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    if set(parts) - set(PARTS):
        ap.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; known {list(PARTS)}")
    torch.set_num_threads(1)
    from engine.loader import load_model_source

    source = load_model_source("default")
    tokenizer, vocab = source.tokenizer, int(source.hf_config.vocab_size)
    eos = sorted(source.info.eos_token_ids)
    libraries = ("xgrammar", "llguidance") if "libraries" in parts else ("xgrammar",)
    results: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]), "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": machine(), "commit": git_commit(),
        "model": source.info.name, "vocab_size": vocab, "compile_threads": a.threads,
        "versions": {p: metadata.version(p) for p in libraries},
    }
    if "libraries" in parts:
        results["libraries"] = {}
        for cls in (XGrammar, LLGuidance):
            lib = cls(tokenizer, vocab, eos, a.threads)
            results["libraries"][cls.name] = measure(lib, tokenizer, eos[0], a.repeats)
            print(cls.name, json.dumps(results["libraries"][cls.name], indent=1), flush=True)
    if "window" in parts:
        results["engine_grammar_state"] = engine_walk(source, vocab, eos, a.repeats)
        print("engine", json.dumps(results["engine_grammar_state"], indent=1), flush=True)
    if "steps" in parts:
        results["engine_steps"] = engine_steps(source, vocab, eos, a.repeats, a.rows, a.steps)
        print("steps", json.dumps(results["engine_steps"], indent=1), flush=True)
    if a.against:
        results["engine_steps_against"] = steps_against(source, vocab, eos, a.against, a.rows, a.steps, a.walks)
        print("against", json.dumps(results["engine_steps_against"], indent=1), flush=True)
    write_result(results, a.out, a.name)


if __name__ == "__main__":
    main()
