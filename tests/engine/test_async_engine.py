"""AsyncEngine on the mock model: streaming of committed tokens, concurrency, abort, replay, identity."""
from __future__ import annotations

import asyncio
import re
from types import SimpleNamespace

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_runner import LoadedModel
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import assert_same, det_workload, replay_requests
from tests.engine.mock_model import MockModel

CFG = dict(window=8, group=4, num_kv_blocks=64)


def _engine(**cfg) -> AsyncEngine:
    model = MockModel()
    info = SimpleNamespace(eos_token_ids=(1,))
    return AsyncEngine(EngineConfig.from_options({**CFG, **cfg}), LoadedModel(model, model.shape, None, info))


def _offline(prompts, params):
    model = MockModel()
    return LLM.from_parts(EngineConfig.from_options(CFG), model, model.shape, {1}).generate(prompts, params)


async def _collect(engine: AsyncEngine, prompt, params, rid=None):
    outs = [o async for o in engine.generate(prompt, params, rid)]
    return outs


async def test_streams_committed_tokens_and_matches_offline() -> None:
    prompts, params = det_workload(8, 64, max_tokens=(10, 25), seed=2)
    engine = _engine()
    await engine.start()
    try:
        streams = await asyncio.gather(*[_collect(engine, p, sp) for p, sp in zip(prompts, params)])
    finally:
        await engine.shutdown()
    finals = [s[-1] for s in streams]
    assert all(s[-1].finished and not any(o.finished for o in s[:-1]) for s in streams)
    for s in streams:  # cumulative, growing by whole committed windows
        lens = [len(o.token_ids) for o in s]
        assert lens == sorted(set(lens))
        for o in s[1:]:
            assert o.windows and o.windows[-1][1] == len(o.token_ids)
    assert_same(finals, _offline(prompts, params))
    assert engine.stats().verify_passes > 0


async def test_abort_returns_committed_and_frees_kv() -> None:
    engine = _engine()
    await engine.start()
    try:
        params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, deterministic=True)
        agen = engine.generate([3, 4, 5], params, "victim")
        first = await agen.__anext__()
        out = await engine.abort("victim")
        assert out is not None and out.finish_reason == "abort" and out.finished
        assert out.token_ids[: len(first.token_ids)] == first.token_ids
        rest = [o async for o in agen]
        assert rest and rest[-1].finish_reason == "abort"
        assert await engine.abort("no-such-request") is None
        ok = await _collect(engine, [7, 8], SamplingParams(max_tokens=5, ignore_eos=True))
        assert ok[-1].finished and len(ok[-1].token_ids) == 5
    finally:
        await engine.shutdown()
    blocks = engine.core.scheduler.blocks
    assert blocks.num_free == blocks.num_usable


async def test_cancelled_iterator_aborts_request() -> None:
    engine = _engine()
    await engine.start()
    try:
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        agen = engine.generate([9, 10, 11], params, "gone")
        await agen.__anext__()
        await agen.aclose()  # the client went away
        for _ in range(200):
            if engine.stats().running == 0 and engine.stats().waiting == 0:
                break
            await asyncio.sleep(0.01)
        assert engine.stats().running == 0
        last = engine.last_output("gone")
        assert last is not None and last.finish_reason == "abort"
    finally:
        await engine.shutdown()


async def test_replay_through_async_engine() -> None:
    prompts, params = det_workload(6, 64, max_tokens=(10, 20), seed=3)
    made = _offline(prompts, params)
    engine = _engine(fault_rate=0.3)
    await engine.start()
    try:
        results = await engine.replay(replay_requests(prompts, params, made))
        with pytest.raises(ValueError, match="window_shape"):
            reqs = replay_requests(prompts, params, made)
            await engine.replay([reqs[0].__class__(**{**reqs[0].__dict__, "window_shape": (8, 32)})])
    finally:
        await engine.shutdown()
    assert [r.replay_id for r in results] == [f"rp{i}" for i in range(6)]
    assert all(r.first_mismatch is None for r in results)
    assert [r.token_logprobs for r in results] == [o.token_logprobs for o in made]


def test_fingerprint_fields_and_short_hash() -> None:
    engine = _engine()
    fp = engine.runtime_fingerprint()
    for key in ("engine_version", "torch_version", "device_name", "attention_backend", "mode", "window", "group",
                "sampler", "dtype", "cpu_isa", "torch_threads", "cuda_version"):
        assert key in fp, key
    assert fp["window"] == 8 and fp["group"] == 4 and fp["sampler"] == "verbatim-gumbel-splitmix64-v1"
    assert fp["row_kernels"] == "torch-cpu-rows-v2-silu-exp"  # the CPU SwiGLU's formula changes the bits
    assert re.fullmatch(r"fp_[0-9a-f]{12}", engine.system_fingerprint())
    assert _engine(window=16).system_fingerprint() != engine.system_fingerprint()


async def test_streams_with_carried_decode_rows_match_offline() -> None:
    """verify_decode_rows: deterministic streams beside non-deterministic ones, whose decode steps ride in the
    verify passes, give the offline bits; the non-deterministic streams finish too, carried or not."""
    prompts, params = det_workload(8, 64, max_tokens=(10, 25), seed=4)
    fast = [SamplingParams(max_tokens=18, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(6)]
    engine = _engine(verify_decode_rows=4, overlap=True)
    await engine.start()
    try:
        streams = await asyncio.gather(*[_collect(engine, p, sp) for p, sp in zip(prompts, params)],
                                       *[_collect(engine, prompts[i][::-1], sp) for i, sp in enumerate(fast)])
    finally:
        await engine.shutdown()
    assert_same([s[-1] for s in streams[: len(prompts)]], _offline(prompts, params))
    assert all(s[-1].finished and len(s[-1].token_ids) == 18 for s in streams[len(prompts):])
    assert engine.stats().carried_decode_rows > 0
