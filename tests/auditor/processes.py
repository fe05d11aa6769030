"""Real ``python -m auditor …`` processes for tests: one-shot commands and long-running servers
(witnesses, replicas), with their output kept in files for the failure message."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The test's environment with this tree first on the path and no VERBATIM_* leaking in."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERBATIM_")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra or {})
    return env


def run_cli(*args: str, env: Mapping[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "auditor", *args], env=child_env(env), capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


@dataclass
class Process:
    """A long-running ``python -m auditor`` command; stdout and stderr go to ``log``."""

    args: tuple[str, ...]
    log: Path
    env: Mapping[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Process:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        out = open(self.log, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen([sys.executable, "-m", "auditor", *self.args], env=child_env(self.env),
                                     stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
        out.close()
        return self

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait_http(self, url: str, timeout: float = 120, status: int = 200) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.args[0]} exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(url, timeout=2).status_code == status:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{url} did not answer {status} within {timeout} s:\n{self.output()[-3000:]}")

    def kill(self) -> None:
        """SIGKILL: no shutdown hook runs (a crash)."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
