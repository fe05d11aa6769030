"""A CPU-time sampling profiler for every Python process of a benchmark run, where py-spy cannot attach.

Python imports `sitecustomize` at start-up from the first directory on sys.path that has one. With this
directory first on PYTHONPATH and VERBATIM_PROFILE_DIR set, every Python process started (the service's
serving processes, its engine process, the bench's clients, each spawned child) samples its main thread's
Python stack on SIGPROF, which the kernel sends after every PERIOD_S of CPU time the process uses (all its
threads together), so the counts are CPU time spent with the main thread in that stack. A daemon thread
writes the counts to VERBATIM_PROFILE_DIR/<pid>.txt every WRITE_EVERY_S and at exit: a header line with the
process's command line, then one line per stack, ``frame;frame;...;frame count`` (outermost first), the
format py-spy's raw output and flame graph tools read. Without VERBATIM_PROFILE_DIR this module does nothing.

    PYTHONPATH=bench/profiling:$PYTHONPATH VERBATIM_PROFILE_DIR=/tmp/prof python bench/serve_bench.py ...
"""
from __future__ import annotations

import atexit
import collections
import os
import signal
import sys
import threading
import time

PERIOD_S = 0.005
WRITE_EVERY_S = 2.0


def _start(directory: str) -> None:
    counts: collections.Counter[str] = collections.Counter()
    path = os.path.join(directory, f"{os.getpid()}.txt")

    def sample(_signum: int, frame: object) -> None:
        names = []
        while frame is not None:
            code = frame.f_code  # type: ignore[attr-defined]
            names.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")  # type: ignore[attr-defined]
            frame = frame.f_back  # type: ignore[attr-defined]
        counts[";".join(reversed(names))] += 1

    lock = threading.Lock()  # the writer thread and the exit hook write the same file

    def write() -> None:
        with lock:
            _write()

    def _write() -> None:
        mp = sys.modules.get("multiprocessing")
        name = mp.current_process().name if mp is not None else "MainProcess"
        lines = [f"# pid {os.getpid()} ppid {os.getppid()} process {name} period_s {PERIOD_S} "
                 f"argv {' '.join(sys.argv)[:300]}"]
        lines += [f"{stack} {n}" for stack, n in counts.most_common()]
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(tmp, path)

    def writer() -> None:
        while True:
            time.sleep(WRITE_EVERY_S)
            if counts:
                write()

    os.makedirs(directory, exist_ok=True)
    signal.signal(signal.SIGPROF, sample)
    signal.setitimer(signal.ITIMER_PROF, PERIOD_S, PERIOD_S)
    threading.Thread(target=writer, name="bench-profile-writer", daemon=True).start()

    def stop() -> None:  # before the interpreter tears down the handler: the signal's default action kills
        signal.setitimer(signal.ITIMER_PROF, 0, 0)
        if counts:
            write()

    atexit.register(stop)


if os.environ.get("VERBATIM_PROFILE_DIR") and threading.current_thread() is threading.main_thread():
    _start(os.environ["VERBATIM_PROFILE_DIR"])
