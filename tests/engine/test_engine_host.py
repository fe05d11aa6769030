"""EngineHost: one engine process shared by several clients (EngineProcess.connect), each in a process of its
own or in this one. On the mock model: each client gets its own requests' streams and its own replays (whose
tokens are equal across clients), and a client that shuts down leaves the others served. On the real SmolLM2:
two client processes generating at once get the in-process engine's bits, a client process killed mid-stream
leaves the other's request finishing with the same bits, and host.stop() ends the engine process."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import signal
import struct
import threading
from multiprocessing.connection import Connection
from typing import Any

import pytest

from engine.config import EngineConfig
from engine.core import EngineStats
from engine.engine_process import EngineHost, EngineProcess
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from tests.engine.dvr_cases import REAL_TEXTS, assert_same, assert_windows_cover, det_workload, replay_requests
from tests.engine.serving_cases import SERVING_CFG, collect, mock_loaded, offline

REAL_CFG = dict(num_kv_blocks=130, num_threads=1)


def _generating_client(conn: Connection, requests: list[tuple[list[int], SamplingParams]], results: Connection) -> None:
    """A client process: connect, run `requests` at once, send back their last outputs, shut down."""
    async def main() -> list[RequestOutput]:
        engine = await asyncio.to_thread(EngineProcess.connect, conn, start_timeout_s=600)
        try:
            streams = await asyncio.gather(*[collect(engine, p, sp) for p, sp in requests])
        finally:
            await engine.shutdown()
        return [s[-1] for s in streams]

    results.send(asyncio.run(main()))


def _streaming_client(conn: Connection, prompt: list[int], params: SamplingParams, results: Connection) -> None:
    """A client process that reports each output's length until it is killed."""
    async def main() -> None:
        engine = await asyncio.to_thread(EngineProcess.connect, conn, start_timeout_s=600)
        async for out in engine.generate(prompt, params):
            results.send(len(out.token_ids))

    asyncio.run(main())


def _bits(out: RequestOutput) -> tuple[Any, ...]:
    """What does not depend on the batch a request ran in (its windows do: checked by assert_windows_cover)."""
    assert_windows_cover(out, out.window_shape[1])
    return (out.token_ids, [struct.pack("<d", v) for v in out.token_logprobs], out.top_logprobs, out.text,
            out.finish_reason, out.seed)


def _recv(conn: Connection, timeout_s: float) -> Any:
    assert conn.poll(timeout_s), f"no message from the client process in {timeout_s} s"
    return conn.recv()


async def test_clients_keep_their_own_streams_and_replays() -> None:
    host = EngineHost(EngineConfig.from_options(SERVING_CFG), clients=2, loader=mock_loaded)
    try:
        a, b = [await asyncio.to_thread(EngineProcess.connect, c, start_timeout_s=300) for c in host.connections]
        prompts, params = det_workload(6, 64, max_tokens=(10, 20), seed=5)
        made = offline(prompts, params)
        streams = await asyncio.gather(*[collect(a if i < 3 else b, p, sp)
                                         for i, (p, sp) in enumerate(zip(prompts, params))])
        assert_same([s[-1] for s in streams], made)
        for s in streams:
            assert_windows_cover(s[-1], s[-1].window_shape[1])
        assert {o.request_id for s in streams[:3] for o in s}.isdisjoint(b._last)
        # each client's first replay token is 0: the engine keeps them apart
        reqs = replay_requests(prompts, params, made)
        on_a, on_b = await asyncio.gather(a.replay(reqs[:3]), b.replay(reqs[:3]))
        for results in (on_a, on_b):
            assert [r.replay_id for r in results] == ["rp0", "rp1", "rp2"]
            assert [r.token_logprobs for r in results] == [o.token_logprobs for o in made[:3]]
        agen = a.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True))
        await agen.__anext__()
        await a.shutdown()  # its request is aborted; the engine serves b on
        assert not a.alive and host.alive()
        with pytest.raises(RuntimeError, match="closed this client's connection"):
            async for _ in agen:
                pass
        alone = await collect(b, prompts[0], params[0])
        assert_same([alone[-1]], made[:1])
        for _ in range(300):
            if b.stats().running == 0:
                break
            await asyncio.sleep(0.01)
        assert b.stats().running == 0 and b.stats().waiting == 0
        await b.shutdown()
        await asyncio.to_thread(host.join, 30)  # every client closed: the engine process ends
        assert not host.alive() and host.exitcode == 0
    finally:
        host.stop(timeout_s=5)


@pytest.mark.slow
def test_two_client_processes_get_the_in_process_engines_bits(smollm2_source: Any, make_real_llm: Any) -> None:
    tok = smollm2_source.tokenizer
    prompts = [tok.encode(t) for t in REAL_TEXTS[:4]]
    params = [SamplingParams(max_tokens=6 + i, temperature=0.8, top_p=0.9, seed=21 + i, deterministic=True,
                             logprobs=2 if i % 2 else None, ignore_eos=True) for i in range(4)]
    ctx = mp.get_context("spawn")
    host = EngineHost(EngineConfig(**REAL_CFG), clients=2)
    try:
        children, results = [], []
        for k, conn in enumerate(host.connections):
            theirs, mine = ctx.Pipe(duplex=False)
            requests = list(zip(prompts, params))[2 * k: 2 * k + 2]
            child = ctx.Process(target=_generating_client, args=(conn, requests, mine))
            child.start()
            conn.close()
            mine.close()
            children.append(child)
            results.append(theirs)
        got = [out for r in results for out in _recv(r, 600)]
        for child in children:
            child.join(30)
            assert child.exitcode == 0
        host.join(30)  # both clients shut down: the engine process ends
        assert not host.alive() and host.exitcode == 0
    finally:
        host.stop(timeout_s=5)
    expected = make_real_llm().generate(prompts, params)
    assert [_bits(o) for o in got] == [_bits(o) for o in expected]
    assert all(o.windows for o in got) and got[1].top_logprobs and got[0].top_logprobs is None


@pytest.mark.slow
async def test_a_killed_client_process_leaves_the_other_served(smollm2_source: Any, make_real_llm: Any) -> None:
    tok = smollm2_source.tokenizer
    prompt = tok.encode(REAL_TEXTS[4])
    params = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=5, deterministic=True, logprobs=1,
                            ignore_eos=True)
    ctx = mp.get_context("spawn")
    host = EngineHost(EngineConfig(**REAL_CFG), clients=2)
    try:
        progress, mine = ctx.Pipe(duplex=False)
        victim = ctx.Process(target=_streaming_client, args=(
            host.connections[0], tok.encode(REAL_TEXTS[5]), SamplingParams(max_tokens=1000, ignore_eos=True), mine))
        victim.start()
        host.connections[0].close()
        mine.close()
        engine = await asyncio.to_thread(EngineProcess.connect, host.connections[1], start_timeout_s=600)
        await asyncio.to_thread(_recv, progress, 600)  # the victim's request is running
        agen = engine.generate(prompt, params)
        outs = [await agen.__anext__()]
        os.kill(victim.pid, signal.SIGKILL)
        await asyncio.to_thread(victim.join, 30)
        outs += [o async for o in agen]
        for _ in range(200):  # the victim's request (1000 tokens) was aborted: the engine falls idle
            if engine.stats().running == 0 and engine.stats().waiting == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.stats().running == 0 and engine.stats().waiting == 0
        assert host.alive() and engine.alive
        await asyncio.to_thread(host.stop, 30)
        assert not host.alive() and host.exitcode is not None
        await asyncio.to_thread(engine._reader.join, 30)  # the reader read the end of the connection
        assert not engine.alive
        with pytest.raises(RuntimeError, match="engine process is gone"):
            await anext(engine.generate(prompt, params))
        await engine.shutdown()
    finally:
        host.stop(timeout_s=5)
    expected = make_real_llm().generate([prompt], [params])
    assert outs[-1].finished and _bits(outs[-1]) == _bits(expected[0])


class _CountingCore:
    """The part of EngineCore that _EngineLoop._commands touches: requests added, whether any is queued, and the
    counters (command seconds)."""

    def __init__(self, busy: bool = True) -> None:
        self.added: list[str] = []
        self.busy = busy  # False: has no work whatever was added (the engine stepped it all)
        self.totals = EngineStats()

    def add_request(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        self.added.append(rid)

    def has_work(self) -> bool:
        return self.busy and bool(self.added)


def test_a_burst_of_requests_is_admitted_between_steps_not_before_them() -> None:
    """The engine process takes at most _COMMANDS_PER_STEP commands between two steps while it has work, so a
    flood of requests from its clients does not hold its steps back until the flood ends; idle, it takes them
    all (nothing to step)."""
    from engine import engine_process as ep

    pipes = [mp.Pipe() for _ in range(2)]
    control_ours, control_theirs = mp.Pipe()
    loop = object.__new__(ep._EngineLoop)
    loop.core, loop.publisher, loop.owner, loop.stop = _CountingCore(), ep._Publisher(), {}, False
    loop.clients = ep._Clients([theirs for _, theirs in pipes], control_theirs)
    try:
        burst = 3 * ep._COMMANDS_PER_STEP
        for k in range(burst):
            pipes[k % 2][0].send(("add", f"r{k}", [1, 2, 3], SamplingParams(max_tokens=1)))
        first = loop._commands(0)
        assert ep._COMMANDS_PER_STEP <= first < ep._COMMANDS_PER_STEP + len(pipes), first
        assert loop.core.added == [f"r{k}" for k in range(first)]  # in arrival order, two clients interleaved
        second = loop._commands(0)
        assert ep._COMMANDS_PER_STEP <= second < ep._COMMANDS_PER_STEP + len(pipes)
        while loop._commands(0):
            pass
        assert len(loop.core.added) == burst and set(loop.owner) == {f"r{k}" for k in range(burst)}
        loop.core = _CountingCore(busy=False)  # nothing to step: every waiting command runs at once
        for k in range(burst):
            pipes[k % 2][0].send(("add", f"s{k}", [1], SamplingParams(max_tokens=1)))
        assert loop._commands(0) == burst
    finally:
        for ours, theirs in [*pipes, (control_ours, control_theirs)]:
            ours.close()
            theirs.close()


def _delta(rid: str, start: int, tokens: list[int]) -> Any:
    from engine.engine_process import Delta

    return Delta(rid, start, tokens, [-0.5] * len(tokens), None, 0, [], False, None, 1, False, 0, 0, 0)


def test_a_client_that_reads_slowly_does_not_hold_the_engine_back() -> None:
    """Step messages to a client whose connection is full wait in the engine process's queue (the engine steps
    on) and go out later as one message, the deltas in order; a message of another kind sends the queue first."""
    from engine import engine_process as ep

    pipes = [mp.Pipe() for _ in range(2)]
    control_ours, control_theirs = mp.Pipe()
    clients = ep._Clients([theirs for _, theirs in pipes], control_theirs)
    sent: list[int] = []

    def steps() -> None:  # far more than a socket's buffer holds, to client 0, which reads nothing meanwhile
        for k in range(3000):
            clients.send_step(0, [_delta(f"r{j}", k, [k]) for j in range(40)], None)
            clients.send_step(1, [_delta("s", k, [k])], None)
            clients.flush(block=False)
            sent.append(k)

    stepper = threading.Thread(target=steps, daemon=True)
    stepper.start()
    stepper.join(60)
    try:
        assert not stepper.is_alive() and len(sent) == 3000, "a send to the full connection blocked the engine"
        assert clients.queued[0][0], "client 0's connection never filled: the test did not test the queue"
        tokens: dict[str, list[int]] = {}
        kinds: list[str] = []

        def read() -> None:
            while not kinds or kinds[-1] != "rejected":
                kind, body = ep.decode_message(pipes[0][0].recv_bytes())
                kinds.append(kind)
                for d in body[0] if kind == "step" else []:
                    assert d.start == len(tokens.setdefault(d.request_id, []))
                    tokens[d.request_id].extend(d.token_ids)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        clients.send(0, ("rejected", "x", "why"))  # another kind of message: the queue goes first
        reader.join(60)
        assert kinds[-1] == "rejected" and set(kinds[:-1]) == {"step"} and len(kinds) < 3001
        assert tokens == {f"r{j}": list(range(3000)) for j in range(40)}
        other: list[int] = []
        while pipes[1][0].poll(0.5):
            other.extend(t for d in ep.decode_message(pipes[1][0].recv_bytes())[1][0] for t in d.token_ids)
        clients.flush(block=True)
        while pipes[1][0].poll(0.5):
            other.extend(t for d in ep.decode_message(pipes[1][0].recv_bytes())[1][0] for t in d.token_ids)
        assert other == list(range(3000))
    finally:
        for conn in [*(ours for ours, _ in pipes), control_ours]:
            conn.close()
