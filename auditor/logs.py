"""Structured (JSON lines) logging that never carries content or secrets.

Only whitelisted fields are emitted, no handler puts prompt or output text into a record, and
exception *text* never reaches a log: a database error's message can hold the SQL parameters of the
failed statement (prompt and output text, token ids, logprobs, the commitment salt), and other
libraries' messages may quote their inputs. A failure is logged as the exception types of its chain,
safe codes (SQLSTATE, SQLite error name) and the traceback frames (``log_failure``); the handler
``configure`` installs applies the same treatment to records from other libraries.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
import traceback
from collections.abc import Iterator

FIELDS = ("event", "method", "path", "route", "status", "duration_ms", "key_id", "tenant", "transcript_id",
          "log_index", "completion_tokens", "error", "trace", "report_id", "replay_id", "count")

_CODE = re.compile(r"^[A-Za-z0-9_]{1,40}$")
_DATA_AT_DEBUG = ("aiosqlite", "sqlalchemy.engine.Engine")
"""Loggers whose DEBUG lines carry data: aiosqlite logs every call with its arguments (the SQL
parameters), SQLAlchemy every result row. Their INFO lines (SQLAlchemy's statements, parameters
hidden by ``hide_parameters``) are kept."""


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _code(exc: BaseException) -> str | None:
    """A machine code the exception carries that cannot hold data: SQLSTATE or SQLite's error name."""
    for attr in ("sqlstate", "pgcode", "sqlite_errorname"):
        value = getattr(exc, attr, None)
        if isinstance(value, str) and _CODE.match(value):
            return value
    return None


def describe(exc: BaseException) -> str:
    """``module.Type [code] <- cause ...`` for the exception chain, without any message text."""
    parts = []
    for e in _chain(exc):
        code = _code(e)
        parts.append(f"{type(e).__module__}.{type(e).__qualname__}" + (f" [{code}]" if code else ""))
    return " <- ".join(parts)


def trace(exc: BaseException) -> str:
    """The traceback frames of the exception chain (innermost cause first), without message text."""
    lines: list[str] = []
    for e in reversed(list(_chain(exc))):
        lines.append(f"{type(e).__qualname__}:")
        lines.extend(f"  {f.filename}:{f.lineno} in {f.name}" for f in traceback.extract_tb(e.__traceback__))
    return "\n".join(lines)


def log_failure(logger: logging.Logger, message: str, exc: BaseException, *, level: int = logging.ERROR,
                **fields: object) -> None:
    """Log a caught exception the safe way: ``message`` (constant text), ``error`` (``describe``),
    ``trace`` (``trace``) and ``fields``; never the exception's own text."""
    logger.log(level, message, extra={**fields, "error": describe(exc), "trace": trace(exc)})


class WithholdExceptionText(logging.Filter):
    """For records made outside this project (uvicorn, asyncio, ...): exception info becomes
    ``error`` / ``trace`` as ``log_failure`` writes them, and a message that comes with an exception
    keeps only its first line (asyncio appends the failed task's repr, exception text included)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            exc = record.exc_info[1]
            record.error, record.trace = describe(exc), trace(exc)
            record.exc_info, record.exc_text = None, None
            if not record.name.startswith("auditor"):
                record.msg, record.args = record.getMessage().split("\n", 1)[0], None
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
                "level": record.levelname, "logger": record.name, "msg": record.getMessage()}
        line.update({k: getattr(record, k) for k in FIELDS if hasattr(record, k)})
        return json.dumps(line, default=str)


def handler(stream: object = None) -> logging.Handler:
    """The service's log handler: JSON lines on ``stream`` (stderr), exception text withheld."""
    out = logging.StreamHandler(stream or sys.stderr)  # type: ignore[arg-type]
    out.setFormatter(JsonFormatter())
    out.addFilter(WithholdExceptionText())
    return out


class _DropDebug(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.DEBUG


def quiet_drivers() -> None:
    """Drop the DEBUG records of the loggers in ``_DATA_AT_DEBUG``, whatever level they are set to."""
    for name in _DATA_AT_DEBUG:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropDebug) for f in logger.filters):
            logger.addFilter(_DropDebug())


def configure(level: str) -> None:
    root = logging.getLogger()
    root.handlers[:] = [handler()]
    root.setLevel(level.upper())
    quiet_drivers()
