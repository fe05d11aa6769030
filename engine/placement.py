"""Where the engine process runs on the host's CPUs.

A model whose step is host-bound (SmolLM2 on a GPU: the step is the engine thread's Python and its kernel
launches) slows down when the service's other processes share its CPU, or the other hardware thread of its core.
The service can keep one physical core for the engine process: every hardware thread of it for the engine, the
rest of the host for the HTTP workers (auditor.workers). ``plan_cpus`` picks that core; ``pin_process`` moves a
process, all its threads, onto a set of CPUs.

Linux only (sched_setaffinity, /sys/devices/system/cpu); elsewhere the plan is None and nothing moves.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

# the fewest CPUs this process may use before a core is set apart for the engine: below it the workers would lose
# too large a share of the host
MIN_CPUS_TO_RESERVE = 8
_SYS = Path("/sys/devices/system/cpu")


def allowed_cpus() -> list[int]:
    """The CPUs this process may run on."""
    if not hasattr(os, "sched_getaffinity"):
        return list(range(os.cpu_count() or 1))
    return sorted(os.sched_getaffinity(0))


def _cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def parse_cpus(text: str) -> list[int]:
    """A CPU list as Linux writes it ('0-3,8'); ValueError naming the problem otherwise."""
    if not re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", text.strip()):
        raise ValueError(f"not a CPU list (like '3' or '6-7,14'): {text!r}")
    return sorted(set(_cpu_list(text)))


def cpu_topology(cpus: list[int] | None = None) -> list[dict[str, Any]]:
    """Per allowed logical CPU: its package, core and hardware-thread siblings (those allowed too), from sysfs;
    a CPU sysfs does not describe is its own core."""
    cpus = allowed_cpus() if cpus is None else cpus
    allowed = set(cpus)
    out = []
    for cpu in cpus:
        topo = _SYS / f"cpu{cpu}" / "topology"
        try:
            package = int((topo / "physical_package_id").read_text())
            core = int((topo / "core_id").read_text())
            siblings = [c for c in _cpu_list((topo / "thread_siblings_list").read_text()) if c in allowed]
        except (OSError, ValueError):
            package, core, siblings = 0, cpu, [cpu]
        out.append({"cpu": cpu, "package": package, "core": core, "siblings": siblings or [cpu]})
    return out


def plan_cpus(topology: list[dict[str, Any]] | None = None, *,
              min_cpus: int = MIN_CPUS_TO_RESERVE) -> list[int] | None:
    """The engine's CPUs: every hardware thread of the last physical core (the first CPUs take most interrupt
    and system work), and of the one before it where a core has one thread (the engine process runs its step
    thread beside the pipe and driver threads). None when fewer than ``min_cpus`` CPUs are allowed."""
    topology = cpu_topology() if topology is None else topology
    if len(topology) < min_cpus:
        return None
    cores: dict[tuple[int, int], list[int]] = {}
    for entry in topology:
        cores.setdefault((entry["package"], entry["core"]), []).append(entry["cpu"])
    ordered = sorted(cores.values(), key=max)
    chosen = list(ordered[-1])
    if len(chosen) == 1 and len(ordered) > 1:
        chosen += ordered[-2]
    return sorted(chosen)


def pin_process(pid: int, cpus: list[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (threads it starts later inherit their starter's set).
    Where the platform has no CPU affinity, nothing moves."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        tasks = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tasks = [pid]
    for tid in tasks:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile


def pin_self(cpus: list[int]) -> None:
    """This process, all its threads, onto ``cpus``."""
    pin_process(os.getpid(), cpus)


def resolve_cpus(setting: str, device: str = "auto", ranks: int = 1) -> list[int] | None:
    """The engine process's CPUs under an ``engine_cpus`` setting (None: no placement): 'off' none; a CPU list as
    given, which must be some, not all, of the CPUs this process may use; 'auto' ``plan_cpus`` on a CUDA device
    with one rank (tensor-parallel ranks start from the engine process and would share its core)."""
    if setting == "off":
        return None
    if setting != "auto":
        cpus, allowed = parse_cpus(setting), allowed_cpus()
        if not set(cpus) <= set(allowed) or set(cpus) == set(allowed):
            raise ValueError(f"engine_cpus: {setting!r} must be some, not all, of the CPUs this process may use "
                             f"({allowed})")
        return cpus
    if device == "cpu" or ranks > 1:
        return None
    import torch

    return plan_cpus() if torch.cuda.is_available() else None


def place_engine_here(device: str = "auto") -> list[int] | None:
    """Put this process where ``serve`` puts its engine process (a benchmark driving the engine in its own
    process runs it as the service does), under VERBATIM_ENGINE_CPUS as ``serve`` reads it ('auto' when unset;
    ``resolve_cpus``). Returns the CPUs, or None where it stays."""
    cpus = resolve_cpus(os.environ.get("VERBATIM_ENGINE_CPUS", "auto").strip(), device)
    if cpus:
        pin_self(cpus)
    return cpus
