"""Verify passes: rows of exactly W tokens, G rows per pass; compare / commit / rollback (DESIGN §2).

A DVR row is [last committed token, candidate 1 .. candidate k] (k <= W-1) at positions
L+s-1 .. L+s-1+k, where s = number of committed outputs; its outputs v_1 .. v_{k+1} are the verifier's
tokens for output slots s .. s+k. A teacher row (preemption rebuild, replay) for recorded window
(s, e) is tokens[s-1 : e-1] at positions L+s-1 .. L+e-2 and predicts tokens[s:e]. The runner pads every
row with dummy tokens up to W and the pass with dummy rows up to G.

Several windows of one DVR row in one pass (run-ahead): window j of a row with candidates c_1 .. c_N is
[c_{jW}, c_{jW+1} .. c_{jW+W-1}] at positions L+s-1+jW .. — the row as it will stand once windows
0 .. j-1 committed in full (c_{jW} in window j-1's bonus slot). Every G x W pass first writes all of its
K/V into the cache, then each query reduces over the cache in the fixed block order, so window j reads
window j-1's canonical K/V from the same pass and gets the bits a later pass would give it. It is applied
only if windows 0 .. j-1 did commit in full (`window_applies`); otherwise its outputs are discarded (its
candidates were already counted as rolled back).
"""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine.sequence import FinishReason, Sequence, SeqKind, SeqStatus

if TYPE_CHECKING:
    from engine.sampling import SampleResult


CommitFn = Callable[[Sequence, int, "SampleResult"], bool]
"""commit(seq, token, sample) -> finished; finish conditions are judged on committed tokens only."""


class RowKind(enum.Enum):
    DVR = "dvr"          # candidates from the fast path: compare, commit, roll back
    TEACHER = "teacher"  # recorded tokens, teacher-forced: predict and check / report


@dataclass(frozen=True)
class VerifyRow:
    seq: Sequence
    kind: RowKind
    tokens: list[int]                  # real input tokens, 1 <= len <= W
    start_pos: int                     # absolute position of tokens[0]
    window: tuple[int, int] | None     # TEACHER: the recorded (start, end) it re-executes
    index: int = 0                     # DVR: which window of the row's candidates (0 = the next one)
    inflight_input: bool = False       # DVR: its last input is the sequence's token in flight (INFLIGHT_INPUT
    #                                    on the host until read; the pass takes the id on the device)

    @property
    def num_outputs(self) -> int:
        """Logit rows that are meaningful: DVR k+1 (all inputs), TEACHER e-s."""
        return len(self.tokens)


INFLIGHT_INPUT = 0  # the host's placeholder for a row input still in flight (its id is patched on the device)


def dvr_row(seq: Sequence, window: int, index: int = 0, inflight: bool = False) -> VerifyRow:
    """Window `index` of a DVR row. Window 0: [last committed token, the first k candidates],
    k = min(#candidates, max_candidates(W)). Window j >= 1: [c_{jW}, the next k candidates], the row as
    it stands once windows 0 .. j-1 committed in full (see the module doc). Candidates past the last
    window taken stay for a later pass.

    `inflight` (a chained verify pass, planned before the decode step before it is read): the row's token
    in flight counts as its next candidate; where a window ends at it, its input is INFLIGHT_INPUT
    (`VerifyRow.inflight_input`) and the engine takes the id from the device, then writes the value in once
    it is read (`engine.inflight.fill_inflight_input`)."""
    s = len(seq.tokens)
    assert seq.inflight <= 1, (seq.request_id, seq.inflight)
    known = len(seq.candidates)
    n = known + (seq.inflight if inflight else 0)
    assert s >= 1 and n, (seq.request_id, s, known)
    # a token in flight (a chained verify pass is planned before the step before it is read) holds its slot
    assert seq.kv_len == seq.prompt_len + s - 1 + known + seq.inflight, "fast path KV counter drift"
    cands = seq.candidates if n == known else [*seq.candidates, INFLIGHT_INPUT]
    if index == 0:
        k = min(n, seq.max_candidates(window))
        return VerifyRow(seq, RowKind.DVR, [seq.tokens[-1], *cands[:k]], seq.prompt_len + s - 1, None,
                         inflight_input=k > known)
    first = index * window  # candidates before this window: windows 0 .. j-1 and their bonus slots
    k = min(n - first, window - 1, seq.params.max_tokens - s - first)
    assert k >= 1, (seq.request_id, index, known)
    return VerifyRow(seq, RowKind.DVR, cands[first - 1: first + k], seq.prompt_len + s - 1 + first, None, index,
                     inflight_input=first + k > known)


def window_applies(row: VerifyRow) -> bool:
    """A DVR row's window may be applied now: the sequence stands where the row was built for (for a
    window j >= 1: windows 0 .. j-1 of this pass committed in full, the bonus equal to its first input)."""
    seq = row.seq
    if seq.is_finished or not seq.tokens:
        return False
    k = len(row.tokens) - 1
    return (row.start_pos == seq.prompt_len + len(seq.tokens) - 1 and seq.tokens[-1] == row.tokens[0]
            and seq.candidates[:k] == row.tokens[1:])


def teacher_row(seq: Sequence) -> VerifyRow:
    s, e = seq.pending_windows[0]
    assert seq.kv_len == seq.prompt_len + s - 1, ("teacher window out of order", seq.request_id, s, seq.kv_len)
    return VerifyRow(seq, RowKind.TEACHER, seq.tokens[s - 1 : e - 1], seq.prompt_len + s - 1, (s, e))


def first_mismatch(candidates: list[int], verified: list[int]) -> int:
    """m (1-based): first i with verified[i-1] != candidates[i-1]; k+1 when all k candidates match."""
    for i, (c, v) in enumerate(zip(candidates, verified), start=1):
        if c != v:
            return i
    return len(candidates) + 1


def apply_dvr(row: VerifyRow, samples: list[SampleResult], commit: CommitFn) -> int:
    """Commit candidates 1..m-1 and v_m (bonus when all k match); roll back the rest. Returns m.

    Candidates past the window (run-ahead) survive only when all k matched and the first of them equals
    the bonus v_{k+1} (it sits in the bonus slot): then the bonus is it, and the others stay candidates,
    their fast-path KV kept (the next verify row rewrites it). Otherwise they are rolled back too.
    """
    seq = row.seq
    k = len(row.tokens) - 1
    assert len(samples) == k + 1, (len(samples), k)
    m = first_mismatch(seq.candidates[:k], [r.token for r in samples[:k]])
    start = len(seq.tokens)
    accepted = seq.candidates[: m - 1] + [samples[m - 1].token]
    extra = seq.candidates[k:]
    keep = m == k + 1 and bool(extra) and extra[0] == samples[k].token
    remaining = extra[1:] if keep else []
    dropped = (k - (m - 1)) + (0 if keep else len(extra))
    seq.candidates.clear()
    if dropped:
        seq.rollbacks += 1
        seq.recomputed_tokens += dropped
    seq.verify_passes += 1
    for tok, res in zip(accepted, samples[:m]):
        assert res.token == tok, "committed tokens are the verifier's"
        if commit(seq, tok, res):
            break
    end = len(seq.tokens)
    assert end > start, "a verify pass must commit at least one token"
    seq.windows.append((start, end))
    speculated = 0
    if keep and not seq.is_finished:  # the surviving run-ahead candidates keep their fast-path KV
        seq.candidates.extend(remaining)
        speculated = seq.inflight  # a decode token launched past them before this pass was read stays valid
    else:  # canonical KV now covers the row inputs that are committed: last token + candidates 1..m-1
        seq.kv_len = row.start_pos + m  # (a token in flight past them, if any, is void: the engine drops it)
    kept = seq.prompt_len + len(seq.tokens) - 1 + len(seq.candidates) + speculated
    assert seq.is_finished or seq.kv_len == kept, (seq.kv_len, len(seq.tokens), len(seq.candidates), seq.inflight)
    return m


def apply_teacher(row: VerifyRow, samples: list[SampleResult]) -> None:
    """Record (replay) or check (rebuild) the verifier's predictions for one recorded window."""
    seq = row.seq
    assert row.window is not None and seq.pending_windows[0] == row.window
    s, e = seq.pending_windows.popleft()
    assert len(samples) == e - s
    if seq.kind == SeqKind.REPLAY:
        assert seq.replay is not None
        seq.replay.predicted.extend(r.token for r in samples)
        seq.replay.logprobs.extend(r.logprob for r in samples)
    else:
        got = [r.token for r in samples]
        assert got == seq.tokens[s:e], (
            f"rebuild of {seq.request_id} window {(s, e)} diverged: {got} != {seq.tokens[s:e]}")
        assert [r.logprob for r in samples] == seq.logprobs[s:e], f"rebuild logprobs of {seq.request_id} diverged"
    seq.kv_len = seq.prompt_len + e - 1
    if seq.kind == SeqKind.REPLAY and not seq.pending_windows:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = FinishReason.STOP
