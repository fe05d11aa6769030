"""Ledger throughput: completions recorded per second through the real HTTP service.

The service (``create_app``: litestar under uvicorn, API-key auth, the ledger, signing, the Merkle log,
JSON-lines logging as ``serve`` configures it) runs in a process of its own on the fake engine of
``tests/auditor/fake_engine.py`` (so the engine costs next to nothing and the append path is what is
measured), against a fresh SQLite file or a fresh PostgreSQL schema. A second process drives it with
``--clients`` concurrent HTTP/1.1 clients (aiohttp, keep-alive), each posting non-streaming
``/v1/completions`` (with ``--stream``: streamed, one event per commit, read to the end) back to back until
``--requests`` have completed.

After the run the log is checked: the latest signed checkpoint covers every completion (waiting for
it through ``GET /v1/log/checkpoint``), log indices are unique and dense, and a sample of transcripts
verifies with ``?verify=true``. The JSON result records the command, the machine and the date.

    python bench/ledger_bench.py --database sqlite --out bench/results/2026-12-04-cpu/ledger-sqlite.json
    python bench/ledger_bench.py --database postgres --postgres-url postgresql+asyncpg://postgres@127.0.0.1:5432/test

``--profile FILE`` runs the server under cProfile and writes its stats (``python -m pstats FILE``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import secrets
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results import git_commit, machine, write_result_file  # noqa: E402

TENANTS = 8
"""Clients are spread over this many tenants (one API key per client): one chain per tenant."""
VERIFY_SAMPLE = 32
SHARED = "a 2-core VM shared with other engineers' jobs; loadavg_at_start shows the background load"


@dataclass(frozen=True)
class Target:
    """Where the service keeps its data: a SQLite file in ``data_dir`` or a PostgreSQL schema."""

    database: str
    data_dir: str
    url: str | None
    schema: str | None

    def settings(self, port: int) -> Any:
        from auditor.settings import Settings

        return Settings(data_dir=Path(self.data_dir), port=port, database_url=self.url, database_schema=self.schema,
                        rate_limit_per_second=1e9, rate_limit_burst=1_000_000_000, bootstrap_admin=False)


# --- the server process ------------------------------------------------------------------------------


def serve(target: Target, port: int, step_delay: float, profile: str | None, log_file: str) -> None:
    """Run the service on the fake engine until SIGTERM/SIGINT (uvicorn's own handling)."""
    import logging

    import uvicorn

    from auditor import logs
    from auditor.app import create_app
    from tests.auditor.fake_engine import FakeAsyncEngine

    settings = target.settings(port)
    logs.configure(settings.log_level)
    handler = logging.FileHandler(log_file)
    handler.setFormatter(logs.JsonFormatter())
    logging.getLogger().handlers[:] = [handler]
    app = create_app(settings, engine=FakeAsyncEngine(step_delay=step_delay))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=10))
    if profile is None:
        server.run()
        return
    import cProfile
    import signal

    def stop(_signum: int, _frame: Any) -> None:
        raise SystemExit(0)

    # uvicorn re-raises the SIGTERM it handled once it has shut down: exit through ``finally``.
    signal.signal(signal.SIGTERM, stop)
    profiler = cProfile.Profile()
    try:
        profiler.runcall(server.run)
    finally:
        profiler.dump_stats(profile)


# --- set-up ---------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _pg(url: str, statement: str) -> None:
    import asyncpg

    connection = await asyncpg.connect(url.replace("postgresql+asyncpg://", "postgresql://"), timeout=10)
    try:
        await connection.execute(statement)
    finally:
        await connection.close()


def prepare(target: Target, clients: int) -> list[str]:
    """Migrate the database and create one client key per client, spread over ``TENANTS`` tenants."""
    from auditor import auth
    from auditor.db import migrate
    from auditor.db.session import create_engine, create_sessionmaker

    settings = target.settings(free_port())
    migrate.upgrade(settings.resolved_database_url, schema=settings.database_schema)

    async def keys() -> list[str]:
        db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
        try:
            async with create_sessionmaker(db)() as session, session.begin():
                return [(await auth.create_key(session, f"bench-{i % TENANTS}", "client"))[1] for i in range(clients)]
        finally:
            await db.dispose()

    return asyncio.run(keys())


def start_server(target: Target, port: int, args: argparse.Namespace, log_file: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, __file__, "_serve", json.dumps(asdict(target)), str(port), str(args.step_delay),
               args.profile or "", log_file]
    process = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode} before listening")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError(f"the server did not listen on port {port} within 60 s")


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the load ---------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    latencies: list[float]
    log_indices: list[int]
    transcript_ids: list[tuple[str, int]]
    """(transcript id, client number) for verification with the client's key."""
    errors: dict[str, int]
    seconds: float


async def drive(url: str, keys: list[str], total: int, max_tokens: int, stream: bool = False) -> Outcome:
    """``len(keys)`` clients, each on its own keep-alive connection, until ``total`` completions.

    aiohttp, not httpx: its client costs a fraction of the CPU per request, and the load generator
    shares this machine's cores with the service it measures."""
    import aiohttp

    latencies: list[float] = []
    indices: list[int] = []
    ids: list[tuple[str, int]] = []
    errors: dict[str, int] = {}
    issued = 0

    async def client(number: int) -> None:
        nonlocal issued
        headers = {"Authorization": f"Bearer {keys[number]}"}
        connector = aiohttp.TCPConnector(limit=1)
        async with aiohttp.ClientSession(url, headers=headers, connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=120)) as http:
            while issued < total:
                issued += 1
                body = {"model": "fake-model", "prompt": f"client {number} request {issued}",
                        "max_tokens": max_tokens, "seed": issued, "ignore_eos": True, "stream": stream}
                started = time.perf_counter()
                async with http.post("/v1/completions", json=body) as response:
                    payload = await (_last_event(response) if stream else response.json())
                latencies.append(time.perf_counter() - started)
                if response.status != 200 or "transcript" not in payload:
                    errors[str(response.status)] = errors.get(str(response.status), 0) + 1
                    continue
                indices.append(payload["transcript"]["log_index"])
                ids.append((payload["transcript"]["id"], number))

    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(len(keys))))
    return Outcome(latencies, indices, ids, errors, time.perf_counter() - started)


async def _last_event(response: Any) -> dict[str, Any]:
    """A streamed completion read to its end: its last JSON event (the one with the usage and the transcript)."""
    last: dict[str, Any] = {}
    async for line in response.content:
        if line.startswith(b"data: {"):
            last = json.loads(line[6:])
    return last


async def check_log(url: str, keys: list[str], outcome: Outcome, expected_size: int) -> dict[str, Any]:
    """Wait for a checkpoint covering every leaf, then verify a sample of transcripts."""
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        started = time.perf_counter()
        while True:
            checkpoint = (await http.get("/v1/log/checkpoint")).json()
            if checkpoint["tree_size"] >= expected_size or time.perf_counter() - started > 30:
                break
            await asyncio.sleep(0.05)
        waited = time.perf_counter() - started
        sample = outcome.transcript_ids[:: max(1, len(outcome.transcript_ids) // VERIFY_SAMPLE)]
        failures = []
        for transcript_id, number in sample:
            doc = (await http.get(f"/v1/transcripts/{transcript_id}", params={"verify": "true"},
                                  headers={"Authorization": f"Bearer {keys[number]}"})).json()
            if not doc.get("verification", {}).get("ok"):
                failures.append(transcript_id)
    dense = sorted(outcome.log_indices) == list(range(expected_size - len(outcome.log_indices), expected_size))
    return {"checkpoint_tree_size": checkpoint["tree_size"], "expected_tree_size": expected_size,
            "checkpoint_covers_all": checkpoint["tree_size"] == expected_size,
            "seconds_until_covering_checkpoint": round(waited, 3), "log_indices_unique_and_dense": dense,
            "verified_sample": len(sample), "verify_failures": failures}


async def count_checkpoints(target: Target) -> int:
    from sqlalchemy import text

    from auditor.db.session import create_engine

    settings = target.settings(free_port())
    db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        async with db.connect() as connection:
            return int((await connection.execute(text("SELECT count(*) FROM log_checkpoints"))).scalar_one())
    finally:
        await db.dispose()


# --- the ledger alone ----------------------------------------------------------------------------------------


def direct(target: Target, clients: int, total: int, max_tokens: int) -> dict[str, Any]:
    """``Ledger.append`` driven in this process by ``clients`` concurrent tasks until ``total`` appends:
    what the ledger sustains without HTTP, auth or the engine in front of it."""
    return asyncio.run(_direct(target, clients, total, max_tokens))


async def _direct(target: Target, clients: int, total: int, max_tokens: int) -> dict[str, Any]:
    import inspect

    from auditor.crypto import KeyRing
    from auditor.db.session import create_engine, create_sessionmaker
    from auditor.ledger import Ledger

    settings = target.settings(free_port())
    url, schema = settings.resolved_database_url, settings.database_schema
    reads = create_engine(url, schema=schema)
    engines = [reads]
    kwargs: dict[str, Any] = {}
    # The same command measures the ledger before group commit, which had no writer connection.
    if "writer" in inspect.signature(Ledger.__init__).parameters:
        engines.append(create_engine(url, schema=schema, connections=1))
        kwargs["writer"] = create_sessionmaker(engines[-1])
    ledger = Ledger(create_sessionmaker(reads), KeyRing.open(settings.keys_dir), settings.log_origin, **kwargs)
    if hasattr(ledger, "start"):
        await ledger.start(0)
    _draft("warm-up", 0, max_tokens)  # imports outside the measured time
    issued = 0

    async def client(number: int) -> None:
        nonlocal issued
        while issued < total:
            issued += 1
            await ledger.append(_draft(f"bench-{number % TENANTS}", issued, max_tokens))

    try:
        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(client(i) for i in range(clients)))
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    finally:
        if hasattr(ledger, "stop"):
            await ledger.stop()
        for engine in engines:
            await engine.dispose()
    return {"appends": total, "seconds": round(seconds, 3), "appends_per_second": round(total / seconds, 1),
            "cpu_ms_per_append": round(1000 * cpu / total, 3)}


def _draft(tenant: str, k: int, max_tokens: int) -> Any:
    """A transcript like the fake engine's completions of the HTTP run."""
    from auditor.ledger import TranscriptDraft
    from auditor.transcript import Api, DvrStats, ModelInfo, Status, new_salt, uuid7
    from tests.auditor.fake_engine import FakeAsyncEngine

    fake = FakeAsyncEngine()
    info = fake.model_info
    output = [(7 * k + i) % 26 for i in range(max_tokens)]
    now = dt.datetime.now(dt.UTC).isoformat().replace("+00:00", "Z")
    inputs = dict(
        transcript_id=str(uuid7()), tenant=tenant, api=Api.COMPLETIONS, received_at=now, completed_at=now,
        status=Status.COMPLETED, model=ModelInfo(info.name, info.weights_digest, info.tokenizer_digest,
                                                 info.chat_template_digest, info.dtype),
        runtime=fake.runtime_fingerprint(), sampling_params={"max_tokens": max_tokens, "temperature": 1.0,
                                                             "top_p": 1.0, "top_k": 0, "ignore_eos": True},
        seed=k, deterministic=True, prompt_ids=[k % 26] * 20, output_ids=output, salt=new_salt(),
        finish_reason="length", windows=[(1, min(9, max_tokens)), (min(9, max_tokens), max_tokens)],
        window_shape=(4, 8), logprobs=[-0.5] * max_tokens, dvr=DvrStats(2, 0, 0))
    return TranscriptDraft(inputs, "key_bench", fake.system_fingerprint(), {"prompt": "bench"}, "bench", "output")


# --- one run ------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace, database: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ledger-bench-") as tmp:
        schema = None
        url = None
        if database == "postgres":
            url = args.postgres_url
            schema = "ledger_bench_" + secrets.token_hex(4)
            asyncio.run(_pg(url, f"CREATE SCHEMA {schema}"))
        target = Target(database, tmp, url, schema)
        try:
            return _measure(args, target, tmp)
        finally:
            if schema is not None:
                asyncio.run(_pg(url or "", f"DROP SCHEMA {schema} CASCADE"))


def _measure(args: argparse.Namespace, target: Target, tmp: str) -> dict[str, Any]:
    keys = prepare(target, args.clients)
    ledger_only = direct(target, args.clients, args.requests, args.max_tokens) if args.direct else None
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(target, port, args, str(Path(tmp) / "server.log"))
    try:
        warm = asyncio.run(drive(url, keys, args.warmup, args.max_tokens, args.stream)) if args.warmup else None
        load_before = os.getloadavg()
        cpu_before = (time.process_time(), process_cpu_seconds(server.pid))
        outcome = asyncio.run(drive(url, keys, args.requests, args.max_tokens, args.stream))
        cpu = {"client": round(time.process_time() - cpu_before[0], 2),
               "server": round(process_cpu_seconds(server.pid) - cpu_before[1], 2)}
        done = (args.requests if ledger_only else 0) + args.warmup + args.requests
        checks = asyncio.run(check_log(url, keys, outcome, done - sum((warm.errors if warm else {}).values())
                                       - sum(outcome.errors.values())))
    finally:
        server.terminate()
        server.wait(timeout=60)
    checks["checkpoints_stored"] = asyncio.run(count_checkpoints(target))
    completed = len(outcome.log_indices)
    lat = sorted(outcome.latencies)
    return {
        "database": target.database, "clients": args.clients, "requests": args.requests, "warmup": args.warmup,
        "stream": args.stream, "max_tokens": args.max_tokens,
        "completed": completed, "errors": outcome.errors, "seconds": round(outcome.seconds, 3),
        "completions_per_second": round(completed / outcome.seconds, 1),
        "latency_ms": {"p50": round(1000 * statistics.median(lat), 2),
                       "p90": round(1000 * lat[int(0.90 * (len(lat) - 1))], 2),
                       "p99": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2)},
        "cpu_seconds": cpu, "server_cpu_ms_per_completion": round(1000 * cpu["server"] / max(1, completed), 3),
        "loadavg_at_start": [round(x, 2) for x in load_before], "log": checks,
        "ledger_only": ledger_only,
    }


def main(argv: list[str]) -> int:
    if argv[:1] == ["_serve"]:
        target = Target(**json.loads(argv[1]))
        serve(target, int(argv[2]), float(argv[3]), argv[4] or None, argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--postgres-url", default=os.environ.get("VERBATIM_TEST_POSTGRES_URL",
                                                                 "postgresql+asyncpg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=4000, help="measured completions")
    parser.add_argument("--warmup", type=int, default=256, help="completions before the measured ones")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--stream", action="store_true",
                        help="streamed completions (server-sent events, one per commit), read to the end")
    parser.add_argument("--step-delay", type=float, default=0.001, help="fake engine seconds per commit")
    parser.add_argument("--direct", action="store_true",
                        help="also drive Ledger.append in-process (no HTTP) on a fresh log first: the ledger alone")
    parser.add_argument("--profile", help="write the server's cProfile stats to this file")
    parser.add_argument("--repeat", type=int, default=1, help="measure each database this many times (interleaved)")
    parser.add_argument("--label", default="", help="free text stored in the result (e.g. the variant measured)")
    parser.add_argument("--out", help="write the JSON result here")
    args = parser.parse_args(argv)
    databases = ["sqlite", "postgres"] if args.database == "both" else [args.database]
    result = {
        "benchmark": "ledger_bench", "label": args.label,
        "command": shlex.join(["python", "bench/ledger_bench.py", *argv]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "git_commit": git_commit(), "machine": {**machine(), "shared": SHARED},
        "fake_engine": {"step_delay_s": args.step_delay, "max_tokens": args.max_tokens, "window": 8},
        "runs": [run(args, database) for _ in range(args.repeat) for database in databases],
    }
    print(json.dumps(result, indent=2))
    if args.out:
        write_result_file(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
