"""C2SP tlog-cosignature and tlog-witness: the cosignature format checked by an independent reading of
the spec, and every answer of the witness's add-checkpoint (200, 400, 403, 404, 409, 422), its
persistence across a restart and its atomicity under concurrent submissions."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from auditor import merkle
from auditor.checkpoint import Checkpoint, sign_checkpoint, verifier_key_string
from auditor.cosignature import (
    Cosigner,
    CosignatureError,
    CosignerKey,
    check_quorum,
    verify_cosignatures,
    with_signature_lines,
)
from auditor.crypto import KeyRole, Signer
from auditor.witness.core import Refusal, Witness
from auditor.witness.protocol import AddCheckpoint, ProtocolError, encode_request
from auditor.witness.state import EVIDENCE_FILE, KEY_FILE, StateError, WitnessState
from tests.auditor import independent

ORIGIN = "verbatim.test/log"


class Log:
    """A tiny log: leaves, a checkpoint signer, notes and consistency proofs."""

    def __init__(self, signer: Signer, leaves: list[bytes] | None = None) -> None:
        self.signer = signer
        self.tree = merkle.MerkleTree()
        for entry in leaves or []:
            self.tree.append(entry)

    def grow(self, n: int, tag: bytes = b"e") -> None:
        for _ in range(n):
            self.tree.append(tag + self.tree.size.to_bytes(4, "big"))

    def note(self, size: int | None = None) -> str:
        size = self.tree.size if size is None else size
        return sign_checkpoint(Checkpoint(ORIGIN, size, self.tree.root(size)), self.signer)

    def submit(self, old: int, size: int | None = None) -> bytes:
        size = self.tree.size if size is None else size
        proof = self.tree.consistency_proof(old, size) if 0 < old < size else []
        return encode_request(old, proof, self.note(size))


@pytest.fixture
def signer() -> Signer:
    return Signer.generate(KeyRole.CHECKPOINT)


@pytest.fixture
def cosigner(tmp_path: Path) -> Cosigner:
    return Cosigner.load_or_create(tmp_path / "w" / KEY_FILE, "witness.test/w1")


def witness_for(tmp_path: Path, cosigner: Cosigner, signer: Signer, clock: float = 1_700_000_000) -> Witness:
    state = WitnessState(tmp_path / "w").open()
    return Witness(cosigner, {ORIGIN: [signer.public_raw]}, state, clock=lambda: clock)


# --- cosignatures ---------------------------------------------------------------------------------------


def test_cosignature_is_the_spec_format(cosigner: Cosigner, signer: Signer) -> None:
    log = Log(signer)
    log.grow(5)
    note = log.note()
    line = cosigner.cosign(note.rpartition("\n\n")[0] + "\n", 1_679_315_147)
    cosigned = with_signature_lines(note, [line])
    assert independent.cosignatures(cosigned, cosigner.key.vkey()) == [1_679_315_147]
    assert [(c.name, c.timestamp) for c in verify_cosignatures(cosigned, [cosigner.key])] == \
        [("witness.test/w1", 1_679_315_147)]
    assert CosignerKey.parse(cosigner.key.vkey()) == cosigner.key


def test_cosignature_checks(cosigner: Cosigner, signer: Signer, tmp_path: Path) -> None:
    log = Log(signer)
    log.grow(3)
    note = log.note()
    text = note.rpartition("\n\n")[0] + "\n"
    stranger = Cosigner.load_or_create(tmp_path / "s" / KEY_FILE, "witness.test/w2")
    cosigned = with_signature_lines(note, [cosigner.cosign(text, 10), stranger.cosign(text, 11)])
    assert [c.name for c in verify_cosignatures(cosigned, [cosigner.key])] == ["witness.test/w1"]
    with pytest.raises(CosignatureError, match="1 of 2 configured witnesses cosigned"):
        check_quorum(cosigned.replace(stranger.cosign(text, 11), ""), [cosigner.key, stranger.key], 2)
    other_log = Log(signer)
    other_log.grow(4)
    forged = with_signature_lines(other_log.note(), [cosigner.cosign(text, 10)])
    with pytest.raises(CosignatureError, match="does not verify"):
        verify_cosignatures(forged, [cosigner.key])
    with pytest.raises(CosignatureError, match="signature type"):
        CosignerKey.parse(verifier_key_string("x.test/k", signer.public_raw))
    with pytest.raises(CosignatureError, match="does not match"):
        CosignerKey.parse(cosigner.key.vkey().replace(cosigner.key.key_id.hex(), "00000000"))
    assert (tmp_path / "w" / KEY_FILE).stat().st_mode & 0o777 == 0o600


# --- the witness ------------------------------------------------------------------------------------------


async def test_add_checkpoint_answers(tmp_path: Path, cosigner: Cosigner, signer: Signer) -> None:
    log = Log(signer)
    log.grow(3)
    witness = witness_for(tmp_path, cosigner, signer)
    first = await witness.add_checkpoint(log.submit(0))
    assert first.size == 3
    assert independent.cosignatures(with_signature_lines(log.note(), [first.line]), cosigner.key.vkey())
    with pytest.raises(Refusal) as stale:
        await witness.add_checkpoint(log.submit(0))
    assert (stale.value.status, stale.value.size) == (409, 3)
    log.grow(4)
    assert (await witness.add_checkpoint(log.submit(3))).size == 7
    assert (await witness.add_checkpoint(log.submit(7))).size == 7  # same tree again: cosigned again
    for body, status in [
        (b"old 7\n\nnot a checkpoint\n", 400),
        (b"new 7\n\n" + log.note().encode(), 400),
        (b"old 07\n\n" + log.note().encode(), 400),
        (encode_request(9, [], log.note()), 400),
        ("old 7\n" + "AAAA\n" * 64 + "\n" + log.note(), 400),
        (log.submit(7).replace(ORIGIN.encode(), b"other.test/log"), 404),
        (encode_request(7, [], Log(Signer.generate(KeyRole.CHECKPOINT), [b"e" + i.to_bytes(4, "big")
                                                                          for i in range(7)]).note()), 403),
    ]:
        with pytest.raises(Refusal) as refused:
            await witness.add_checkpoint(body if isinstance(body, bytes) else body.encode())
        assert refused.value.status == status, (body[:40], refused.value.message)
    assert not (tmp_path / "w" / EVIDENCE_FILE).exists()


async def test_a_rewritten_leaf_is_refused_and_kept_as_evidence(tmp_path: Path, cosigner: Cosigner,
                                                                signer: Signer) -> None:
    genuine = Log(signer)
    genuine.grow(6)
    witness = witness_for(tmp_path, cosigner, signer)
    await witness.add_checkpoint(genuine.submit(0))
    forked = Log(signer, [genuine.tree.leaf_hash(i) for i in range(0)])
    for i in range(6):
        forked.tree.append_leaf_hash(genuine.tree.leaf_hash(i) if i != 4 else merkle.leaf_hash(b"rewritten"))
    forked.grow(2)
    with pytest.raises(Refusal) as inconsistent:
        await witness.add_checkpoint(forked.submit(6))
    assert inconsistent.value.status == 422
    with pytest.raises(Refusal) as conflict:
        await witness.add_checkpoint(forked.submit(6, 6))
    assert (conflict.value.status, conflict.value.size) == (409, 6)
    evidence = [json.loads(line) for line in (tmp_path / "w" / EVIDENCE_FILE).read_text().splitlines()]
    assert [e["reason"] for e in evidence] == ["inconsistent", "root_conflict"]
    assert evidence[0]["cosigned"] == genuine.note(6) and evidence[0]["old_size"] == 6
    genuine.grow(1)
    assert (await witness.add_checkpoint(genuine.submit(6))).size == 7


async def test_state_survives_a_restart_and_one_process_holds_it(tmp_path: Path, cosigner: Cosigner,
                                                                 signer: Signer) -> None:
    log = Log(signer)
    log.grow(5)
    witness = witness_for(tmp_path, cosigner, signer)
    await witness.add_checkpoint(log.submit(0))
    with pytest.raises(StateError, match="another witness process"):
        WitnessState(tmp_path / "w").open()
    witness.state.close()
    again = witness_for(tmp_path, cosigner, signer)
    with pytest.raises(Refusal) as refused:
        await again.add_checkpoint(log.submit(0))
    assert refused.value.size == 5
    assert again.state.get(ORIGIN).checkpoint == log.note()


async def test_concurrent_submissions_never_roll_back(tmp_path: Path, cosigner: Cosigner, signer: Signer) -> None:
    log = Log(signer)
    log.grow(4)
    witness = witness_for(tmp_path, cosigner, signer)
    await witness.add_checkpoint(log.submit(0))
    log.grow(8)
    bodies = [log.submit(4, size) for size in range(5, 13)]
    results = await asyncio.gather(*(witness.add_checkpoint(b) for b in bodies), return_exceptions=True)
    accepted = [r.size for r in results if not isinstance(r, Exception)]
    assert len(accepted) == 1 and all(isinstance(r, Refusal) and r.status == 409 for r in results
                                      if isinstance(r, Exception))
    assert witness.state.get(ORIGIN).size == accepted[0]


def test_request_body_round_trip(signer: Signer) -> None:
    log = Log(signer)
    log.grow(9)
    request = AddCheckpoint.parse(log.submit(3))
    assert (request.old_size, request.note) == (3, log.note())
    merkle.verify_consistency(3, 9, log.tree.root(3), log.tree.root(), list(request.proof))
    with pytest.raises(ProtocolError, match="not base64"):
        AddCheckpoint.parse(b"old 3\n!!\n\n" + log.note().encode())
