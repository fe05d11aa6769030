"""Service settings: one frozen object, built once at the edge (CLI or test) and passed down.

Every field can be set from the environment as ``VERBATIM_<FIELD>`` (upper case); the CLI flags
override the environment. Nothing reads the environment after ``Settings.from_env`` returns.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

ENV_PREFIX = "VERBATIM_"


def _setting(default: Any, help: str) -> Any:
    """A field with its help text (shown by ``verbatim <command> --help`` and listed in docs/cli.md)."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class Settings:
    host: str = _setting("127.0.0.1", "bind address")
    port: int = _setting(8000, "TCP port")
    data_dir: Path = _setting(Path("data"), "data directory: SQLite database, signing keys, report bundles")
    database_url: str | None = _setting(
        None, "SQLAlchemy async URL, e.g. postgresql+asyncpg://user@host/db (default: sqlite+aiosqlite:///"
        "<data dir>/verbatim.db)")
    database_schema: str | None = _setting(
        None, "PostgreSQL schema (search_path) to use instead of the default; tests use a fresh one")
    log_origin: str = _setting("verbatim.local/log", "origin line of the log's checkpoints (C2SP); name the deployment")
    model: str = _setting(
        "default", "'default' (the SmolLM2 GGUF), a local Hugging Face model folder, a .gguf file, a Hugging Face "
        "model id ORG/NAME[@REVISION] (resolved through the Hugging Face cache; HF_HUB_OFFLINE, HF_HOME / "
        "HF_HUB_CACHE and HF_TOKEN apply), or synthetic:<preset>[:peaked] (seeded random weights of a preset "
        "shape, for benchmarks)")
    served_model_name: str | None = _setting(
        None, "the model id clients send and transcripts record; none: the name given to --model (the hub id "
        "without revision, the folder name, or the GGUF file stem)")
    device: str = _setting("auto", "auto / cpu / cuda")
    deterministic_default: bool = _setting(True, "value of the deterministic extension field when a request "
                                           "leaves it out")
    max_body_bytes: int = _setting(1_048_576, "largest request body accepted, in bytes")
    max_prompt_tokens: int = _setting(4096, "longest prompt accepted, in tokens (413 beyond)")
    max_tokens_limit: int = _setting(4096, "largest max_tokens a request may ask for")
    max_n: int = _setting(8, "most choices (n) one completion request may ask for")
    api_key_cache_seconds: float = _setting(
        1.0, "seconds a valid API key is remembered without reading the database again; a key revoked by another "
        "process (replica, CLI) is refused after at most this long, one revoked through this process at once")
    rate_limit_per_second: float = _setting(20.0, "requests per second per API key (token bucket rate)")
    rate_limit_burst: int = _setting(60, "token bucket size per API key")
    replay_max_queued: int = _setting(8, "replays one tenant may have queued or running at once (429 beyond)")
    log_level: str = _setting("INFO", "DEBUG / INFO / WARNING / ERROR")
    log_check_interval_seconds: float = _setting(
        600.0, "the log's full self-check runs at start and then this often, in seconds; 0: at start only")
    bootstrap_admin: bool = _setting(True, "on first start with no admin key, create one and print it once")
    keep_serving_on_load_error: bool = _setting(
        False, "when the model cannot be loaded, keep serving (/readyz answers 503 with the error) instead of "
        "exiting with status 1")
    tensor_parallel_size: int = _setting(
        1, "shard the model over this many ranks, one process each (CUDA: one GPU each, over NCCL); part of the "
        "runtime fingerprint, so a transcript replays only at its own size")
    engine_options: Mapping[str, Any] = field(default_factory=dict, metadata={"help": (
        "other engine options as a JSON object: EngineConfig and DvrTuning fields by name, e.g. '{\"window\": "
        "16, \"group\": 8, \"overlap\": false}'")})
    engine_process: bool = _setting(
        True, "run the engine in a process of its own (the serving process then only serves: the two do not "
        "share one Python interpreter lock); false: an engine thread inside the serving process")
    workers: int = _setting(
        0, "HTTP worker processes serving the API on one port, all sharing one engine process, the database and "
        "the data directory; 0: automatic (1 on a host without CUDA or when engine_process is off; on a CUDA host "
        "a quarter of the CPU cores, from 1 to 8)")
    engine_cpus: str = _setting(
        "auto", "the CPUs the engine process runs on when worker processes share it, the workers taking the others: "
        "a CPU list such as '14-15'; 'auto': on a CUDA host with at least 8 CPUs and tensor_parallel_size 1, one "
        "physical core (two where a core has one hardware thread; engine/placement.py), so that the workers and "
        "other processes on the host do not slow the engine's step; 'off': wherever the kernel puts them")
    engine_factory: str | None = _setting(
        None, "module:callable building the engine from the Settings instead of engine.AsyncEngine (tests run "
        "several server processes on a small fake engine this way)")
    witnesses: tuple[tuple[str, str], ...] = _setting(
        (), "C2SP tlog-witnesses asked to cosign each new checkpoint, as a JSON list of {\"url\", \"vkey\"} "
        "objects, e.g. '[{\"url\": \"http://w1:8090\", \"vkey\": \"w1.example+1a2b3c4d+BA...\"}]'")
    witness_quorum: int = _setting(0, "cosignatures a checkpoint needs to count as witnessed (?witnessed=true); "
                                   "0 means every witness")
    witness_interval: float = _setting(1.0, "seconds between two checks for a checkpoint the witnesses have not "
                                       "cosigned yet")
    witness_timeout: float = _setting(10.0, "seconds one witness request (and a ?witnessed=true wait) may take")
    redis_url: str | None = _setting(None, "redis://host:port/db: console sessions and rate limits shared by "
                                     "every replica (else in memory)")
    key_reload_interval: float = _setting(5.0, "seconds between checks of the key directory for keys rotated by "
                                          "another process")

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")
        if self.api_key_cache_seconds < 0:
            raise ValueError(f"api_key_cache_seconds must be >= 0, got {self.api_key_cache_seconds}")
        if self.log_check_interval_seconds < 0:
            raise ValueError(f"log_check_interval_seconds must be >= 0, got {self.log_check_interval_seconds}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.workers < 0:
            raise ValueError(f"workers must be >= 0 (0: automatic), got {self.workers}")
        if self.workers > 1 and not self.engine_process and not self.engine_factory:
            raise ValueError(f"workers: {self.workers} worker processes share one engine process, so engine_process "
                             "must be on")
        if self.engine_cpus not in ("auto", "off"):
            from engine.placement import parse_cpus

            try:
                parse_cpus(self.engine_cpus)
            except ValueError as exc:
                raise ValueError(f"engine_cpus: {exc}; or 'auto' or 'off'") from None
        if self.replay_max_queued < 1:
            raise ValueError(f"replay_max_queued must be >= 1, got {self.replay_max_queued}")
        if self.rate_limit_per_second <= 0 or self.rate_limit_burst < 1:
            raise ValueError(
                f"rate limit must be positive, got {self.rate_limit_per_second}/s burst {self.rate_limit_burst}"
            )
        self.witness_keys()
        if not 0 <= self.witness_quorum <= len(self.witnesses):
            raise ValueError(f"witness_quorum must be in 0..{len(self.witnesses)} (the witnesses configured), "
                             f"got {self.witness_quorum}")
        if self.witness_interval <= 0 or self.witness_timeout <= 0 or self.key_reload_interval <= 0:
            raise ValueError(f"witness_interval, witness_timeout and key_reload_interval must be > 0, got "
                             f"{self.witness_interval}, {self.witness_timeout}, {self.key_reload_interval}")

    def witness_keys(self) -> list[tuple[str, Any]]:
        """``(url, CosignerKey)`` per configured witness; raises ``ValueError`` naming a bad one."""
        from auditor.cosignature import CosignatureError, CosignerKey

        out = []
        for i, (url, vkey) in enumerate(self.witnesses):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"witnesses[{i}].url must be an http(s) URL, got {url!r}")
            try:
                out.append((url, CosignerKey.parse(vkey)))
            except CosignatureError as exc:
                raise ValueError(f"witnesses[{i}].vkey: {exc}") from None
        return out

    @property
    def required_cosignatures(self) -> int:
        return self.witness_quorum or len(self.witnesses)

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        return f"sqlite+aiosqlite:///{(self.data_dir / 'verbatim.db').resolve()}"

    @property
    def keys_dir(self) -> Path:
        return self.data_dir / "keys"

    @property
    def run_dir(self) -> Path:
        """State the worker processes of one ``serve`` share while it runs (rate limits, console sessions,
        metrics); emptied when ``serve`` starts them. One folder per host and port, so replicas sharing the data
        directory (on one host or over a shared filesystem) keep theirs apart."""
        import socket

        return self.data_dir / "run" / f"{socket.gethostname()}-{self.port}"

    @classmethod
    def from_env(cls, env: Mapping[str, str], **overrides: Any) -> "Settings":
        """Build from ``VERBATIM_*`` variables, then apply non-None ``overrides`` (CLI flags)."""
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(ENV_PREFIX + f.name.upper())
            if f.name == "engine_options":
                if raw is not None:
                    values[f.name] = _json_object(raw)
                continue
            if f.name == "witnesses":
                if raw is not None:
                    values[f.name] = _witness_list(raw)
                continue
            if raw is not None:
                values[f.name] = _coerce(f.name, raw, type(getattr(cls(), f.name)))
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ValueError(f"unknown settings: {sorted(unknown)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        if "data_dir" in values:
            values["data_dir"] = Path(values["data_dir"])
        return cls(**values)


def _json_object(raw: str) -> dict[str, Any]:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}ENGINE_OPTIONS must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{ENV_PREFIX}ENGINE_OPTIONS must be a JSON object, got {type(value).__name__}")
    return value


def _witness_list(raw: str) -> tuple[tuple[str, str], ...]:
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV_PREFIX}WITNESSES must be a JSON list of {{\"url\", \"vkey\"}}: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(w, dict) and set(w) == {"url", "vkey"} and
                                              all(isinstance(v, str) for v in w.values()) for w in value):
        raise ValueError(f"{ENV_PREFIX}WITNESSES must be a JSON list of {{\"url\": str, \"vkey\": str}} objects")
    return tuple((w["url"], w["vkey"]) for w in value)


def _coerce(name: str, raw: str, kind: type) -> Any:
    if kind is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{ENV_PREFIX}{name.upper()} must be a boolean, got {raw!r}")
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            raise ValueError(f"{ENV_PREFIX}{name.upper()} must be a number, got {raw!r}") from None
    if kind is type(None):
        return raw
    if issubclass(kind, Path):
        return Path(raw)
    return raw
