"""EngineProcess: the engine in a spawned process behind AsyncEngine's interface. Streams, abort, replay,
rejection and a dead engine process on the mock model; the real SmolLM2's bits equal the in-process
engine's."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from types import SimpleNamespace

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_process import EngineProcess
from engine.grammar import GrammarSpec
from engine.llm import LLM
from engine.model_runner import LoadedModel
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import REAL_TEXTS, assert_same, det_workload, replay_requests
from tests.engine.mock_model import MockModel

CFG = dict(window=8, group=4, num_kv_blocks=64, num_threads=1)


def mock_loaded(config: EngineConfig) -> LoadedModel:
    """Run in the engine process: the mock model with EOS id 1."""
    model = MockModel()
    return LoadedModel(model, model.shape, None, SimpleNamespace(eos_token_ids=(1,), name="mock"))


def failing_loader(config: EngineConfig) -> LoadedModel:
    raise FileNotFoundError("no weights at /nowhere")


def _offline(prompts, params, **cfg):
    model = MockModel()
    llm = LLM.from_parts(EngineConfig.from_options({**CFG, **cfg}), model, model.shape, {1})
    return llm.generate(prompts, params)


async def _collect(engine, prompt, params, rid=None):
    return [o async for o in engine.generate(prompt, params, rid)]


@pytest.fixture(scope="module")
def mock_process():
    engine = EngineProcess(EngineConfig.from_options(CFG), loader=mock_loaded, start_timeout_s=300)
    yield engine
    asyncio.run(engine.shutdown())


async def test_streams_match_offline_and_in_process(mock_process: EngineProcess) -> None:
    prompts, params = det_workload(8, 64, max_tokens=(10, 25), seed=2)
    fast = [SamplingParams(max_tokens=18, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(4)]
    streams = await asyncio.gather(*[_collect(mock_process, p, sp) for p, sp in zip(prompts, params)],
                                   *[_collect(mock_process, prompts[i][::-1], sp) for i, sp in enumerate(fast)])
    for s in streams:  # cumulative and growing; only the last is finished
        lens = [len(o.token_ids) for o in s]
        assert lens == sorted(set(lens))
        assert s[-1].finished and not any(o.finished for o in s[:-1])
    assert_same([s[-1] for s in streams[: len(prompts)]], _offline(prompts, params))
    assert all(len(s[-1].token_ids) == 18 for s in streams[len(prompts):])
    model = MockModel()
    local = AsyncEngine(EngineConfig.from_options(CFG),
                        LoadedModel(model, model.shape, None, SimpleNamespace(eos_token_ids=(1,))))
    assert mock_process.runtime_fingerprint() == local.runtime_fingerprint()
    assert mock_process.system_fingerprint() == local.system_fingerprint()
    stats = mock_process.stats()
    assert stats.verify_passes > 0 and stats.generated_tokens > 0


async def test_abort_rejection_and_last_output(mock_process: EngineProcess) -> None:
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, deterministic=True)
    agen = mock_process.generate([3, 4, 5], params, "victim")
    first = await agen.__anext__()
    out = await mock_process.abort("victim")
    assert out is not None and out.finish_reason == "abort" and out.finished
    assert out.token_ids[: len(first.token_ids)] == first.token_ids
    rest = [o async for o in agen]
    assert rest and rest[-1].finish_reason == "abort"
    assert mock_process.last_output("victim").token_ids == out.token_ids
    assert await mock_process.abort("no-such-request") is None
    with pytest.raises(ValueError, match="max_tokens"):  # checked in the serving process, nothing sent
        await anext(mock_process.generate([1] * 60, SamplingParams(max_tokens=10_000)))
    with pytest.raises(ValueError, match="top_k"):
        mock_process.validate([1, 2], SamplingParams(top_k=10_000))
    gone = mock_process.generate([9, 10, 11], SamplingParams(max_tokens=300, ignore_eos=True), "gone")
    await gone.__anext__()
    await gone.aclose()  # the client went away: the engine process aborts it
    for _ in range(300):
        if mock_process.stats().running == 0:
            break
        await asyncio.sleep(0.01)
    assert mock_process.stats().running == 0


def test_streams_whose_event_loops_closed_do_not_stop_the_others(mock_process: EngineProcess) -> None:
    """Clients that went away with their event loop (the engine process answers their aborts later) leave
    the reader serving the requests that follow."""
    async def leave(i: int) -> None:
        agen = mock_process.generate([9, 10, 11 + i], SamplingParams(max_tokens=300, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()

    for i in range(3):
        asyncio.run(leave(i))

    async def finish() -> list:
        return [o async for o in mock_process.generate([3, 4], SamplingParams(max_tokens=5, ignore_eos=True))]

    outs = asyncio.run(asyncio.wait_for(finish(), 60))
    assert outs[-1].finished and len(outs[-1].token_ids) == 5


async def test_replay_in_the_engine_process(mock_process: EngineProcess) -> None:
    prompts, params = det_workload(6, 64, max_tokens=(10, 20), seed=3)
    made = _offline(prompts, params)
    seen: list[tuple[int, int]] = []
    results = await mock_process.replay(replay_requests(prompts, params, made), lambda d, t: seen.append((d, t)))
    assert [r.replay_id for r in results] == [f"rp{i}" for i in range(6)]
    assert all(r.first_mismatch is None for r in results)
    assert [r.token_logprobs for r in results] == [o.token_logprobs for o in made]
    total = sum(len(o.token_ids) for o in made)
    assert seen and seen[-1] == (total, total)
    reqs = replay_requests(prompts, params, made)
    with pytest.raises(ValueError, match="window_shape"):
        await mock_process.replay([reqs[0].__class__(**{**reqs[0].__dict__, "window_shape": (8, 32)})])


def test_a_model_that_cannot_load_is_an_error_at_start() -> None:
    with pytest.raises(RuntimeError, match="FileNotFoundError: no weights at /nowhere"):
        EngineProcess(EngineConfig.from_options(CFG), loader=failing_loader, start_timeout_s=300)


async def test_a_killed_engine_process_fails_its_streams() -> None:
    engine = EngineProcess(EngineConfig.from_options(CFG), loader=mock_loaded, start_timeout_s=300)
    try:
        agen = engine.generate([3, 4], SamplingParams(max_tokens=400, ignore_eos=True))
        await agen.__anext__()
        os.kill(engine._proc.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process exited"):
            async for _ in agen:
                pass
        assert not engine.alive
        with pytest.raises(RuntimeError, match="engine process is gone"):
            await anext(engine.generate([3, 4], SamplingParams(max_tokens=4)))
    finally:
        await engine.shutdown()


async def test_real_model_bits_equal_the_in_process_engine(make_real_llm) -> None:
    """SmolLM2 on the CPU: the engine process gives the in-process engine's token ids and logprobs."""
    engine = EngineProcess(EngineConfig(num_kv_blocks=130, num_threads=1), start_timeout_s=600)
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(t) for t in REAL_TEXTS[:3]]
        params = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11 + i, deterministic=True,
                                 logprobs=2, ignore_eos=True) for i in range(3)]
        schema = GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
        params[1] = dataclasses.replace(params[1], grammar=schema, prompt_logprobs=1, presence_penalty=0.5,
                                        logit_bias=((tok.encode("{")[0], 2.0),), ignore_eos=False)
        with pytest.raises(ValueError, match="grammar"):  # compiled in the serving process, nothing sent
            engine.validate(prompts[0], dataclasses.replace(params[0], grammar=GrammarSpec("json_schema", "{1")))
        streams = await asyncio.gather(*[_collect(engine, p, sp) for p, sp in zip(prompts, params)])
    finally:
        await engine.shutdown()
    expected = make_real_llm().generate(prompts, params)
    assert_same([s[-1] for s in streams], expected)
    assert [s[-1].text for s in streams] == [o.text for o in expected]
    assert [s[-1].top_logprobs for s in streams] == [o.top_logprobs for o in expected]
    assert streams[1][-1].prompt_logprobs and streams[1][-1].prompt_logprobs == expected[1].prompt_logprobs
    assert streams[1][-1].prompt_top_logprobs == expected[1].prompt_top_logprobs
