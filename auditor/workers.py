"""``serve`` with several HTTP worker processes sharing one engine process (``workers`` > 1).

One Python process cannot both serve hundreds of streamed, signed completions a second and keep up with a
small model on a GPU: HTTP parsing, authentication, JSON, signing and the log cost about a millisecond and a
half of CPU per completion. ``serve`` therefore runs, on a CUDA host, several worker processes:

    serve (this process)  binds the port, migrates, creates keys, then starts and watches the others
      engine process      one EngineCore (engine.engine_process.EngineHost), one pipe per worker
      worker 1..N         uvicorn + the app on its own listening socket of the port (SO_REUSEPORT: the
                          kernel spreads connections evenly over the workers); its engine is an
                          EngineProcess client on its pipe

On such a host the engine process gets a physical core of its own and the workers the other CPUs
(``settings.engine_cpus``, engine/placement.py): a small model's step is the engine thread's Python, and with the
workers and other processes free to run on its CPU it took 1.3-1.6x as long (bench/contention_probe.py).

The workers share what a replica shares (docs/replicas.md): the database (on SQLite, one file on this host;
appends take the database's write lock first), the key directory, and, in ``settings.run_dir``, the rate
limit buckets (``FileRateLimiter``), the console sessions (litestar's ``FileStore``) and the Prometheus
counters (multiprocess mode). With ``redis_url`` set, rate limits and sessions live in Redis instead.

The bits do not depend on the number of workers: there is one engine, and a request's bits never depend on
the batch it runs in. A worker that exits stops the whole server (exit status 1): a process manager restarts
it; a worker whose engine failed to load stops it too, with the engine's error.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import time
from typing import Any

from auditor.settings import Settings

log = logging.getLogger("auditor.workers")

ENGINE_LOAD_FAILED = 3
"""A worker's exit status when its engine could not be loaded."""


def resolved_workers(settings: Settings) -> int:
    """``settings.workers``, or when 0 the automatic count: 1 without CUDA, with the engine in the serving process
    or with an engine factory; else a quarter of the CPU cores, from 1 to 8."""
    if settings.workers:
        return settings.workers
    if not settings.engine_process or settings.engine_factory or settings.device == "cpu":
        return 1
    import torch

    if not torch.cuda.is_available():
        return 1
    return max(1, min(8, (os.cpu_count() or 1) // 4))


def engine_cpus(settings: Settings) -> list[int] | None:
    """The engine process's CPUs under ``settings.engine_cpus`` (engine.placement.resolve_cpus); None with an
    engine factory (no engine process)."""
    from engine.placement import resolve_cpus

    if settings.engine_factory:
        return None
    return resolve_cpus(settings.engine_cpus, settings.device, settings.tensor_parallel_size)


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """The listening sockets of ``count`` workers on ``(host, port)`` (port 0: one free port for all).

    Where the platform load-balances SO_REUSEPORT sockets (Linux), each worker gets one of its own: the kernel
    spreads new connections over their accept queues by address hash, so a burst of connections, and the
    keep-alive traffic each then carries, is shared out evenly. Elsewhere all workers share one socket and
    accept from it in turn (a worker's event loop takes every connection waiting when it wakes, so a burst
    may land on one)."""
    balanced = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    socks: list[socket.socket] = []
    try:
        for _ in range(count if balanced else 1):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if balanced:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, port))
            port = sock.getsockname()[1]
            sock.listen(2048)
            sock.set_inheritable(True)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks if balanced else socks * count


def _reset_run_dir(settings: Settings) -> None:
    """Empty the state the previous run's workers shared, before any new worker starts."""
    from auditor.ratelimit import FileRateLimiter

    run = settings.run_dir
    shutil.rmtree(run, ignore_errors=True)
    (run / "metrics").mkdir(parents=True, mode=0o700)
    (run / "sessions").mkdir(mode=0o700)
    (run / "ready").mkdir(mode=0o700)
    FileRateLimiter.reset(run / "ratelimit")


def serve_workers(settings: Settings, workers: int, *, stop_on_load_error: bool) -> int:
    """Run ``workers`` worker processes (and the shared engine process) until SIGINT / SIGTERM or until one of
    them exits. Returns the exit status: 0 after a signal, 1 when a worker exited by itself."""
    settings = dataclasses.replace(settings, workers=workers)
    _reset_run_dir(settings)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(settings.run_dir / "metrics")
    socks = listen_sockets(settings.host, settings.port, workers)
    host = None
    connections: list[Any] = [None] * workers
    cpus = engine_cpus(settings)
    worker_cpus = None
    if cpus:
        from engine.placement import allowed_cpus, pin_self

        worker_cpus = [c for c in allowed_cpus() if c not in cpus]
        pin_self(worker_cpus)  # this process too; the workers it starts inherit the set
        log.info("engine process on CPUs %s, workers on %s", cpus, worker_cpus,
                 extra={"event": "placement", "engine_cpus": cpus, "worker_cpus": worker_cpus})
    if not settings.engine_factory:
        from engine.cli import engine_config
        from engine.engine_process import EngineHost

        config = engine_config({**settings.engine_options, "model": settings.model, "device": settings.device,
                                "tensor_parallel_size": settings.tensor_parallel_size})
        host = EngineHost(config, workers, cpus=cpus)
        connections = list(host.connections)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_worker_main, args=(settings, sock, conn, stop_on_load_error),
                         name=f"verbatim-worker-{i}") for i, (sock, conn) in enumerate(zip(socks, connections))]
    for proc in procs:
        proc.start()
    for conn in connections:  # each end lives on in its worker
        if conn is not None:
            conn.close()
    for sock in set(socks):
        sock.close()
    stopping = {"signal": None}

    def on_signal(signum: int, _frame: Any) -> None:
        stopping["signal"] = signum

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while stopping["signal"] is None and all(p.is_alive() for p in procs):
            if host is not None and not host.alive():
                # a load failure reaches every worker, which then stops with ENGINE_LOAD_FAILED: let them
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and any(p.is_alive() for p in procs):
                    time.sleep(0.2)
                if not any(p.exitcode == ENGINE_LOAD_FAILED for p in procs):
                    log.error("the engine process exited (code %s)", host.exitcode, extra={"event": "engine_exit"})
                break
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    exited = [p for p in procs if not p.is_alive()]
    engine_gone = host is not None and not host.alive()
    for proc in procs:
        if proc.is_alive():
            proc.terminate()  # uvicorn's graceful shutdown: in-flight completions finish and are recorded
    deadline = time.monotonic() + 30
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if host is not None:
        host.stop(timeout_s=30)
    if stopping["signal"] is not None and not exited and not engine_gone:
        return 0
    if any(p.exitcode == ENGINE_LOAD_FAILED for p in exited):
        print(f"error: model {settings.model!r} could not be loaded, so the server stopped (the workers' log "
              "has the engine's error)", file=sys.stderr, flush=True)
    else:
        codes = ", ".join(f"{p.name}: {p.exitcode}" for p in exited) or "the engine process"
        print(f"error: a process of the server exited ({codes}), so the server stopped", file=sys.stderr,
              flush=True)
    return 1


def _worker_main(settings: Settings, sock: socket.socket, conn: Any, stop_on_load_error: bool) -> None:
    """One worker: the app on its listening socket, its engine the shared one (through ``conn``) or, with an
    engine factory, its own."""
    import uvicorn

    from auditor import logs
    from auditor.app import create_app
    from auditor.engine_seam import load_engine

    logs.configure(settings.log_level)

    def connect(_settings: Settings) -> Any:
        from engine.engine_process import EngineProcess

        return EngineProcess.connect(conn)

    server: Any = None

    def stop(_error: str) -> None:
        if server is not None and stop_on_load_error:
            server.should_exit = True

    app = create_app(settings, engine_loader=connect if conn is not None else load_engine, on_engine_error=stop)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None, access_log=False,
                                           timeout_graceful_shutdown=10))
    server.run(sockets=[sock])
    if app.state.services.engine_error and stop_on_load_error:
        sys.exit(ENGINE_LOAD_FAILED)
