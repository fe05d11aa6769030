"""Replay attestations: a signed statement that this server re-executed a transcript (DESIGN §5).

In-toto Statement v1, DSSE-signed with the ``replay`` role key::

    subject        [{name: "transcript:<id>", digest: {sha256: <transcript payload digest>}}]
    predicateType  "https://verbatim.dev/replay/v1"
    predicate      {replay_id, transcript_id, result: match|mismatch|inconclusive_environment,
                    details: {...}, replayed_at, engine_fingerprint: {...}, system_fingerprint}

``details`` for ``mismatch``: window_index, position, expected_token, replayed_token (and optionally
logprob digests); for ``inconclusive_environment``: ``differences`` {field: {recorded, current}}.
The envelope digest is appended to the Merkle log like a transcript's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from auditor.crypto import KeyRing, KeyRole
from auditor.transcript import STATEMENT_TYPE, SignedStatement, open_statement

REPLAY_PREDICATE = "https://verbatim.dev/replay/v1"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


class ReplayVerdict(StrEnum):
    MATCH = "match"
    MISMATCH = "mismatch"
    INCONCLUSIVE_ENVIRONMENT = "inconclusive_environment"


_REQUIRED_DETAILS = {
    ReplayVerdict.MATCH: (),
    ReplayVerdict.MISMATCH: ("window_index", "position", "expected_token", "replayed_token"),
    ReplayVerdict.INCONCLUSIVE_ENVIRONMENT: ("differences",),
}


@dataclass(frozen=True)
class ReplayAttestationInputs:
    replay_id: str
    transcript_id: str
    transcript_payload_digest: str
    result: ReplayVerdict
    replayed_at: str
    engine_fingerprint: Mapping[str, Any]
    system_fingerprint: str
    details: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not _HEX64.match(self.transcript_payload_digest):
            raise ValueError(f"transcript_payload_digest {self.transcript_payload_digest!r} is not 64 hex chars")
        missing = [k for k in _REQUIRED_DETAILS[ReplayVerdict(self.result)] if k not in self.details]
        if missing:
            raise ValueError(f"result {ReplayVerdict(self.result).value!r} needs details {missing}")


def build_replay_statement(x: ReplayAttestationInputs) -> dict[str, Any]:
    """The in-toto Statement for a replay attestation."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": f"transcript:{x.transcript_id}", "digest": {"sha256": x.transcript_payload_digest}}],
        "predicateType": REPLAY_PREDICATE,
        "predicate": {
            "replay_id": x.replay_id, "transcript_id": x.transcript_id,
            "result": ReplayVerdict(x.result).value, "details": dict(x.details),
            "replayed_at": x.replayed_at, "engine_fingerprint": dict(x.engine_fingerprint),
            "system_fingerprint": x.system_fingerprint,
        },
    }


@dataclass(frozen=True, kw_only=True)
class SignedAttestation(SignedStatement):
    replay_id: str


def sign_replay_attestation(x: ReplayAttestationInputs, keyring: KeyRing) -> SignedAttestation:
    """Build and sign the attestation with the ``replay`` role key."""
    return SignedAttestation.sign(build_replay_statement(x), keyring, KeyRole.REPLAY, replay_id=x.replay_id)


def verify_replay_attestation(envelope: Mapping[str, Any], jwks: Mapping[str, Any],
                              transcript_payload_digest: str | None = None) -> dict[str, Any]:
    """Verify signature (replay role) and type; optionally that it attests the given transcript.

    Returns the Statement; raises ``CryptoError`` / ``ValueError`` with the reason otherwise.
    """
    _, statement = open_statement(envelope, jwks, REPLAY_PREDICATE, KeyRole.REPLAY)
    subject = statement["subject"][0]["digest"]["sha256"]  # shape checked by open_statement
    if transcript_payload_digest is not None and subject != transcript_payload_digest:
        raise ValueError(f"attestation is about transcript payload {subject}, not {transcript_payload_digest}")
    return statement
