"""``python -m auditor serve | keys create|list|revoke | verify FILE | migrate``.

Every subcommand takes ``--data-dir`` and ``--database-url`` (also ``VERBATIM_DATA_DIR`` /
``VERBATIM_DATABASE_URL``); ``serve`` also ``--host`` / ``--port``. The environment is read once,
here. Other parts contribute subcommands through ``plugin_commands`` (``replay``, ``export``, …).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from auditor import auth, repository
from auditor.db import migrate
from auditor.db.models import Role
from auditor.db.session import create_engine, create_sessionmaker
from auditor.settings import Settings

BOOTSTRAP_TENANT = "default"

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None]]


def _db_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--data-dir", help="data directory (default ./data; env VERBATIM_DATA_DIR)")
    parser.add_argument("--database-url", help="SQLAlchemy async URL, e.g. postgresql+asyncpg://… "
                        "(default: SQLite file in the data directory; env VERBATIM_DATABASE_URL)")


def _witness_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--witness", action="append", default=[], metavar="VKEY",
                        help="a witness cosigner vkey (C2SP tlog-cosignature); repeatable. Default: the witnesses "
                        "of VERBATIM_WITNESSES. With any, the checkpoint must carry their cosignatures")
    parser.add_argument("--witness-quorum", type=int, metavar="N",
                        help="cosignatures required (default: every witness given)")


def witness_keys_from(args: argparse.Namespace, settings: Settings) -> tuple[list[Any], int]:
    """``(cosigner keys, quorum)`` from ``--witness``/``--witness-quorum``, else from the settings."""
    from auditor.cosignature import CosignerKey

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
    overrides = {k: getattr(args, k, None) for k in ("host", "port", "data_dir", "database_url")}
    return Settings.from_env(os.environ if env is None else env, **overrides)


# --- serve -----------------------------------------------------------------------------------------


def _serve_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", help="bind address (default 127.0.0.1; env VERBATIM_HOST)")
    parser.add_argument("--port", type=int, help="port (default 8000; env VERBATIM_PORT)")
    _db_flags(parser)
    parser.set_defaults(run=serve)


def prepare_storage(settings: Settings) -> None:
    """Create the data directory, migrate the database to head, create missing signing keys."""
    from auditor.crypto import KeyRing

    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    migrate.upgrade(settings.resolved_database_url, schema=settings.database_schema)
    KeyRing.open(settings.keys_dir)


async def bootstrap_admin(settings: Settings) -> str | None:
    """Create the first admin key if there is no active one; returns its secret (else None)."""
    db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        async with create_sessionmaker(db)() as session, session.begin():
            await repository.lock(session, "verbatim-bootstrap-admin")
            if await repository.count_admin_keys(session):
                return None
            _, secret = await auth.create_key(session, BOOTSTRAP_TENANT, Role.ADMIN, "bootstrap admin")
            return secret
    finally:
        await db.dispose()


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from auditor import logs
    from auditor.app import create_app

    settings = settings_from(args)
    logs.configure(settings.log_level)
    prepare_storage(settings)
    if settings.bootstrap_admin:
        secret = asyncio.run(bootstrap_admin(settings))
        if secret:
            print(f"Created the first admin API key (tenant {BOOTSTRAP_TENANT!r}, role admin). "
                  "It is shown once and stored only as a hash:", flush=True)
            print(secret, flush=True)
    print(f"Verbatim listening on http://{settings.host}:{settings.port} (model loads in the background; "
          "GET /readyz says when it is ready)", flush=True)
    # log_config=None: uvicorn's records go through the service's handler (JSON, exception text withheld).
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="warning",
                log_config=None, access_log=False, timeout_graceful_shutdown=10)
    return 0


# --- keys ----------------------------------------------------------------------------------------------


def _keys_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="create an API key; prints the key alone on the last line")
    create.add_argument("--tenant", required=True)
    create.add_argument("--role", required=True, choices=[r.value for r in Role])
    create.add_argument("--name", help="a label for the key")
    _db_flags(create)
    create.set_defaults(run=lambda a: asyncio.run(_keys_create(a)))
    listing = sub.add_parser("list", help="list API keys (ids, tenants, roles; never secrets)")
    listing.add_argument("--tenant")
    _db_flags(listing)
    listing.set_defaults(run=lambda a: asyncio.run(_keys_list(a)))
    revoke = sub.add_parser("revoke", help="revoke an API key by id")
    revoke.add_argument("key_id")
    _db_flags(revoke)
    revoke.set_defaults(run=lambda a: asyncio.run(_keys_revoke(a)))


async def _with_session(args: argparse.Namespace, action: Callable[[Any], Any]) -> Any:
    """Run ``action`` in one transaction on a database migrated to head (a fresh one is created)."""
    settings = settings_from(args)
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    await asyncio.to_thread(migrate.upgrade, settings.resolved_database_url, schema=settings.database_schema)
    db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        async with create_sessionmaker(db)() as session, session.begin():
            return await action(session)
    finally:
        await db.dispose()


async def _keys_create(args: argparse.Namespace) -> int:
    try:
        row, secret = await _with_session(args, lambda s: auth.create_key(s, args.tenant, args.role, args.name))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"created key {row.id} tenant={row.tenant} role={row.role} (shown once; stored as a hash)")
    print(secret)
    return 0


async def _keys_list(args: argparse.Namespace) -> int:
    rows = await _with_session(args, lambda s: repository.list_api_keys(s, args.tenant))
    for row in rows:
        state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
        print(f"{row.id}\t{row.tenant}\t{row.role}\t{state}\t{row.name or ''}")
    return 0


async def _keys_revoke(args: argparse.Namespace) -> int:
    row = await _with_session(args, lambda s: auth.revoke_key(s, args.key_id))
    if row is None:
        print(f"error: no key {args.key_id!r}", file=sys.stderr)
        return 1
    print(f"revoked {row.id}")
    return 0


# --- verify / migrate ----------------------------------------------------------------------------------


def _verify_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="transcript document (GET /v1/transcripts/{id}) or bundle entry")
    parser.add_argument("--jwks", help="JWKS file or http(s) URL (default: this server's keys in the data dir)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    _witness_flags(parser)
    _db_flags(parser)
    parser.set_defaults(run=verify)


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
    from auditor.crypto import KeyRing

    return KeyRing.open(settings.keys_dir).jwks()


def verify(args: argparse.Namespace) -> int:
    from auditor.verify import verify_file

    from auditor.cosignature import CosignatureError

    settings = settings_from(args)
    try:
        jwks = load_jwks(args.jwks, settings)
    except (OSError, ValueError) as exc:
        print(f"error: cannot load the JWKS: {exc}", file=sys.stderr)
        return 2
    try:
        witnesses, quorum = witness_keys_from(args, settings)
    except (ValueError, CosignatureError) as exc:
        print(f"error: witnesses: {exc}", file=sys.stderr)
        return 2
    report = verify_file(args.file, jwks, witnesses=witnesses, quorum=quorum)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.render())
    return 0 if report.ok else 1


def _migrate_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--revision", default="head", help="target revision (default head)")
    parser.add_argument("--down", action="store_true", help="downgrade to --revision (default base)")
    _db_flags(parser)
    parser.set_defaults(run=run_migrate)


def run_migrate(args: argparse.Namespace) -> int:
    settings = settings_from(args)
    settings.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    if args.down:
        migrate.downgrade(settings.resolved_database_url, "base" if args.revision == "head" else args.revision,
                          schema=settings.database_schema)
    else:
        migrate.upgrade(settings.resolved_database_url, args.revision, schema=settings.database_schema)
    print(f"database at {'base' if args.down and args.revision == 'head' else args.revision}")
    return 0


def _signing_keys_parser(parser: argparse.ArgumentParser) -> None:
    from auditor.crypto import KeyRole

    sub = parser.add_subparsers(dest="signing_keys_command", required=True)
    listing = sub.add_parser("list", help="list the signing keys (kid, role, status; public facts only)")
    _db_flags(listing)
    listing.set_defaults(run=signing_keys_list)
    rotate = sub.add_parser("rotate", help="retire a role's active key and create a new one (old ones stay "
                            "published); running servers sharing the key directory pick it up")
    rotate.add_argument("--role", required=True, choices=[r.value for r in KeyRole])
    _db_flags(rotate)
    rotate.set_defaults(run=signing_keys_rotate)


def signing_keys_list(args: argparse.Namespace) -> int:
    from auditor.crypto import KeyRing

    for jwk in KeyRing.open(settings_from(args).keys_dir).jwks()["keys"]:
        print(f"{jwk['kid']}\t{jwk['role']}\t{jwk['status']}")
    return 0


def signing_keys_rotate(args: argparse.Namespace) -> int:
    from auditor.crypto import KeyRing

    signer = KeyRing.open(settings_from(args).keys_dir).rotate(args.role)
    print(f"rotated {signer.role.value}: new active key {signer.kid}")
    return 0


SUBCOMMANDS: list[Command] = [
    ("serve", "migrate, create keys, and serve the API", _serve_parser),
    ("keys", "manage API keys", _keys_parser),
    ("verify", "verify a transcript document offline with public keys only", _verify_parser),
    ("migrate", "apply database migrations", _migrate_parser),
    ("signing-keys", "list or rotate the Ed25519 signing keys", _signing_keys_parser),
]


def plugin_commands() -> list[Command]:
    """Subcommands other parts contribute: replay; reports (export, verify-bundle, retention, purge)."""
    from auditor import monitor, replay_cli
    from auditor.reports.cli import COMMANDS
    from auditor.witness import cli as witness_cli

    return [("replay", "replay a transcript and print the verdict", replay_cli.configure), *COMMANDS,
            ("witness", "run a C2SP tlog-witness that cosigns consistent checkpoints", witness_cli.configure),
            ("monitor", "follow a log's checkpoints and fail loudly on any inconsistency", monitor.configure)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m auditor", description="Verbatim audit service")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, configure in [*SUBCOMMANDS, *plugin_commands()]:
        configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)
