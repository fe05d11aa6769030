"""AsyncEngine: the service's engine (docs/engine.md). One background thread owns the EngineCore
and steps it; the event loop talks to it only through a command inbox and per-request asyncio queues.

    event loop                         engine thread
    generate() --("add", seq)------>   inbox -> core.add_request
    abort()    --("abort", id, fut)->  core.abort -> fut
    replay()   --("replay", reqs)-->   core.add_replay ... all finished -> fut
    queue.get() <--call_soon_threadsafe-- committed outputs after each step
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine import progress
from engine.config import EngineConfig
from engine.core import EngineCore, EngineStats
from engine.fingerprint import runtime_fingerprint
from engine.identity import Fingerprinted
from engine.llm import detokenizer
from engine.loading import load_model
from engine.model_runner import LoadedModel
from engine.replay import ReplayRequest, ReplayResult, replay_results, validate_replays
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput, Sequence, SeqKind

_LAST_OUTPUTS_KEPT = 4096


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | BaseException]
    published: int = -1


ReplayProgress = Callable[[int, int], None]
"""on_progress(tokens replayed, tokens in all the job's records), called on the caller's event loop."""


@dataclass
class _ReplayJob:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[list[ReplayResult]]
    requests: list[ReplayRequest]
    seqs: list[Sequence] = field(default_factory=list)
    on_progress: ReplayProgress | None = None
    reported: int = -1


class AsyncEngine(Fingerprinted):
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> None:
        """Loads the model (blocking: call it off the event loop)."""
        self.config = config or EngineConfig()
        started = time.perf_counter()
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        # OpenMP thread counts are per thread: the stepping thread must use the same count as here,
        # or its GEMMs block differently and the bits change (and the fingerprint would lie).
        self._threads = torch.get_num_threads()
        loaded = loaded or load_model(self.config)
        self.tokenizer = loaded.tokenizer
        self.model_info = loaded.info
        eos = set(getattr(loaded.info, "eos_token_ids", ()) or ())
        try:
            self.core = EngineCore(self.config, loaded.model, loaded.shape, eos, detokenizer(loaded.tokenizer),
                                   loaded.tokenizer, tp=loaded.tp)
        except BaseException:
            if loaded.tp is not None:
                loaded.tp.close()
            raise
        self.config = self.core.config  # resolved
        self._fingerprint = runtime_fingerprint(self.config)
        progress.ready(self.config, str(getattr(loaded.info, "name", "?")), started)
        self._inbox: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._streams: dict[str, _Stream] = {}
        self._replays: list[_ReplayJob] = []
        self._last: OrderedDict[str, RequestOutput] = OrderedDict()
        self._ids = itertools.count()

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="verbatim-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
        await asyncio.to_thread(self.core.close)

    # ---- validation, stats ---------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; nothing is queued (engine.limits.validate_request)."""
        self.core.validate(prompt_token_ids, params)

    def stats(self) -> EngineStats:
        return self.core.stats()

    def last_output(self, request_id: str) -> RequestOutput | None:
        return self._last.get(request_id)

    # ---- requests ----------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a cumulative RequestOutput each time tokens are committed (the newest, when several steps
        landed since the last one was taken: a busy event loop sends fewer, longer chunks); the last has
        finished=True."""
        self.validate(prompt_token_ids, params)
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._streams:
            raise ValueError(f"request_id: {rid!r} is already running")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[rid] = stream
        self._send(("add", rid, list(prompt_token_ids), params))
        finished = False
        try:
            while not finished:
                item = latest(stream.queue, await stream.queue.get())
                assert isinstance(item, RequestOutput)
                finished = item.finished
                yield item
        finally:
            if not finished:  # client gone: stop spending compute on it
                self._send(("abort", rid, None))

    async def abort(self, request_id: str) -> RequestOutput | None:
        fut: asyncio.Future[RequestOutput | None] = asyncio.get_running_loop().create_future()
        self._send(("abort", request_id, fut))
        return await fut

    async def replay(self, requests: list[ReplayRequest],
                     on_progress: ReplayProgress | None = None) -> list[ReplayResult]:
        """Teacher-forced re-execution of recorded windows; replays share G x W verify passes.
        on_progress hears the replayed token count after every engine step that advanced it."""
        validate_replays(self.core.limits(), self.tokenizer, requests)
        if not requests:
            return []
        loop = asyncio.get_running_loop()
        job = _ReplayJob(loop, loop.create_future(), list(requests), on_progress=on_progress)
        self._send(("replay", job))
        return await job.future

    def _send(self, command: tuple[Any, ...]) -> None:
        self._inbox.put(command)
        self._wake.set()

    # ---- engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self._threads)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self._drain_inbox()
            self.core.totals.command_seconds += time.perf_counter() - t0
            if not self.core.has_work():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                touched = self.core.step()
            except Exception as exc:  # noqa: BLE001 - every waiter must hear about it
                self._fail_all(exc)
                continue
            t0 = time.perf_counter()
            self._publish(touched)
            self._report_replays()
            self._finish_replays()
            self.core.totals.publish_seconds += time.perf_counter() - t0

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            getattr(self, f"_on_{command[0]}")(*command[1:])

    def _on_add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        try:
            self.core.add_request(rid, prompt, params)
        except ValueError as exc:
            self._push(rid, exc)

    def _on_abort(self, rid: str, fut: asyncio.Future[RequestOutput | None] | None) -> None:
        seq = self.core.abort(rid)
        out = self.core.output(seq) if seq is not None and seq.kind != SeqKind.REPLAY else None
        if out is not None:
            self._remember(out)
            self._push(rid, out)
        elif rid in self._last:
            out = self._last[rid]
        self._streams.pop(rid, None)
        if fut is not None:
            fut.get_loop().call_soon_threadsafe(_resolve, fut, out)

    def _on_replay(self, job: _ReplayJob) -> None:
        try:
            job.seqs = [self.core.add_replay(f"replay-{next(self._ids)}-{r.replay_id}", r.prompt_token_ids,
                                             r.token_ids, r.params, r.windows) for r in job.requests]
            self._replays.append(job)
        except ValueError as exc:
            job.loop.call_soon_threadsafe(_reject, job.future, exc)

    def _publish(self, touched: list[Sequence]) -> None:
        """Hand each touched request's committed output to its stream: one wake-up of each event loop per
        step (a thread-safe call per request would wake it hundreds of times a step under load)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Any], RequestOutput]]] = {}
        for seq in touched:
            if seq.kind == SeqKind.REPLAY:
                continue
            stream = self._streams.get(seq.request_id)
            if stream is not None and stream.published == len(seq.tokens) and not seq.is_finished:
                continue
            out = self.core.output(seq)
            self._remember(out)
            if stream is not None:
                stream.published = len(seq.tokens)
                batches.setdefault(stream.loop, []).append((stream.queue, out))
            if seq.is_finished:
                self._streams.pop(seq.request_id, None)
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)

    def _report_replays(self) -> None:
        for job in self._replays:
            if job.on_progress is None:
                continue
            done = sum(len(s.replay.predicted) for s in job.seqs if s.replay is not None)
            if done != job.reported:
                job.reported = done
                total = sum(len(r.token_ids) for r in job.requests)
                job.loop.call_soon_threadsafe(job.on_progress, done, total)

    def _finish_replays(self) -> None:
        done = [j for j in self._replays if all(s.is_finished for s in j.seqs)]
        for job in done:
            self._replays.remove(job)
            # replay_results reports each request's own replay_id, not the engine-internal sequence id
            job.loop.call_soon_threadsafe(_resolve, job.future, replay_results(job.requests, job.seqs))

    def _push(self, rid: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(rid)
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        if isinstance(item, BaseException):
            self._streams.pop(rid, None)

    def _remember(self, out: RequestOutput) -> None:
        self._last[out.request_id] = out
        self._last.move_to_end(out.request_id)
        while len(self._last) > _LAST_OUTPUTS_KEPT:
            self._last.popitem(last=False)

    def _fail_all(self, exc: Exception) -> None:
        """A failed step leaves no trustworthy state: abort everything and tell every waiter."""
        for rid in list(self.core.seqs):
            self.core.abort(rid)
        for rid in list(self._streams):
            self._push(rid, RuntimeError(f"engine step failed: {exc!r}"))
        for job in self._replays:
            job.loop.call_soon_threadsafe(_reject, job.future, RuntimeError(f"engine step failed: {exc!r}"))
        self._replays.clear()


def latest(q: asyncio.Queue[Any], item: Any) -> Any:
    """The newest of `item` and the items waiting behind it in `q` (outputs are cumulative, so the older
    ones add nothing); an exception among them is raised."""
    while True:
        if isinstance(item, BaseException):
            raise item
        try:
            item = q.get_nowait()
        except asyncio.QueueEmpty:
            return item


def _deliver(items: list[tuple[asyncio.Queue[Any], RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _reject(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
