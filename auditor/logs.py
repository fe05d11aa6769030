"""Structured (JSON lines) logging. Only whitelisted fields are emitted, and no handler puts prompt
or output text into a record, so logs never carry content or secrets."""

from __future__ import annotations

import json
import logging
import sys
import time

FIELDS = ("event", "method", "path", "route", "status", "duration_ms", "key_id", "tenant", "transcript_id",
          "log_index", "completion_tokens", "error")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        line.update({k: getattr(record, k) for k in FIELDS if hasattr(record, k)})
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
