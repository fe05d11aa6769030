"""EngineProcess: the engine in a spawned process behind AsyncEngine's interface. On the mock model: its
fingerprint, clients whose event loops closed, a model that cannot load, a dead engine process; the real
SmolLM2's bits equal the in-process engine's. Streams, abort and replay of both serving engines:
test_serving_engines.py."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_process import EngineProcess
from engine.grammar import GrammarSpec
from engine.model_runner import LoadedModel
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import REAL_TEXTS, assert_same
from tests.engine.serving_cases import SERVING_CFG, mock_loaded

CFG = SERVING_CFG


def failing_loader(config: EngineConfig) -> LoadedModel:
    raise FileNotFoundError("no weights at /nowhere")


async def _collect(engine, prompt, params, rid=None):
    return [o async for o in engine.generate(prompt, params, rid)]


def test_the_fingerprint_is_the_in_process_engines(mock_engine_process: EngineProcess) -> None:
    local = AsyncEngine(EngineConfig.from_options(CFG), mock_loaded(EngineConfig.from_options(CFG)))
    assert mock_engine_process.runtime_fingerprint() == local.runtime_fingerprint()
    assert mock_engine_process.system_fingerprint() == local.system_fingerprint()


def test_streams_whose_event_loops_closed_do_not_stop_the_others(mock_engine_process: EngineProcess) -> None:
    """Clients that went away with their event loop (the engine process answers their aborts later) leave
    the reader serving the requests that follow."""
    async def leave(i: int) -> None:
        agen = mock_engine_process.generate([9, 10, 11 + i], SamplingParams(max_tokens=300, ignore_eos=True))
        await agen.__anext__()
        await agen.aclose()

    for i in range(3):
        asyncio.run(leave(i))

    async def finish() -> list:
        return [o async for o in mock_engine_process.generate([3, 4], SamplingParams(max_tokens=5, ignore_eos=True))]

    outs = asyncio.run(asyncio.wait_for(finish(), 60))
    assert outs[-1].finished and len(outs[-1].token_ids) == 5


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


@pytest.mark.slow
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
