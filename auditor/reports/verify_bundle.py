"""Offline verification of a report bundle with only public keys (its own ``jwks.json`` by default).

Checks, each reported as a ``Finding`` that names the file, line and transcript it is about:

* ``manifest``      manifest.dsse.json verifies with a ``report`` key and its payload is manifest.json
* ``file_hash``     every listed file is present with its SHA-256 and size; no unlisted files
* ``checkpoint``    start and end notes verify with a ``checkpoint`` key and equal the manifest's
* ``consistency``   the proof shows the start tree is a prefix of the end tree
* ``cosignatures``  with witness keys given: the end checkpoint carries valid cosignatures from the
                    quorum of them (C2SP tlog-cosignature)
* per transcripts.jsonl line: ``signature`` (and hash-chain fields), ``envelope_digest``,
  ``inclusion`` (against the end checkpoint), ``scope`` (the line's scope holds: a ``report`` line
  is within the tenant and filters, a ``chain`` / ``replayed`` line is the tenant's and outside
  them; content only on ``report`` lines of a report that asked for it), ``content`` (when present:
  commitments / window chain / logprob digest), ``manifest_index``
* ``hash_chain``: the per-tenant chain over the report's span has no gap: every line's predecessor
  that the span needs is in the bundle and its payload digest is the line's ``previous_digest``
  (``auditor.reports.scope.chain_findings``)
* per replays.jsonl line: ``replay`` (attestation signature, subject, verdict, inclusion; a replay
  of a ``chain`` / ``replayed`` line must be attested in the period), and every ``replayed`` line is
  named by such a replay
* per summary.csv row: ``summary`` (equals the row recomputed from the bundle)
* per access_log.csv row: ``access_log`` (tenant)

``jwks.json`` inside the bundle is the trust anchor unless another JWKS is passed: a bundle whose
keys were all replaced is self-consistent, so compare the report key id with the server's JWKS.
"""

from __future__ import annotations

import io
import json
import zipfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from auditor import canonical as cn
from auditor.attestation import verify_replay_attestation
from auditor.checkpoint import Checkpoint, verify_checkpoint
from auditor.cosignature import CosignerKey
from auditor.crypto import VerifierKey, as_verifier_keys
from auditor.merkle import ConsistencyProof, InclusionProof, leaf_hash, verify_consistency, verify_inclusion
from auditor.reports import bundle as b
from auditor.reports.manifest import MANIFEST_ENVELOPE_PATH, MANIFEST_PATH, checkpoint_json, open_manifest
from auditor.reports.bundle import envelope_digest_or_empty
from auditor.reports.scope import (
    ChainLink,
    ChainStatus,
    Scope,
    attested_at,
    chain_findings,
    in_period,
    instant,
    outside_filters,
    tenant_problem,
)
from auditor.reports.summary import SUMMARY_COLUMNS, read_csv, readable_statement, replay_status, summary_row
from auditor.transcript import verify_transcript
from auditor.verify import cosignature_check


@dataclass(frozen=True)
class Finding:
    check: str
    ok: bool
    detail: str
    file: str | None = None
    line: int | None = None
    transcript_id: str | None = None

    def location(self) -> str:
        where = (self.file or "") + (f":{self.line}" if self.line is not None else "")
        tid = f" transcript {self.transcript_id}" if self.transcript_id else ""
        return (where + tid).strip()

    def to_json(self) -> dict[str, Any]:
        return {"check": self.check, "ok": self.ok, "detail": self.detail, "file": self.file,
                "line": self.line, "transcript_id": self.transcript_id}


@dataclass
class BundleVerification:
    source: str
    findings: list[Finding] = field(default_factory=list)
    report_kid: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.findings) and all(f.ok for f in self.findings)

    def failures(self) -> list[Finding]:
        return [f for f in self.findings if not f.ok]

    def add(self, check: str, ok: bool, detail: str, file: str | None = None, line: int | None = None,
            transcript_id: str | None = None) -> None:
        self.findings.append(Finding(check, ok, detail, file, line, transcript_id))

    def fail(self, check: str, detail: str, file: str | None = None, line: int | None = None,
             transcript_id: str | None = None) -> None:
        self.add(check, False, detail, file, line, transcript_id)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "ok": self.ok, "report_kid": self.report_kid,
                "findings": [f.to_json() for f in self.findings]}

    def render(self, verbose: bool = False) -> str:
        """Failures (all findings with ``verbose``), then a one-line verdict."""
        shown = self.findings if verbose else self.failures()
        lines = [f"{'PASS' if f.ok else 'FAIL'}  {f.check:<15} {f.location() + ': ' if f.location() else ''}{f.detail}"
                 for f in shown]
        passed = sum(f.ok for f in self.findings)
        verdict = "VALID" if self.ok else "INVALID"
        lines.append(f"{verdict} bundle {self.source}: {passed} checks passed, {len(self.failures())} failed"
                     + (f"; report signed by key {self.report_kid}" if self.report_kid else ""))
        return "\n".join(lines)


@dataclass(frozen=True)
class _Line:
    """One transcripts.jsonl line as the later checks need it."""

    scope: str
    shown: dict[str, Any] | None
    """The payload read without the signature check (the summary's cells); None if unreadable."""
    envelope_digest: str
    log_index: Any
    ok: bool
    link: ChainLink


@dataclass
class _Ctx:
    """What earlier checks learned, for later ones."""

    files: dict[str, bytes]
    keys: dict[str, VerifierKey]
    manifest: dict[str, Any]
    end: Checkpoint | None = None
    lines: dict[str, _Line] = field(default_factory=dict)
    payload_digests: dict[str, str] = field(default_factory=dict)
    """transcript id → payload digest, for lines whose signature verifies."""
    replays: list[dict[str, Any]] = field(default_factory=list)
    witnesses: Sequence[CosignerKey] = ()
    quorum: int = 0


def verify_bundle(source: bytes | str | Path, jwks: Mapping[str, Any] | None = None, *,
                  witnesses: Sequence[CosignerKey] = (), quorum: int | None = None) -> BundleVerification:
    """Verify a bundle (ZIP bytes or a path); ``jwks`` overrides the bundle's own ``jwks.json``;
    ``witnesses``: the end checkpoint must be cosigned by ``quorum`` of them (default: all)."""
    result = BundleVerification("<bytes>" if isinstance(source, bytes) else str(source))
    files = _read_zip(source, result)
    if files is None:
        return result
    keys = _keys(files, jwks, result)
    if keys is None:
        return result
    manifest = _manifest(files, keys, result)
    if manifest is None:
        return result
    ctx = _Ctx(files, keys, manifest, witnesses=witnesses, quorum=quorum or len(witnesses))
    for stage in (_file_hashes, _checkpoints, _transcripts, _replays, _summary, _access_log):
        try:
            stage(ctx, result)
        except Exception as exc:  # noqa: BLE001 - a malformed bundle is a finding, never a crash
            result.fail(stage.__name__.strip("_"), f"could not be checked: {type(exc).__name__}: {exc}")
    return result


def _read_zip(source: bytes | str | Path, result: BundleVerification) -> dict[str, bytes] | None:
    try:
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            names = zf.namelist()
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                result.fail("zip", f"duplicate entries {dupes}")
                return None
            return {n: zf.read(n) for n in names if not n.endswith("/")}
    except (OSError, zipfile.BadZipFile) as exc:
        result.fail("zip", f"cannot read the ZIP: {exc}")
        return None


def _keys(files: Mapping[str, bytes], jwks: Mapping[str, Any] | None,
          result: BundleVerification) -> dict[str, VerifierKey] | None:
    try:
        doc = jwks if jwks is not None else json.loads(files[b.JWKS_PATH])
        keys = as_verifier_keys(doc)
    except KeyError:
        result.fail("jwks", "the bundle has no jwks.json", b.JWKS_PATH)
        return None
    except Exception as exc:  # noqa: BLE001 - any parse failure is reported, not raised
        result.fail("jwks", f"{type(exc).__name__}: {exc}", b.JWKS_PATH)
        return None
    result.add("jwks", True, f"{len(keys)} public keys ({'given' if jwks is not None else 'from the bundle'})", b.JWKS_PATH)
    return keys


def _manifest(files: Mapping[str, bytes], keys: Mapping[str, VerifierKey],
              result: BundleVerification) -> dict[str, Any] | None:
    for path in (MANIFEST_PATH, MANIFEST_ENVELOPE_PATH):
        if path not in files:
            result.fail("manifest", f"{path} is missing", path)
            return None
    try:
        manifest = open_manifest(files[MANIFEST_PATH], files[MANIFEST_ENVELOPE_PATH], keys)
    except Exception as exc:  # noqa: BLE001
        result.fail("manifest", f"manifest signature: {type(exc).__name__}: {exc}", MANIFEST_ENVELOPE_PATH)
        return None
    result.report_kid = ", ".join(s.get("keyid", "?") for s in json.loads(files[MANIFEST_ENVELOPE_PATH])["signatures"])
    result.add("manifest", True, f"signed by report key {result.report_kid}", MANIFEST_ENVELOPE_PATH)
    return manifest


def _file_hashes(ctx: _Ctx, result: BundleVerification) -> None:
    listed = {f["path"]: f for f in ctx.manifest.get("files", [])}
    for path, entry in sorted(listed.items()):
        data = ctx.files.get(path)
        if data is None:
            result.fail("file_hash", "listed in the manifest but missing from the bundle", path)
        elif cn.sha256_hex(data) != entry["sha256"] or len(data) != entry["size"]:
            result.fail("file_hash", f"SHA-256 {cn.sha256_hex(data)} ({len(data)} bytes), manifest says "
                        f"{entry['sha256']} ({entry['size']} bytes)", path)
        else:
            result.add("file_hash", True, f"SHA-256 {entry['sha256']}", path)
    for path in sorted(set(ctx.files) - set(listed) - {MANIFEST_PATH, MANIFEST_ENVELOPE_PATH}):
        result.fail("file_hash", "in the bundle but not listed in the signed manifest", path)


def _checkpoints(ctx: _Ctx, result: BundleVerification) -> None:
    cps: dict[str, Checkpoint] = {}
    for name, path in (("start", b.START_CHECKPOINT_PATH), ("end", b.END_CHECKPOINT_PATH)):
        try:
            cp = verify_checkpoint(ctx.files[path].decode("utf-8"), ctx.keys)
        except Exception as exc:  # noqa: BLE001
            result.fail("checkpoint", f"{type(exc).__name__}: {exc}", path)
            continue
        if checkpoint_json(cp) != ctx.manifest["log"][name]:
            result.fail("checkpoint", f"size {cp.tree_size} root {cp.root_hash.hex()} differs from the manifest's "
                        f"{ctx.manifest['log'][name]}", path)
            continue
        result.add("checkpoint", True, f"signed, tree size {cp.tree_size}", path)
        cps[name] = cp
    ctx.end = cps.get("end")
    if ctx.witnesses and ctx.end is not None:
        check = cosignature_check(ctx.files[b.END_CHECKPOINT_PATH].decode("utf-8"), ctx.witnesses, ctx.quorum)
        result.add(check.name, check.ok, check.detail, b.END_CHECKPOINT_PATH)
    if "start" in cps and "end" in cps:
        _consistency(ctx, cps["start"], cps["end"], result)


def _consistency(ctx: _Ctx, start: Checkpoint, end: Checkpoint, result: BundleVerification) -> None:
    try:
        proof = ConsistencyProof.from_json(json.loads(ctx.files[b.CONSISTENCY_PATH]))
        if (proof.old_size, proof.new_size) != (start.tree_size, end.tree_size):
            raise ValueError(f"proof is for sizes {proof.old_size} -> {proof.new_size}, checkpoints are "
                             f"{start.tree_size} -> {end.tree_size}")
        verify_consistency(proof.old_size, proof.new_size, start.root_hash, end.root_hash, proof.hashes)
    except Exception as exc:  # noqa: BLE001
        result.fail("consistency", f"{type(exc).__name__}: {exc}", b.CONSISTENCY_PATH)
        return
    result.add("consistency", True, f"tree {start.tree_size} is a prefix of tree {end.tree_size}", b.CONSISTENCY_PATH)


def _jsonl(data: bytes | None) -> list[tuple[int, Any]]:
    """``(line number, parsed object or the exception)`` per non-empty line."""
    out: list[tuple[int, Any]] = []
    for n, raw in enumerate((data or b"").split(b"\n"), start=1):
        if raw.strip():
            try:
                out.append((n, json.loads(raw)))
            except ValueError as exc:
                out.append((n, exc))
    return out


def _transcripts(ctx: _Ctx, result: BundleVerification) -> None:
    seen: list[tuple[str, str]] = []
    for n, obj in _jsonl(ctx.files.get(b.TRANSCRIPTS_PATH)):
        if not isinstance(obj, dict) or not isinstance(obj.get("envelope"), dict):
            result.fail("transcript", f"not a transcript object: {str(obj)[:200]}", b.TRANSCRIPTS_PATH, n)
            continue
        tid = str(obj.get("transcript_id"))
        seen.append((tid, str(obj.get("scope", Scope.REPORT))))
        try:
            _one_transcript(ctx, obj, n, tid, result)
        except Exception as exc:  # noqa: BLE001 - one bad line must not hide the others
            result.fail("transcript", f"malformed line: {type(exc).__name__}: {exc}", b.TRANSCRIPTS_PATH, n, tid)
    _manifest_index(ctx, seen, result)
    _hash_chain(ctx, result)


def _hash_chain(ctx: _Ctx, result: BundleVerification) -> None:
    """The chain over the report's span has no gap and every needed link holds."""
    findings = chain_findings([line.link for line in ctx.lines.values()])
    counted = Counter(status for status, _ in findings.values())
    for tid, (status, detail) in findings.items():
        if status is ChainStatus.BROKEN:
            result.fail("hash_chain", detail, b.TRANSCRIPTS_PATH, transcript_id=tid)
    if not counted[ChainStatus.BROKEN]:
        result.add("hash_chain", True, f"{counted[ChainStatus.LINKED]} links checked, "
                   f"{counted[ChainStatus.FIRST]} chain start, {counted[ChainStatus.UNCHECKED]} outside the span",
                   b.TRANSCRIPTS_PATH)


def _one_transcript(ctx: _Ctx, obj: dict[str, Any], n: int, tid: str, result: BundleVerification) -> None:
    where = {"file": b.TRANSCRIPTS_PATH, "line": n, "transcript_id": tid}
    scope = obj.get("scope", Scope.REPORT)
    content = obj.get("content")
    kwargs = _content_kwargs(content) if isinstance(content, dict) else {}
    v = verify_transcript(obj["envelope"], ctx.keys, **kwargs)
    for c in v.checks:
        result.add(c.name, c.ok, c.detail, **where)
    digest = envelope_digest_or_empty(obj["envelope"])
    if digest != obj.get("envelope_digest"):
        result.fail("envelope_digest", f"envelope hashes to {digest or 'nothing'}, line says {obj.get('envelope_digest')}",
                    **where)
    _inclusion(ctx, "inclusion", digest, obj.get("log_index"), obj.get("inclusion_proof"), where, result)
    signed = v.statement["predicate"]["transcript"] if v.statement is not None else {}
    if v.statement is not None and signed.get("id") != tid:
        result.fail("transcript", f"line says {tid} but the signed payload is transcript {signed.get('id')}", **where)
    if scope not in tuple(Scope):
        result.fail("scope", f"scope {scope!r} is not one of {[s.value for s in Scope]}", **where)
    elif v.statement is not None:
        _scope(ctx, v.statement, Scope(scope), content, where, result)
    link = ChainLink(tid, str(scope), signed.get("sequence"), signed.get("previous_digest"), v.payload_digest)
    ctx.lines[tid] = _Line(str(scope), readable_statement(obj["envelope"]), digest, obj.get("log_index"), v.ok, link)
    if v.statement is not None and v.payload_digest:
        ctx.payload_digests[tid] = v.payload_digest


def _content_kwargs(content: Mapping[str, Any]) -> dict[str, Any]:
    try:
        salt = bytes.fromhex(content["salt"])
    except (KeyError, TypeError, ValueError):
        salt = b""
    return {"prompt_ids": content.get("prompt_token_ids"), "output_ids": content.get("output_token_ids"),
            "salt": salt, "logprobs": content.get("token_logprobs")}


def _inclusion(ctx: _Ctx, check: str, digest: str, log_index: Any, proof_json: Any, where: Mapping[str, Any],
               result: BundleVerification) -> None:
    if ctx.end is None:
        result.fail(check, "no verified end checkpoint to check the inclusion proof against", **where)
        return
    try:
        proof = InclusionProof.from_json(proof_json)
        if proof.log_index != log_index or proof.tree_size != ctx.end.tree_size:
            raise ValueError(f"proof is for index {proof.log_index} in size {proof.tree_size}, expected index "
                             f"{log_index} in the end checkpoint's size {ctx.end.tree_size}")
        verify_inclusion(leaf_hash(bytes.fromhex(digest)), proof.log_index, proof.tree_size, proof.hashes,
                         ctx.end.root_hash)
    except Exception as exc:  # noqa: BLE001
        result.fail(check, f"{type(exc).__name__}: {exc}", **where)
        return
    result.add(check, True, f"log index {log_index} under the end checkpoint's root", **where)


def _scope(ctx: _Ctx, statement: Mapping[str, Any], scope: Scope, content: Any, where: Mapping[str, Any],
           result: BundleVerification) -> None:
    """A ``report`` line is selected by the filters; a ``chain`` line is not; a ``replayed`` line is
    selected but for the period (it was received before it). All are the tenant's."""
    f = ctx.manifest["filters"]
    problems = [p for p in [tenant_problem(statement, ctx.manifest["tenant"])] if p]
    outside = outside_filters(statement, f)
    if scope is Scope.REPORT:
        problems += outside
    elif scope is Scope.CHAIN and not outside:
        problems.append("a chain line that the filters select: it belongs to the report")
    elif scope is Scope.REPLAYED:
        problems += outside_filters(statement, f, period=False)
        received = instant(statement["predicate"].get("request", {}).get("received_at"))
        if received is not None and not (f.get("since") and received < instant(f["since"])):
            problems.append(f"a replayed line received {received.isoformat()}, not before the period")
    if content is not None and (scope is not Scope.REPORT or not f.get("include_content")):
        problems.append("content present although the report excludes content" if scope is Scope.REPORT
                        else f"content present on a {scope.value} line")
    detail = {Scope.REPORT: "within the report's tenant and filters",
              Scope.CHAIN: "the tenant's, outside the filters: carried for the chain",
              Scope.REPLAYED: "the tenant's, before the period: carried for a replay in the period"}[scope]
    result.add("scope", not problems, "; ".join(problems) or detail, **where)


def _manifest_index(ctx: _Ctx, seen: Sequence[tuple[str, str]], result: BundleVerification) -> None:
    listed = ctx.manifest.get("transcripts", [])
    listed_ids = [t["id"] for t in listed]
    seen_ids = [tid for tid, _ in seen]
    scopes = dict(seen)
    for t in listed:
        got = ctx.lines.get(t["id"])
        if t["id"] not in scopes:
            result.fail("manifest_index", f"listed in the manifest (log index {t['log_index']}) but missing from "
                        f"{b.TRANSCRIPTS_PATH}", b.TRANSCRIPTS_PATH, transcript_id=t["id"])
        elif scopes[t["id"]] != t.get("scope", Scope.REPORT):
            result.fail("manifest_index", f"line scope {scopes[t['id']]!r} differs from the manifest's "
                        f"{t.get('scope', Scope.REPORT)!r}", b.TRANSCRIPTS_PATH, transcript_id=t["id"])
        elif got is not None and (got.envelope_digest, got.log_index) != (t["envelope_digest"], t["log_index"]):
            result.fail("manifest_index", f"envelope digest {got.envelope_digest} / log index {got.log_index} differ "
                        f"from the manifest's {t['envelope_digest']} / {t['log_index']}", b.TRANSCRIPTS_PATH,
                        transcript_id=t["id"])
    for tid in sorted(set(seen_ids) - set(listed_ids)):
        result.fail("manifest_index", "not listed in the signed manifest", b.TRANSCRIPTS_PATH, transcript_id=tid)
    dupes = sorted({t for t in seen_ids if seen_ids.count(t) > 1})
    if dupes:
        result.fail("manifest_index", f"duplicate transcript lines {dupes}", b.TRANSCRIPTS_PATH)
    if seen_ids == listed_ids:
        result.add("manifest_index", True, f"{len(seen_ids)} transcripts, as listed in the manifest", b.TRANSCRIPTS_PATH)


def _replays(ctx: _Ctx, result: BundleVerification) -> None:
    named: set[str] = set()
    for n, obj in _jsonl(ctx.files.get(b.REPLAYS_PATH)):
        if not isinstance(obj, dict) or "transcript_id" not in obj or "replay_id" not in obj:
            result.fail("replay", f"not a replay object: {str(obj)[:200]}", b.REPLAYS_PATH, n)
            continue
        ctx.replays.append(obj)
        tid = str(obj["transcript_id"])
        where = {"file": b.REPLAYS_PATH, "line": n, "transcript_id": tid}
        if tid not in ctx.payload_digests:
            result.fail("replay", f"replay {obj['replay_id']} is of a transcript that is not (validly) in the bundle",
                        **where)
            continue
        if not isinstance(obj.get("attestation"), (dict, type(None))):
            result.fail("replay", f"replay {obj['replay_id']}: attestation is not an object", **where)
            continue
        if ctx.lines[tid].scope != Scope.REPORT:
            if not in_period(attested_at(obj.get("attestation")), ctx.manifest["filters"]):
                result.fail("replay", f"replay {obj['replay_id']} of a {ctx.lines[tid].scope} transcript is not "
                            "attested in the period", **where)
                continue
            named.add(tid)
        if obj.get("attestation") is None:
            ok = obj.get("verdict") is None
            result.add("replay", ok, f"replay {obj['replay_id']} {obj.get('status')}, no attestation"
                       + ("" if ok else f" although it claims verdict {obj.get('verdict')!r}"), **where)
            continue
        _attestation(ctx, obj, where, result)
    for tid, line in ctx.lines.items():
        if line.scope == Scope.REPLAYED and tid not in named:
            result.fail("replay", "a replayed line that no replay attested in the period names",
                        b.TRANSCRIPTS_PATH, transcript_id=tid)


def _attestation(ctx: _Ctx, obj: dict[str, Any], where: Mapping[str, Any], result: BundleVerification) -> None:
    try:
        st = verify_replay_attestation(obj["attestation"], ctx.keys, ctx.payload_digests[where["transcript_id"]])
        if st["predicate"]["result"] != obj.get("verdict"):
            raise ValueError(f"line says verdict {obj.get('verdict')!r}, attestation says {st['predicate']['result']!r}")
    except Exception as exc:  # noqa: BLE001
        result.fail("replay", f"replay {obj['replay_id']}: {type(exc).__name__}: {exc}", **where)
        return
    result.add("replay", True, f"replay {obj['replay_id']}: signed attestation, {obj.get('verdict')}", **where)
    if obj.get("inclusion_proof") is not None:
        try:
            digest = cn.envelope_digest(obj["attestation"])
        except Exception as exc:  # noqa: BLE001
            result.fail("replay_inclusion", f"attestation cannot be hashed: {exc}", **where)
            return
        _inclusion(ctx, "replay_inclusion", digest, obj.get("log_index"), obj["inclusion_proof"], where, result)


def _summary(ctx: _Ctx, result: BundleVerification) -> None:
    header, rows = read_csv(ctx.files.get(b.SUMMARY_PATH, b""))
    if tuple(header) != SUMMARY_COLUMNS:
        result.fail("summary", f"header {header} is not {list(SUMMARY_COLUMNS)}", b.SUMMARY_PATH, 1)
        return
    by_tid: dict[str, list[dict[str, Any]]] = {}
    for r in ctx.replays:
        by_tid.setdefault(str(r["transcript_id"]), []).append(r)
    chain = chain_findings([line.link for line in ctx.lines.values()])
    seen: set[str] = set()
    for n, row in rows:
        tid = row.get("transcript_id", "")
        line = ctx.lines.get(tid)
        if line is None:
            result.fail("summary", "row for a transcript that is not in transcripts.jsonl", b.SUMMARY_PATH, n, tid)
            continue
        seen.add(tid)
        det = bool(line.shown and line.shown["predicate"].get("sampling", {}).get("deterministic"))
        want = summary_row(line.shown, line.log_index, line.ok, replay_status(det, by_tid.get(tid, [])),
                           line.envelope_digest, transcript_id=tid, scope=line.scope, chain_status=chain[tid][0])
        diff = [f"{k}={row.get(k)!r} (recomputed from the transcript: {want[k]!r})"
                for k in SUMMARY_COLUMNS if row.get(k) != want[k]]
        result.add("summary", not diff, "; ".join(diff) or "row matches the signed transcript", b.SUMMARY_PATH, n, tid)
    for tid in sorted(set(ctx.lines) - seen):
        result.fail("summary", "transcript has no row in summary.csv", b.SUMMARY_PATH, transcript_id=tid)


def _access_log(ctx: _Ctx, result: BundleVerification) -> None:
    header, rows = read_csv(ctx.files.get(b.ACCESS_LOG_PATH, b""))
    if tuple(header) != b.ACCESS_LOG_COLUMNS:
        result.fail("access_log", f"header {header} is not {list(b.ACCESS_LOG_COLUMNS)}", b.ACCESS_LOG_PATH, 1)
        return
    bad = [(n, r) for n, r in rows if r.get("tenant") != ctx.manifest["tenant"]]
    for n, r in bad:
        result.fail("access_log", f"row of tenant {r.get('tenant')!r} in a report for {ctx.manifest['tenant']!r}",
                    b.ACCESS_LOG_PATH, n)
    if not bad:
        result.add("access_log", True, f"{len(rows)} rows, all of tenant {ctx.manifest['tenant']!r}", b.ACCESS_LOG_PATH)
