"""Appends per second with 1 and N replicas on one PostgreSQL database.

Each run starts fresh ``python -m auditor serve`` processes on a new database, sharing a data directory
and Redis, with the test fake engine (``VERBATIM_ENGINE_FACTORY``, one committed token per request) so
the figure is the service's recording path — authenticate, sign, transcript + content rows, log leaf and
checkpoint under the cross-process append lock, commit — not the model. ``--clients`` concurrent clients
send ``--requests`` non-streaming completions spread round-robin over the replicas; appends/s is requests
over wall time (after ``--warmup`` requests), checked against the growth of the log.

    VERBATIM_TEST_POSTGRES_URL=postgresql+asyncpg://postgres@127.0.0.1:5432/test \\
    python bench/replicas_bench.py --replicas 1 3 --out bench/results/2026-12-04-cpu/replicas-appends.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results import write_result_file  # noqa: E402
from tests.auditor.replicas_support import Cluster, create_database, drop_database  # noqa: E402


async def _drive(urls: list[str], key: str, requests: int, clients: int) -> float:
    counter = iter(range(requests))
    headers = {"Authorization": f"Bearer {key}"}

    async def client(c: int) -> None:
        async with httpx.AsyncClient(timeout=60, headers=headers) as http:
            for n in counter:
                response = await http.post(f"{urls[(c + n) % len(urls)]}/v1/completions", json={
                    "model": "fake-model", "prompt": f"bench {n}", "max_tokens": 1, "deterministic": True,
                    "seed": n})
                response.raise_for_status()

    started = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(clients)))
    return time.perf_counter() - started


def _tree_size(url: str) -> int:
    return int(httpx.get(url + "/v1/log/checkpoint", timeout=30).json()["tree_size"])


def run_one(base_url: str, redis_url: str | None, replicas: int, requests: int, clients: int, warmup: int) -> dict[str, Any]:
    database = create_database(base_url, "verbatim_replicas_bench")
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(database, Path(tmp) / "data", redis_url,
                          {"VERBATIM_RATE_LIMIT_PER_SECOND": "100000", "VERBATIM_RATE_LIMIT_BURST": "100000",
                           "VERBATIM_ENGINE_OPTIONS": json.dumps({"step_delay": 0.0})})
        try:
            cluster.start(replicas)
            key = cluster.create_key("bench")
            asyncio.run(_drive(cluster.urls, key, warmup, clients))
            before = _tree_size(cluster.urls[0])
            seconds = asyncio.run(_drive(cluster.urls, key, requests, clients))
            appended = _tree_size(cluster.urls[0]) - before
        finally:
            cluster.stop()
            drop_database(database)
    assert appended == requests, (appended, requests)
    return {"replicas": replicas, "clients": clients, "requests": requests, "seconds": round(seconds, 3),
            "appends_per_second": round(requests / seconds, 1)}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=40)
    parser.add_argument("--repeat", type=int, default=1, help="rounds over --replicas, interleaved (noisy machines)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    base_url = os.environ["VERBATIM_TEST_POSTGRES_URL"]
    redis_url = os.environ.get("VERBATIM_TEST_REDIS_URL")
    runs = []
    load_before = os.getloadavg()
    for _ in range(args.repeat):
        for n in args.replicas:
            runs.append(run_one(base_url, redis_url, n, args.requests, args.clients, args.warmup))
            print(json.dumps(runs[-1]), flush=True)
    median = {str(n): statistics.median(r["appends_per_second"] for r in runs if r["replicas"] == n)
              for n in args.replicas}
    result = {
        "benchmark": "appends per second, N replicas on one PostgreSQL database",
        "command": "python bench/replicas_bench.py " + " ".join(sys.argv[1:]),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(),
                    "load_average_1_5_15_before": [round(x, 2) for x in load_before],
                    "load_average_1_5_15_after": [round(x, 2) for x in os.getloadavg()]},
        "engine": "test fake engine (tests.auditor.fake_engine.from_settings), one committed token per request",
        "database": "PostgreSQL on 127.0.0.1; rate limits in Redis" if redis_url else "PostgreSQL on 127.0.0.1",
        "median_appends_per_second": median,
        "runs": runs,
    }
    write_result_file(result, args.out)
    print(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
