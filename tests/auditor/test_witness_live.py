"""Witnesses and monitors end to end: the server (real SmolLM2 engine) submits every new checkpoint to a
real ``python -m auditor witness`` process and serves the cosigned checkpoints; transcripts carry them and
``python -m auditor verify --witness`` checks them. Then a leaf is rewritten while the server is stopped:
after the restart the witness refuses the server's checkpoints and ``python -m auditor monitor`` exits 1.

Two rewrites: the one from the issue (one ``log_leaves.leaf_hash`` changed), and an operator holding the
database and the keys who rewrites the last transcript, its leaf and the latest checkpoint so that
everything the server can check about itself is consistent — only outside observers can catch that.
"""

from __future__ import annotations

import asyncio
import base64
import json
import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from auditor import canonical as cn
from auditor import merkle
from auditor.checkpoint import Checkpoint, sign_checkpoint
from auditor.crypto import KeyRing, KeyRole
from auditor.transcript import sign_statement
from tests.auditor import independent
from tests.auditor.conftest import LiveServer, free_port, make_key, serving, sqlite_settings, with_port
from tests.auditor.processes import Process, run_cli

ORIGIN = "verbatim.test/witnessed"
WITNESS = "witness.test/w1"


def start_witness(tmp_path: Path, jwks_path: Path) -> tuple[Process, str, str]:
    state = tmp_path / "witness"
    vkey = run_cli("witness", "vkey", "--state-dir", str(state), "--name", WITNESS)
    assert vkey.returncode == 0, vkey.stderr
    port = free_port()
    witness = Process(("witness", "serve", "--state-dir", str(state), "--name", WITNESS, "--log-jwks",
                       f"{ORIGIN}={jwks_path}", "--port", str(port)), tmp_path / "witness.log").start()
    url = f"http://127.0.0.1:{port}"
    witness.wait_http(url + "/healthz", timeout=60)
    return witness, url, vkey.stdout.strip()


async def complete(server: LiveServer, key: str, prompt: str) -> str:
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=300)
    response = await client.completions.create(model="SmolLM2-135M-Instruct.Q4_1", prompt=prompt, max_tokens=3,
                                               extra_body={"deterministic": True, "seed": 7})
    return response.model_extra["transcript"]["id"]


def monitor(server_url: str, tmp_path: Path, vkey: str) -> Any:
    return run_cli("monitor", server_url, "--jwks", str(tmp_path / "jwks.json"), "--state",
                   str(tmp_path / "monitor.json"), "--once", "--witness", vkey)


async def wait_for_refusal(server: LiveServer, timeout: float = 30) -> str:
    deadline = time.monotonic() + timeout
    async with server.client() as http:
        while time.monotonic() < deadline:
            metrics = (await http.get("/metrics")).text
            if re.search(r'verbatim_witness_submissions_total\{outcome="refused",witness="[^"]+"\} [1-9]', metrics):
                return metrics
            await asyncio.sleep(0.3)
    raise AssertionError(f"no witness refusal within {timeout} s:\n{metrics}")


def rewrite_leaf_hash(db: Path, index: int) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE log_leaves SET leaf_hash = ? WHERE \"index\" = ?",
                     (merkle.leaf_hash(b"rewritten"), index))


def rewrite_as_operator(db: Path, keys_dir: Path) -> None:
    """Re-sign the last transcript with an altered payload, rewrite its leaf, drop the witness's
    cosignature and re-sign the latest checkpoint over the altered tree."""
    keyring = KeyRing.open(keys_dir)
    with sqlite3.connect(db) as conn:
        tid, envelope, index = conn.execute(
            "SELECT id, envelope, log_index FROM transcripts ORDER BY log_index DESC LIMIT 1").fetchone()
        statement = json.loads(base64.b64decode(json.loads(envelope)["payload"]))
        statement["predicate"]["dvr"]["rollbacks"] += 1
        payload, forged = sign_statement(statement, keyring, KeyRole.TRANSCRIPT)
        digest = cn.envelope_digest(forged)
        conn.execute("UPDATE transcripts SET envelope = ?, payload_digest = ?, envelope_digest = ? WHERE id = ?",
                     (cn.canonical_json(forged), cn.sha256_hex(payload), digest, tid))
        conn.execute("UPDATE log_leaves SET entry = ?, leaf_hash = ? WHERE \"index\" = ?",
                     (bytes.fromhex(digest), merkle.leaf_hash(bytes.fromhex(digest)), index))
        leaves = [bytes(h) for (h,) in conn.execute("SELECT leaf_hash FROM log_leaves ORDER BY \"index\"")]
        size = len(leaves)
        root = merkle.MerkleTree(leaves).root()
        note = sign_checkpoint(Checkpoint(ORIGIN, size, root), keyring.signer(KeyRole.CHECKPOINT))
        conn.execute("DELETE FROM checkpoint_cosignatures WHERE tree_size = ?", (size,))
        conn.execute("UPDATE log_checkpoints SET root_hash = ?, note = ? WHERE tree_size = ?", (root, note, size))


@pytest.mark.parametrize("rewrite", ["leaf_hash", "operator"])
@pytest.mark.slow
async def test_rewritten_leaf_is_refused_by_the_witness_and_flagged_by_the_monitor(
        real_engine: tuple[Any, Any], tmp_path: Path, rewrite: str) -> None:
    loop_thread, engine = real_engine
    keyring = KeyRing.open(tmp_path / "data" / "keys")
    (tmp_path / "jwks.json").write_text(json.dumps(keyring.jwks()))
    witness, witness_url, vkey = start_witness(tmp_path, tmp_path / "jwks.json")
    try:
        settings = await asyncio.to_thread(sqlite_settings, tmp_path / "data", log_origin=ORIGIN,
                                           witnesses=((witness_url, vkey),), witness_interval=0.2,
                                           witness_timeout=3)
        key = await make_key(settings, "acme", "client")
        async with serving(settings, engine, {}, loop_thread=loop_thread) as server:
            ids = [await complete(server, key, p) for p in ("The sky is", "Two and two", "Paris is")]
            async with server.client(key) as http:
                checkpoint = (await http.get("/v1/log/checkpoint", params={"witnessed": "true"})).json()
                doc = (await http.get(f"/v1/transcripts/{ids[0]}", params={"witnessed": "true"})).json()
            assert checkpoint["tree_size"] == 3
            assert len(independent.cosignatures(checkpoint["note"], vkey)) == 1
            (tmp_path / "doc.json").write_text(json.dumps(doc))
            verified = run_cli("verify", str(tmp_path / "doc.json"), "--jwks", str(tmp_path / "jwks.json"),
                               "--witness", vkey)
            assert verified.returncode == 0 and "PASS  cosignatures: 1 of 1 witnesses" in verified.stdout, \
                verified.stdout + verified.stderr
            first = await asyncio.to_thread(monitor, server.url, tmp_path, vkey)
            assert first.returncode == 0 and "size 3" in first.stdout, first.stdout + first.stderr

        db = tmp_path / "data" / "verbatim.db"
        if rewrite == "leaf_hash":
            rewrite_leaf_hash(db, 1)
        else:
            rewrite_as_operator(db, keyring.key_dir)

        async with serving(with_port(settings), engine, {}, loop_thread=loop_thread) as again:
            async with again.client(key) as http:
                appended = await http.post("/v1/completions", json={
                    "model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "After the rewrite", "max_tokens": 2})
                if appended.status_code == 503:  # the server's own check caught the bare leaf rewrite
                    assert rewrite == "leaf_hash", appended.text
                    return
                assert appended.status_code == 200, appended.text
                await wait_for_refusal(again)
                refused = await http.get("/v1/log/checkpoint", params={"witnessed": "true"})
                latest = (await http.get("/v1/log/checkpoint")).json()
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "witness_unavailable"
            assert latest["tree_size"] == 4 and independent.cosignatures(latest["note"], vkey) == []
            flagged = await asyncio.to_thread(monitor, again.url, tmp_path, vkey)
            unwitnessed = run_cli("monitor", again.url, "--jwks", str(tmp_path / "jwks.json"), "--state",
                                  str(tmp_path / "fresh-monitor.json"), "--once")
        assert flagged.returncode == 1 and "INCONSISTENT" in flagged.stderr, flagged.stdout + flagged.stderr
        assert "is not an extension of checkpoint 3" in flagged.stderr, flagged.stderr
        evidence = json.loads((tmp_path / "monitor.json.evidence.json").read_text())
        assert evidence["kept"] == checkpoint["note"] and evidence["consistency_proof"]["old_size"] == 3
        assert json.loads((tmp_path / "monitor.json").read_text())["size"] == 3  # the last good one kept
        assert unwitnessed.returncode == 0  # a monitor that never saw the genuine tree cannot tell
        refusals = [json.loads(line) for line in (tmp_path / "witness" / "evidence.jsonl").read_text().splitlines()]
        assert refusals and {r["reason"] for r in refusals} <= {"inconsistent", "root_conflict"}
        submitted = "".join(line for line in checkpoint["note"].splitlines(keepends=True)
                            if not line.startswith(f"\u2014 {WITNESS} "))
        assert all(r["cosigned"] == submitted for r in refusals), refusals
    finally:
        witness.stop()
    assert "refused (422)" in witness.output() or "refused (409)" in witness.output(), witness.output()[-2000:]
