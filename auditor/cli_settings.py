"""The ``verbatim`` subcommands' shared flags: Settings fields as flags, the settings they give, witness flags,
JWKS sources and storage preparation. Every subcommand module (``auditor.cli`` and the ones it mounts:
replay, reports, witness, monitor) takes them from here."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import urllib.request
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from auditor.cosignature import CosignerKey
from auditor.crypto import KeyRing
from auditor.settings import ENV_PREFIX, Settings, _witness_list
from engine.cli import json_object

STORAGE_SETTINGS = ("data_dir", "database_url", "database_schema", "log_origin")
ENGINE_SETTINGS = ("model", "served_model_name", "device", "tensor_parallel_size", "engine_options", "engine_process",
                   "engine_factory")
SERVICE_SETTINGS = ("host", "port", "workers", "engine_cpus", "log_level", "keep_serving_on_load_error",
                    "deterministic_default", "max_body_bytes", "max_prompt_tokens", "max_tokens_limit", "max_n",
                    "rate_limit_per_second", "rate_limit_burst", "replay_max_queued", "bootstrap_admin", "redis_url",
                    "key_reload_interval", "witnesses", "witness_quorum", "witness_interval", "witness_timeout",
                    "api_key_cache_seconds", "log_check_interval_seconds")
_DEST = "setting_"


def setting_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """``--field-name`` for each named Settings field; left out, the field keeps ``VERBATIM_FIELD_NAME`` or
    its default (``settings_from``). The dest is ``setting_<name>``, so a subcommand's own flag of the same
    name (``export --model``, a filter; ``verify --witness-quorum``) stays apart."""
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    defaults = Settings()
    parsers = {"engine_options": json_object, "witnesses": _witnesses_flag}
    group = parser.add_argument_group("settings (each defaults to its VERBATIM_* variable, then to the default shown)")
    for name in names:
        default = getattr(defaults, name)
        text = f"{fields[name].metadata['help']} (env {ENV_PREFIX}{name.upper()}; default {_shown(default)})"
        flag, dest, text = "--" + name.replace("_", "-"), _DEST + name, text.replace("%", "%%")
        if isinstance(default, bool):
            group.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, help=text)
        else:
            kind = parsers.get(name) or {int: int, float: float}.get(type(default), str)
            group.add_argument(flag, dest=dest, type=kind, metavar=name.upper(), help=text)


def _shown(default: Any) -> str:
    if default is None or default == {} or default == ():
        return "none"
    return repr(str(default) if isinstance(default, Path) else default)


def _witnesses_flag(raw: str) -> tuple[tuple[str, str], ...]:
    try:
        return _witness_list(raw)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def storage_flags(parser: argparse.ArgumentParser) -> None:
    setting_flags(parser, STORAGE_SETTINGS)


def witness_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--witness", action="append", default=[], metavar="VKEY",
                        help="a witness cosigner vkey (C2SP tlog-cosignature); repeatable. Default: the witnesses "
                        "of VERBATIM_WITNESSES. With any, the checkpoint must carry their cosignatures")
    parser.add_argument("--witness-quorum", type=int, metavar="N",
                        help="cosignatures required (default: every witness given)")


def witness_keys_from(args: argparse.Namespace, settings: Settings) -> tuple[list[Any], int]:
    """``(cosigner keys, quorum)`` from ``--witness``/``--witness-quorum``, else from the settings."""
    if args.witness:
        keys = [CosignerKey.parse(v) for v in args.witness]
    else:
        keys = [key for _, key in settings.witness_keys()]
    quorum = args.witness_quorum if args.witness_quorum is not None else (
        settings.required_cosignatures if not args.witness else len(keys))
    if keys and not 1 <= quorum <= len(keys):
        raise ValueError(f"--witness-quorum must be in 1..{len(keys)}, got {quorum}")
    return keys, quorum


def settings_from(args: argparse.Namespace, env: dict[str, str] | None = None) -> Settings:
    """Settings from the flags this subcommand has, over ``VERBATIM_*`` in ``env`` (default os.environ)."""
    overrides = {f.name: getattr(args, _DEST + f.name, None) for f in dataclasses.fields(Settings)}
    return Settings.from_env(os.environ if env is None else env, **overrides)


def prepare_storage(settings: Settings) -> None:
    """Create the data directory, migrate the database to head, create missing signing keys."""
    from auditor.db import migrate  # Alembic: only the commands that keep a database import it

    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    migrate.upgrade(settings.resolved_database_url, schema=settings.database_schema)
    KeyRing.open(settings.keys_dir)


def read_jwks(source: str) -> dict[str, Any]:
    """A JWKS document from a file path or an http(s) URL."""
    if source.startswith(("http://", "https://")):
        with urllib.request.urlopen(source, timeout=30) as response:  # noqa: S310 - explicit user URL
            return json.loads(response.read())
    return json.loads(Path(source).read_text())


def load_jwks(source: str | None, settings: Settings) -> dict[str, Any]:
    if source:
        return read_jwks(source)
    if not (settings.keys_dir / "manifest.json").exists():
        raise FileNotFoundError(f"no --jwks given and no key ring at {settings.keys_dir}")
    return KeyRing.open(settings.keys_dir).jwks()
