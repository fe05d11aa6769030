"""In-flight steps (engine overlap): launched passes whose samples stay on the device until the host needs them.

A decode step's sampled tokens are not read at once: the next pass is planned and launched first, its input
ids copied from them device to device (`decode_chain`; a verify pass: `VerifyChain`), and only then is the
step read and applied (`settle_decode`). A prefill pass's first tokens wait the same way for the next
prefill pass (`settle_prefill`).

    step N:    launch decode N ......................................... (GPU runs N)
    step N+1:  plan N+1 | launch N+1 (ids <- tokens of N) | settle N      (GPU runs N+1)

Each in-flight token already holds its KV slot (`Sequence.inflight` counts them, `kv_len` includes them); a
token that a verify pass made void (`Sequence.stale_inflight`) is dropped when its step is settled.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from engine.model_runner import Chain
from engine.sampling import PendingSamples, SampleResult
from engine.scheduler import PrefillItem
from engine.sequence import Sequence, SeqKind, SeqStatus
from engine.verifier import CommitFn, VerifyRow


@dataclass
class InflightDecode:
    """A launched decode step whose samples have not been applied to its sequences yet."""

    seqs: list[Sequence]
    samples: PendingSamples
    row_of: dict[str, int]   # seq key -> its row in this step (the next step's input ids come from there)


@dataclass
class InflightPrefill:
    """A launched prefill pass whose first-token samples have not been applied yet (engine overlap)."""

    items: list[PrefillItem]   # the pass's rows that sample, in the samples' order
    samples: PendingSamples


def decode_chain(prev: InflightDecode | None, seqs: list[Sequence]) -> Chain | None:
    """(tokens, dst, src): row dst[i] of a step of `seqs` takes its input id from row src[i] of the step in
    flight, on the device (the rows whose last token is that step's); None when no step is in flight."""
    if prev is None:
        return None
    dst = [j for j, s in enumerate(seqs) if s.inflight]
    return prev.samples.tokens, dst, [prev.row_of[seqs[j].key] for j in dst]


@dataclass(frozen=True)
class VerifyChain:
    """A verify pass's inputs that come from the decode step in flight (a chained pass, planned before that
    step is read): the carried rows' input ids (`decode`), and the windows that end at a token in flight
    (`rows` = [(verify row, its row in the step)], the windows themselves in `inputs`)."""

    decode: Chain | None = None
    rows: list[tuple[int, int]] | None = None
    inputs: list[VerifyRow] = field(default_factory=list)

    @classmethod
    def of(cls, prev: InflightDecode | None, carried: list[Sequence], rows: list[VerifyRow]) -> VerifyChain:
        if prev is None:
            return cls()
        row_chain = [(i, prev.row_of[r.seq.key]) for i, r in enumerate(rows) if r.inflight_input]
        return cls(decode_chain(prev, carried), row_chain, [rows[i] for i, _ in row_chain])

    def fill_inputs(self) -> None:
        """Once the step in flight is read: write its tokens into the windows that took them on the device."""
        for row in self.inputs:
            fill_inflight_input(row)


def fill_inflight_input(row: VerifyRow) -> None:
    """Once the token in flight is read (a candidate now), write it into the row's last input (the pass already
    took it from the device), so that applying the row compares against what the pass ran."""
    seq, known = row.seq, len(row.seq.candidates)
    last = row.start_pos + len(row.tokens) - 1 - (seq.prompt_len + len(seq.tokens))  # its 0-based candidate index
    assert row.inflight_input and last < known, ("a pass input in flight was not read as a candidate", seq.request_id)
    row.tokens[-1] = seq.candidates[last]


def needs_prefix(seqs: list[Sequence]) -> bool:
    """Some row of a step is processed and its previous token is still in flight (its prefix is not known)."""
    return any(s.params.processed and s.inflight for s in seqs)


def settle_decode(step: InflightDecode | None, commit: CommitFn, add_candidate: Callable[[Sequence, int], None],
                  eos_ids: set[int]) -> list[Sequence]:
    """Apply a decode step's samples (waits for them): commit (non-deterministic rows) or append candidates
    (DVR rows, `add_candidate`). Rows that finished or were aborted meanwhile drop theirs, and so does a DVR
    row whose previous candidate is a stop token (it decoded one step past it). Returns the rows committed to."""
    if step is None:
        return []
    touched = []
    for seq, res in zip(step.seqs, step.samples.results()):
        seq.inflight -= 1
        if seq.status != SeqStatus.RUNNING:
            continue
        if seq.stale_inflight:  # decoded past candidates a verify pass rolled back: void
            seq.stale_inflight -= 1
            continue
        if seq.kind == SeqKind.FAST:
            commit(seq, res.token, res)
            touched.append(seq)
        elif seq.candidates and seq.params.is_stop_token(seq.candidates[-1], eos_ids):
            seq.kv_len -= 1
        else:
            add_candidate(seq, res.token)
    return touched


def settle_prefill(held: InflightPrefill | None, after_prefill: Callable[[Sequence, SampleResult], None]
                   ) -> list[Sequence]:
    """Apply a prefill pass's first tokens (waits for them); rows aborted meanwhile drop theirs."""
    if held is None:
        return []
    touched = []
    for it, res in zip(held.items, held.samples.results(), strict=True):
        if it.seq.status == SeqStatus.RUNNING:
            after_prefill(it.seq, res)
            touched.append(it.seq)
    return touched
