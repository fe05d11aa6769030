"""EngineProcess: the engine in a spawned process behind AsyncEngine's interface. On the mock model: its
fingerprint, clients whose event loops closed, a model that cannot load, a dead engine process, and the step
messages, which rebuild the core's outputs after every step; the real SmolLM2's bits equal the in-process
engine's. Streams, abort and replay of both serving engines: test_serving_engines.py; several clients of one
engine process: test_engine_host.py."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import struct
import time
from collections import OrderedDict

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.engine_process import EngineProcess, _Publisher, _Request, decode_message, encode_step
from engine.grammar import GrammarSpec
from engine.model_runner import LoadedModel
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import REAL_TEXTS, assert_same, assert_windows_cover, det_workload
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
        os.kill(engine._host.pid, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="engine process exited"):
            async for _ in agen:
                pass
        assert not engine.alive
        with pytest.raises(RuntimeError, match="engine process is gone"):
            await anext(engine.generate([3, 4], SamplingParams(max_tokens=4)))
    finally:
        await engine.shutdown()


def test_step_messages_rebuild_the_cores_outputs_bit_for_bit() -> None:
    """Each step of an in-process EngineCore (mock model), through the wire as the engine process sends it
    (_Publisher's deltas, encode_step, decode_message) into a client's request table (EngineProcess._apply):
    after every step the client's output of each request equals the core's, logprobs bit for bit."""
    config = EngineConfig.from_options(CFG)
    loaded = mock_loaded(config)
    core = EngineCore(config, loaded.model, loaded.shape, {1})
    prompts, params = det_workload(6, 64, max_tokens=(10, 30), seed=9)
    params[1] = dataclasses.replace(params[1], logprobs=3, prompt_logprobs=2)
    params[2] = dataclasses.replace(params[2], logprobs=0)
    params += [SamplingParams(max_tokens=25, temperature=0.9, seed=3, logprobs=2, ignore_eos=True)]
    prompts += [prompts[0][::-1]]
    client = EngineProcess.__new__(EngineProcess)  # the request table only: no process, no event loop
    client._requests, client._last, client._detokenize, client._window_shape = {}, OrderedDict(), None, (4, 8)
    publisher, seqs = _Publisher(), {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        seqs[f"r{i}"] = core.add_request(f"r{i}", p, sp)
        publisher.open(f"r{i}")
        client._requests[f"r{i}"] = _Request(p, sp, None, None)
    windows_seen = 0
    started = time.perf_counter()
    while core.has_work():
        deltas = [d for d in (publisher.delta(s) for s in core.step()) if d is not None]
        kind, (received, stats) = decode_message(bytes(encode_step(deltas, core.stats())))
        assert kind == "step" and received == deltas and stats == core.stats()
        client._apply(received, None, None, None, None)
        windows_seen += sum(len(d.windows) for d in received)
        for rid, seq in seqs.items():
            out = client.last_output(rid)
            if out is not None:
                assert out == core.output(seq)
                assert float_bits(out.token_logprobs) == float_bits(seq.logprobs)
    looped = time.perf_counter() - started
    assert not client._requests and all(client.last_output(rid).finished for rid in seqs)
    assert windows_seen == sum(len(s.windows) for s in seqs.values()) > len(seqs)
    assert client.last_output("r1").top_logprobs and client.last_output("r1").prompt_top_logprobs
    # the counters the stats carry: every step counted, its time in step() summed (a share of the loop's time)
    stats = core.stats()
    assert stats.steps >= stats.prefill_passes > 0 and stats.decode_passes > 0 and stats.verify_passes > 0
    assert 0 < stats.step_seconds < looped


@pytest.mark.slow
async def test_real_model_bits_equal_the_in_process_engine(make_real_llm) -> None:
    """SmolLM2 on the CPU: the engine process gives the in-process engine's token ids, logprobs (bit for bit),
    top logprobs and text; a request alone, the in-process engine's windows too."""
    engine = EngineProcess(EngineConfig(num_kv_blocks=130, num_threads=1), start_timeout_s=600)
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(t) for t in REAL_TEXTS[:4]]
        params = [SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=11 + i, deterministic=True,
                                 logprobs=2, ignore_eos=True) for i in range(3)]
        schema = GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}')
        params[1] = dataclasses.replace(params[1], grammar=schema, prompt_logprobs=1, presence_penalty=0.5,
                                        logit_bias=((tok.encode("{")[0], 2.0),), ignore_eos=False)
        params.append(SamplingParams(max_tokens=11, temperature=0.0, seed=5, deterministic=True, ignore_eos=True))
        with pytest.raises(ValueError, match="grammar"):  # compiled in the serving process, nothing sent
            engine.validate(prompts[0], dataclasses.replace(params[0], grammar=GrammarSpec("json_schema", "{1")))
        streams = await asyncio.gather(*[_collect(engine, p, sp) for p, sp in zip(prompts, params)])
        alone = (await _collect(engine, prompts[0], params[0]))[-1]
    finally:
        await engine.shutdown()
    llm = make_real_llm()
    expected = llm.generate(prompts, params)
    expected_alone = llm.generate(prompts[:1], params[:1])[0]
    assert (alone.windows, alone.token_ids, float_bits(alone.token_logprobs), alone.top_logprobs) == (
        expected_alone.windows, expected_alone.token_ids, float_bits(expected_alone.token_logprobs),
        expected_alone.top_logprobs)
    got = [s[-1] for s in streams]
    assert_same(got, expected)
    assert [float_bits(o.token_logprobs) for o in got] == [float_bits(o.token_logprobs) for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    assert [o.top_logprobs for o in got] == [o.top_logprobs for o in expected]
    assert got[0].top_logprobs and got[3].top_logprobs is None
    for s in streams:  # the windows as committed; where a window ends depends on the batch it ran in
        assert all(o.windows == s[-1].windows[:len(o.windows)] for o in s)
        assert_windows_cover(s[-1], s[-1].window_shape[1])
    assert [o.seed for o in got] == [o.seed for o in expected]
    assert streams[1][-1].prompt_logprobs and streams[1][-1].prompt_logprobs == expected[1].prompt_logprobs
    assert streams[1][-1].prompt_top_logprobs == expected[1].prompt_top_logprobs


def float_bits(values: list[float]) -> list[bytes]:
    return [struct.pack("<d", v) for v in values]


def test_the_loops_command_and_publishing_seconds_are_counted(mock_engine_process: EngineProcess) -> None:
    """The engine process's loop counts the time it spent on commands (not its waits for them) and sending its
    steps' outputs; with the steps' own time they fit in the wall time that passed, most of it idle here."""
    before = mock_engine_process.stats()
    started = time.perf_counter()
    time.sleep(0.3)  # idle: the loop waits for commands, which does not count

    async def run() -> list:
        return [o async for o in mock_engine_process.generate([5, 6, 7], SamplingParams(max_tokens=20,
                                                                                       ignore_eos=True))]

    outs = asyncio.run(asyncio.wait_for(run(), 60))
    assert outs[-1].finished
    time.sleep(0.3)  # the stats ride on the step message sent when the engine falls idle
    after, elapsed = mock_engine_process.stats(), time.perf_counter() - started
    commands = after.command_seconds - before.command_seconds
    publish = after.publish_seconds - before.publish_seconds
    steps = after.step_seconds - before.step_seconds
    assert commands > 0 and publish > 0 and steps > 0
    assert commands + publish + steps < elapsed - 0.5


async def test_the_in_process_engines_loop_counts_them_too() -> None:
    config = EngineConfig.from_options(CFG)
    engine = AsyncEngine(config, mock_loaded(config))
    await engine.start()
    try:
        started = time.perf_counter()
        await asyncio.sleep(0.3)
        outs = [o async for o in engine.generate([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))]
        assert outs[-1].finished
        stats, elapsed = engine.stats(), time.perf_counter() - started
        assert stats.command_seconds > 0 and stats.publish_seconds > 0 and stats.step_seconds > 0
        assert stats.command_seconds + stats.publish_seconds + stats.step_seconds < elapsed - 0.25
    finally:
        await engine.shutdown()
