"""Signed transcripts: the in-toto Statement of one completion, its DSSE envelope, and verification.

Layout of the Statement (DESIGN §4; serialized with ``canonical_json`` and signed as DSSE with the
``transcript`` role key)::

    _type          "https://in-toto.io/Statement/v1"
    subject        [{name: "transcript:<id>/prompt", digest: {sha256: prompt_commitment}},
                    {name: "transcript:<id>/output", digest: {sha256: output_commitment}}]
    predicateType  "https://verbatim.dev/transcript/v1"
    predicate      transcript {id, tenant, sequence, previous_digest}
                   request    {api, received_at, completed_at, status,
                               choice {index, count, request_seed}   (only when n > 1),
                               extras {metadata, user, ...}          (only when given)}
                   model      {name, weights_digest, tokenizer_digest, chat_template_digest, dtype}
                   runtime    the engine's runtime fingerprint dict, verbatim
                   sampling   {params (without seed), seed: decimal string, deterministic}
                   tokens     {commitment_scheme, prompt_commitment, output_commitment,
                               prompt_count, output_count, finish_reason}
                   windows    {shape: {G, W}, spans: [[start, end], …], chain_scheme,
                               chain_head, logprob_digest}
                   dvr        {verify_passes, rollbacks, recomputed_tokens}

The subjects are the salted token commitments: they identify the content without disclosing it.
Hash chain: ``sequence`` starts at 1 per tenant; ``previous_digest`` is the ``payload_digest``
(SHA-256 of the exact signed payload bytes) of the tenant's previous transcript, ``None`` exactly when
``sequence == 1``. The Merkle log's leaf data is the 32 bytes of ``envelope_digest``.
"""

from __future__ import annotations

import json
import os
import re
import struct
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Self

from auditor import canonical as cn
from auditor.crypto import KeyRing, KeyRole, sign_envelope, verify_envelope

STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
TRANSCRIPT_PREDICATE = "https://verbatim.dev/transcript/v1"
COMMITMENT_SCHEME = "sha256(salt||u32le(ids))"
CHAIN_SCHEME = "verbatim-windows-v1"
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_RFC3339_UTC = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?Z$")


class Api(StrEnum):
    COMPLETIONS = "completions"
    CHAT_COMPLETIONS = "chat.completions"


class Status(StrEnum):
    COMPLETED = "completed"
    CLIENT_DISCONNECTED = "client_disconnected"
    ERROR = "error"


def uuid7(unix_ms: int | None = None, rand: bytes | None = None) -> uuid.UUID:
    """RFC 9562 UUIDv7: 48-bit Unix ms timestamp, version 7, variant 10, 74 random bits."""
    ms = time.time_ns() // 1_000_000 if unix_ms is None else unix_ms
    rnd = os.urandom(10) if rand is None else rand
    if len(rnd) != 10 or not 0 <= ms < 2**48:
        raise ValueError(f"uuid7 needs 10 random bytes and a 48-bit timestamp, got {len(rnd)} and {ms}")
    value = (ms << 80) | int.from_bytes(rnd, "big")
    value = (value & ~(0xF << 76)) | (0x7 << 76)
    value = (value & ~(0x3 << 62)) | (0x2 << 62)
    return uuid.UUID(int=value)


def new_salt() -> bytes:
    """A fresh random 32-byte commitment salt (kept beside the record, never inside it)."""
    return os.urandom(cn.SALT_BYTES)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    weights_digest: str
    tokenizer_digest: str
    chat_template_digest: str | None
    dtype: str


@dataclass(frozen=True)
class DvrStats:
    verify_passes: int
    rollbacks: int
    recomputed_tokens: int


@dataclass(frozen=True)
class Choice:
    """Which of a request's ``n`` choices a transcript holds; its seed derives from ``request_seed``
    (``auditor.service.choice_seed``)."""

    index: int
    count: int
    request_seed: int | None


@dataclass(frozen=True)
class TranscriptInputs:
    """Everything a transcript records. Times are RFC 3339 UTC strings ending in ``Z``."""

    transcript_id: str
    tenant: str
    sequence: int
    previous_digest: str | None
    api: Api
    received_at: str
    completed_at: str
    status: Status
    model: ModelInfo
    runtime: Mapping[str, Any]
    sampling_params: Mapping[str, Any]
    seed: int
    deterministic: bool
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    salt: bytes = field(repr=False)
    finish_reason: str | None
    windows: Sequence[tuple[int, int]]
    window_shape: tuple[int, int]
    logprobs: Sequence[float]
    dvr: DvrStats
    choice: Choice | None = None
    """Set when the request asked for several choices (``n`` > 1)."""
    request_extras: Mapping[str, Any] | None = None
    """Accepted request fields without effect on generation (``metadata``, ``user``, ...)."""

    def __post_init__(self) -> None:
        _validate_inputs(self)


def _validate_inputs(x: TranscriptInputs) -> None:
    uid = uuid.UUID(x.transcript_id)
    if uid.version != 7 or str(uid) != x.transcript_id:
        raise ValueError(f"transcript_id {x.transcript_id!r} is not a canonical UUIDv7 string")
    if not isinstance(x.sequence, int) or x.sequence < 1:
        raise ValueError(f"sequence must be an int >= 1, got {x.sequence!r}")
    if (x.previous_digest is None) != (x.sequence == 1):
        raise ValueError(f"previous_digest must be None exactly when sequence == 1 (sequence {x.sequence}, "
                         f"previous_digest {x.previous_digest!r})")
    if x.previous_digest is not None and not _HEX64.match(x.previous_digest):
        raise ValueError(f"previous_digest must be 64 lower-case hex chars, got {x.previous_digest!r}")
    Api(x.api)
    Status(x.status)
    for name in ("received_at", "completed_at"):
        if not _RFC3339_UTC.match(getattr(x, name)):
            raise ValueError(f"{name} must be RFC 3339 UTC ending in 'Z', got {getattr(x, name)!r}")
    cn.check_salt(x.salt)
    cn.seed_to_str(x.seed)
    cn.check_windows(x.windows, len(x.output_ids))
    if len(x.logprobs) != len(x.output_ids):
        raise ValueError(f"{len(x.logprobs)} logprobs for {len(x.output_ids)} output tokens")
    if x.choice is not None and not 0 <= x.choice.index < x.choice.count:
        raise ValueError(f"choice index {x.choice.index} is outside 0..{x.choice.count - 1}")
    if x.choice is not None and x.choice.request_seed is not None:
        cn.seed_to_str(x.choice.request_seed)
    if "seed" in x.sampling_params and x.sampling_params["seed"] not in (None, x.seed, str(x.seed)):
        raise ValueError(f"sampling_params seed {x.sampling_params['seed']!r} differs from seed {x.seed}")


def build_predicate(x: TranscriptInputs) -> dict[str, Any]:
    """The ``https://verbatim.dev/transcript/v1`` predicate (layout in the module docstring)."""
    g, w = x.window_shape
    request: dict[str, Any] = {"api": Api(x.api).value, "received_at": x.received_at,
                               "completed_at": x.completed_at, "status": Status(x.status).value}
    if x.choice is not None:
        seed = x.choice.request_seed
        request["choice"] = {"index": x.choice.index, "count": x.choice.count,
                             "request_seed": cn.seed_to_str(seed) if seed is not None else None}
    if x.request_extras:
        request["extras"] = dict(x.request_extras)
    return {
        "transcript": {"id": x.transcript_id, "tenant": x.tenant, "sequence": x.sequence,
                       "previous_digest": x.previous_digest},
        "request": request,
        "model": {"name": x.model.name, "weights_digest": x.model.weights_digest,
                  "tokenizer_digest": x.model.tokenizer_digest,
                  "chat_template_digest": x.model.chat_template_digest, "dtype": x.model.dtype},
        "runtime": dict(x.runtime),
        "sampling": {"params": {k: v for k, v in x.sampling_params.items() if k != "seed"},
                     "seed": cn.seed_to_str(x.seed), "deterministic": bool(x.deterministic)},
        "tokens": {"commitment_scheme": COMMITMENT_SCHEME,
                   "prompt_commitment": cn.prompt_commitment(x.salt, x.prompt_ids),
                   "output_commitment": cn.output_commitment(x.salt, x.output_ids),
                   "prompt_count": len(x.prompt_ids), "output_count": len(x.output_ids),
                   "finish_reason": x.finish_reason},
        "windows": {"shape": {"G": g, "W": w}, "spans": [[s, e] for s, e in x.windows],
                    "chain_scheme": CHAIN_SCHEME,
                    "chain_head": cn.window_chain_head(x.salt, x.windows, x.output_ids),
                    "logprob_digest": cn.logprob_digest(x.logprobs)},
        "dvr": {"verify_passes": x.dvr.verify_passes, "rollbacks": x.dvr.rollbacks,
                "recomputed_tokens": x.dvr.recomputed_tokens},
    }


def build_statement(x: TranscriptInputs) -> dict[str, Any]:
    """The in-toto Statement v1 for one transcript."""
    predicate = build_predicate(x)
    tokens = predicate["tokens"]
    return {
        "_type": STATEMENT_TYPE,
        "subject": [
            {"name": f"transcript:{x.transcript_id}/prompt", "digest": {"sha256": tokens["prompt_commitment"]}},
            {"name": f"transcript:{x.transcript_id}/output", "digest": {"sha256": tokens["output_commitment"]}},
        ],
        "predicateType": TRANSCRIPT_PREDICATE,
        "predicate": predicate,
    }


@dataclass(frozen=True)
class SignedStatement:
    """A signed in-toto Statement. Store ``payload`` bytes exactly; ``envelope`` embeds them in base64.

    The digests, and the canonical bytes of ``envelope``, are derived at construction."""

    statement: dict[str, Any]
    payload: bytes
    envelope: dict[str, Any]
    payload_digest: str = field(init=False)
    envelope_bytes: bytes = field(init=False, repr=False)
    """``canonical_json(envelope)``: what is stored, and what ``envelope_digest`` hashes."""
    envelope_digest: str = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload_digest", cn.sha256_hex(self.payload))
        object.__setattr__(self, "envelope_bytes", cn.canonical_json(self.envelope))
        object.__setattr__(self, "envelope_digest", cn.sha256_hex(self.envelope_bytes))

    @classmethod
    def sign(cls, statement: dict[str, Any], keyring: KeyRing, role: KeyRole, **ids: str) -> Self:
        """Serialize ``statement`` canonically and sign it as DSSE with ``role``'s active key."""
        return cls(statement, *sign_statement(statement, keyring, role), **ids)

    @property
    def leaf_data(self) -> bytes:
        """The Merkle log's leaf data: the 32 raw bytes of ``envelope_digest``."""
        return bytes.fromhex(self.envelope_digest)


@dataclass(frozen=True, kw_only=True)
class SignedTranscript(SignedStatement):
    transcript_id: str


def sign_statement(statement: dict[str, Any], keyring: KeyRing, role: KeyRole) -> tuple[bytes, dict[str, Any]]:
    """Serialize ``statement`` canonically and sign it as DSSE with ``role``'s active key."""
    payload = cn.canonical_json(statement)
    return payload, sign_envelope(payload, PAYLOAD_TYPE, keyring.signer(role))


def sign_transcript(x: TranscriptInputs, keyring: KeyRing) -> SignedTranscript:
    """Build, serialize and sign the transcript of ``x`` with the ``transcript`` role key."""
    return SignedTranscript.sign(build_statement(x), keyring, KeyRole.TRANSCRIPT, transcript_id=x.transcript_id)


@dataclass(frozen=True)
class Check:
    """One named verification outcome; ``detail`` says exactly what failed (or what passed)."""

    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class TranscriptVerification:
    checks: list[Check]
    statement: dict[str, Any] | None
    payload_digest: str | None

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


def open_statement(envelope: Mapping[str, Any], jwks: Mapping[str, Any], predicate_type: str,
                   role: KeyRole) -> tuple[bytes, dict[str, Any]]:
    """Verify ``envelope`` (exact payload bytes) and parse its Statement; raises on any failure."""
    payload = verify_envelope(envelope, jwks, payload_type=PAYLOAD_TYPE, role=role)
    statement = _parse_statement(payload)
    if statement.get("_type") != STATEMENT_TYPE or statement.get("predicateType") != predicate_type:
        raise ValueError(f"statement type {statement.get('_type')!r} / predicateType "
                         f"{statement.get('predicateType')!r}, expected {STATEMENT_TYPE!r} / {predicate_type!r}")
    if not isinstance(statement.get("predicate"), dict) or not _subject_digest(statement):
        raise ValueError("statement lacks a predicate object or a subject with a sha256 digest")
    return payload, statement


def _subject_digest(statement: Mapping[str, Any]) -> str | None:
    subjects = statement.get("subject")
    if not isinstance(subjects, list) or not subjects or not isinstance(subjects[0], dict):
        return None
    digest = subjects[0].get("digest")
    value = digest.get("sha256") if isinstance(digest, dict) else None
    return value if isinstance(value, str) else None


def _parse_statement(payload: bytes) -> dict[str, Any]:
    obj = json.loads(payload)
    if not isinstance(obj, dict):
        raise ValueError("payload is not a JSON object")
    if cn.canonical_json(obj) != payload:
        raise ValueError("payload is not in RFC 8785 canonical form")
    return obj


def verify_transcript(
    envelope: Mapping[str, Any],
    jwks: Mapping[str, Any],
    *,
    prompt_ids: Sequence[int] | None = None,
    output_ids: Sequence[int] | None = None,
    salt: bytes | None = None,
    logprobs: Sequence[float] | None = None,
) -> TranscriptVerification:
    """Check signature and structure; with ``salt`` and ids, also commitments and the window chain.

    ``jwks`` is a JWKS document or a parsed ``{kid: VerifierKey}`` mapping. The signature is checked
    over the exact payload bytes in the envelope; the statement is never re-serialized to verify.
    """
    try:
        payload, statement = open_statement(envelope, jwks, TRANSCRIPT_PREDICATE, KeyRole.TRANSCRIPT)
    except Exception as exc:  # noqa: BLE001 - every failure becomes a named check
        return TranscriptVerification([Check("signature", False, f"{type(exc).__name__}: {exc}")], None, None)
    checks = [Check("signature", True, f"signed by {_keyids(envelope)}")]
    checks.append(check_chain_fields(statement))
    checks += check_content(statement, prompt_ids, output_ids, salt, logprobs)
    return TranscriptVerification(checks, statement, cn.sha256_hex(payload))


def _keyids(envelope: Mapping[str, Any]) -> str:
    return ", ".join(str(s.get("keyid")) for s in envelope.get("signatures", []))


def check_chain_fields(statement: Mapping[str, Any]) -> Check:
    """The hash-chain fields: id, tenant, sequence >= 1, previous_digest None iff sequence == 1."""
    t = statement["predicate"].get("transcript")
    if not isinstance(t, dict):
        return Check("hash_chain_fields", False, "predicate.transcript is missing")
    problems = _chain_problems(t)
    if problems:
        return Check("hash_chain_fields", False, "; ".join(problems))
    return Check("hash_chain_fields", True, f"tenant {t['tenant']!r} sequence {t['sequence']} "
                 f"previous {t['previous_digest'] or 'none (first)'}")


def _chain_problems(t: Mapping[str, Any]) -> list[str]:
    problems = [f"{k} missing" for k in ("id", "tenant", "sequence", "previous_digest") if k not in t]
    if problems:
        return problems
    seq, prev = t["sequence"], t["previous_digest"]
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 1:
        problems.append(f"sequence {seq!r} is not an int >= 1")
    elif (prev is None) != (seq == 1):
        problems.append(f"previous_digest {prev!r} inconsistent with sequence {seq}")
    if prev is not None and not (isinstance(prev, str) and _HEX64.match(prev)):
        problems.append(f"previous_digest {prev!r} is not a 64-char hex digest")
    return problems


def check_content(statement: Mapping[str, Any], prompt_ids: Sequence[int] | None,
                  output_ids: Sequence[int] | None, salt: bytes | None,
                  logprobs: Sequence[float] | None) -> list[Check]:
    """Commitment, count, window-chain and logprob checks for whatever content was supplied."""
    pred = statement["predicate"]
    tokens, windows = pred.get("tokens") or {}, pred.get("windows") or {}
    checks: list[Check] = []
    if salt is not None and prompt_ids is not None:
        checks.append(_commitment_check("prompt", tokens, salt, prompt_ids))
    if salt is not None and output_ids is not None:
        checks.append(_commitment_check("output", tokens, salt, output_ids))
        checks.append(_window_chain_check(windows, salt, output_ids))
    if logprobs is not None:
        checks.append(_logprob_check(windows, logprobs))
    return checks


def _logprob_check(windows: Mapping[str, Any], logprobs: Sequence[float]) -> Check:
    try:
        got = cn.logprob_digest(logprobs)
    except (struct.error, TypeError) as exc:
        return Check("logprob_digest", False, f"logprobs are not a list of floats: {exc}")
    want = windows.get("logprob_digest")
    if got != want:
        return Check("logprob_digest", False, f"float32 logprob digest {got} differs from signed {want}")
    return Check("logprob_digest", True, f"{len(logprobs)} logprobs match digest {want}")


def _commitment_check(which: str, tokens: Mapping[str, Any], salt: bytes, ids: Sequence[int]) -> Check:
    name = f"{which}_commitment"
    try:
        got = cn.token_commitment(salt, ids)
    except ValueError as exc:
        return Check(name, False, str(exc))
    want, count = tokens.get(name), tokens.get(f"{which}_count")
    if count != len(ids):
        return Check(name, False, f"{len(ids)} {which} token ids supplied, signed count is {count}")
    if got != want:
        return Check(name, False, f"{which} token ids (or salt) do not match the signed commitment: "
                     f"SHA-256(salt ‖ ids) = {got}, signed {want}")
    return Check(name, True, f"{len(ids)} {which} tokens match commitment {want}")


def _window_chain_check(windows: Mapping[str, Any], salt: bytes, output_ids: Sequence[int]) -> Check:
    try:
        spans = [(int(s), int(e)) for s, e in windows["spans"]]
        chain = cn.window_chain(salt, spans, output_ids)
    except (KeyError, TypeError, ValueError) as exc:
        return Check("window_chain", False, f"cannot recompute the window chain: {exc}")
    head = chain[-1] if chain else cn.window_chain_head(salt, [], output_ids)
    if head != windows.get("chain_head"):
        return Check("window_chain", False, f"window chain over {len(spans)} windows gives head {head}, "
                     f"signed {windows.get('chain_head')}")
    return Check("window_chain", True, f"{len(spans)} windows chain to {head}")
