"""``python -m auditor monitor URL``: follow a Verbatim log and fail loudly when it is not append-only.

Every ``--interval`` seconds the monitor fetches the signed checkpoint (``GET /v1/log/checkpoint?format=note``),
verifies the log's signature with the pinned JWKS (and, with ``--witness``, the witnesses' cosignatures),
and compares it with the last checkpoint it accepted (kept in ``--state``):

* a smaller tree size, or the same size with another root: the log rewrote history;
* a larger size: the consistency proof from the kept size (``GET /v1/log/proofs/consistency``) must
  show the kept tree is a prefix of the new one.

Any of these prints ``INCONSISTENT: …`` on stderr, writes both checkpoints and the proof beside the
state file (``<state>.evidence.json``) and exits 1; the state keeps the last good checkpoint. Exit 2:
bad arguments or state; 3: the log could not be read (only with ``--once`` / ``--iterations``: otherwise
the monitor retries). The first checkpoint seen is trusted (pin it by keeping the state file).
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from auditor.checkpoint import Checkpoint, CheckpointError, verify_checkpoint
from auditor.cli_settings import read_jwks, settings_from, witness_flags, witness_keys_from
from auditor.cosignature import CosignatureError, CosignerKey, check_quorum
from auditor.merkle import ConsistencyProof, ProofError, verify_consistency

if TYPE_CHECKING:  # imported where a monitor runs: every `verbatim` command builds this one's parser
    import httpx


class Inconsistent(Exception):
    """The log is not an append-only extension of what the monitor saw before."""

    def __init__(self, message: str, evidence: Mapping[str, Any]) -> None:
        super().__init__(message)
        self.evidence = dict(evidence)


class Unreadable(Exception):
    """The log could not be fetched, or answered something malformed (retried)."""


@dataclass(frozen=True)
class Seen:
    size: int
    root_hash: bytes
    note: str

    def to_json(self, origin: str) -> dict[str, Any]:
        return {"origin": origin, "size": self.size, "root_hash": base64.b64encode(self.root_hash).decode("ascii"),
                "checkpoint": self.note, "checked_at": dt.datetime.now(dt.UTC).isoformat()}


class Monitor:
    def __init__(self, client: httpx.Client, url: str, jwks: Mapping[str, Any], state_path: Path, *,
                 origin: str | None = None, witnesses: Sequence[CosignerKey] = (), quorum: int = 0) -> None:
        self.client = client
        self.url = url.rstrip("/")
        self.jwks = jwks
        self.state_path = state_path
        self.witnesses = list(witnesses)
        self.quorum = quorum
        self.origin, self.seen = origin, None
        if state_path.exists():
            self.origin, self.seen = _load_state(state_path, origin)

    def poll(self) -> Seen:
        """One check; returns the accepted checkpoint or raises ``Inconsistent`` / ``Unreadable``."""
        note = self._get("/v1/log/checkpoint", {"format": "note"}).text
        try:
            checkpoint = verify_checkpoint(note, self.jwks, origin=self.origin)
        except CheckpointError as exc:
            raise Unreadable(f"checkpoint does not verify with the pinned keys: {exc}") from None
        current = Seen(checkpoint.tree_size, checkpoint.root_hash, note)
        if self.seen is not None:
            self._check_extends(self.seen, current)
        if self.witnesses:
            try:
                check_quorum(note, self.witnesses, self.quorum)
            except CosignatureError as exc:
                raise Unreadable(f"checkpoint {checkpoint.tree_size} is not witnessed (not accepted yet): "
                                 f"{exc}") from None
        self.origin = checkpoint.origin
        if self.seen is None or current.size != self.seen.size:
            _save_state(self.state_path, current.to_json(checkpoint.origin))
        self.seen = current
        return current

    def _check_extends(self, old: Seen, new: Seen) -> None:
        evidence = {"url": self.url, "kept": old.note, "served": new.note}
        if new.size < old.size:
            raise Inconsistent(f"the log shrank from size {old.size} to {new.size}", evidence)
        if new.size == old.size:
            if new.root_hash != old.root_hash:
                raise Inconsistent(f"size {new.size} has root {new.root_hash.hex()}, earlier {old.root_hash.hex()}",
                                   evidence)
            return
        body = self._get("/v1/log/proofs/consistency", {"first": old.size, "second": new.size}).json()
        evidence["consistency_proof"] = body
        try:
            proof = ConsistencyProof.from_json(body)
            if (proof.old_size, proof.new_size) != (old.size, new.size):
                raise ProofError(f"proof is for sizes {proof.old_size} -> {proof.new_size}")
            verify_consistency(old.size, new.size, old.root_hash, new.root_hash, list(proof.hashes))
        except ProofError as exc:
            raise Inconsistent(f"checkpoint {new.size} is not an extension of checkpoint {old.size}: {exc}",
                               evidence) from None

    def _get(self, path: str, params: Mapping[str, Any]) -> httpx.Response:
        import httpx

        try:
            response = self.client.get(self.url + path, params=dict(params))
        except httpx.HTTPError as exc:
            raise Unreadable(f"GET {path}: {type(exc).__name__}: {exc}") from None
        if response.status_code != 200:
            raise Unreadable(f"GET {path} answered {response.status_code}: {response.text[:200]}")
        return response


def _load_state(path: Path, origin: str | None) -> tuple[str, Seen]:
    try:
        obj = json.loads(path.read_text())
        seen = Seen(int(obj["size"]), base64.b64decode(obj["root_hash"], validate=True), str(obj["checkpoint"]))
        kept_origin = str(obj["origin"])
    except (OSError, KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"state file {path} is unreadable: {exc!r}") from None
    if origin is not None and origin != kept_origin:
        raise ValueError(f"state file {path} follows origin {kept_origin!r}, not {origin!r}")
    if Checkpoint.parse(seen.note.rpartition("\n\n")[0] + "\n").root_hash != seen.root_hash:
        raise ValueError(f"state file {path}: the kept checkpoint's root differs from its root_hash field")
    return kept_origin, seen


def _save_state(path: Path, obj: Mapping[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# --- command ----------------------------------------------------------------------------------------


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("url", help="the log's base URL (http://host:8000)")
    parser.add_argument("--jwks", required=True, help="the log's JWKS to pin (file, or http(s) URL read once)")
    parser.add_argument("--state", type=Path, required=True, help="JSON file keeping the last accepted checkpoint")
    parser.add_argument("--origin", help="the log origin to expect (default: the first checkpoint's, then the state's)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between polls (default 10)")
    parser.add_argument("--once", action="store_true", help="poll once and exit")
    parser.add_argument("--iterations", type=int, help="poll this many times, then exit")
    witness_flags(parser)
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import httpx

    try:
        jwks = read_jwks(args.jwks)
        witnesses, quorum = witness_keys_from(args, settings_from(args))
        with httpx.Client(timeout=30) as client:
            monitor = Monitor(client, args.url, jwks, args.state, origin=args.origin, witnesses=witnesses,
                              quorum=quorum)
            return _loop(monitor, 1 if args.once else args.iterations, args.interval)
    except (OSError, ValueError, CosignatureError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _loop(monitor: Monitor, iterations: int | None, interval: float) -> int:
    done = 0
    while True:
        try:
            seen = monitor.poll()
            print(f"ok: {monitor.origin} size {seen.size} root {seen.root_hash.hex()}", flush=True)
        except Inconsistent as exc:
            evidence_path = monitor.state_path.with_name(monitor.state_path.name + ".evidence.json")
            evidence_path.write_text(json.dumps({**exc.evidence, "reason": str(exc)}, indent=2) + "\n")
            print(f"INCONSISTENT: {monitor.url}: {exc} (evidence in {evidence_path})", file=sys.stderr, flush=True)
            return 1
        except Unreadable as exc:
            print(f"warning: {monitor.url}: {exc}", file=sys.stderr, flush=True)
            if iterations is not None:
                return 3
        done += 1
        if iterations is not None and done >= iterations:
            return 0
        time.sleep(interval)
