"""Golden bits: a fixed workload on the real SmolLM2 (float32, CPU) against committed token ids and logprobs.

The fixture (`golden/smollm2_cpu.json`) holds every committed token id and the exact float32 bits (hex) of
every logprob and top logprob. Any change to the engine that is meant to leave the numerics alone (a
refactor, a new feature that is off by default) must keep this test green; a change that is meant to move
bits regenerates the fixture on purpose:

    python -m tests.engine.test_golden_bits --write

Three runs, each one engine:

- `dvr`: deterministic requests (greedy, temperature with top-p, top-k, min-p, top logprobs) arriving
  staggered among non-deterministic co-traffic, with faults injected into the fast path. Only the
  deterministic rows are compared: DVR makes them a function of their own request whatever the schedule,
  so they must not move when the verify cadence or the batching changes.
- `nondeterministic`: the fast path alone, two waves (the second arrives while the first decodes, so
  prefill and decode passes mix and batch sizes vary). Every row is compared: the schedule of this run is a
  function of the workload, so its bits are too.
- `batch_invariant`: a short batch in the batch-invariant mode (its own tile kernels on the CPU).

CPU GEMM blocking follows the instruction set, so the bits hold for the machine class named in a fixture:
`golden/` holds one fixture per machine class (`smollm2_cpu*.json`, each naming its environment) and the test
takes the one made on this class; where none is, it skips and says how to write one.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.fingerprint import cpu_isa_flags
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput

GOLDEN = Path(__file__).parent / "golden"


def fixture_for(env: dict[str, Any]) -> Path | None:
    """The fixture made on the machine class `env`, if there is one."""
    for path in sorted(GOLDEN.glob("smollm2_cpu*.json")):
        if json.loads(path.read_text())["environment"] == env:
            return path
    return None


def new_fixture_path(env: dict[str, Any]) -> Path:
    """Where `--write` puts the fixture of a machine class that has none yet: named by its environment."""
    digest = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:10]
    return GOLDEN / f"smollm2_cpu-{digest}.json"

TEXTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "Roses are red,",
         "2 + 2 =", "The quick brown fox", "List three prime numbers:", "In 1969, the first humans"]


def f32_hex(x: float) -> str:
    """The float32 bits of a logprob (logprobs are float32 values carried as Python floats)."""
    return struct.pack(">f", x).hex()


def _det_params() -> list[SamplingParams]:
    base = dict(deterministic=True, ignore_eos=True)
    return [
        SamplingParams(max_tokens=7, temperature=0.0, seed=1, logprobs=2, **base),
        SamplingParams(max_tokens=9, temperature=0.8, top_p=0.9, seed=101, **base),
        SamplingParams(max_tokens=6, temperature=1.0, top_k=20, seed=102, **base),
        SamplingParams(max_tokens=8, temperature=0.7, min_p=0.05, top_k=50, top_p=0.95, seed=103, logprobs=3,
                       **base),
    ]


def _fast_params(seed0: int) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=6, temperature=0.0, logprobs=1, ignore_eos=True, seed=seed0),
        SamplingParams(max_tokens=8, temperature=1.0, seed=seed0 + 1, ignore_eos=True),
        SamplingParams(max_tokens=5, temperature=0.9, top_p=0.8, seed=seed0 + 2, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=1.1, top_k=10, seed=seed0 + 3, logprobs=2, ignore_eos=True),
    ]


def _record(out: RequestOutput) -> dict[str, Any]:
    row: dict[str, Any] = {"token_ids": out.token_ids, "logprobs": [f32_hex(x) for x in out.token_logprobs],
                           "finish_reason": out.finish_reason}
    if out.top_logprobs is not None:
        row["top_logprobs"] = [{str(t): f32_hex(x) for t, x in d.items()} for d in out.top_logprobs]
    return row


def _run_dvr(make_llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    llm = make_llm(window=4, group=2, fault_rate=0.2, fault_seed=5)
    core = llm.core
    det, fast = _det_params(), _fast_params(500)
    seqs = []
    for i in range(4):  # one deterministic and one non-deterministic request arrive every other step
        seqs.append(core.add_request(f"d{i}", prompts[i], det[i]))
        core.add_request(f"n{i}", prompts[4 + i], fast[i])
        core.step()
        core.step()
    while core.has_work():
        core.step()
    return [_record(core.output(s)) for s in seqs]


def _run_nondeterministic(make_llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    core = make_llm(mode="nondeterministic").core
    first, second = _fast_params(700), _fast_params(800)
    seqs = [core.add_request(f"a{i}", prompts[i], first[i]) for i in range(4)]
    for _ in range(3):
        core.step()
    seqs += [core.add_request(f"b{i}", prompts[4 + i], second[i]) for i in range(4)]
    while core.has_work():
        core.step()
    return [_record(core.output(s)) for s in seqs]


def _run_batch_invariant(make_llm: Any, prompts: list[list[int]]) -> list[dict[str, Any]]:
    llm = make_llm(mode="batch_invariant")
    params = [SamplingParams(max_tokens=4, temperature=0.0 if i == 0 else 0.9, seed=900 + i, deterministic=True,
                             ignore_eos=True) for i in range(3)]
    return [_record(o) for o in llm.generate(prompts[:3], params)]


RUNS = {"dvr": _run_dvr, "nondeterministic": _run_nondeterministic, "batch_invariant": _run_batch_invariant}


def environment() -> dict[str, Any]:
    """What the bits depend on outside the engine: the torch build, the CPU instruction set, the threads."""
    return {"torch": torch.__version__, "cpu_isa": cpu_isa_flags(), "torch_threads": torch.get_num_threads()}


def golden(make_llm: Any, tokenizer: Any) -> dict[str, Any]:
    prompts = [list(tokenizer.encode(t)) for t in TEXTS]
    return {"environment": environment(), "texts": TEXTS,
            "runs": {name: run(make_llm, prompts) for name, run in RUNS.items()}}


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    path = fixture_for(environment())
    if path is None:
        made = [json.loads(p.read_text())["environment"] for p in sorted(GOLDEN.glob("smollm2_cpu*.json"))]
        pytest.skip(f"golden bits were made on {made}, this is {environment()}; "
                    "write this machine's with `python -m tests.engine.test_golden_bits --write`")
    return json.loads(path.read_text())


@pytest.mark.parametrize("run", list(RUNS))
def test_golden_bits(make_real_llm: Any, smollm2_source: Any, expected: dict[str, Any], run: str) -> None:
    prompts = [list(smollm2_source.tokenizer.encode(t)) for t in expected["texts"]]
    got = RUNS[run](make_real_llm, prompts)
    want = expected["runs"][run]
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g == w, f"{run} row {i}: committed bits moved"


def test_golden_fixture_covers_the_workload(expected: dict[str, Any]) -> None:
    """The fixture is not vacuous: sampled rows, top logprobs and every run present, tokens of each row."""
    runs = expected["runs"]
    assert set(runs) == set(RUNS)
    assert [len(r["token_ids"]) for r in runs["dvr"]] == [p.max_tokens for p in _det_params()]
    assert len(runs["nondeterministic"]) == 8 and all(r["token_ids"] for r in runs["nondeterministic"])
    assert any("top_logprobs" in r for r in runs["dvr"]) and any("top_logprobs" in r for r in runs["nondeterministic"])


def dump(data: dict[str, Any]) -> str:
    """The fixture as JSON with one line per row, so a diff names the rows that moved."""
    runs = ",\n".join(f'  "{name}": [\n' + ",\n".join("   " + json.dumps(row) for row in rows) + "\n  ]"
                      for name, rows in data["runs"].items())
    return (f'{{\n "environment": {json.dumps(data["environment"])},\n "texts": {json.dumps(data["texts"])},\n'
            f' "runs": {{\n{runs}\n }}\n}}\n')


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the golden-bits fixture from this tree's engine.")
    parser.add_argument("--write", action="store_true",
                        help="write this machine class's fixture under golden/ (else print it)")
    args = parser.parse_args(argv)
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.loader import load_model_source
    from engine.model_runner import ModelShape
    from engine.models import arch_from_hf, build_model

    torch.set_num_threads(1)  # as tests/engine/conftest.py
    source = load_model_source("default")
    model = build_model(source.hf_config, torch.float32, "cpu")
    model.load_weights(source.weights())
    arch = arch_from_hf(source.hf_config)
    shape = ModelShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size, source.info.max_model_len)

    def make(**cfg: Any) -> LLM:
        cfg.setdefault("num_kv_blocks", 130)
        cfg.setdefault("cuda_graphs", False)
        cfg.setdefault("max_num_seqs", 32)
        return LLM.from_parts(EngineConfig(**cfg), model, shape, set(source.info.eos_token_ids), source.tokenizer)

    text = dump(golden(make, source.tokenizer))
    if args.write:
        env = environment()
        path = fixture_for(env) or new_fixture_path(env)
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        print(f"wrote {path}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
