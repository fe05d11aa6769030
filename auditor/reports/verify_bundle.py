"""Offline verification of a report bundle with only public keys (its own ``jwks.json`` by default).

Checks, each reported as a ``Finding`` that names the file, line and transcript it is about:

* ``manifest``      manifest.dsse.json verifies with a ``report`` key and its payload is manifest.json
* ``file_hash``     every listed file is present with its SHA-256 and size; no unlisted files
* ``checkpoint``    start and end notes verify with a ``checkpoint`` key and equal the manifest's
* ``consistency``   the proof shows the start tree is a prefix of the end tree
* ``cosignatures``  with witness keys given: the end checkpoint carries valid cosignatures from the
                    quorum of them (C2SP tlog-cosignature)
* per transcripts.jsonl line: ``signature`` (and hash-chain fields), ``envelope_digest``,
  ``inclusion`` (against the end checkpoint), ``scope`` (tenant and filters), ``content`` (absent
  unless requested; when present, commitments / window chain / logprob digest), ``manifest_index``
* per replays.jsonl line: ``replay`` (attestation signature, subject, verdict, inclusion)
* per summary.csv row: ``summary`` (equals the row recomputed from the signed payloads)
* per access_log.csv row: ``access_log`` (tenant)

``jwks.json`` inside the bundle is the trust anchor unless another JWKS is passed: a bundle whose
keys were all replaced is self-consistent, so compare the report key id with the server's JWKS.
"""

from __future__ import annotations

import datetime as dt
import io
import json
import zipfile
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
from auditor.reports.summary import SUMMARY_COLUMNS, read_csv, replay_status, summary_row
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


@dataclass
class _Ctx:
    """What earlier checks learned, for later ones."""

    files: dict[str, bytes]
    keys: dict[str, VerifierKey]
    manifest: dict[str, Any]
    end: Checkpoint | None = None
    statements: dict[str, tuple[dict[str, Any], str, int, bool]] = field(default_factory=dict)
    """transcript id → (statement, envelope digest, log index, signature ok)."""
    payload_digests: dict[str, str] = field(default_factory=dict)
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
    seen: list[str] = []
    for n, obj in _jsonl(ctx.files.get(b.TRANSCRIPTS_PATH)):
        if not isinstance(obj, dict) or not isinstance(obj.get("envelope"), dict):
            result.fail("transcript", f"not a transcript object: {str(obj)[:200]}", b.TRANSCRIPTS_PATH, n)
            continue
        tid = str(obj.get("transcript_id"))
        seen.append(tid)
        try:
            _one_transcript(ctx, obj, n, tid, result)
        except Exception as exc:  # noqa: BLE001 - one bad line must not hide the others
            result.fail("transcript", f"malformed line: {type(exc).__name__}: {exc}", b.TRANSCRIPTS_PATH, n, tid)
    _manifest_index(ctx, seen, result)
    _hash_chain(ctx, result)


def _hash_chain(ctx: _Ctx, result: BundleVerification) -> None:
    """Where a transcript and its tenant predecessor are both in the bundle, the link must hold."""
    by_seq = {st["predicate"]["transcript"].get("sequence"): (tid, st) for tid, (st, _, _, _) in ctx.statements.items()}
    links, broken = 0, 0
    for seq, (tid, st) in sorted(by_seq.items(), key=lambda kv: str(kv[0])):
        prev = by_seq.get(seq - 1) if isinstance(seq, int) else None
        if prev is None:
            continue
        links += 1
        want, got = ctx.payload_digests[prev[0]], st["predicate"]["transcript"].get("previous_digest")
        if got != want:
            broken += 1
            result.fail("hash_chain", f"previous_digest {got} is not the payload digest {want} of sequence "
                        f"{seq - 1} (transcript {prev[0]})", b.TRANSCRIPTS_PATH, transcript_id=tid)
    if not broken:
        result.add("hash_chain", True, f"{links} consecutive links checked", b.TRANSCRIPTS_PATH)


def _one_transcript(ctx: _Ctx, obj: dict[str, Any], n: int, tid: str, result: BundleVerification) -> None:
    where = {"file": b.TRANSCRIPTS_PATH, "line": n, "transcript_id": tid}
    content = obj.get("content")
    kwargs = _content_kwargs(content) if isinstance(content, dict) else {}
    v = verify_transcript(obj["envelope"], ctx.keys, **kwargs)
    for c in v.checks:
        result.add(c.name, c.ok, c.detail, **where)
    digest = cn.envelope_digest(obj["envelope"])
    if digest != obj.get("envelope_digest"):
        result.fail("envelope_digest", f"envelope hashes to {digest}, line says {obj.get('envelope_digest')}", **where)
    _inclusion(ctx, "inclusion", digest, obj.get("log_index"), obj.get("inclusion_proof"), where, result)
    if v.statement is None:
        return
    if v.statement["predicate"]["transcript"].get("id") != tid:
        result.fail("transcript", f"line says {tid} but the signed payload is transcript "
                    f"{v.statement['predicate']['transcript'].get('id')}", **where)
    _scope(ctx, v.statement, content, where, result)
    ctx.statements[tid] = (v.statement, digest, obj.get("log_index"), v.ok)
    ctx.payload_digests[tid] = v.payload_digest or ""


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


def _scope(ctx: _Ctx, statement: Mapping[str, Any], content: Any, where: Mapping[str, Any],
           result: BundleVerification) -> None:
    f, p = ctx.manifest["filters"], statement["predicate"]
    problems = []
    if p["transcript"].get("tenant") != ctx.manifest["tenant"]:
        problems.append(f"tenant {p['transcript'].get('tenant')!r} is not the report's {ctx.manifest['tenant']!r}")
    received = _instant(p.get("request", {}).get("received_at"))
    if received is None:
        problems.append(f"received_at {p.get('request', {}).get('received_at')!r} is not an RFC 3339 time")
    elif f.get("since") and received < _instant(f["since"]):
        problems.append(f"received {received.isoformat()} before the period start {f['since']}")
    elif f.get("until") and received >= _instant(f["until"]):
        problems.append(f"received {received.isoformat()} at or after the period end {f['until']}")
    if f.get("model") and p.get("model", {}).get("name") != f["model"]:
        problems.append(f"model {p.get('model', {}).get('name')!r} is not the filter's {f['model']!r}")
    if f.get("deterministic_only") and not p.get("sampling", {}).get("deterministic"):
        problems.append("non-deterministic transcript in a deterministic-only report")
    if content is not None and not f.get("include_content"):
        problems.append("content present although the report excludes content")
    result.add("scope", not problems, "; ".join(problems) or "within the report's tenant and filters", **where)


def _instant(text: Any) -> dt.datetime | None:
    try:
        return dt.datetime.fromisoformat(str(text).replace("Z", "+00:00"))
    except ValueError:
        return None


def _manifest_index(ctx: _Ctx, seen: Sequence[str], result: BundleVerification) -> None:
    listed = ctx.manifest.get("transcripts", [])
    listed_ids = [t["id"] for t in listed]
    for t in listed:
        got = ctx.statements.get(t["id"])
        if t["id"] not in seen:
            result.fail("manifest_index", f"listed in the manifest (log index {t['log_index']}) but missing from "
                        f"{b.TRANSCRIPTS_PATH}", b.TRANSCRIPTS_PATH, transcript_id=t["id"])
        elif got is not None and (got[1], got[2]) != (t["envelope_digest"], t["log_index"]):
            result.fail("manifest_index", f"envelope digest {got[1]} / log index {got[2]} differ from the manifest's "
                        f"{t['envelope_digest']} / {t['log_index']}", b.TRANSCRIPTS_PATH, transcript_id=t["id"])
    for tid in sorted(set(seen) - set(listed_ids)):
        result.fail("manifest_index", "not listed in the signed manifest", b.TRANSCRIPTS_PATH, transcript_id=tid)
    dupes = sorted({t for t in seen if seen.count(t) > 1})
    if dupes:
        result.fail("manifest_index", f"duplicate transcript lines {dupes}", b.TRANSCRIPTS_PATH)
    if list(seen) == listed_ids:
        result.add("manifest_index", True, f"{len(seen)} transcripts, as listed in the manifest", b.TRANSCRIPTS_PATH)


def _replays(ctx: _Ctx, result: BundleVerification) -> None:
    for n, obj in _jsonl(ctx.files.get(b.REPLAYS_PATH)):
        if not isinstance(obj, dict) or "transcript_id" not in obj or "replay_id" not in obj:
            result.fail("replay", f"not a replay object: {str(obj)[:200]}", b.REPLAYS_PATH, n)
            continue
        ctx.replays.append(obj)
        tid = str(obj["transcript_id"])
        where = {"file": b.REPLAYS_PATH, "line": n, "transcript_id": tid}
        if tid not in ctx.payload_digests:
            result.fail("replay", f"replay {obj['replay_id']} is of a transcript not in the bundle", **where)
            continue
        if not isinstance(obj.get("attestation"), (dict, type(None))):
            result.fail("replay", f"replay {obj['replay_id']}: attestation is not an object", **where)
            continue
        if obj.get("attestation") is None:
            ok = obj.get("verdict") is None
            result.add("replay", ok, f"replay {obj['replay_id']} {obj.get('status')}, no attestation"
                       + ("" if ok else f" although it claims verdict {obj.get('verdict')!r}"), **where)
            continue
        _attestation(ctx, obj, where, result)


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
    seen: set[str] = set()
    for n, row in rows:
        tid = row.get("transcript_id", "")
        known = ctx.statements.get(tid)
        if known is None:
            result.fail("summary", "row for a transcript that is not (validly) in transcripts.jsonl", b.SUMMARY_PATH, n, tid)
            continue
        seen.add(tid)
        statement, digest, log_index, sig_ok = known
        det = bool(statement["predicate"].get("sampling", {}).get("deterministic"))
        want = summary_row(statement, log_index, sig_ok, replay_status(det, by_tid.get(tid, [])), digest)
        diff = [f"{k}={row.get(k)!r} (recomputed from the transcript: {want[k]!r})"
                for k in SUMMARY_COLUMNS if row.get(k) != want[k]]
        result.add("summary", not diff, "; ".join(diff) or "row matches the signed transcript", b.SUMMARY_PATH, n, tid)
    for tid in sorted(set(ctx.statements) - seen):
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
