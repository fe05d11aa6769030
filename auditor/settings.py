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


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("data")
    database_url: str | None = None
    """SQLAlchemy async URL; ``None`` means ``sqlite+aiosqlite:///<data_dir>/verbatim.db``."""
    database_schema: str | None = None
    """PostgreSQL schema (search_path) to use instead of the default; tests use a fresh one."""
    log_origin: str = "verbatim.local/log"
    """Origin line of the log's checkpoints (C2SP); name the deployment."""
    model: str = "default"
    """``default`` (the SmolLM2 GGUF), a local Hugging Face model directory, a .gguf file, or
    ``synthetic:<preset>[:peaked]`` (seeded random weights of a preset shape, for benchmarks)."""
    device: str = "auto"
    deterministic_default: bool = True
    """Value of the ``deterministic`` extension field when a request leaves it out."""
    max_body_bytes: int = 1_048_576
    max_prompt_tokens: int = 4096
    max_tokens_limit: int = 4096
    rate_limit_per_second: float = 20.0
    rate_limit_burst: int = 60
    replay_max_queued: int = 8
    """Replays one tenant may have queued or running at once; past it, POST .../replay answers 429."""
    log_level: str = "INFO"
    bootstrap_admin: bool = True
    """On first start with no admin key, create one and print it once."""
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    """Extra ``EngineConfig`` keyword arguments, e.g. ``VERBATIM_ENGINE_OPTIONS='{"window": 16, "group": 8}'``."""
    engine_factory: str | None = None
    """``module:callable`` building the engine from the ``Settings`` instead of ``engine.AsyncEngine``
    (tests run several server processes on a small fake engine this way)."""
    witnesses: tuple[tuple[str, str], ...] = ()
    """C2SP tlog-witnesses asked to cosign each new checkpoint: ``(submission URL, cosigner vkey)`` pairs;
    ``VERBATIM_WITNESSES='[{"url": "http://w1:8090", "vkey": "w1.example+1a2b3c4d+BA…"}]'``."""
    witness_quorum: int = 0
    """Cosignatures a checkpoint needs to count as witnessed (``?witnessed=true``); 0 means every witness."""
    witness_interval: float = 1.0
    """Seconds between two checks for a checkpoint the witnesses have not cosigned yet."""
    witness_timeout: float = 10.0
    """Seconds one witness request (and a ``?witnessed=true`` wait) may take."""
    redis_url: str | None = None
    """``redis://host:port/db``: console sessions and rate limits shared by every replica (else in memory)."""
    key_reload_interval: float = 5.0
    """Seconds between checks of the key directory for keys rotated by another process."""

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
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
