"""``python -m auditor``: serve (first start sets everything up), keys create|list|revoke, verify."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.auditor.conftest import LiveServer, free_port
from tests.auditor.test_api_fake import _tamper, completion

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "auditor", *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)


def test_help_lists_flags() -> None:
    result = run_cli("serve", "--help")
    assert result.returncode == 0
    for flag in ("--host", "--port", "--data-dir", "--database-url"):
        assert flag in result.stdout


def test_keys_create_list_revoke(tmp_path: Path) -> None:
    created = run_cli("keys", "create", "--tenant", "acme", "--role", "auditor", "--data-dir", str(tmp_path))
    assert created.returncode == 0, created.stderr
    secret = created.stdout.strip().splitlines()[-1]
    assert secret.startswith("vbk_") and " " not in secret
    with sqlite3.connect(tmp_path / "verbatim.db") as connection:
        rows = connection.execute("SELECT * FROM api_keys").fetchall()
    assert secret not in repr(rows) and hashlib.sha256(secret.encode()).hexdigest() in repr(rows)
    listed = run_cli("keys", "list", "--data-dir", str(tmp_path))
    key_id = listed.stdout.split()[0]
    assert "acme" in listed.stdout and "auditor" in listed.stdout and secret not in listed.stdout
    assert run_cli("keys", "revoke", key_id, "--data-dir", str(tmp_path)).returncode == 0
    assert "revoked" in run_cli("keys", "list", "--data-dir", str(tmp_path)).stdout
    assert run_cli("keys", "create", "--tenant", "acme", "--role", "root", "--data-dir", str(tmp_path)).returncode != 0
    by_env = run_cli("keys", "create", "--tenant", "t2", "--role", "client", env={"VERBATIM_DATA_DIR": str(tmp_path)})
    assert by_env.returncode == 0
    assert "t2" in run_cli("keys", "list", "--data-dir", str(tmp_path)).stdout


async def test_verify_command_accepts_served_document_and_rejects_tampering(fake_server: LiveServer,
                                                                             tmp_path: Path) -> None:
    async with fake_server.client(fake_server.keys["client"]) as client:
        transcript_id = (await client.post("/v1/completions", json=completion())).json()["transcript"]["id"]
        doc = (await client.get(f"/v1/transcripts/{transcript_id}", params={"include_content": "true"})).json()
        (tmp_path / "jwks.json").write_text((await client.get("/.well-known/jwks.json")).text)
    (tmp_path / "good.json").write_text(json.dumps(doc))
    good = run_cli("verify", str(tmp_path / "good.json"), "--jwks", str(tmp_path / "jwks.json"))
    assert good.returncode == 0, good.stdout + good.stderr
    assert "VALID" in good.stdout
    local_keys = run_cli("verify", str(tmp_path / "good.json"), "--data-dir", str(fake_server.settings.data_dir))
    assert local_keys.returncode == 0, local_keys.stdout + local_keys.stderr
    _tamper(fake_server.settings.resolved_database_url, transcript_id)
    async with fake_server.client(fake_server.keys["client"]) as client:
        tampered = (await client.get(f"/v1/transcripts/{transcript_id}")).json()
    (tmp_path / "bad.json").write_text(json.dumps(tampered))
    bad = run_cli("verify", str(tmp_path / "bad.json"), "--jwks", str(tmp_path / "jwks.json"))
    assert bad.returncode == 1 and "INVALID" in bad.stdout


@pytest.mark.slow
def test_serve_first_start_sets_everything_up(tmp_path: Path) -> None:
    """Migrates, creates owner-only signing keys and one admin key (printed once), listens; the model
    path is made invalid so the test does not load a model, and the server is told to keep serving
    (readyz reports the engine error)."""
    data = tmp_path / "data"
    port = free_port()
    env = {"VERBATIM_MODEL": str(tmp_path / "no-such-model"), "VERBATIM_PORT": str(port),
           "VERBATIM_KEEP_SERVING_ON_LOAD_ERROR": "1"}
    first, output = _serve_once(data, env, port)
    admin_key = next(line for line in output.splitlines() if line.startswith("vbk_"))
    assert (data / "verbatim.db").exists()
    pems = list((data / "keys").glob("*.pem"))
    assert len(pems) == 4 and all(p.stat().st_mode & 0o077 == 0 for p in pems)
    assert first["health"] == 200 and first["ready"] == 503 and first["transcripts"] == 401
    second, output = _serve_once(data, env, port, admin_key)
    assert "vbk_" not in output
    assert second["transcripts"] == 200


def _serve_once(data: Path, env: dict[str, str], port: int, key: str | None = None) -> tuple[dict[str, int], str]:
    process = subprocess.Popen([sys.executable, "-m", "auditor", "serve", "--data-dir", str(data)], cwd=ROOT,
                               env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        statuses = _probe(port, key)
    finally:
        process.send_signal(signal.SIGINT)
        output, _ = process.communicate(timeout=30)
    return statuses, output


def _probe(port: int, key: str | None) -> dict[str, int]:
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            health = httpx.get(f"{base}/healthz", timeout=2).status_code
            break
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    for _ in range(50):
        ready = httpx.get(f"{base}/readyz", timeout=5)
        if "engine_error" in ready.json():
            break
        time.sleep(0.2)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transcripts = httpx.get(f"{base}/v1/transcripts", headers=headers, timeout=5).status_code
    return {"health": health, "ready": ready.status_code, "transcripts": transcripts}
