"""The ``verbatim`` command (also ``python -m auditor``): serve | generate | keys | signing-keys | replay |
verify | export | verify-bundle | retention | purge | witness | monitor | migrate.

Every setting of ``auditor.settings.Settings`` is a flag (``--model``, ``--device``, ``--served-model-name``,
``--data-dir``, ...) on the subcommands it concerns, defaulting to its ``VERBATIM_*`` variable, then to the
field's default; the environment is read once, here. ``generate`` is the engine's own
subcommand (``engine.cli``), mounted unchanged. docs/cli.md is the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from auditor import monitor, replay_cli
from auditor.cli_settings import (ENGINE_SETTINGS, SERVICE_SETTINGS, STORAGE_SETTINGS, load_jwks, prepare_storage,
                                  settings_from, setting_flags, storage_flags, witness_flags, witness_keys_from)
from auditor.reports.cli import COMMANDS as REPORT_COMMANDS
from auditor.roles import Role
from auditor.settings import Settings
from auditor.witness import cli as witness_cli
from engine.cli import COMMANDS as ENGINE_COMMANDS

BOOTSTRAP_TENANT = "default"

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None]]

# The database layer (SQLAlchemy, the API's error types, Alembic) and httpx are imported by the commands
# that use them, so that `verbatim verify`, `monitor` or `witness` start in about a fifth of a second.


# --- serve -----------------------------------------------------------------------------------------


def _serve_parser(parser: argparse.ArgumentParser) -> None:
    setting_flags(parser, (*ENGINE_SETTINGS, *SERVICE_SETTINGS, *STORAGE_SETTINGS))
    parser.set_defaults(run=serve)


async def bootstrap_admin(settings: Settings) -> str | None:
    """Create the first admin key if there is no active one; returns its secret (else None)."""
    from auditor import auth, repository
    from auditor.db.session import create_engine, create_sessionmaker

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


class _StopOnLoadError:
    """``on_engine_error`` hook: stops the server (built after the app, so set later) when the model fails."""

    def __init__(self) -> None:
        self.server: Any = None  # uvicorn.Server

    def __call__(self, _error: str) -> None:
        if self.server is not None:
            self.server.should_exit = True


def serve(args: argparse.Namespace) -> int:
    """Exit status 1 when the model cannot be loaded (unless --keep-serving-on-load-error), else 0."""
    import uvicorn

    from auditor import logs
    from auditor.app import create_app
    from auditor.workers import resolved_workers, serve_workers

    settings = settings_from(args)
    logs.configure(settings.log_level)
    prepare_storage(settings)
    if settings.bootstrap_admin:
        secret = asyncio.run(bootstrap_admin(settings))
        if secret:
            print(f"Created the first admin API key (tenant {BOOTSTRAP_TENANT!r}, role admin). "
                  "It is shown once and stored only as a hash:", flush=True)
            print(secret, flush=True)
    workers = resolved_workers(settings)
    if workers > 1:
        print(f"Verbatim listening on http://{settings.host}:{settings.port} with {workers} worker processes; "
              f"loading model {settings.model!r} (progress on stderr; GET /readyz says when it is ready)", flush=True)
        return serve_workers(settings, workers, stop_on_load_error=not settings.keep_serving_on_load_error)
    stop = None if settings.keep_serving_on_load_error else _StopOnLoadError()
    app = create_app(settings, on_engine_error=stop)
    # log_config=None: uvicorn's records go through the service's handler (JSON, exception text withheld).
    server = uvicorn.Server(uvicorn.Config(app, host=settings.host, port=settings.port, log_level="warning",
                                           log_config=None, access_log=False, timeout_graceful_shutdown=10))
    if stop is not None:
        stop.server = server
    print(f"Verbatim listening on http://{settings.host}:{settings.port}; loading model {settings.model!r} "
          "(progress on stderr; GET /readyz says when it is ready)", flush=True)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on, once shut down (as uvicorn.run)
        pass
    error = app.state.services.engine_error
    if error and stop is not None:
        print(f"error: model {settings.model!r} could not be loaded, so the server stopped: {error}",
              file=sys.stderr, flush=True)
        return 1
    return 0


# --- keys ----------------------------------------------------------------------------------------------


def _keys_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", required=True)
    create = sub.add_parser("create", help="create an API key; prints the key alone on the last line")
    create.add_argument("--tenant", required=True)
    create.add_argument("--role", required=True, choices=[r.value for r in Role])
    create.add_argument("--name", help="a label for the key")
    storage_flags(create)
    create.set_defaults(run=lambda a: asyncio.run(_keys_create(a)))
    listing = sub.add_parser("list", help="list API keys (ids, tenants, roles; never secrets)")
    listing.add_argument("--tenant")
    storage_flags(listing)
    listing.set_defaults(run=lambda a: asyncio.run(_keys_list(a)))
    revoke = sub.add_parser("revoke", help="revoke an API key by id")
    revoke.add_argument("key_id")
    storage_flags(revoke)
    revoke.set_defaults(run=lambda a: asyncio.run(_keys_revoke(a)))


async def _with_session(args: argparse.Namespace, action: Callable[[Any], Any]) -> Any:
    """Run ``action`` in one transaction on a database migrated to head (a fresh one is created)."""
    from auditor.db import migrate
    from auditor.db.session import create_engine, create_sessionmaker

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
    from auditor import auth

    try:
        row, secret = await _with_session(args, lambda s: auth.create_key(s, args.tenant, args.role, args.name))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"created key {row.id} tenant={row.tenant} role={row.role} (shown once; stored as a hash)")
    print(secret)
    return 0


async def _keys_list(args: argparse.Namespace) -> int:
    from auditor import repository

    rows = await _with_session(args, lambda s: repository.list_api_keys(s, args.tenant))
    for row in rows:
        state = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
        print(f"{row.id}\t{row.tenant}\t{row.role}\t{state}\t{row.name or ''}")
    return 0


async def _keys_revoke(args: argparse.Namespace) -> int:
    from auditor import auth

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
    witness_flags(parser)
    storage_flags(parser)
    parser.set_defaults(run=verify)


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
    storage_flags(parser)
    parser.set_defaults(run=run_migrate)


def run_migrate(args: argparse.Namespace) -> int:
    from auditor.db import migrate

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
    storage_flags(listing)
    listing.set_defaults(run=signing_keys_list)
    rotate = sub.add_parser("rotate", help="retire a role's active key and create a new one (old ones stay "
                            "published); running servers sharing the key directory pick it up")
    rotate.add_argument("--role", required=True, choices=[r.value for r in KeyRole])
    storage_flags(rotate)
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
    """Subcommands other parts contribute: replay; reports (export, verify-bundle, retention, purge);
    witness; monitor; the engine's generate."""
    return [("replay", "replay a transcript and print the verdict", replay_cli.configure), *REPORT_COMMANDS,
            ("witness", "run a C2SP tlog-witness that cosigns consistent checkpoints", witness_cli.configure),
            ("monitor", "follow a log's checkpoints and fail loudly on any inconsistency", monitor.configure),
            *ENGINE_COMMANDS]


def build_parser(prog: str = "verbatim") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Verbatim: verifiable LLM inference (bit-exact "
                                     "replayable completions, signed transcripts, a tamper-evident log)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_text, configure in [*SUBCOMMANDS, *plugin_commands()]:
        configure(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "verbatim") -> int:
    """The ``verbatim`` console script. Exit status 2 for a bad setting (the message names it)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(prog).parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
