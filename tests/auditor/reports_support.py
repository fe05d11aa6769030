"""Signed test transcripts, a Merkle log and replay attestations made with the real crypto library."""

from __future__ import annotations

import datetime as dt
import uuid
from dataclasses import dataclass, field

from auditor.attestation import ReplayAttestationInputs, ReplayVerdict, sign_replay_attestation
from auditor.checkpoint import Checkpoint, sign_checkpoint
from auditor.crypto import KeyRing, KeyRole
from auditor.merkle import ConsistencyProof, InclusionProof, MerkleTree
from auditor.reports import (
    AccessEntry,
    BundleInputs,
    LogEvidence,
    ReplayEntry,
    ReportFilters,
    TranscriptContent,
    TranscriptEntry,
)
from auditor.transcript import (
    Api,
    DvrStats,
    ModelInfo,
    SignedTranscript,
    Status,
    TranscriptInputs,
    sign_transcript,
    uuid7,
)

ORIGIN = "verbatim.test/log"
T0 = dt.datetime(2026, 11, 20, 9, 0, tzinfo=dt.UTC)
MODEL = ModelInfo("smollm2-135m-instruct", "a" * 64, "b" * 64, "c" * 64, "float32")
RUNTIME = {"engine_version": "0.1.0", "device": "cpu", "mode": "dvr", "W": 8, "G": 4, "threads": 2}


def _iso(t: dt.datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


@dataclass
class Made:
    signed: SignedTranscript
    content: TranscriptContent
    log_index: int


@dataclass
class SampleLog:
    """A log holding transcripts of two tenants, and replay attestations."""

    keyring: KeyRing
    tree: MerkleTree = field(default_factory=MerkleTree)
    transcripts: dict[str, list[Made]] = field(default_factory=dict)
    replays: list[ReplayEntry] = field(default_factory=list)
    checkpoints: dict[int, str] = field(default_factory=dict)

    def add_transcript(self, tenant: str, k: int, *, deterministic: bool = True) -> Made:
        chain = self.transcripts.setdefault(tenant, [])
        received = T0 + dt.timedelta(hours=5 * k)
        prompt, output = [1, 2, 3 + k], [10 + i for i in range(9)]
        salt = bytes([k + 1]) * 32
        x = TranscriptInputs(
            transcript_id=str(uuid7(int(received.timestamp() * 1000) + len(chain))), tenant=tenant,
            sequence=len(chain) + 1, previous_digest=chain[-1].signed.payload_digest if chain else None,
            api=Api.COMPLETIONS, received_at=_iso(received), completed_at=_iso(received + dt.timedelta(seconds=2)),
            status=Status.COMPLETED, model=MODEL, runtime=RUNTIME,
            sampling_params={"max_tokens": 9, "temperature": 0.7, "top_p": 1.0, "top_k": 0},
            seed=2**63 + k, deterministic=deterministic, prompt_ids=prompt, output_ids=output, salt=salt,
            finish_reason="length", windows=[(1, 5), (5, 9)] if deterministic else [], window_shape=(4, 8),
            logprobs=[-0.5] * len(output),
            dvr=DvrStats(2 + k % 2, k % 2, 3 * (k % 2)) if deterministic else DvrStats(0, 0, 0),
        )
        signed = sign_transcript(x, self.keyring)
        made = Made(signed, TranscriptContent(salt, prompt, output, [-0.5] * len(output),
                                              f"prompt {k} <b>secret</b>", f"output {k} text"),
                    self.tree.append(signed.leaf_data))
        chain.append(made)
        return made

    def add_replay(self, made: Made, verdict: ReplayVerdict = ReplayVerdict.MATCH) -> ReplayEntry:
        replay_id = str(uuid.uuid4())
        details = {} if verdict is ReplayVerdict.MATCH else {"window_index": 0, "position": 2, "expected_token": 12,
                                                             "replayed_token": 99}
        att = sign_replay_attestation(ReplayAttestationInputs(
            replay_id, made.signed.transcript_id, made.signed.payload_digest, verdict, _iso(T0 + dt.timedelta(days=3)),
            RUNTIME, "fp_000000000000", details), self.keyring)
        entry = ReplayEntry(replay_id, made.signed.transcript_id, "done", verdict.value, {"verdict": verdict.value},
                            "key_auditor", T0 + dt.timedelta(days=3), T0 + dt.timedelta(days=3, seconds=1),
                            att.envelope, self.tree.append(att.leaf_data))
        self.replays.append(entry)
        return entry

    def checkpoint(self) -> int:
        size = self.tree.size
        self.checkpoints[size] = sign_checkpoint(Checkpoint(ORIGIN, size, self.tree.root(size)),
                                                 self.keyring.signer(KeyRole.CHECKPOINT))
        return size

    def inputs(self, filters: ReportFilters, start_size: int, *, access: list[AccessEntry] | None = None) -> BundleInputs:
        """The bundle inputs the exporter gathers: the selected transcripts (scope ``report``), the
        tenant's others in their sequence span and the one before (``chain``), the replays of the
        selected ones and those attested in the period (with their transcripts, ``replayed``)."""
        end_size = self.checkpoint()
        chain = self.transcripts.get(filters.tenant, [])
        selected = [m for m in chain if self._selected(m, filters)]
        sequences = [chain.index(m) + 1 for m in selected]
        span = range(min(sequences) - 1, max(sequences) + 1) if sequences else range(0)
        scopes = {m.signed.transcript_id: "report" for m in selected}
        for k, m in enumerate(chain, start=1):
            if k in span and m.signed.transcript_id not in scopes:
                scopes[m.signed.transcript_id] = "chain"
        replays = [r for r in self.replays if r.transcript_id in scopes and scopes[r.transcript_id] == "report"
                   or self._attested_in(r, filters) and r.transcript_id in {m.signed.transcript_id for m in chain}]
        for r in replays:
            scopes.setdefault(r.transcript_id, "replayed")
        entries = [TranscriptEntry(m.signed.envelope, m.log_index, self._proof(m.log_index, end_size),
                                   m.content if scopes[m.signed.transcript_id] == "report" else None,
                                   scopes[m.signed.transcript_id], m.signed.transcript_id)
                   for m in chain if m.signed.transcript_id in scopes]
        replays = [ReplayEntry(**{**r.__dict__, "inclusion_proof": self._proof(r.log_index, end_size)}) for r in replays]
        consistency = ConsistencyProof(start_size, end_size, tuple(self.tree.consistency_proof(start_size, end_size)))
        return BundleInputs(
            report_id=str(uuid.uuid4()), filters=filters, transcripts=entries, replays=replays,
            access_log=access if access is not None else [
                AccessEntry(T0 + dt.timedelta(days=4), "key_auditor", filters.tenant, "export", "report")],
            log=LogEvidence(self.checkpoints[start_size], self.checkpoints[end_size], consistency),
            jwks=self.keyring.jwks(), generator_version="0.1.0-test", created_at=T0 + dt.timedelta(days=5))

    def _proof(self, index: int, size: int) -> InclusionProof:
        return InclusionProof(index, size, tuple(self.tree.inclusion_proof(index, size)))

    @staticmethod
    def _selected(made: Made, filters: ReportFilters) -> bool:
        st = made.signed.statement["predicate"]
        received = st["request"]["received_at"]
        return not (filters.since and received < _iso(filters.since) or filters.until and received >= _iso(filters.until)
                    or filters.deterministic_only and not st["sampling"]["deterministic"])

    @staticmethod
    def _attested_in(replay: ReplayEntry, filters: ReportFilters) -> bool:
        if not (filters.since or filters.until) or replay.finished_at is None:
            return False
        return not (filters.since and replay.finished_at < filters.since or
                    filters.until and replay.finished_at >= filters.until)


def sample_log(key_dir: str, per_tenant: int = 5) -> tuple[SampleLog, int]:
    """Tenants ``acme`` and ``globex`` interleaved; a checkpoint after the first two; replays of acme's."""
    log = SampleLog(KeyRing.open(key_dir))
    log.add_transcript("acme", 0)
    log.add_transcript("globex", 0)
    start = log.checkpoint()
    for k in range(1, per_tenant):
        log.add_transcript("acme", k, deterministic=k != 3)
        log.add_transcript("globex", k)
    acme = log.transcripts["acme"]
    log.add_replay(acme[1])
    log.add_replay(acme[2], ReplayVerdict.MISMATCH)
    return log, start
