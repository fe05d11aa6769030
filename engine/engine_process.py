"""EngineProcess: AsyncEngine's interface with the EngineCore in a process of its own (docs/engine.md).

In one process the engine thread and the service's event loop share the GIL: while the loop formats and
writes hundreds of stream chunks, the engine waits to launch its next step and the device idles. Here the
engine process does nothing but step, and the serving process nothing but serve.

    serving process (event loop)                 engine process (spawned)
    generate() --("add", rid, prompt, params)--> pipe -> core.add_request
    abort()    --("abort", rid, token)--------->         core.abort -> ("aborted", token, delta)
    replay()   --("replay", token, requests)--->         core.add_replay ... -> ("replayed", token, results)
    reader thread <--("step", deltas, stats)----         one message per step: the new committed tokens

A step message carries only what each touched request committed since the last one (tokens, logprobs,
windows, counters): committed tokens are never taken back, so the serving process appends them and keeps
the cumulative RequestOutput that AsyncEngine's callers expect; the text is detokenized there, when a
stream asks for it. A consumer that falls behind takes the newest output and skips the ones before it
(they are cumulative), so a busy event loop sends fewer, longer chunks instead of slowing the engine.

The engine's bits do not depend on which process runs it: the child builds the same EngineCore from the
same EngineConfig, with the same torch thread count, and reports the same runtime fingerprint.
"""
from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing as mp
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.async_engine import ReplayProgress, latest
from engine.config import EngineConfig
from engine.core import EngineStats, stop_cut
from engine.identity import Fingerprinted
from engine.limits import RequestLimits, validate_request
from engine.replay import ReplayRequest, ReplayResult, validate_replays
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput

log = logging.getLogger("engine.process")

Loader = Callable[[EngineConfig], Any]
"""loader(config) -> LoadedModel, run in the engine process."""

_LAST_OUTPUTS_KEPT = 4096
_STATS_EVERY_S = 0.25


@dataclass(frozen=True)
class Delta:
    """What one request committed in one engine step (append-only: `start` is its committed length before)."""

    request_id: str
    start: int
    token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    windows: list[tuple[int, int]]
    finished: bool
    finish_reason: str | None
    seed: int
    deterministic: bool
    verify_passes: int
    rollbacks: int
    recomputed_tokens: int
    prompt_logprobs: list[float] | None = None            # sent once, with the first delta that has them
    prompt_top_logprobs: list[dict[int, float]] | None = None


@dataclass(frozen=True)
class Ready:
    """The engine process's first message: what the serving process needs to validate and answer."""

    config: EngineConfig  # resolved in the engine process
    tokenizer: Any
    model_info: Any
    fingerprint: dict[str, str | int]
    limits: RequestLimits
    window_shape: tuple[int, int]
    stats: EngineStats


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop | None
    queue: asyncio.Queue[bool | BaseException] | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    last: Delta | None = None


@dataclass
class _ReplayJob:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[ReplayResult]]
    on_progress: ReplayProgress | None


class EngineProcess(Fingerprinted):
    """The engine in a spawned process; the same public interface as AsyncEngine."""

    def __init__(self, config: EngineConfig | None = None, *, loader: Loader | None = None,
                 start_timeout_s: float | None = None) -> None:
        """Starts the engine process and waits until its model is loaded (blocking: call it off the event
        loop). `loader` (a module-level function, run in the engine process) replaces load_model. Raises
        RuntimeError with the engine's own error when it cannot start."""
        self.config = config or EngineConfig()  # resolved by the engine process once it is ready
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        # not a daemon: the engine process starts the tensor-parallel ranks itself. It ends when told to, or
        # when the pipe closes (this process gone); _close_at_exit closes the pipe before multiprocessing's own
        # exit handler joins it.
        self._proc = ctx.Process(target=_engine_main, args=(self.config, child, loader), name="verbatim-engine")
        self._proc.start()
        child.close()
        atexit.register(_close_at_exit, weakref.ref(self))
        ready = self._wait_ready(start_timeout_s)
        self.config = ready.config
        self.tokenizer = ready.tokenizer
        self.model_info = ready.model_info
        self._fingerprint = ready.fingerprint
        self._limits = ready.limits
        self._window_shape = ready.window_shape
        self._stats = ready.stats
        from engine.llm import detokenizer

        self._detokenize = detokenizer(self.tokenizer)
        self._send_lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._last: OrderedDict[str, RequestOutput] = OrderedDict()
        self._aborts: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[RequestOutput | None], str]] = {}
        self._replays: dict[int, _ReplayJob] = {}
        self._tokens = itertools.count()
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="verbatim-engine-reader", daemon=True)
        self._reader.start()

    def _wait_ready(self, timeout_s: float | None) -> Ready:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if not self._conn.poll(1.0):
                if deadline is not None and time.monotonic() >= deadline:
                    self._proc.kill()
                    raise RuntimeError(f"engine process: not ready after {timeout_s} s")
                if not self._proc.is_alive():
                    raise RuntimeError(f"engine process exited with code {self._proc.exitcode} while starting")
                continue
            try:
                kind, *body = self._conn.recv()
            except EOFError:
                self._proc.join(5)
                raise RuntimeError(f"engine process exited with code {self._proc.exitcode} while starting") from None
            if kind == "log":
                _relog(*body)
            elif kind == "failed":
                self._proc.join(5)
                raise RuntimeError(f"engine process could not start: {body[0]}")
            elif kind == "ready":
                return body[0]

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """The engine process runs from construction; kept for AsyncEngine's interface."""

    async def shutdown(self) -> None:
        if self._proc.is_alive():
            try:
                self._send(("stop",))
            except (OSError, RuntimeError):
                pass
            await asyncio.to_thread(self._proc.join, 30)
            if self._proc.is_alive():
                self._proc.kill()
                await asyncio.to_thread(self._proc.join, 5)
        await asyncio.to_thread(self._reader.join, 5)

    @property
    def alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    # ---- validation, stats ---------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """The engine's check, here, with the engine's limits (engine.limits.validate_request); nothing is sent."""
        validate_request(self._limits, self.tokenizer, prompt_token_ids, params)

    def stats(self) -> EngineStats:
        return self._stats

    def last_output(self, request_id: str) -> RequestOutput | None:
        req = self._requests.get(request_id)
        return self._output(req) if req is not None and req.last is not None else self._last.get(request_id)

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a cumulative RequestOutput each time tokens are committed (the newest, when several steps
        landed since the last one was taken); the last has finished=True."""
        self.validate(prompt_token_ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._requests:
            raise ValueError(f"request_id: {rid!r} is already running")
        self._check_alive()
        req = _Request(list(prompt_token_ids), params, asyncio.get_running_loop(), asyncio.Queue())
        self._requests[rid] = req
        self._send(("add", rid, req.prompt, params))
        finished = False
        try:
            while not finished:
                assert req.queue is not None
                latest(req.queue, await req.queue.get())
                out = self._output(req)
                finished = out.finished
                yield out
        finally:
            if not finished:  # client gone: stop spending compute on it, deliver it nothing more (its loop
                # may close before the engine process answers)
                if self._requests.get(rid) is req:
                    self._requests.pop(rid)
                    if req.last is not None:
                        self._remember(self._output(req))
                self._send_quiet(("abort", rid, None))

    async def abort(self, request_id: str) -> RequestOutput | None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[RequestOutput | None] = loop.create_future()
        token = next(self._tokens)
        self._aborts[token] = (loop, fut, request_id)
        self._send(("abort", request_id, token))
        return await fut

    async def replay(self, requests: list[ReplayRequest],
                     on_progress: ReplayProgress | None = None) -> list[ReplayResult]:
        """Teacher-forced re-execution of recorded windows in the engine process (see AsyncEngine.replay)."""
        validate_replays(self._limits, self.tokenizer, requests)
        if not requests:
            return []
        self._check_alive()
        loop = asyncio.get_running_loop()
        token = next(self._tokens)
        self._replays[token] = _ReplayJob(loop, loop.create_future(), on_progress)
        self._send(("replay", token, list(requests)))
        return await self._replays[token].future

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise RuntimeError(f"engine process is gone: {self._dead}")

    def _send(self, message: tuple[Any, ...]) -> None:
        with self._send_lock:
            self._conn.send(message)

    def _send_quiet(self, message: tuple[Any, ...]) -> None:
        try:
            self._send(message)
        except (OSError, ValueError):
            pass

    def _output(self, req: _Request) -> RequestOutput:
        d = req.last
        assert d is not None
        text = ""
        if self._detokenize is not None:
            text = stop_cut(self._detokenize(req.tokens), req.params.stop or [])
        return RequestOutput(
            request_id=d.request_id, prompt_token_ids=list(req.prompt), token_ids=list(req.tokens), text=text,
            finished=d.finished, finish_reason=d.finish_reason, seed=d.seed, deterministic=d.deterministic,
            token_logprobs=list(req.logprobs),
            top_logprobs=[dict(t) for t in req.top] if req.params.logprobs else None,
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            windows=list(d.windows), window_shape=self._window_shape, verify_passes=d.verify_passes,
            rollbacks=d.rollbacks, recomputed_tokens=d.recomputed_tokens,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            prompt_top_logprobs=([dict(t) for t in req.prompt_top_logprobs]
                                 if req.prompt_top_logprobs is not None else None))

    # ---- reader thread -----------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                kind, *body = self._conn.recv()
            except (EOFError, OSError):
                self._proc.join(5)
                self._fail_all(f"engine process exited (code {self._proc.exitcode})")
                return
            try:
                self._handle(kind, body)
            except Exception:  # noqa: BLE001 - one bad message must not leave every stream waiting
                log.exception("engine process: handling a %r message failed", kind)

    def _handle(self, kind: str, body: list[Any]) -> None:
        if kind == "step":
            deltas, stats = body
            if stats is not None:
                self._stats = stats
            self._deliver(deltas, None)
        elif kind == "rejected":
            rid, message = body
            self._deliver([], (rid, ValueError(message)))
        elif kind == "aborted":
            token, delta = body
            self._deliver([delta] if delta is not None else [], None,
                          abort=self._aborts.pop(token) if token is not None else None)
        elif kind == "replay_progress":
            token, done, total = body
            job = self._replays.get(token)
            if job is not None and job.on_progress is not None:
                _call_soon(job.loop, job.on_progress, done, total)
        elif kind == "replayed":
            token, results, error = body
            job = self._replays.pop(token, None)
            if job is not None:
                outcome = RuntimeError(error) if error else results
                _call_soon(job.loop, _settle, job.future, outcome)
        elif kind == "step_failed":
            self._deliver([], None, failed=body[0])
        elif kind == "log":
            _relog(*body)

    def _deliver(self, deltas: list[Delta], rejected: tuple[str, BaseException] | None, *,
                 abort: tuple[Any, Any, Any] | None = None, failed: str | None = None) -> None:
        """Hand the messages to the event loops: one thread-safe call per loop per message."""
        loops = {r.loop for r in list(self._requests.values()) if r.loop is not None}
        if abort is not None and abort[0] is not None:
            loops.add(abort[0])
        if not loops:
            loops = {None}  # type: ignore[arg-type]
        for loop in loops:
            if loop is None:
                self._apply(deltas, rejected, abort, failed, loop)
            elif not _call_soon(loop, self._apply, deltas, rejected, abort, failed, loop):
                for rid, req in list(self._requests.items()):  # nobody is left to read these
                    if req.loop is loop:
                        self._requests.pop(rid, None)

    def _apply(self, deltas: list[Delta], rejected: tuple[str, BaseException] | None, abort: tuple[Any, Any, Any] | None,
               failed: str | None, loop: asyncio.AbstractEventLoop | None) -> None:
        """On `loop`'s thread: append the deltas of the requests that loop waits on and wake their streams."""
        for d in deltas:
            req = self._requests.get(d.request_id)
            if req is None or req.loop is not loop:
                continue
            if d.prompt_logprobs is not None:
                req.prompt_logprobs, req.prompt_top_logprobs = d.prompt_logprobs, d.prompt_top_logprobs
            if d.start == len(req.tokens):
                req.tokens.extend(d.token_ids)
                req.logprobs.extend(d.token_logprobs)
                req.top.extend(d.top_logprobs or ())
            req.last = d
            if req.queue is not None:
                req.queue.put_nowait(True)
            if d.finished:
                self._requests.pop(d.request_id, None)
                self._remember(self._output(req))
        if rejected is not None:
            req = self._requests.get(rejected[0])
            if req is not None and req.loop is loop:
                self._requests.pop(rejected[0], None)
                assert req.queue is not None
                req.queue.put_nowait(rejected[1])
        if abort is not None and abort[0] is loop:
            _, fut, rid = abort
            req = self._requests.pop(rid, None)
            out = self._output(req) if req is not None and req.last is not None else self._last.get(rid)
            if out is not None:
                self._remember(out)
            if req is not None and req.queue is not None and req.last is not None:
                req.queue.put_nowait(True)
            if not fut.done():
                fut.set_result(out)
        if failed is not None:
            for rid, req in list(self._requests.items()):
                if req.loop is loop and req.queue is not None:
                    self._requests.pop(rid, None)
                    req.queue.put_nowait(RuntimeError(f"engine step failed: {failed}"))

    def _remember(self, out: RequestOutput) -> None:
        self._last[out.request_id] = out
        self._last.move_to_end(out.request_id)
        while len(self._last) > _LAST_OUTPUTS_KEPT:
            self._last.popitem(last=False)

    def _fail_all(self, why: str) -> None:
        self._dead = why
        for rid, req in list(self._requests.items()):
            if req.loop is not None and req.queue is not None:
                _call_soon(req.loop, req.queue.put_nowait, RuntimeError(why))
        self._requests.clear()
        for loop, fut, _ in self._aborts.values():
            _call_soon(loop, _settle, fut, None)
        for job in self._replays.values():
            _call_soon(job.loop, _settle, job.future, RuntimeError(why))
        self._aborts.clear()
        self._replays.clear()


def _close_at_exit(ref: weakref.ref[EngineProcess]) -> None:
    engine = ref()
    if engine is not None and engine._proc.is_alive():
        engine._send_quiet(("stop",))
        engine._proc.join(10)
        if engine._proc.is_alive():
            engine._proc.kill()


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Any, *args: Any) -> bool:
    """`fn(*args)` on `loop`'s thread; False when that loop has closed (whoever waited there is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _settle(fut: asyncio.Future[Any], outcome: Any) -> None:
    if fut.done():
        return
    if isinstance(outcome, BaseException):
        fut.set_exception(outcome)
    else:
        fut.set_result(outcome)


def _relog(level: int, name: str, message: str) -> None:
    logging.getLogger(name).log(level, "%s", message)


# ---- the engine process ----------------------------------------------------------------------------
class _PipeLogHandler(logging.Handler):
    """The engine process's log records, re-emitted by the serving process's logging."""

    def __init__(self, conn: Any, lock: threading.Lock) -> None:
        super().__init__()
        self.conn, self.send_lock = conn, lock

    def emit(self, record: logging.LogRecord) -> None:
        try:
            with self.send_lock:
                self.conn.send(("log", record.levelno, record.name, record.getMessage()))
        except Exception:  # noqa: BLE001 - logging must never take the engine down
            pass


def _engine_main(config: EngineConfig, conn: Any, loader: Loader | None) -> None:
    lock = threading.Lock()
    handler = _PipeLogHandler(conn, lock)
    for name in ("engine", "auditor"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        loop = _EngineLoop(config, conn, lock, loader)
    except BaseException as exc:  # noqa: BLE001 - the serving process reports it
        with lock:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        loop.run()
    finally:
        loop.core.close()  # tensor-parallel worker ranks, if any


class _EngineLoop:
    def __init__(self, config: EngineConfig, conn: Any, lock: threading.Lock, loader: Loader | None) -> None:
        import torch

        from engine import progress
        from engine.core import EngineCore
        from engine.fingerprint import runtime_fingerprint
        from engine.llm import detokenizer
        from engine.loading import load_model

        self.conn, self.lock = conn, lock
        started = time.perf_counter()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded = (loader or load_model)(config)
        eos = set(getattr(loaded.info, "eos_token_ids", ()) or ())
        try:
            self.core = EngineCore(config, loaded.model, loaded.shape, eos, detokenizer(loaded.tokenizer),
                                   loaded.tokenizer, tp=getattr(loaded, "tp", None))
        except BaseException:
            if getattr(loaded, "tp", None) is not None:
                loaded.tp.close()
            raise
        progress.ready(self.core.config, str(getattr(loaded.info, "name", "?")), started)
        self.published: dict[str, int] = {}
        self.prompt_sent: set[str] = set()
        self.replays: list[tuple[int, list[ReplayRequest], list[Any], int]] = []
        self.stats_at = 0.0
        self.stop = False
        core = self.core
        self._send(("ready", Ready(core.config, loaded.tokenizer, loaded.info, runtime_fingerprint(core.config),
                                   core.limits(), (core.config.group, core.config.window), core.stats())))

    def _send(self, message: tuple[Any, ...]) -> None:
        with self.lock:
            self.conn.send(message)

    def run(self) -> None:
        while not self.stop:
            try:
                busy = self.core.has_work()
                commands = 0
                while self.conn.poll(0 if busy or commands else 0.05):
                    self._command(*self.conn.recv())
                    commands += 1
            except (EOFError, OSError):
                return  # the serving process is gone
            if self.stop:
                continue
            if not self.core.has_work():
                if commands:  # an abort or a rejection left the engine idle: its counters changed
                    self._send(("step", [], self.core.stats()))
                continue
            try:
                touched = self.core.step()
            except Exception as exc:  # noqa: BLE001 - every waiter must hear about it
                self._fail_all(exc)
                continue
            deltas = [d for d in (self._delta(s) for s in touched) if d is not None]
            now = time.monotonic()
            stats = None
            if now - self.stats_at >= _STATS_EVERY_S or not self.core.has_work():
                stats, self.stats_at = self.core.stats(), now
            if deltas or stats is not None:
                self._send(("step", deltas, stats))
            self._replays()

    def _command(self, kind: str, *body: Any) -> None:
        if kind == "add":
            rid, prompt, params = body
            try:
                self.core.add_request(rid, prompt, params)
                self.published[rid] = 0
            except ValueError as exc:
                self._send(("rejected", rid, str(exc)))
        elif kind == "abort":
            rid, token = body
            seq = self.core.abort(rid)
            delta = self._delta(seq, force=True) if seq is not None and seq.replay is None else None
            self.published.pop(rid, None)
            if token is not None or delta is not None:
                self._send(("aborted", token, delta))
        elif kind == "replay":
            token, requests = body
            try:
                from engine.replay import add_replays

                seqs = add_replays(self.core, [dataclass_replace_id(r, f"replay-{token}-{i}-{r.replay_id}")
                                               for i, r in enumerate(requests)])
                self.replays.append((token, requests, seqs, -1))
            except ValueError as exc:
                self._send(("replayed", token, None, str(exc)))
        elif kind == "stop":
            self.stop = True

    def _delta(self, seq: Any, force: bool = False) -> Delta | None:
        from engine.sequence import SeqKind

        if seq.kind == SeqKind.REPLAY:
            return None
        rid = seq.request_id
        start = self.published.get(rid)
        if start is None:
            return None
        n = len(seq.tokens)
        if n == start and not seq.is_finished and not force:
            return None
        self.published[rid] = n
        prompt = seq.prompt_logprobs if rid not in self.prompt_sent else None
        if prompt is not None:
            self.prompt_sent.add(rid)
        if seq.is_finished:
            self.published.pop(rid, None)
            self.prompt_sent.discard(rid)
        return Delta(rid, start, seq.tokens[start:n], seq.logprobs[start:n],
                     [dict(t) for t in seq.top_logprobs[start:n]] if seq.params.logprobs else None,
                     list(seq.windows), seq.is_finished,
                     seq.finish_reason.value if seq.finish_reason else None, seq.seed,
                     seq.kind == SeqKind.DVR, seq.verify_passes, seq.rollbacks, seq.recomputed_tokens,
                     list(prompt.logprobs) if prompt is not None else None,
                     [dict(t) for t in prompt.top] if prompt is not None and prompt.top is not None else None)

    def _replays(self) -> None:
        from engine.replay import replay_results

        keep = []
        for token, requests, seqs, reported in self.replays:
            done = sum(len(s.replay.predicted) for s in seqs if s.replay is not None)
            if done != reported:
                self._send(("replay_progress", token, done, sum(len(r.token_ids) for r in requests)))
            if all(s.is_finished for s in seqs):
                self._send(("replayed", token, replay_results(requests, seqs), None))
            else:
                keep.append((token, requests, seqs, done))
        self.replays = keep

    def _fail_all(self, exc: Exception) -> None:
        """A failed step leaves no trustworthy state: abort everything and tell every waiter."""
        for rid in list(self.core.seqs):
            self.core.abort(rid)
        self.published.clear()
        self._send(("step_failed", repr(exc)))
        for token, _, _, _ in self.replays:
            self._send(("replayed", token, None, f"engine step failed: {exc!r}"))
        self.replays = []


def dataclass_replace_id(req: ReplayRequest, replay_id: str) -> ReplayRequest:
    import dataclasses

    return dataclasses.replace(req, replay_id=replay_id)
