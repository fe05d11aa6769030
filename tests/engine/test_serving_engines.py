"""Both serving engines on the mock model, through the interface the service uses (auditor.engine_seam):
AsyncEngine (a thread in this process) and EngineProcess (a process of its own). Streams of committed
tokens, abort, rejection, a client that goes away, replay."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import assert_same, det_workload, replay_requests
from tests.engine.serving_cases import collect, in_process_engine, offline


@pytest.fixture(params=["async_engine", "engine_process"])
async def serving(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A started serving engine of each kind (the engine process is shared by the tests)."""
    if request.param == "engine_process":
        yield request.getfixturevalue("mock_engine_process")
        return
    engine = in_process_engine()
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


async def test_streams_committed_tokens_and_match_offline(serving: Any) -> None:
    prompts, params = det_workload(8, 64, max_tokens=(10, 25), seed=2)
    fast = [SamplingParams(max_tokens=18, temperature=0.9, seed=40 + i, ignore_eos=True) for i in range(4)]
    streams = await asyncio.gather(*[collect(serving, p, sp) for p, sp in zip(prompts, params)],
                                   *[collect(serving, prompts[i][::-1], sp) for i, sp in enumerate(fast)])
    for s in streams:  # cumulative and growing; only the last is finished
        lens = [len(o.token_ids) for o in s]
        assert lens == sorted(set(lens))
        assert s[-1].finished and not any(o.finished for o in s[:-1])
    for s in streams[: len(prompts)]:  # deterministic streams grow by whole committed windows
        for o in s[1:]:
            assert o.windows and o.windows[-1][1] == len(o.token_ids)
    assert_same([s[-1] for s in streams[: len(prompts)]], offline(prompts, params))
    assert all(len(s[-1].token_ids) == 18 for s in streams[len(prompts):])
    stats = serving.stats()
    assert stats.verify_passes > 0 and stats.generated_tokens > 0


async def test_abort_rejection_and_last_output(serving: Any) -> None:
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, deterministic=True)
    agen = serving.generate([3, 4, 5], params, "victim")
    first = await agen.__anext__()
    out = await serving.abort("victim")
    assert out is not None and out.finish_reason == "abort" and out.finished
    assert out.token_ids[: len(first.token_ids)] == first.token_ids
    rest = [o async for o in agen]
    assert rest and rest[-1].finish_reason == "abort"
    assert serving.last_output("victim").token_ids == out.token_ids
    assert await serving.abort("no-such-request") is None
    with pytest.raises(ValueError, match="max_tokens"):  # checked on the way in, nothing queued or sent
        await anext(serving.generate([1] * 60, SamplingParams(max_tokens=10_000)))
    with pytest.raises(ValueError, match="top_k"):
        serving.validate([1, 2], SamplingParams(top_k=10_000))
    ok = await collect(serving, [7, 8], SamplingParams(max_tokens=5, ignore_eos=True))
    assert ok[-1].finished and len(ok[-1].token_ids) == 5
    if isinstance(serving, AsyncEngine):  # the aborted and the finished request left no KV behind
        blocks = serving.core.scheduler.blocks
        assert blocks.num_free == blocks.num_usable


async def test_cancelled_iterator_aborts_request(serving: Any) -> None:
    agen = serving.generate([9, 10, 11], SamplingParams(max_tokens=300, ignore_eos=True), "gone")
    await agen.__anext__()
    await agen.aclose()  # the client went away: the engine aborts the request
    for _ in range(300):
        if serving.stats().running == 0 and serving.stats().waiting == 0:
            break
        await asyncio.sleep(0.01)
    assert serving.stats().running == 0
    last = serving.last_output("gone")
    assert last is not None
    if isinstance(serving, AsyncEngine):  # the engine thread records the abort; the serving process of an
        # engine process keeps what it had streamed when the client left
        assert last.finish_reason == "abort"


async def test_replay(serving: Any) -> None:
    prompts, params = det_workload(6, 64, max_tokens=(10, 20), seed=3)
    made = offline(prompts, params)
    seen: list[tuple[int, int]] = []
    results = await serving.replay(replay_requests(prompts, params, made), lambda d, t: seen.append((d, t)))
    assert [r.replay_id for r in results] == [f"rp{i}" for i in range(6)]
    assert all(r.first_mismatch is None for r in results)
    assert [r.token_logprobs for r in results] == [o.token_logprobs for o in made]
    total = sum(len(o.token_ids) for o in made)
    assert seen and seen[-1] == (total, total)
    reqs = replay_requests(prompts, params, made)
    with pytest.raises(ValueError, match="window_shape"):
        await serving.replay([reqs[0].__class__(**{**reqs[0].__dict__, "window_shape": (8, 32)})])
