"""``serve`` with several HTTP worker processes (auditor/workers.py).

Real ``python -m auditor serve`` processes on a fresh SQLite data directory: with the fake engine (an engine
factory gives each worker its own), concurrent clients spread over the workers must leave one consistent log
(every completion recorded once, dense indices, the checkpoint covering all of them) and the Prometheus counters
summed over the workers; with the real default model, the workers share one engine process and a deterministic
request gives the same bits whichever worker serves it. Also the shared rate-limit file and the settings' checks.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from auditor.ratelimit import FileRateLimiter
from auditor.settings import Settings
from auditor.workers import engine_cpus, listen_sockets, resolved_workers
from tests.auditor.processes import Process
from tests.auditor.replicas_support import FAKE_ENGINE
from tests.auditor.conftest import REAL_ENGINE_OPTIONS, free_port


def test_file_rate_limiter_is_one_bucket_per_key_across_instances(tmp_path: Path) -> None:
    path = tmp_path / "ratelimit"
    FileRateLimiter.reset(path)
    now = [100.0]
    a = FileRateLimiter(path, 2.0, 3, clock=lambda: now[0])
    b = FileRateLimiter(path, 2.0, 3, clock=lambda: now[0])
    assert [a.acquire("k"), b.acquire("k"), a.acquire("k")] == [None, None, None]
    assert b.acquire("k") == pytest.approx(0.5)          # the burst of 3 is spent, whichever process asks
    assert a.acquire("other") is None                     # another key, another bucket
    now[0] += 0.5                                        # one token back at 2 per second
    assert b.acquire("k") is None
    assert a.acquire("k") == pytest.approx(0.5)
    FileRateLimiter.reset(path)
    assert FileRateLimiter(path, 2.0, 3, clock=lambda: now[0]).acquire("k") is None


def test_file_rate_limiter_gives_the_longest_idle_slot_to_a_new_key_when_full(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(FileRateLimiter, "SLOTS", 4)
    monkeypatch.setattr(FileRateLimiter, "PROBES", 4)
    path = tmp_path / "ratelimit"
    FileRateLimiter.reset(path)
    now = [0.0]
    limiter = FileRateLimiter(path, 1.0, 1, clock=lambda: now[0])
    for i in range(4):
        now[0] = float(i)
        assert limiter.acquire(f"k{i}") is None
    now[0] = 3.5
    assert limiter.acquire("k3") is not None   # k3 spent its token at t=3 and is still in the table
    assert limiter.acquire("k4") is None       # takes k0's slot (idle since t=0)
    assert limiter.acquire("k3") is not None   # k3 kept its own


def test_workers_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="workers must be >= 0"):
        Settings(workers=-1)
    with pytest.raises(ValueError, match="engine_process must be on"):
        Settings(workers=2, engine_process=False)
    assert resolved_workers(Settings(workers=3)) == 3
    assert resolved_workers(Settings(device="cpu")) == 1
    assert resolved_workers(Settings(engine_process=False)) == 1
    for bad in ("all", "1-", "", "2;3"):
        with pytest.raises(ValueError, match="engine_cpus: not a CPU list"):
            Settings(engine_cpus=bad)
    assert engine_cpus(Settings(engine_cpus="off")) is None
    assert engine_cpus(Settings(device="cpu")) is None  # 'auto' places the engine on CUDA hosts only
    assert engine_cpus(Settings(tensor_parallel_size=2)) is None  # and with one rank
    everything = ",".join(map(str, os.sched_getaffinity(0)))
    with pytest.raises(ValueError, match="must be some, not all, of the CPUs"):
        engine_cpus(Settings(engine_cpus=everything))
    with pytest.raises(ValueError, match="must be some, not all, of the CPUs"):
        engine_cpus(Settings(engine_cpus="4096"))


def _children(server: Process) -> list[Any]:
    """The processes ``serve`` started (multiprocessing's resource tracker left out)."""
    import psutil

    assert server.proc is not None
    return [p for p in psutil.Process(server.proc.pid).children()
            if "resource_tracker" not in " ".join(p.cmdline())]


def _admin_key(log: str) -> str:
    return next(line.strip() for line in log.splitlines() if line.strip().startswith("vbk_"))


async def _load(url: str, key: str, n: int) -> list[int]:
    """``n`` completions, half streamed, over 16 connections at once; returns their log indices."""
    indices: list[int] = []

    async def client(k: int) -> None:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as http:
            for i in range(k, n, 16):
                body = {"model": "fake-model", "prompt": f"request {i}", "max_tokens": 8, "seed": i}
                if i % 2:
                    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        assert r.status_code == 200, await r.aread()
                        lines = [line async for line in r.aiter_lines() if line.startswith("data: {")]
                    tail = json.loads(lines[-1][6:])
                    indices.append(tail["transcript"]["log_index"])
                else:
                    r = await http.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    indices.append(r.json()["transcript"]["log_index"])

    await asyncio.gather(*(client(k) for k in range(16)))
    return indices


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT balancing is Linux's")
def test_each_worker_listens_on_the_port_and_connections_are_spread_over_them() -> None:
    """Every worker gets a listening socket of its own on the one port, and the kernel spreads a burst of
    connections over all of them (with one shared socket, whichever worker woke first would take the burst)."""
    socks = listen_sockets("127.0.0.1", 0, 4)
    clients: list[socket.socket] = []
    try:
        assert len(set(socks)) == 4
        port = socks[0].getsockname()[1]
        assert {s.getsockname() for s in socks} == {("127.0.0.1", port)}
        clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(200)]
        accepted = [0] * len(socks)
        for i, sock in enumerate(socks):
            sock.setblocking(False)
            while select.select([sock], [], [], 0.2)[0]:
                sock.accept()[0].close()
                accepted[i] += 1
        assert sum(accepted) == 200 and min(accepted) > 0, accepted
    finally:
        for c in [*clients, *socks]:
            c.close()


@pytest.mark.timeout(180)
def test_workers_on_one_sqlite_file_keep_one_log(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {"VERBATIM_DATA_DIR": str(tmp_path / "data"), "VERBATIM_ENGINE_FACTORY": FAKE_ENGINE,
           "VERBATIM_WORKERS": "3", "VERBATIM_PORT": str(port), "VERBATIM_LOG_LEVEL": "WARNING",
           "VERBATIM_RATE_LIMIT_PER_SECOND": "100000", "VERBATIM_RATE_LIMIT_BURST": "100000"}
    server = Process(("serve",), tmp_path / "serve.log", env).start()
    try:
        server.wait_http(url + "/readyz", timeout=120)
        assert "with 3 worker processes" in server.output()
        key = _admin_key(server.output())
        n = 96
        indices = asyncio.run(_load(url, key, n))
        assert sorted(indices) == list(range(n))
        headers = {"Authorization": f"Bearer {key}"}
        checkpoint = httpx.get(url + "/v1/log/checkpoint", headers=headers, timeout=30).json()
        assert checkpoint["tree_size"] == n
        run_dir = Settings(data_dir=tmp_path / "data", port=port).run_dir
        metric_files = list((run_dir / "metrics").glob("*.db"))
        assert len({f.stem.rsplit("_", 1)[-1] for f in metric_files}) >= 2, metric_files  # several workers served
        metrics = httpx.get(url + "/metrics", headers=headers, timeout=30).text
        completed = [line for line in metrics.splitlines()
                     if line.startswith("verbatim_completions_total{") and 'status="completed"' in line]
        assert sum(float(line.rsplit(" ", 1)[1]) for line in completed) == n, completed
        # a console login made through one worker holds on every worker (sessions in the run directory)
        login = httpx.post(url + "/ui/login", data={"api_key": key}, timeout=30)
        assert login.status_code == 303 and login.headers["location"] == "/ui/transcripts"
        for _ in range(12):  # a fresh connection each: the kernel spreads them over the workers
            page = httpx.get(url + "/ui/transcripts", cookies=login.cookies, timeout=30, follow_redirects=False)
            assert page.status_code == 200, (page.status_code, page.headers.get("location"))
    finally:
        server.stop()
    assert server.proc is not None and server.proc.returncode == 0, server.output()[-3000:]


@pytest.mark.timeout(120)
def test_a_worker_that_dies_stops_the_server(tmp_path: Path) -> None:
    port = free_port()
    env = {"VERBATIM_DATA_DIR": str(tmp_path / "data"), "VERBATIM_ENGINE_FACTORY": FAKE_ENGINE,
           "VERBATIM_WORKERS": "2", "VERBATIM_PORT": str(port), "VERBATIM_LOG_LEVEL": "WARNING"}
    server = Process(("serve",), tmp_path / "serve.log", env).start()
    try:
        server.wait_http(f"http://127.0.0.1:{port}/readyz", timeout=120)
        import psutil

        workers = _children(server)
        assert len(workers) == 2
        os.kill(workers[0].pid, signal.SIGKILL)
        assert server.proc.wait(timeout=60) == 1
        assert "exited" in server.output()
        assert not any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers)
    finally:
        server.stop()


@pytest.mark.timeout(300)
def test_workers_share_one_real_engine_and_its_bits(tmp_path: Path) -> None:
    """Two workers on the default model: one engine process (the fingerprint every worker reports is the same),
    and the same deterministic request gives the same token ids and logprobs, bit for bit, on every connection."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cpus = sorted(os.sched_getaffinity(0))
    env = {"VERBATIM_DATA_DIR": str(tmp_path / "data"), "VERBATIM_WORKERS": "2", "VERBATIM_PORT": str(port),
           "VERBATIM_LOG_LEVEL": "WARNING", "VERBATIM_ENGINE_OPTIONS": json.dumps(REAL_ENGINE_OPTIONS),
           # the engine process on the last CPU, the workers on the others (a CUDA host's 'auto' does this)
           "VERBATIM_ENGINE_CPUS": str(cpus[-1]) if len(cpus) > 1 else "off"}
    server = Process(("serve",), tmp_path / "serve.log", env).start()
    try:
        server.wait_http(url + "/readyz", timeout=240)
        children = _children(server)
        assert len(children) == 3, children  # the engine process and two workers
        if len(cpus) > 1:
            placed = sorted(sorted(p.cpu_affinity()) for p in children)
            assert placed == sorted([cpus[:-1], cpus[:-1], [cpus[-1]]]), placed
        key = _admin_key(server.output())
        body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "The capital of France is", "max_tokens": 6,
                "seed": 11, "temperature": 0.9, "logprobs": 1, "deterministic": True}

        async def once(k: int) -> tuple[list[Any], list[str]]:
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"},
                                         timeout=120) as http:
                models = (await http.get("/v1/models")).json()
                r = await http.post("/v1/completions", json={**body, "model": models["data"][0]["id"]})
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                return [choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"]], [r.json()["system_fingerprint"]]

        async def all_at_once() -> list[tuple[list[Any], list[str]]]:
            return list(await asyncio.gather(*(once(k) for k in range(6))))

        results = asyncio.run(all_at_once())
        bits = {json.dumps([tokens, [float.hex(x) for x in lps]]) for (tokens, lps), _ in results}
        assert len(bits) == 1, bits
        assert len({fp for _, fps in results for fp in fps}) == 1

        async def interrupted() -> list[dict[str, Any]]:
            """Ctrl-C reaches the whole process group once a streamed completion has sent its first tokens: it
            still completes and is recorded."""
            events: list[dict[str, Any]] = []
            async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"},
                                         timeout=120) as http:
                model = (await http.get("/v1/models")).json()["data"][0]["id"]
                async with http.stream("POST", "/v1/completions", json={
                        **body, "model": model, "max_tokens": 8, "ignore_eos": True, "stream": True}) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        events.append(json.loads(line[6:]))
                        if len(events) == 1:
                            os.killpg(server.proc.pid, signal.SIGINT)
            return events

        events = asyncio.run(interrupted())
        assert not any("error" in e for e in events), events[-1]
        assert events[-1]["transcript"]["log_index"] >= 0
        assert events[-1]["usage"]["completion_tokens"] == 8
        assert server.proc.wait(timeout=60) == 0, server.output()[-3000:]
    finally:
        server.stop()


@pytest.mark.timeout(180)
def test_workers_stop_with_the_engine_error_when_the_model_cannot_load(tmp_path: Path) -> None:
    port = free_port()
    env = {"VERBATIM_DATA_DIR": str(tmp_path / "data"), "VERBATIM_WORKERS": "2", "VERBATIM_PORT": str(port),
           "VERBATIM_LOG_LEVEL": "WARNING", "VERBATIM_MODEL": str(tmp_path / "missing.gguf")}
    server = Process(("serve",), tmp_path / "serve.log", env).start()
    assert server.proc is not None
    assert server.proc.wait(timeout=150) == 1, server.output()[-3000:]
    assert "could not be loaded" in server.output()


async def test_readyz_waits_for_every_worker(tmp_path: Path) -> None:
    """With ``workers`` = 2, a worker whose engine is up still answers 503 until the other one's is too: a
    client that saw 200 may be handed to either."""
    from dataclasses import replace

    from tests.auditor.conftest import serving, sqlite_settings
    from tests.auditor.fake_engine import FakeAsyncEngine

    settings = replace(await asyncio.to_thread(sqlite_settings, tmp_path), workers=2)
    (settings.run_dir / "ready").mkdir(parents=True)
    async with serving(settings, FakeAsyncEngine()) as server:
        async with httpx.AsyncClient(base_url=server.url) as http:
            first = await http.get("/readyz")
            assert first.status_code == 503 and first.json()["checks"] == {
                "engine": True, "database": True, "log": True, "workers": False}
            (settings.run_dir / "ready" / "12345").touch()   # the other worker's engine is up
            assert (await http.get("/readyz")).status_code == 200
