"""``python -m auditor witness serve|vkey``: run a C2SP tlog-witness, or print its cosigner vkey.

The witness trusts a log's checkpoint keys given as signed-note vkeys (``--log NAME+ID+KEY``, the
key name being the log's origin) or read from the log's JWKS (``--log-jwks ORIGIN=FILE|URL``: its
``checkpoint`` role keys, active and retired).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from auditor.checkpoint import CheckpointError, parse_verifier_key
from auditor.cli_settings import read_jwks
from auditor.cosignature import Cosigner, CosignatureError
from auditor.crypto import JwksError, KeyRole, as_verifier_keys
from auditor.witness.state import KEY_FILE, StateError, WitnessState

DEFAULT_PORT = 8090


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="witness_command", required=True)
    serve = sub.add_parser("serve", help="serve POST /add-checkpoint (C2SP tlog-witness)")
    _identity(serve)
    serve.add_argument("--log", action="append", default=[], metavar="VKEY",
                       help="a trusted log checkpoint key as a signed-note vkey (name = the log's origin); repeatable")
    serve.add_argument("--log-jwks", action="append", default=[], metavar="ORIGIN=FILE|URL",
                       help="trust the checkpoint keys of this JWKS for ORIGIN; repeatable")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=DEFAULT_PORT)
    serve.set_defaults(run=serve_witness)
    vkey = sub.add_parser("vkey", help="print the witness's cosigner vkey (creates the key on first use)")
    _identity(vkey)
    vkey.set_defaults(run=print_vkey)


def _identity(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, required=True, help="key and state directory (0700)")
    parser.add_argument("--name", required=True, help="the cosigner name, a schema-less URL (witness.example/w1)")


def trusted_logs(vkeys: Sequence[str], jwks_sources: Sequence[str]) -> dict[str, list[bytes]]:
    """``{origin: [Ed25519 public key, …]}`` from ``--log`` and ``--log-jwks`` values."""
    logs: dict[str, list[bytes]] = {}
    for vkey in vkeys:
        name, raw = parse_verifier_key(vkey)
        logs.setdefault(name, []).append(raw)
    for spec in jwks_sources:
        origin, sep, source = spec.partition("=")
        if not sep or not origin or not source:
            raise ValueError(f"--log-jwks {spec!r} is not ORIGIN=FILE|URL")
        keys = [k.public_raw for k in as_verifier_keys(read_jwks(source)).values() if k.role is KeyRole.CHECKPOINT]
        if not keys:
            raise ValueError(f"--log-jwks {source}: no checkpoint keys in the JWKS")
        logs.setdefault(origin, []).extend(keys)
    return logs


def print_vkey(args: argparse.Namespace) -> int:
    try:
        print(Cosigner.load_or_create(args.state_dir / KEY_FILE, args.name).key.vkey())
    except (CosignatureError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def serve_witness(args: argparse.Namespace) -> int:
    import uvicorn

    from auditor import logs as logging_setup
    from auditor.witness.core import Witness
    from auditor.witness.server import create_witness_app

    logging_setup.configure("INFO")
    try:
        logs = trusted_logs(args.log, args.log_jwks)
        if not logs:
            raise ValueError("no trusted log: give --log VKEY or --log-jwks ORIGIN=SOURCE")
        cosigner = Cosigner.load_or_create(args.state_dir / KEY_FILE, args.name)
        state = WitnessState(args.state_dir).open()
    except (ValueError, OSError, CheckpointError, CosignatureError, JwksError, StateError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        print(f"witness {args.name} listening on http://{args.host}:{args.port} for {', '.join(sorted(logs))}; "
              f"vkey {cosigner.key.vkey()}", flush=True)
        uvicorn.run(create_witness_app(Witness(cosigner, logs, state)), host=args.host, port=args.port,
                    log_level="warning", access_log=False)
    finally:
        state.close()
    return 0
