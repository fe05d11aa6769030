"""Cosigned checkpoints in everything the service hands out, against a real witness process (fake engine,
fast): report bundles end at a witnessed checkpoint and ``verify-bundle --witness`` checks it; replay
evidence carries the cosignatures; with the witness gone, ``?witnessed=true`` answers 503, exports still
complete, and the verifiers given the witness key fail them (``cosignatures``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from auditor.cosignature import CosignerKey
from auditor.crypto import KeyRing
from auditor.reports.verify_bundle import verify_bundle
from auditor.verify import verify_document
from tests.auditor import independent
from tests.auditor.conftest import DEFAULT_KEYS, LiveServer, serving, sqlite_settings
from tests.auditor.processes import Process, run_cli
from tests.auditor.test_replay_fake import ReplayFakeEngine
from tests.auditor.test_reports_api import complete, export
from tests.auditor.test_witness_live import ORIGIN, start_witness


@pytest.fixture
async def witnessed(tmp_path: Path) -> AsyncIterator[tuple[LiveServer, Process, str]]:
    keyring = KeyRing.open(tmp_path / "data" / "keys")
    (tmp_path / "jwks.json").write_text(json.dumps(keyring.jwks()))
    witness, url, vkey = start_witness(tmp_path, tmp_path / "jwks.json")
    try:
        settings = await asyncio.to_thread(sqlite_settings, tmp_path / "data", log_origin=ORIGIN,
                                           witnesses=((url, vkey),), witness_interval=0.1, witness_timeout=2)
        async with serving(settings, ReplayFakeEngine(), DEFAULT_KEYS) as server:
            yield server, witness, vkey
    finally:
        witness.stop()


def _bundle_check(result: Any) -> list[Any]:
    return [f for f in result.findings if f.check == "cosignatures"]


async def test_bundles_and_replays_carry_cosignatures(witnessed: tuple[LiveServer, Process, str],
                                                      tmp_path: Path) -> None:
    server, witness, vkey = witnessed
    key = CosignerKey.parse(vkey)
    async with server.client(server.keys["auditor"]) as auditor, server.client(server.keys["client"]) as client:
        ids = await complete(client, 3, deterministic=True)
        _, bundle = await export(auditor)
        replay = (await client.post(f"/v1/transcripts/{ids[0]}/replay", params={"wait": "true"})).json()
        await asyncio.sleep(0.5)  # the attestation's checkpoint gets witnessed
        replay = (await client.get(f"/v1/replays/{replay['id']}")).json()
        jwks = (await client.get("/.well-known/jwks.json")).json()

    result = verify_bundle(bundle, jwks, witnesses=[key])
    assert result.ok, result.render()
    assert [f.ok for f in _bundle_check(result)] == [True]
    (tmp_path / "report.zip").write_bytes(bundle)
    cli = run_cli("verify-bundle", str(tmp_path / "report.zip"), "--jwks", str(tmp_path / "jwks.json"),
                  "--witness", vkey)
    assert cli.returncode == 0, cli.stdout + cli.stderr
    two = verify_bundle(bundle, jwks, witnesses=[key, CosignerKey("witness.test/absent", b"\x01" * 32)], quorum=2)
    assert not two.ok and "1 of 2 configured witnesses cosigned (need 2" in _bundle_check(two)[0].detail

    assert (replay["status"], replay["result"]) == ("done", "match"), replay
    evidence = replay["evidence"]
    assert independent.cosignatures(evidence["checkpoint"], vkey)
    report = verify_document(evidence, jwks, witnesses=[key])
    assert report.ok, report.render()


async def test_without_the_witness(witnessed: tuple[LiveServer, Process, str]) -> None:
    server, witness, vkey = witnessed
    key = CosignerKey.parse(vkey)
    async with server.client(server.keys["auditor"]) as auditor, server.client(server.keys["client"]) as client:
        ids = await complete(client, 2)
        witnessed_doc = (await client.get(f"/v1/transcripts/{ids[0]}", params={"witnessed": "true"})).json()
        witness.stop()
        ids += await complete(client, 1)
        refused = await client.get(f"/v1/transcripts/{ids[-1]}", params={"witnessed": "true"})
        unwitnessed = (await client.get(f"/v1/transcripts/{ids[-1]}")).json()
        _, bundle = await export(auditor)
        jwks = (await client.get("/.well-known/jwks.json")).json()
        metrics = (await client.get("/metrics")).text
    assert verify_document(witnessed_doc, jwks, witnesses=[key]).ok
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "witness_unavailable", refused.text
    failed = verify_document(unwitnessed, jwks, witnesses=[key])
    assert [c.name for c in failed.failures()] == ["cosignatures"], failed.render()
    assert verify_document(unwitnessed, jwks).ok  # the log's own signature and proofs are intact
    result = verify_bundle(bundle, jwks, witnesses=[key])
    assert [f.check for f in result.failures()] == ["cosignatures"], result.render()
    assert 'outcome="unreachable"' in metrics


async def test_witnessed_needs_witnesses(tmp_path: Path) -> None:
    from tests.auditor.fake_engine import FakeAsyncEngine

    settings = await asyncio.to_thread(sqlite_settings, tmp_path)
    async with serving(settings, FakeAsyncEngine(), DEFAULT_KEYS) as server:
        async with server.client(server.keys["client"]) as client:
            response = await client.get("/v1/log/checkpoint", params={"witnessed": "true"})
    assert response.status_code == 400 and response.json()["error"]["param"] == "witnessed", response.text
    with pytest.raises(ValueError, match=r"witnesses\[0\]\.vkey"):
        type(settings)(witnesses=(("http://w.example", "not-a-vkey"),))
    with pytest.raises(ValueError, match="witness_quorum"):
        type(settings)(witness_quorum=1)

