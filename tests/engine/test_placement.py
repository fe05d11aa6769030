"""engine/placement.py: the engine process's CPUs from the host's topology, and moving a process onto them."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
import threading

import pytest

from engine import placement


def _topology(cores: int, threads: int) -> list[dict]:
    """Linux's usual numbering: CPU c and c + cores are the hardware threads of core c."""
    n = cores * threads
    return [{"cpu": cpu, "package": 0, "core": cpu % cores,
             "siblings": [cpu % cores + k * cores for k in range(threads)]} for cpu in range(n)]


def test_the_engine_gets_every_hardware_thread_of_the_last_core() -> None:
    assert placement.plan_cpus(_topology(8, 2)) == [7, 15]
    assert placement.plan_cpus(_topology(16, 2)) == [15, 31]


def test_where_a_core_has_one_thread_the_engine_gets_two_cores() -> None:
    assert placement.plan_cpus(_topology(16, 1)) == [14, 15]
    assert placement.plan_cpus(_topology(8, 1)) == [6, 7]


def test_a_small_host_keeps_every_cpu_for_everyone() -> None:
    assert placement.plan_cpus(_topology(7, 1)) is None
    assert placement.plan_cpus(_topology(2, 1)) is None
    assert placement.plan_cpus(_topology(4, 2)) == [3, 7]  # 8 logical CPUs


def test_cpu_lists_parse_as_linux_writes_them() -> None:
    assert placement.parse_cpus("3") == [3]
    assert placement.parse_cpus("6-7,14") == [6, 7, 14]
    assert placement.parse_cpus("1,1,0") == [0, 1]
    for bad in ("", "a", "3-", "-1", "1;2"):
        with pytest.raises(ValueError, match="not a CPU list"):
            placement.parse_cpus(bad)


def test_this_hosts_topology_covers_the_allowed_cpus() -> None:
    topo = placement.cpu_topology()
    assert [e["cpu"] for e in topo] == placement.allowed_cpus()
    for entry in topo:
        assert entry["cpu"] in entry["siblings"]


def _spin(stop: threading.Event) -> None:
    stop.wait(10)


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(placement.allowed_cpus()) < 2,
                    reason="needs Linux affinity and two CPUs")
def test_pin_process_moves_every_thread_of_the_process() -> None:
    ctx = mp.get_context("spawn")
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_threads_then_wait, args=(ready, done), daemon=True)
    proc.start()
    try:
        assert ready.wait(60)
        cpu = placement.allowed_cpus()[-1]
        placement.pin_process(proc.pid, [cpu])
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert len(tids) >= 3
        assert {frozenset(os.sched_getaffinity(t)) for t in tids} == {frozenset({cpu})}
    finally:
        done.set()
        proc.join(10)


def _threads_then_wait(ready: object, done: object) -> None:
    stop = threading.Event()
    threads = [threading.Thread(target=_spin, args=(stop,)) for _ in range(2)]
    for t in threads:
        t.start()
    ready.set()  # type: ignore[attr-defined]
    done.wait(60)  # type: ignore[attr-defined]
    stop.set()


def test_a_setting_resolves_to_the_engines_cpus() -> None:
    allowed = placement.allowed_cpus()
    assert placement.resolve_cpus("off") is None
    assert placement.resolve_cpus("auto", "cpu") is None           # 'auto' places an engine on CUDA only
    assert placement.resolve_cpus("auto", "cuda", ranks=2) is None  # and with one rank
    if len(allowed) > 1:
        assert placement.resolve_cpus(str(allowed[-1]), "cpu") == [allowed[-1]]  # a list holds on any device
    for taken in (",".join(map(str, allowed)), "4096"):
        with pytest.raises(ValueError, match="must be some, not all, of the CPUs"):
            placement.resolve_cpus(taken)
