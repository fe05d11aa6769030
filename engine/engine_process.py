"""EngineProcess: AsyncEngine's interface with the EngineCore in a process of its own; EngineHost: that
process shared by several serving processes (docs/engine.md).

In one process the engine thread and the service's event loop share the GIL: while the loop formats and
writes hundreds of stream chunks, the engine waits to launch its next step and the device idles. Here the
engine process does nothing but step, and the serving processes nothing but serve.

An EngineHost starts the engine process with one duplex pipe per client; an EngineProcess is one client, over
one of those pipes. `EngineProcess(config)` is the one-client shape: it starts its own host and stops it on
shutdown. With `EngineHost(config, clients=N)` each of N serving processes (each with its own event loop)
takes one connection and `EngineProcess.connect(conn)`; they share the one engine and its batches.

    serving process k (event loop)                  engine process (spawned by EngineHost)
    generate() --("add", rid, prompt, params)--> pipe k -> core.add_request; rid's client is k
    abort()    --("abort", rid, token)--------->        -> core.abort -> ("aborted", token, delta) on pipe k
    replay()   --("replay", token, requests)--->        -> core.add_replay ... -> ("replayed", token, results)
    shutdown() --("close",)------------------->         -> aborts client k's requests, closes pipe k
                                                           (a client of a shared host; EngineProcess(config)
                                                           stops its own host instead)
    reader thread <--"S" + msgpack(deltas, stats)--     one message per step per client that has deltas:
                                                        the newly committed tokens of its own requests
    EngineHost.stop() --("stop",) on the control pipe-> the engine process ends

A step message carries only what each touched request committed since the last one (tokens, logprobs, the
windows added, counters): committed tokens and windows are never taken back, so the serving process appends
them and keeps the cumulative RequestOutput that AsyncEngine's callers expect; the text is detokenized there,
when a stream asks for it. A consumer that falls behind takes the newest output and skips the ones before it
(they are cumulative), so a busy event loop sends fewer, longer chunks instead of slowing the engine; and the
engine process sends a step message only to a connection with room, queueing the rest for a later message
(_Clients), so a serving process that reads slowly never holds its next step back.

The wire: a step message is the byte "S" followed by the msgpack of a `StepMessage` (array-like Structs:
msgpack's float64 carries every logprob bit for bit); every other message (ready, failed, rejected, aborted,
replay_progress, replayed, step_failed, log) is rare and pickled, and a pickle's first byte is its protocol
opcode 0x80, never "S". Stats ride on a step message to every client every _STATS_EVERY_S and when the
engine falls idle. The engine process's log records go to one client, the lowest-numbered one still
connected, so the service logs each once.

A client whose connection closes (its process died, or shutdown) has its requests aborted and its replays
dropped; the others are served on. The engine process ends on `stop` from the host, when the host's process
is gone (the control pipe closes), or when every client has closed.

The engine's bits do not depend on which process runs it: the child builds the same EngineCore from the
same EngineConfig, with the same torch thread count, and reports the same runtime fingerprint.
"""
from __future__ import annotations

import asyncio
import atexit
import dataclasses
import gc
import itertools
import logging
import multiprocessing as mp
import pickle
import select
import signal
import threading
import time
import uuid
import weakref
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import msgspec

from engine.async_engine import ReplayProgress, latest
from engine.config import EngineConfig
from engine.core import EngineStats, stop_cut
from engine.identity import Fingerprinted
from engine.limits import RequestLimits, validate_request
from engine.replay import ReplayRequest, ReplayResult, validate_replays
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, SeqKind

log = logging.getLogger("engine.process")

Loader = Callable[[EngineConfig], Any]
"""loader(config) -> LoadedModel, run in the engine process."""

_LAST_OUTPUTS_KEPT = 4096
_STATS_EVERY_S = 0.25
# commands the engine process runs between two steps while it has work: a burst of requests (a thousand sent at
# once through several serving processes arrives over a few hundred milliseconds) is admitted step by step
# instead of holding every step back until it is over
_COMMANDS_PER_STEP = 64
_STEP_TAG = b"S"


class Delta(msgspec.Struct, frozen=True, array_like=True):
    """What one request committed in one engine step (append-only: `start` is its committed length before,
    `windows_from` its number of windows before; `windows` are the ones added since)."""

    request_id: str
    start: int
    token_ids: list[int]
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    windows_from: int
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


class StepMessage(msgspec.Struct, array_like=True):
    """One engine step, for one client: its requests' deltas; the engine's stats when they are due."""

    deltas: list[Delta]
    stats: EngineStats | None


_STEP_ENCODER = msgspec.msgpack.Encoder()
_STEP_DECODER = msgspec.msgpack.Decoder(StepMessage)


def encode_step(deltas: list[Delta], stats: EngineStats | None) -> bytearray:
    """A step message's bytes: the tag, then the msgpack of StepMessage(deltas, stats)."""
    buf = bytearray(_STEP_TAG)
    _STEP_ENCODER.encode_into(StepMessage(deltas, stats), buf, -1)
    return buf


def decode_message(data: bytes) -> tuple[str, list[Any]]:
    """(kind, body) of one message read with recv_bytes: a step message or a pickled tuple."""
    if data[:1] == _STEP_TAG:
        step = _STEP_DECODER.decode(memoryview(data)[1:])
        return "step", [step.deltas, step.stats]
    kind, *body = pickle.loads(data)
    return kind, body


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
    windows: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[dict[int, float]] | None = None
    last: Delta | None = None


@dataclass
class _ReplayJob:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[ReplayResult]]
    on_progress: ReplayProgress | None


class EngineHost:
    """The engine process, with one duplex pipe per client.

    `connections` are the clients' ends: hand each to one process (a spawned child takes a Connection as an
    argument) that calls `EngineProcess.connect(conn)`, or connect in this process. After starting the
    children, close their ends here (`conn.close()`): the engine process sees a client leave only when no
    process holds its end any more. The constructor returns at once; each client waits for the model to load
    in `connect`."""

    def __init__(self, config: EngineConfig | None = None, clients: int = 1, *, loader: Loader | None = None,
                 cpus: list[int] | None = None) -> None:
        """`loader` (a module-level function, run in the engine process) replaces load_model. `cpus`: the CPUs
        the engine process runs on (engine.placement; None: any)."""
        if clients < 1:
            raise ValueError(f"clients: {clients} (at least 1)")
        self.config = config or EngineConfig()
        ctx = mp.get_context("spawn")
        pipes = [ctx.Pipe(duplex=True) for _ in range(clients)]
        control, self._control = ctx.Pipe(duplex=False)  # (the engine's read end, the host's write end)
        self.connections: list[Connection] = [mine for mine, _ in pipes]
        # not a daemon: the engine process starts the tensor-parallel ranks itself. _stop_at_exit stops it before
        # multiprocessing's own exit handler joins it.
        self._proc = ctx.Process(target=_engine_main, args=(self.config, [theirs for _, theirs in pipes], control,
                                                             loader, cpus), name="verbatim-engine")
        self._proc.start()
        for _, theirs in pipes:
            theirs.close()
        control.close()
        atexit.register(_stop_at_exit, weakref.ref(self))

    def alive(self) -> bool:
        return self._proc.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self._proc.exitcode

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def join(self, timeout_s: float | None = None) -> None:
        self._proc.join(timeout_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Tell the engine process to stop and wait for it; killed when it has not ended after `timeout_s`.
        The clients' connections stay open (their holders close them)."""
        try:
            self._control.send(("stop",))
        except OSError:
            pass
        self._control.close()
        self._proc.join(timeout_s)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)


def _stop_at_exit(ref: weakref.ref[EngineHost]) -> None:
    host = ref()
    if host is not None and host.alive():
        host.stop(timeout_s=10)


class EngineProcess(Fingerprinted):
    """A client of the engine process; the same public interface as AsyncEngine."""

    def __init__(self, config: EngineConfig | None = None, *, loader: Loader | None = None,
                 start_timeout_s: float | None = None) -> None:
        """Starts an engine process of its own (one-client EngineHost) and waits until its model is loaded
        (blocking: call it off the event loop). `loader` (a module-level function, run in the engine process)
        replaces load_model. Raises RuntimeError with the engine's own error when it cannot start."""
        self.config = config or EngineConfig()  # resolved by the engine process once it is ready
        host = EngineHost(self.config, 1, loader=loader)
        try:
            self._attach(host.connections[0], host, start_timeout_s)
        except BaseException:
            host.stop(timeout_s=5)
            raise

    @classmethod
    def connect(cls, conn: Connection, *, start_timeout_s: float | None = None) -> EngineProcess:
        """The client over one of an EngineHost's connections; waits until the engine's model is loaded
        (blocking: call it off the event loop). Its shutdown closes only this connection."""
        engine = cls.__new__(cls)
        engine._attach(conn, None, start_timeout_s)
        return engine

    def _attach(self, conn: Connection, host: EngineHost | None, start_timeout_s: float | None) -> None:
        self._conn, self._host = conn, host
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
        self._closing = False
        self._reader = threading.Thread(target=self._read, name="verbatim-engine-reader", daemon=True)
        self._reader.start()

    def _gone(self, when: str) -> str:
        if self._host is None:
            return f"engine process exited{when} (its connection closed)"
        self._host.join(5)
        return f"engine process exited with code {self._host.exitcode}{when}"

    def _wait_ready(self, timeout_s: float | None) -> Ready:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if not self._conn.poll(1.0):
                if deadline is not None and time.monotonic() >= deadline:
                    raise RuntimeError(f"engine process: not ready after {timeout_s} s")
                if self._host is not None and not self._host.alive():
                    raise RuntimeError(self._gone(" while starting"))
                continue
            try:
                kind, body = decode_message(self._conn.recv_bytes())
            except (EOFError, OSError):
                raise RuntimeError(self._gone(" while starting")) from None
            if kind == "log":
                _relog(*body)
            elif kind == "failed":
                raise RuntimeError(f"engine process could not start: {body[0]}")
            elif kind == "ready":
                return body[0]

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """The engine process runs from construction; kept for AsyncEngine's interface."""

    async def shutdown(self) -> None:
        """Close this client: its own engine process stops; a shared one aborts this client's requests and
        serves the others on."""
        self._closing = True
        if self._host is not None:
            await asyncio.to_thread(self._host.stop, 30)
        else:
            self._send_quiet(("close",))  # the engine process closes its end: the reader reads EOF
        await asyncio.to_thread(self._reader.join, 30)
        self._conn.close()

    @property
    def alive(self) -> bool:
        return self._dead is None and (self._host is None or self._host.alive())

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
            windows=list(req.windows), window_shape=self._window_shape, verify_passes=d.verify_passes,
            rollbacks=d.rollbacks, recomputed_tokens=d.recomputed_tokens,
            prompt_logprobs=list(req.prompt_logprobs) if req.prompt_logprobs is not None else None,
            prompt_top_logprobs=([dict(t) for t in req.prompt_top_logprobs]
                                 if req.prompt_top_logprobs is not None else None))

    # ---- reader thread -----------------------------------------------------------------------
    def _read(self) -> None:
        while True:
            try:
                kind, body = decode_message(self._conn.recv_bytes())
            except (EOFError, OSError):
                self._fail_all("engine process closed this client's connection" if self._closing else self._gone(""))
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
            if deltas:
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
            if d.windows_from != len(req.windows) or d.windows:
                del req.windows[d.windows_from:]
                req.windows.extend(d.windows)
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
class _Clients:
    """The engine process's connections to its clients, by client number (its index in EngineHost's
    `connections`), and the host's control pipe. Every send holds one lock: log records are sent from
    whichever thread logs.

    Step messages are queued per client and sent by `flush`: without blocking, only to the clients whose
    connection has room (poll's POLLOUT: a quarter of the socket's buffer or less in use); a client whose
    serving process reads slowly gets its queued deltas in one later message (several deltas of a request,
    in order, which the client applies one after the other) instead of holding the engine's next step back.
    Every other message to a client first sends what is queued for it, so the order of a client's messages
    is the order they were made in."""

    def __init__(self, conns: list[Connection], control: Connection) -> None:
        self.conns: dict[int, Connection] = dict(enumerate(conns))
        self.control = control
        self.lock = threading.Lock()
        self.closed: list[int] = []  # clients whose connection failed on a send, for the loop to drop
        self.queued: dict[int, tuple[list[Delta], EngineStats | None]] = {}
        self._poll = select.poll()
        self._by_fd: dict[int, int] = {}
        for client, conn in self.conns.items():
            self._poll.register(conn.fileno(), select.POLLOUT)
            self._by_fd[conn.fileno()] = client

    def send(self, client: int, message: tuple[Any, ...]) -> None:
        self._flush_one(client)
        self._send(client, pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    def send_step(self, client: int, deltas: list[Delta], stats: EngineStats | None) -> None:
        """Queue a step message for `client` (`flush` sends it): its deltas after those queued, the newest stats."""
        if client not in self.conns:
            return
        queued, old = self.queued.get(client, ([], None))
        queued.extend(deltas)
        self.queued[client] = (queued, stats if stats is not None else old)

    def flush(self, block: bool) -> None:
        """Send the queued step messages: every one (`block`), or those whose connection has room now."""
        if not self.queued:
            return
        if block:
            ready = list(self.queued)
        else:
            ready = [self._by_fd[fd] for fd, events in self._poll.poll(0)
                     if events & select.POLLOUT and fd in self._by_fd]
        for client in ready:
            self._flush_one(client)

    def _flush_one(self, client: int) -> None:
        queued = self.queued.pop(client, None)
        if queued is not None:
            self._send(client, encode_step(*queued))

    def send_all(self, message: tuple[Any, ...]) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        for client in list(self.conns):
            self._flush_one(client)
            self._send(client, data)

    def send_log(self, message: tuple[Any, ...]) -> None:
        """To the lowest-numbered client that takes it."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self.lock:
            for conn in [self.conns[c] for c in sorted(self.conns)]:
                try:
                    conn.send_bytes(data)
                    return
                except OSError:
                    continue

    def _send(self, client: int, data: bytes | bytearray) -> None:
        with self.lock:
            conn = self.conns.get(client)
            if conn is None:
                return
            try:
                conn.send_bytes(data)
            except OSError:  # its process is gone: the loop drops it before the next step
                self.closed.append(client)
                self._forget(client)

    def close(self, client: int) -> None:
        with self.lock:
            self._forget(client)

    def _forget(self, client: int) -> None:
        """(holding the lock) Drop `client`'s connection and what is queued for it."""
        conn = self.conns.pop(client, None)
        self.queued.pop(client, None)
        if conn is not None:
            fd = conn.fileno()
            self._by_fd.pop(fd, None)
            self._poll.unregister(fd)
            conn.close()

    def client_of(self, conn: Connection) -> int | None:
        return next((c for c, k in self.conns.items() if k is conn), None)


class _PipeLogHandler(logging.Handler):
    """The engine process's log records, re-emitted by one serving process's logging."""

    def __init__(self, clients: _Clients) -> None:
        super().__init__()
        self.clients = clients

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.clients.send_log(("log", record.levelno, record.name, record.getMessage()))
        except Exception:  # noqa: BLE001 - logging must never take the engine down
            pass


def _engine_main(config: EngineConfig, conns: list[Connection], control: Connection, loader: Loader | None,
                 cpus: list[int] | None = None) -> None:
    if cpus:  # before torch starts its threads: they inherit the set
        from engine.placement import pin_self

        pin_self(cpus)
    # Ctrl-C reaches the whole process group: the serving processes shut down gracefully, finishing the
    # requests in flight, and then stop this one (stop, or their connections closing); it must not die first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    clients = _Clients(conns, control)
    handler = _PipeLogHandler(clients)
    for name in ("engine", "auditor"):
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        loop = _EngineLoop(config, clients, loader)
    except BaseException as exc:  # noqa: BLE001 - the serving processes report it
        clients.send_all(("failed", f"{type(exc).__name__}: {exc}"))
        return
    try:
        loop.run()
    finally:
        loop.core.close()  # tensor-parallel worker ranks, if any


class _Publisher:
    """What the engine process has sent of each request: its committed tokens and windows (both only grow),
    and whether its prompt logprobs went out."""

    def __init__(self) -> None:
        self.sent: dict[str, tuple[int, int]] = {}  # request id -> (tokens sent, windows sent)
        self.prompt_sent: set[str] = set()

    def open(self, rid: str) -> None:
        self.sent[rid] = (0, 0)

    def forget(self, rid: str) -> None:
        self.sent.pop(rid, None)
        self.prompt_sent.discard(rid)

    def clear(self) -> None:
        self.sent.clear()
        self.prompt_sent.clear()

    def delta(self, seq: Any, force: bool = False) -> Delta | None:
        """What `seq` committed since its last delta; None when nothing (unless `force`) or not a request."""
        rid = seq.request_id
        sent = self.sent.get(rid)
        if sent is None or seq.kind is SeqKind.REPLAY:
            return None
        start, windows_from = sent
        n, w, finished = len(seq.tokens), len(seq.windows), seq.is_finished
        if n == start and w == windows_from and not finished and not force:
            return None
        prompt = seq.prompt_logprobs if rid not in self.prompt_sent else None
        if prompt is not None:
            self.prompt_sent.add(rid)
        if finished:
            self.forget(rid)
        else:
            self.sent[rid] = (n, w)
        return Delta(rid, start, seq.tokens[start:n], seq.logprobs[start:n],
                     seq.top_logprobs[start:n] if seq.params.logprobs else None,
                     windows_from, seq.windows[windows_from:w] if w != windows_from else [], finished,
                     seq.finish_reason.value if seq.finish_reason else None, seq.seed,
                     seq.kind is SeqKind.DVR, seq.verify_passes, seq.rollbacks, seq.recomputed_tokens,
                     prompt.logprobs if prompt is not None else None,
                     prompt.top if prompt is not None else None)


@dataclass
class _EngineReplay:
    client: int
    token: int
    requests: list[ReplayRequest]
    seqs: list[Any]
    reported: int = -1


class _EngineLoop:
    def __init__(self, config: EngineConfig, clients: _Clients, loader: Loader | None) -> None:
        import torch

        from engine import progress
        from engine.core import EngineCore
        from engine.fingerprint import runtime_fingerprint
        from engine.llm import detokenizer
        from engine.loading import load_model

        self.clients = clients
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
        # the model's and the core's long-lived objects leave the collector's generations: the step messages'
        # short-lived objects trigger collections every step, which then no longer walk them
        gc.collect()
        gc.freeze()
        self.publisher = _Publisher()
        self.owner: dict[str, int] = {}  # request id -> the client that added it
        self.replays: list[_EngineReplay] = []
        self.stats_at = 0.0
        self.stop = False
        core = self.core
        clients.send_all(("ready", Ready(core.config, loaded.tokenizer, loaded.info, runtime_fingerprint(core.config),
                                         core.limits(), (core.config.group, core.config.window), core.stats())))

    def run(self) -> None:
        totals = self.core.totals
        while not self.stop and self.clients.conns:
            commands = self._commands(0 if self.core.has_work() else 0.05)
            if self.stop or not self.clients.conns:
                continue
            if not self.core.has_work():
                if commands:  # an abort, a rejection or a client gone left the engine idle: its counters changed
                    self._send_steps({}, self.core.stats())
                continue
            try:
                touched = self.core.step()
            except Exception as exc:  # noqa: BLE001 - every waiter must hear about it
                self._fail_all(exc)
                continue
            t0 = time.perf_counter()
            by_client: dict[int, list[Delta]] = {}
            for seq in touched:
                d = self.publisher.delta(seq)
                if d is not None:
                    by_client.setdefault(self.owner[d.request_id], []).append(d)
                    if d.finished:
                        self.owner.pop(d.request_id, None)
            now = time.monotonic()
            stats = None
            if now - self.stats_at >= _STATS_EVERY_S or not self.core.has_work():
                stats, self.stats_at = self.core.stats(), now
            self._send_steps(by_client, stats)
            self._replays()
            totals.publish_seconds += time.perf_counter() - t0

    def _commands(self, timeout: float) -> int:
        """Run the commands waiting on the pipes (waiting up to `timeout` for the first): every one when the
        engine is idle, at most about _COMMANDS_PER_STEP when it has work; how many ran, counting clients
        dropped. The time spent, less the wait, counts as command_seconds."""
        started, waited = time.perf_counter(), 0.0
        try:
            count = 0
            while not (count >= _COMMANDS_PER_STEP and self.core.has_work()):
                count += self._drop_closed()
                conns = [*self.clients.conns.values(), self.clients.control]
                if timeout and count == 0:
                    t0 = time.perf_counter()
                    ready = wait(conns, timeout)
                    waited += time.perf_counter() - t0
                else:
                    ready = wait(conns, 0)
                if not ready:
                    return count
                for conn in ready:
                    if conn is self.clients.control:
                        try:
                            self.stop = self.stop or self.clients.control.recv()[0] == "stop"
                        except (EOFError, OSError):
                            self.stop = True  # the host's process is gone
                        continue
                    client = self.clients.client_of(conn)
                    if client is None:
                        continue
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        self._drop(client)
                    else:
                        self._command(client, *message)
                    count += 1
                if self.stop:
                    return count
            return count
        finally:
            self.core.totals.command_seconds += time.perf_counter() - started - waited

    def _command(self, client: int, kind: str, *body: Any) -> None:
        if kind == "add":
            rid, prompt, params = body
            try:
                self.core.add_request(rid, prompt, params)
                self.publisher.open(rid)
                self.owner[rid] = client
            except ValueError as exc:
                self.clients.send(client, ("rejected", rid, str(exc)))
        elif kind == "abort":
            rid, token = body
            delta = None
            if self.owner.get(rid) == client:
                seq = self.core.abort(rid)
                delta = self.publisher.delta(seq, force=True) if seq is not None and seq.replay is None else None
                self.publisher.forget(rid)
                self.owner.pop(rid)
            if token is not None or delta is not None:
                self.clients.send(client, ("aborted", token, delta))
        elif kind == "replay":
            token, requests = body
            try:
                from engine.replay import add_replays

                # tokens count per client: the client's number keeps two clients' replays apart
                seqs = add_replays(self.core, [
                    dataclasses.replace(r, replay_id=f"replay-{client}-{token}-{i}-{r.replay_id}")
                    for i, r in enumerate(requests)])
                self.replays.append(_EngineReplay(client, token, requests, seqs))
            except ValueError as exc:
                self.clients.send(client, ("replayed", token, None, str(exc)))
        elif kind == "close":
            self._drop(client)

    def _drop(self, client: int) -> None:
        """A client left: abort its requests and replays, close its end."""
        for rid in [r for r, c in self.owner.items() if c == client]:
            self.core.abort(rid)
            self.publisher.forget(rid)
            self.owner.pop(rid)
        for job in [j for j in self.replays if j.client == client]:
            for seq in job.seqs:
                self.core.abort(seq.request_id)
            self.replays.remove(job)
        self.clients.close(client)

    def _drop_closed(self) -> int:
        closed, self.clients.closed = self.clients.closed, []
        for client in closed:
            self._drop(client)
        return len(closed)

    def _send_steps(self, by_client: dict[int, list[Delta]], stats: EngineStats | None) -> None:
        """Queue the step messages and send what the connections take; every queue once the engine has no work
        (the only producer of step messages, so nothing stays queued while the engine waits)."""
        for client in (list(self.clients.conns) if stats is not None else by_client):
            self.clients.send_step(client, by_client.get(client, []), stats)
        self.clients.flush(block=not self.core.has_work())

    def _replays(self) -> None:
        from engine.replay import replay_results

        keep = []
        for job in self.replays:
            done = sum(len(s.replay.predicted) for s in job.seqs if s.replay is not None)
            if done != job.reported:
                self.clients.send(job.client, ("replay_progress", job.token, done,
                                               sum(len(r.token_ids) for r in job.requests)))
            if all(s.is_finished for s in job.seqs):
                self.clients.send(job.client, ("replayed", job.token, replay_results(job.requests, job.seqs), None))
            else:
                job.reported = done
                keep.append(job)
        self.replays = keep

    def _fail_all(self, exc: Exception) -> None:
        """A failed step leaves no trustworthy state: abort everything and tell every waiter."""
        for rid in list(self.core.seqs):
            self.core.abort(rid)
        self.publisher.clear()
        self.owner.clear()
        self.clients.send_all(("step_failed", repr(exc)))
        for job in self.replays:
            self.clients.send(job.client, ("replayed", job.token, None, f"engine step failed: {exc!r}"))
        self.replays = []
