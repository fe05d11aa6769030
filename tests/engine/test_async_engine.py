"""AsyncEngine on the mock model: what only the in-process engine has (identity fields, carried decode rows,
replay beside fault injection). Streams, abort and replay of both serving engines: test_serving_engines.py."""
from __future__ import annotations

import asyncio
import re

from engine.sampling import SamplingParams
from tests.engine.dvr_cases import assert_same, det_workload, replay_requests
from tests.engine.serving_cases import collect, in_process_engine, offline


async def test_replay_beside_fast_path_faults() -> None:
    """A replay runs no fast path: an engine injecting faults into it replays the records exactly."""
    prompts, params = det_workload(6, 64, max_tokens=(10, 20), seed=3)
    made = offline(prompts, params)
    engine = in_process_engine(fault_rate=0.3)
    await engine.start()
    try:
        results = await engine.replay(replay_requests(prompts, params, made))
    finally:
        await engine.shutdown()
    assert [r.replay_id for r in results] == [f"rp{i}" for i in range(6)]
    assert all(r.first_mismatch is None for r in results)
    assert [r.token_logprobs for r in results] == [o.token_logprobs for o in made]


def test_fingerprint_fields_and_short_hash() -> None:
    engine = in_process_engine()
    fp = engine.runtime_fingerprint()
    for key in ("engine_version", "torch_version", "device_name", "attention_backend", "mode", "window", "group",
                "sampler", "dtype", "cpu_isa", "torch_threads", "cuda_version"):
        assert key in fp, key
    assert fp["window"] == 8 and fp["group"] == 4 and fp["sampler"] == "verbatim-gumbel-splitmix64-v1"
    assert fp["row_kernels"] == "torch-cpu-rows-v2-silu-exp"  # the CPU SwiGLU's formula changes the bits
    assert re.fullmatch(r"fp_[0-9a-f]{12}", engine.system_fingerprint())
    assert in_process_engine(window=16).system_fingerprint() != engine.system_fingerprint()


async def test_streams_with_carried_decode_rows_match_offline() -> None:
    """verify_decode_rows: deterministic streams beside non-deterministic ones, whose decode steps ride in the
    verify passes, give the offline bits; the non-deterministic streams finish too, carried or not."""
    prompts, params = det_workload(8, 64, max_tokens=(10, 25), seed=4)
    fast = [SamplingParams(max_tokens=18, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(6)]
    engine = in_process_engine(verify_decode_rows=4, overlap=True)
    await engine.start()
    try:
        streams = await asyncio.gather(*[collect(engine, p, sp) for p, sp in zip(prompts, params)],
                                       *[collect(engine, prompts[i][::-1], sp) for i, sp in enumerate(fast)])
    finally:
        await engine.shutdown()
    assert_same([s[-1] for s in streams[: len(prompts)]], offline(prompts, params))
    assert all(s[-1].finished and len(s[-1].token_ids) == 18 for s in streams[len(prompts):])
    assert engine.stats().carried_decode_rows > 0
