"""Applying a verify pass: every window's samples against its row, in pass order, then the KV past what is kept
released (DESIGN §2).

    for each row of the pass, in order:
        TEACHER   record (replay) or check (rebuild) the predictions             apply_teacher
        DVR       window 0, or a window j >= 1 whose windows 0 .. j-1 of this
                  pass committed in full (window_applies): commit the matching
                  candidates and the verifier's token, roll back the rest         apply_dvr
    then, per sequence: its block table truncated to kv_len                     release_kv

A rollback is bookkeeping: `kv_len` is lowered, and only once every row is applied are the blocks past it
released (a later window of the same row wrote its canonical K/V past the earlier window's kv_len).
"""
from __future__ import annotations

from engine.block_manager import BlockManager
from engine.sampling import SampleResult
from engine.scheduler import seq_key
from engine.verifier import CommitFn, RowKind, VerifyRow, apply_dvr, apply_teacher, window_applies


def apply_pass(rows: list[VerifyRow], samples: list[SampleResult], commit: CommitFn) -> tuple[int, int]:
    """Apply the pass's samples (row r's num_outputs of them, rows back to back, in row order); returns the
    pass's (rollbacks, recomputed tokens)."""
    rollbacks = recomputed = 0
    at = 0
    for row in rows:
        seq = row.seq
        n = row.num_outputs
        got, at = samples[at:at + n], at + n
        if row.kind == RowKind.TEACHER:
            apply_teacher(row, got)
        elif row.index and not window_applies(row):
            continue  # a later window of a row whose earlier window in this pass rolled back or finished it
        else:
            before = seq.rollbacks, seq.recomputed_tokens
            apply_dvr(row, got, commit)
            rollbacks += seq.rollbacks - before[0]
            recomputed += seq.recomputed_tokens - before[1]
        seq.ready_since = None
    assert at == len(samples), (at, len(samples))
    return rollbacks, recomputed


def release_kv(rows: list[VerifyRow], blocks: BlockManager) -> None:
    """Free the KV past what each DVR row of the applied pass keeps. Only now: a later window of the same row in
    the pass wrote its canonical K/V past the earlier window's kv_len, and applying it keeps those positions."""
    for seq in dict.fromkeys(r.seq for r in rows if r.kind == RowKind.DVR):
        if seq.inflight and seq.kv_len != seq.num_tokens - 1:
            # an early step decoded past run-ahead candidates that this pass rolled back: void token
            # (apply_dvr reset kv_len without its slot); the settle drops it
            seq.stale_inflight = seq.inflight
        blocks.truncate(seq_key(seq), seq.kv_len)
