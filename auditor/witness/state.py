"""The witness's memory: the latest cosigned checkpoint of each log, persisted before any answer.

    <state_dir>/            0700
      witness.pem           the cosigning key (0600)
      state.json            {"logs": {origin: {"size", "root_hash" (base64), "checkpoint" (note)}}}
      evidence.jsonl        one line per refused submission whose signature verified (proof of misbehaviour)
      witness.lock          held (flock) by the one process serving this state

``state.json`` is replaced atomically (write, fsync, rename, fsync the directory), so a crash leaves the
old or the new record, never a torn one.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"
EVIDENCE_FILE = "evidence.jsonl"
LOCK_FILE = "witness.lock"
KEY_FILE = "witness.pem"


class StateError(Exception):
    """The state directory is locked by another process or its file is malformed."""


@dataclass(frozen=True)
class LogRecord:
    size: int
    root_hash: bytes
    checkpoint: str

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "root_hash": base64.b64encode(self.root_hash).decode("ascii"),
                "checkpoint": self.checkpoint}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> LogRecord:
        return cls(int(obj["size"]), base64.b64decode(obj["root_hash"], validate=True), str(obj["checkpoint"]))


class WitnessState:
    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self._lock_fd: int | None = None
        self._logs: dict[str, LogRecord] = {}

    def open(self) -> WitnessState:
        """Create the directory, take the process lock (refused if another witness holds it), load."""
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateError(f"another witness process is serving {self.dir}") from None
        self._lock_fd = fd
        self._logs = self._load()
        return self

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _load(self) -> dict[str, LogRecord]:
        path = self.dir / STATE_FILE
        if not path.exists():
            return {}
        try:
            logs = json.loads(path.read_text())["logs"]
            return {origin: LogRecord.from_json(rec) for origin, rec in logs.items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise StateError(f"{path} is malformed: {exc!r}") from None

    def get(self, origin: str) -> LogRecord | None:
        return self._logs.get(origin)

    def put(self, origin: str, record: LogRecord) -> None:
        """Record ``origin``'s latest cosigned checkpoint durably."""
        logs = {**self._logs, origin: record}
        _write_atomic(self.dir / STATE_FILE, json.dumps({"logs": {o: r.to_json() for o, r in sorted(logs.items())}},
                                                        indent=2).encode("utf-8") + b"\n")
        self._logs = logs

    def record_evidence(self, entry: dict[str, Any]) -> None:
        with open(self.dir / EVIDENCE_FILE, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(entry, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
