"""Report bundles built from transcripts signed with the real crypto library, verified offline."""

from __future__ import annotations

import base64
import csv
import dataclasses
import datetime as dt
import io
import json
import re
import zipfile
import zlib
from collections.abc import Callable

import pytest

from auditor import canonical as cn
from auditor.crypto import KeyRing, KeyRole, Signer
from auditor.reports import ReportFilters, build_bundle, verify_bundle
from auditor.reports.manifest import MANIFEST_ENVELOPE_PATH, MANIFEST_PATH, sign_manifest
from auditor.reports.summary import SUMMARY_COLUMNS
from tests.auditor.reports_support import T0, SampleLog, sample_log


@pytest.fixture(scope="module")
def log_and_start(tmp_path_factory: pytest.TempPathFactory) -> tuple[SampleLog, int]:
    return sample_log(str(tmp_path_factory.mktemp("keys") / "k"))


def make(log_and_start: tuple[SampleLog, int], **filters: object) -> bytes:
    log, start = log_and_start
    inputs = log.inputs(ReportFilters(**{"tenant": "acme", **filters}), start)  # type: ignore[arg-type]
    return build_bundle(inputs, log.keyring.signer(KeyRole.REPORT))


def unzip(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        return {n: zf.read(n) for n in zf.namelist()}


def rezip(files: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return buf.getvalue()


def edit_line(data: bytes, n: int, change: Callable[[dict], None]) -> bytes:
    """Apply ``change`` to the JSON object on 1-based line ``n`` of a JSONL file."""
    lines = data.split(b"\n")
    obj = json.loads(lines[n - 1])
    change(obj)
    lines[n - 1] = json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()
    return b"\n".join(lines)


def lines_of(data: bytes) -> list[dict]:
    return [json.loads(x) for x in data.splitlines() if x.strip()]


def pdf_text(pdf: bytes) -> bytes:
    """The decoded content streams of a reportlab PDF (ASCII85 + Flate), images skipped."""
    out = []
    for m in re.finditer(rb"stream\r?\n(.*?)\s*endstream", pdf, re.S):
        header, data = pdf[max(0, m.start() - 400):m.start()], m.group(1)
        header = header[header.rfind(b"<<"):]
        if b"/Subtype /Image" in header:
            continue
        if b"ASCII85Decode" in header:
            data = base64.a85decode(data.strip().removesuffix(b"~>"))
        if b"FlateDecode" in header:
            data = zlib.decompress(data)
        out.append(data)
    return b"\n".join(out)


def failures(data: bytes, **kw: object) -> list:
    result = verify_bundle(data, **kw)  # type: ignore[arg-type]
    assert not result.ok, result.render(verbose=True)
    return result.failures()


def test_valid_bundle_verifies_and_lists_every_file(log_and_start: tuple[SampleLog, int]) -> None:
    data = make(log_and_start)
    result = verify_bundle(data)
    assert result.ok, result.render()
    files = unzip(data)
    manifest = json.loads(files[MANIFEST_PATH])
    listed = {f["path"]: f["sha256"] for f in manifest["files"]}
    assert set(listed) | {MANIFEST_PATH, MANIFEST_ENVELOPE_PATH} == set(files)
    assert all(cn.sha256_hex(files[p]) == h for p, h in listed.items())
    assert manifest["generator"] == {"name": "verbatim", "version": "0.1.0-test"}
    assert manifest["filters"]["tenant"] == "acme" and manifest["content_included"] is False
    assert manifest["log"]["end"]["tree_size"] > manifest["log"]["start"]["tree_size"]
    assert files[MANIFEST_PATH] == cn.canonical_json(manifest)
    checks = {f.check for f in result.findings}
    assert {"manifest", "file_hash", "checkpoint", "consistency", "signature", "inclusion", "summary",
            "replay", "hash_chain", "scope", "access_log"} <= checks


def test_summary_has_the_issue_columns_and_one_row_per_transcript(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start))
    rows = files["summary.csv"].decode().splitlines()
    assert rows[0].split(",") == list(SUMMARY_COLUMNS)
    transcripts = lines_of(files["transcripts.jsonl"])
    assert len(rows) - 1 == len(transcripts) == 5
    replays = {json.loads(x)["transcript_id"]: json.loads(x)["verdict"] for x in files["replays.jsonl"].splitlines()}
    assert sorted(replays.values()) == ["match", "mismatch"]
    assert "not_replayable" in files["summary.csv"].decode()  # the one non-deterministic transcript


def test_content_absent_unless_requested(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start))
    assert all("content" not in line for line in lines_of(files["transcripts.jsonl"]))
    for name, data in {**files, "report.pdf (text)": pdf_text(files["report.pdf"])}.items():
        assert b"secret" not in data and b"output 1 text" not in data, name
    assert b"excluded" in files["report.html"] and b"Log integrity evidence" in pdf_text(files["report.pdf"])


def test_content_included_when_requested_and_checked(log_and_start: tuple[SampleLog, int]) -> None:
    data = make(log_and_start, include_content=True)
    result = verify_bundle(data)
    assert result.ok, result.render()
    assert sum(f.check == "output_commitment" and f.ok for f in result.findings) == 5
    files = unzip(data)
    assert all("content" in line for line in lines_of(files["transcripts.jsonl"]))
    assert b"&lt;b&gt;secret&lt;/b&gt;" in files["report.html"]  # escaped, not injected
    assert b"output 1 text" in pdf_text(files["report.pdf"])


def test_altered_transcript_line_names_file_line_and_transcript(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start))
    third = lines_of(files["transcripts.jsonl"])[2]
    env = third["envelope"]
    statement = json.loads(base64.b64decode(env["payload"]))
    statement["predicate"]["tokens"]["output_count"] = 999
    forged = base64.b64encode(cn.canonical_json(statement)).decode()
    files["transcripts.jsonl"] = edit_line(files["transcripts.jsonl"], 3,
                                           lambda o: o["envelope"].__setitem__("payload", forged))
    bad = failures(rezip(files))
    by_check = {f.check: f for f in bad}
    assert by_check["file_hash"].file == "transcripts.jsonl"
    sig = by_check["signature"]
    assert (sig.file, sig.line, sig.transcript_id) == ("transcripts.jsonl", 3, third["transcript_id"])
    assert "does not verify" in sig.detail
    assert by_check["envelope_digest"].line == 3 and by_check["inclusion"].line == 3


def test_altered_summary_row_is_named(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start))
    text = files["summary.csv"].decode().split("\n")
    tid = text[2].split(",")[0]
    text[2] = text[2].replace(",completed,", ",error,")
    files["summary.csv"] = "\n".join(text).encode()
    bad = failures(rezip(files))
    summary = [f for f in bad if f.check == "summary"]
    assert len(summary) == 1 and (summary[0].line, summary[0].transcript_id) == (3, tid)
    assert "status='error' (recomputed from the transcript: 'completed')" in summary[0].detail


def test_removed_transcript_is_named(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start))
    lines = files["transcripts.jsonl"].split(b"\n")
    gone = json.loads(lines.pop(1))["transcript_id"]
    files["transcripts.jsonl"] = b"\n".join(lines)
    bad = failures(rezip(files))
    index = [f for f in bad if f.check == "manifest_index"]
    assert [f.transcript_id for f in index] == [gone] and "missing" in index[0].detail
    assert any(f.check == "summary" and f.transcript_id == gone for f in bad)
    assert any(f.check == "replay" and f.transcript_id == gone for f in bad)  # its replay is orphaned


def test_tampered_manifest_fails(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start))
    manifest = json.loads(files[MANIFEST_PATH])
    manifest["filters"]["include_content"] = True
    files[MANIFEST_PATH] = cn.canonical_json(manifest)
    bad = failures(rezip(files))
    assert [(f.check, f.file) for f in bad] == [("manifest", MANIFEST_ENVELOPE_PATH)]
    assert "not the signed payload" in bad[0].detail


def test_manifest_forged_with_another_key_fails(log_and_start: tuple[SampleLog, int], tmp_path: object) -> None:
    log, _ = log_and_start
    files = unzip(make(log_and_start))
    lines = files["transcripts.jsonl"].split(b"\n")
    del lines[0]
    files["transcripts.jsonl"] = b"\n".join(lines)
    manifest = json.loads(files[MANIFEST_PATH])
    manifest["transcripts"] = manifest["transcripts"][1:]
    for f in manifest["files"]:
        if f["path"] == "transcripts.jsonl":
            f["sha256"], f["size"] = cn.sha256_hex(files["transcripts.jsonl"]), len(files["transcripts.jsonl"])
    intruder = Signer.generate(KeyRole.REPORT)
    files[MANIFEST_PATH], files[MANIFEST_ENVELOPE_PATH] = sign_manifest(manifest, intruder)
    bad = failures(rezip(files))
    assert bad[0].check == "manifest" and intruder.kid in bad[0].detail and "not in the JWKS" in bad[0].detail

    # The intruder also swaps jwks.json: self-consistent, so only a pinned JWKS catches it.
    jwks = json.loads(files["jwks.json"])
    jwks["keys"].append(intruder.verifier().to_jwk())
    files["jwks.json"] = json.dumps(jwks).encode()
    for f in manifest["files"]:
        if f["path"] == "jwks.json":
            f["sha256"], f["size"] = cn.sha256_hex(files["jwks.json"]), len(files["jwks.json"])
    files[MANIFEST_PATH], files[MANIFEST_ENVELOPE_PATH] = sign_manifest(manifest, intruder)
    forged = rezip(files)
    assert verify_bundle(forged).report_kid == intruder.kid
    bad = failures(forged, jwks=log.keyring.jwks())
    assert bad[0].check == "manifest" and intruder.kid in bad[0].detail


def test_other_tenants_transcript_is_flagged(log_and_start: tuple[SampleLog, int]) -> None:
    log, start = log_and_start
    acme = unzip(make(log_and_start))
    globex = unzip(build_bundle(log.inputs(ReportFilters("globex"), start), log.keyring.signer(KeyRole.REPORT)))
    acme_ids = {x["transcript_id"] for x in lines_of(acme["transcripts.jsonl"])}
    globex_lines = lines_of(globex["transcripts.jsonl"])
    assert acme_ids.isdisjoint({x["transcript_id"] for x in globex_lines})
    assert all(r["tenant"] == "acme" for r in _csv_rows(acme["summary.csv"]))
    acme["transcripts.jsonl"] += cn.canonical_json(globex_lines[0]) + b"\n"
    bad = failures(rezip(acme))
    scope = [f for f in bad if f.check == "scope"]
    assert len(scope) == 1 and scope[0].transcript_id == globex_lines[0]["transcript_id"] and "globex" in scope[0].detail


def _csv_rows(data: bytes) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(data.decode())))


def test_smuggled_content_and_altered_token_ids_are_flagged(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start, include_content=True))
    files["transcripts.jsonl"] = edit_line(files["transcripts.jsonl"], 2,
                                           lambda o: o["content"]["output_token_ids"].__setitem__(4, 7))
    bad = failures(rezip(files))
    commit = [f for f in bad if f.check == "output_commitment"]
    assert len(commit) == 1 and commit[0].line == 2

    plain = unzip(make(log_and_start))
    content = lines_of(files["transcripts.jsonl"])[0]["content"]
    plain["transcripts.jsonl"] = edit_line(plain["transcripts.jsonl"], 1, lambda o: o.__setitem__("content", content))
    bad = failures(rezip(plain))
    assert any(f.check == "scope" and f.line == 1 and "content present" in f.detail for f in bad)


def test_tampered_checkpoint_and_replay_verdict(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start))
    note = files["checkpoints/end.txt"].decode().split("\n")
    note[1] = str(int(note[1]) + 1)
    files["checkpoints/end.txt"] = "\n".join(note).encode()
    files["replays.jsonl"] = edit_line(files["replays.jsonl"], 2,
                                       lambda o: o.__setitem__("verdict", "inconclusive_environment"))
    bad = failures(rezip(files))
    assert any(f.check == "checkpoint" and f.file == "checkpoints/end.txt" for f in bad)
    assert any(f.check == "replay" and f.line == 2 and "verdict 'inconclusive_environment', attestation says" in f.detail
               for f in bad)


def test_filters_period_and_deterministic_only(log_and_start: tuple[SampleLog, int]) -> None:
    data = make(log_and_start, since=T0 + dt.timedelta(hours=4), deterministic_only=True)
    result = verify_bundle(data)
    assert result.ok, result.render()
    rows = _csv_rows(unzip(data)["summary.csv"])
    report = [r for r in rows if r["scope"] == "report"]
    assert len(report) == 3 and all(r["deterministic"] == "true" and r["received_at"] >= "2026-11-20T13" for r in report)
    # The chain span carries, without content: sequence 1 (before the period) and 4 (not deterministic).
    assert sorted((r["sequence"], r["scope"]) for r in rows if r["scope"] != "report") == [("1", "chain"), ("4", "chain")]
    assert {r["sequence"]: r["chain_status"] for r in rows} == {"1": "first", "2": "linked", "3": "linked",
                                                                 "4": "linked", "5": "linked"}


def test_report_html_and_pdf_have_the_narrative(log_and_start: tuple[SampleLog, int]) -> None:
    files = unzip(make(log_and_start))
    html = files["report.html"].decode()
    for heading in ("Scope", "Counts", "Decode–verify–rollback", "Replay outcomes", "Key inventory",
                    "Log integrity evidence"):
        assert f"<h2>{heading}</h2>" in html
    assert html.count("data:image/png;base64,") == 3 and "http://" not in html and "https://" not in html
    assert "80.0 %" in html  # 4 of 5 deterministic
    for role, signed in (("transcript", 5), ("replay", 2), ("report", 1), ("checkpoint", 0)):
        assert f'<td>{role}</td><td>active</td><td class="num">{signed}</td>' in html
    assert files["report.pdf"].startswith(b"%PDF-") and len(files["report.pdf"]) > 10_000


def test_build_refuses_broken_log_evidence(log_and_start: tuple[SampleLog, int]) -> None:
    log, start = log_and_start
    inputs = log.inputs(ReportFilters("acme"), start)
    other = KeyRing.open(str(log.keyring.key_dir) + "-other")
    bad = type(inputs)(**{**inputs.__dict__, "jwks": other.jwks()})
    with pytest.raises(Exception, match="checkpoint"):
        build_bundle(bad, log.keyring.signer(KeyRole.REPORT))


WEIRD: tuple[object, ...] = (None, 2**60, -1, [], {}, "x", 1.5, True)
TRANSCRIPT_FIELDS = (("envelope",), ("envelope", "payload"), ("envelope", "signatures"), ("envelope", "payloadType"),
                     ("inclusion_proof",), ("inclusion_proof", "hashes"), ("inclusion_proof", "tree_size"),
                     ("log_index",), ("transcript_id",), ("envelope_digest",))
REPLAY_FIELDS = (("attestation",), ("attestation", "payload"), ("verdict",), ("transcript_id",), ("inclusion_proof",),
                 ("log_index",))


def _set(obj: dict, path: tuple[str, ...], value: object) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


def test_malformed_bundles_are_findings_never_crashes(log_and_start: tuple[SampleLog, int]) -> None:
    good = unzip(make(log_and_start))
    cases: list[dict[str, bytes]] = []
    for path in TRANSCRIPT_FIELDS:
        for value in WEIRD:
            files = dict(good)
            files["transcripts.jsonl"] = edit_line(files["transcripts.jsonl"], 2, lambda o: _set(o, path, value))
            cases.append(files)
    for path in REPLAY_FIELDS:
        for value in WEIRD:
            files = dict(good)
            files["replays.jsonl"] = edit_line(files["replays.jsonl"], 1, lambda o: _set(o, path, value))
            cases.append(files)
    for name in ("jwks.json", "checkpoints/consistency.json", "summary.csv", "access_log.csv", "manifest.dsse.json"):
        for junk in (b"", b"{", b"[1, 2]", b"\xff\xfe"):
            cases.append({**good, name: junk})
    for files in cases:
        result = verify_bundle(rezip(files))
        assert not result.ok and result.failures()
    assert not verify_bundle(b"not a zip").ok
    assert verify_bundle(rezip({k: v for k, v in good.items() if k != "jwks.json"})).failures()[0].check == "jwks"


def _signed(log_and_start: tuple[SampleLog, int], change: Callable[[list], list], **filters: object) -> bytes:
    """A bundle built (and signed with the report key) from inputs that ``change`` altered."""
    log, start = log_and_start
    inputs = log.inputs(ReportFilters(**{"tenant": "acme", **filters}), start)  # type: ignore[arg-type]
    inputs = type(inputs)(**{**inputs.__dict__, "transcripts": change(list(inputs.transcripts))})
    return build_bundle(inputs, log.keyring.signer(KeyRole.REPORT))


def test_a_transcript_left_out_of_the_chain_span_fails_the_bundle(log_and_start: tuple[SampleLog, int]) -> None:
    """An exporter (with the report key) that drops a transcript, or a row deleted from the database:
    the successor's previous_digest names a transcript the bundle lacks."""
    data = _signed(log_and_start, lambda entries: entries[:3] + entries[4:])
    rows = _csv_rows(unzip(data)["summary.csv"])
    assert [r["chain_status"] for r in rows] == ["first", "linked", "linked", "broken"]
    bad = failures(data)
    assert [(f.check, f.transcript_id) for f in bad] == [("hash_chain", rows[3]["transcript_id"])]
    assert "sequence 4" in bad[0].detail and "missing" in bad[0].detail


def test_the_period_explains_only_the_first_predecessor(log_and_start: tuple[SampleLog, int]) -> None:
    since = {"since": T0 + dt.timedelta(hours=4)}
    without_head = _signed(log_and_start, lambda entries: [e for e in entries if e.scope == "report"], **since)
    bad = failures(without_head)
    assert {f.check for f in bad} == {"hash_chain"}  # the chain line before the period is needed

    def mislabel(entries: list) -> list:
        return [dataclasses.replace(e, scope="chain") if i == 2 else e for i, e in enumerate(entries)]

    bad = failures(_signed(log_and_start, mislabel, **since))
    assert any(f.check == "scope" and "belongs to the report" in f.detail for f in bad)
