"""Prometheus metrics on a registry owned by the app (no process-global registry).

Service counters are updated by the HTTP layer; engine figures (tokens, verify passes, rollbacks,
verify-pass seconds, queue depth) are read from ``engine.stats()`` and the log's (appends, batches,
checkpoints, self-check state) from ``Ledger.stats`` at scrape time.

Under ``serve`` with several worker processes (``PROMETHEUS_MULTIPROC_DIR`` set by ``serve`` before they
start), the HTTP, completion and witness counters of every worker are summed at scrape time from the
directory's files (prometheus_client's multiprocess mode); the engine figures are the shared engine's; the
log's counters are those of the worker that answers the scrape (its appends), and its tree size the log's.

The log's self-check: ``verbatim_log_integrity_ok`` is 1 after a passing check, 0 after a mismatch
(absent before the first check); on a mismatch ``verbatim_log_integrity_first_bad_index{check=…}``
names the first bad log index.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from auditor.engine_seam import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_ENGINE_COUNTERS = {
    "steps": "Engine steps (each plans a prefill, decode or verify pass; a verify step may also launch a decode step)",
    "prefill_passes": "Prefill passes run",
    "decode_passes": "Decode steps run, those launched behind a verify pass included (not its carried rows)",
    "step_seconds": "Seconds the engine spent in its steps: its rate is the engine loop's utilization",
    "command_seconds": "Seconds the engine loop spent on its commands (requests added, aborts), not waiting for them",
    "publish_seconds": "Seconds the engine loop spent handing its steps' outputs to the serving processes",
    "prompt_tokens": "Prompt tokens prefilled by the engine",
    "generated_tokens": "Output tokens committed by the engine",
    "verify_passes": "DVR verify passes run",
    "rollbacks": "DVR rollbacks (candidate mismatches)",
    "recomputed_tokens": "Candidate tokens discarded by rollbacks",
    "verify_seconds": "Seconds spent in verify passes",
    "carried_decode_rows": "Decode rows run inside verify passes",
    "early_decode_steps": "Decode steps launched before the preceding verify pass's samples were read",
    "chained_verify_passes": "Verify passes launched before the preceding decode step's samples were read",
    "preemptions": "Requests preempted for lack of KV blocks",
}
_ENGINE_GAUGES = {"running": "Requests running in the engine", "waiting": "Requests queued in the engine"}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []  # read at scrape time only; the engine may not exist yet

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        if stats is None:
            return
        values = dataclasses.asdict(stats)
        for name, doc in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"verbatim_engine_{name}", doc, value=float(values[name]))
        passes = stats.verify_passes
        yield GaugeMetricFamily("verbatim_engine_verify_pass_mean_seconds", "Mean verify-pass latency",
                                value=stats.verify_seconds / passes if passes else 0.0)
        for name, doc in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"verbatim_engine_{name}", doc, value=float(values[name]))


class _LogCollector(Collector):
    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        for name, doc, value in (("appends", "Transcripts recorded in the log", stats.appends),
                                 ("leaves", "Log leaves appended", stats.leaves),
                                 ("append_batches", "Append transactions committed (one checkpoint each)", stats.batches),
                                 ("checkpoints", "Checkpoints signed", stats.checkpoints)):
            yield CounterMetricFamily(f"verbatim_log_{name}", doc, value=float(value))
        yield GaugeMetricFamily("verbatim_log_tree_size", "Leaves in the log", value=float(stats.tree_size))
        checks = CounterMetricFamily("verbatim_log_integrity_checks", "Full log self-checks by result",
                                     labels=["result"])
        for result, count in stats.checks.items():
            checks.add_metric([result], float(count))
        yield checks
        if stats.integrity.value != "unchecked":
            yield GaugeMetricFamily("verbatim_log_integrity_ok", "1: the log passed its self-check; 0: a mismatch "
                                    "was found (appends refused, nothing signed)",
                                    value=1.0 if stats.fault is None else 0.0)
        if stats.fault is not None:
            bad = GaugeMetricFamily("verbatim_log_integrity_first_bad_index",
                                    "First log index that failed the self-check", labels=["check"])
            bad.add_metric([stats.fault.check], float(stats.fault.first_bad_index))
            yield bad


class Metrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None], log_stats: Callable[[], Any] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("verbatim_http_requests", "HTTP requests by route and status",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("verbatim_http_request_seconds", "HTTP request latency by route",
                                 ["route"], registry=self.registry)
        self.completions = Counter("verbatim_completions", "Completions by API, determinism and status",
                                   ["api", "deterministic", "status"], registry=self.registry)
        self.tokens = Counter("verbatim_tokens", "Tokens served, by kind (prompt / completion)",
                              ["kind"], registry=self.registry)
        self.witness = Counter("verbatim_witness_submissions", "Checkpoint submissions to witnesses, by outcome "
                               "(cosigned, refused, unreachable, ahead, bad_cosignature, http_<status>, error)",
                               ["witness", "outcome"], registry=self.registry)
        self._collectors: list[Collector] = [_EngineCollector(engine_stats)]
        if log_stats is not None:
            self._collectors.append(_LogCollector(log_stats))
        for collector in self._collectors:
            self.registry.register(collector)

    def witness_result(self, witness: str, outcome: str) -> None:
        self.witness.labels(witness, outcome).inc()

    def render(self) -> bytes:
        if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        for collector in self._collectors:
            registry.register(collector)
        return generate_latest(registry)

    def completion(self, api: str, deterministic: bool, status: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.completions.labels(api, str(deterministic).lower(), status).inc()
        self.tokens.labels("prompt").inc(prompt_tokens)
        self.tokens.labels("completion").inc(completion_tokens)
