"""``export``, ``verify-bundle``, ``purge`` and ``retention`` subcommands.

``COMMANDS`` has the shape of ``auditor.cli.SUBCOMMANDS`` (name, help, configure); ``auditor.cli.plugin_commands``
mounts them under ``python -m auditor``, and they also run as ``python -m auditor.reports …``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from auditor.cli_settings import read_jwks, settings_from, storage_flags, witness_flags, witness_keys_from

Command = tuple[str, str, Callable[[argparse.ArgumentParser], None]]


def _time(text: str) -> dt.datetime:
    value = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return value.astimezone(dt.UTC)


# --- export -----------------------------------------------------------------------------------------


def _export_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", required=True, help="the tenant whose transcripts the report covers")
    parser.add_argument("--since", type=_time, help="period start, inclusive (ISO 8601; UTC if no zone)")
    parser.add_argument("--until", type=_time, help="period end, exclusive (ISO 8601; UTC if no zone)")
    parser.add_argument("--model", help="only this model")
    parser.add_argument("--deterministic-only", action="store_true", help="only deterministic requests")
    parser.add_argument("--include-content", action="store_true",
                        help="include prompts, outputs, token ids and salts (excluded by default)")
    parser.add_argument("-o", "--output", type=Path, help="where to write the ZIP (default ./verbatim-report-<id>.zip)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    storage_flags(parser)
    parser.set_defaults(run=lambda a: asyncio.run(export(a)))


class _Bar:
    """A tqdm bar per stage (transcripts, render), drawn on stderr."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bars: dict[str, Any] = {}

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        bar = self._bars.get(stage)
        if bar is None:
            unit = " step" if stage == "render" else " items"
            bar = self._bars[stage] = tqdm(total=total, desc=f"{stage:<11}", unit=unit, file=sys.stderr, leave=True)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()


async def export(args: argparse.Namespace) -> int:
    from auditor.auth import Principal
    from auditor.crypto import KeyRing
    from auditor.db.models import Role
    from auditor.db.session import create_engine, create_sessionmaker
    from auditor.ledger import Ledger
    from auditor.reports.inputs import ReportFilters
    from auditor.reports.jobs import JobStatus, JobStore
    from auditor.reports.service import REPORTS_DIR, ReportService
    from auditor.witnessing import WitnessPool

    settings = settings_from(args)
    filters = ReportFilters(args.tenant, args.since, args.until, args.model, args.deterministic_only,
                            args.include_content)
    db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        sessionmaker = create_sessionmaker(db)
        keyring = KeyRing.open(settings.keys_dir)
        ledger = Ledger(sessionmaker, keyring, settings.log_origin)
        witnesses = WitnessPool.from_settings(settings, sessionmaker, ledger)
        service = ReportService(sessionmaker, ledger, keyring, JobStore(settings.data_dir / REPORTS_DIR), witnesses)
        try:
            job = await service.export(Principal("cli", args.tenant, Role.ADMIN), filters, _Bar(not args.no_progress))
        finally:
            if witnesses is not None:
                await witnesses.stop()
    finally:
        await db.dispose()
    if job.status is not JobStatus.DONE:
        print(f"error: report {job.id} failed: {job.error}", file=sys.stderr)
        return 1
    out = args.output or Path(f"verbatim-report-{job.id}.zip")
    shutil.copyfile(service.jobs.bundle_path(job.id), out)
    print(f"report {job.id}: {job.transcripts} transcripts, {job.bundle_size} bytes, sha256 {job.bundle_sha256}")
    print(out)
    return 0


# --- verify-bundle ------------------------------------------------------------------------------------


def _verify_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", type=Path, help="the report ZIP")
    parser.add_argument("--jwks", help="pin a JWKS file or http(s) URL instead of trusting the bundle's jwks.json")
    parser.add_argument("--json", action="store_true", help="print every finding as JSON")
    parser.add_argument("-v", "--verbose", action="store_true", help="print passing checks too")
    witness_flags(parser)
    parser.set_defaults(run=verify_bundle_command)


def verify_bundle_command(args: argparse.Namespace) -> int:
    from auditor.reports.verify_bundle import verify_bundle

    from auditor.cosignature import CosignatureError

    try:
        jwks = read_jwks(args.jwks) if args.jwks else None
    except (OSError, ValueError) as exc:
        print(f"error: cannot load the JWKS: {exc}", file=sys.stderr)
        return 2
    try:
        witnesses, quorum = witness_keys_from(args, settings_from(args))
    except (ValueError, CosignatureError) as exc:
        print(f"error: witnesses: {exc}", file=sys.stderr)
        return 2
    result = verify_bundle(args.bundle, jwks, witnesses=witnesses, quorum=quorum)
    print(json.dumps(result.to_json(), indent=2) if args.json else result.render(verbose=args.verbose))
    return 0 if result.ok else 1


# --- retention / purge --------------------------------------------------------------------------------


def _retention_parser(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="retention_command", required=True)
    show = sub.add_parser("show", help="print the retention settings")
    storage_flags(show)
    show.set_defaults(run=retention_show)
    put = sub.add_parser("set", help="set a tenant's (or the default) retention in days")
    put.add_argument("--tenant", help="tenant (omit to set the default)")
    put.add_argument("--days", type=int, required=True)
    storage_flags(put)
    put.set_defaults(run=retention_set)


def retention_show(args: argparse.Namespace) -> int:
    from auditor.reports.retention import load_policy

    policy = load_policy(settings_from(args).data_dir)
    print(f"default\t{policy.default_days} days")
    for tenant, days in sorted(policy.tenants.items()):
        print(f"{tenant}\t{days} days")
    return 0


def retention_set(args: argparse.Namespace) -> int:
    from auditor.reports.retention import RetentionPolicy, load_policy, save_policy

    data_dir = settings_from(args).data_dir
    policy = load_policy(data_dir)
    try:
        policy = (policy.with_tenant(args.tenant, args.days) if args.tenant
                  else RetentionPolicy(args.days, policy.tenants))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    save_policy(data_dir, policy)
    print(f"retention for {args.tenant or 'default'}: {args.days} days")
    return 0


def _purge_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tenant", help="only this tenant (default: all)")
    storage_flags(parser)
    parser.set_defaults(run=lambda a: asyncio.run(purge_command(a)))


async def purge_command(args: argparse.Namespace) -> int:
    from auditor.db.session import create_engine, create_sessionmaker
    from auditor.reports.retention import load_policy, purge

    settings = settings_from(args)
    policy = load_policy(settings.data_dir)
    db = create_engine(settings.resolved_database_url, schema=settings.database_schema)
    try:
        async with create_sessionmaker(db)() as session, session.begin():
            purged = await purge(session, policy, dt.datetime.now(dt.UTC), args.tenant)
    finally:
        await db.dispose()
    for tenant, ids in purged.items():
        print(f"{tenant}: purged content of {len(ids)} transcripts older than {policy.days(tenant)} days "
              "(envelopes, log and signatures kept)")
    return 0


COMMANDS: list[Command] = [
    ("export", "export a signed compliance report bundle (ZIP)", _export_parser),
    ("verify-bundle", "verify a report bundle offline with public keys only", _verify_parser),
    ("retention", "show or set per-tenant content retention", _retention_parser),
    ("purge", "erase transcript content past its tenant's retention (log and signatures stay)", _purge_parser),
]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m auditor.reports", description="Verbatim compliance reports")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, configure in COMMANDS:
        configure(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)
