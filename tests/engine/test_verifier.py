"""Compare / commit / rollback rules (DESIGN §2) on hand-made rows: exact m, bonus token, finish
conditions judged on committed tokens only."""
from __future__ import annotations

from engine.sampling import SampleResult, SamplingParams
from engine.sequence import FinishReason, Sequence, SeqKind, SeqStatus
from engine.verifier import apply_dvr, dvr_row, first_mismatch

EOS = 1
W = 8  # max candidates per window: W - 1


def _seq(tokens: list[int], candidates: list[int], max_tokens: int = 50) -> Sequence:
    seq = Sequence("r", [9, 9, 9], SamplingParams(max_tokens=max_tokens, deterministic=True), 0, SeqKind.DVR, 1,
                   status=SeqStatus.RUNNING, tokens=list(tokens), logprobs=[-0.5] * len(tokens),
                   candidates=list(candidates))
    seq.kv_len = 3 + len(tokens) - 1 + len(candidates)
    return seq


def _commit(seq: Sequence, token: int, res: SampleResult) -> bool:
    seq.tokens.append(token)
    seq.logprobs.append(res.logprob)
    if token == EOS or len(seq.tokens) >= seq.params.max_tokens:
        seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.STOP
        return True
    return False


def _verified(tokens: list[int]) -> list[SampleResult]:
    return [SampleResult(t, -float(i + 1), None) for i, t in enumerate(tokens)]


def test_first_mismatch() -> None:
    assert first_mismatch([4, 5, 6], [4, 5, 6]) == 4
    assert first_mismatch([4, 5, 6], [4, 7, 6]) == 2
    assert first_mismatch([4, 5, 6], [0, 5, 6]) == 1


def test_rollback_commits_prefix_and_verifier_token() -> None:
    seq = _seq([10], [4, 5, 6])
    row = dvr_row(seq, W)
    assert row.tokens == [10, 4, 5, 6] and row.start_pos == 3
    m = apply_dvr(row, _verified([4, 8, 2, 3]), _commit)
    assert m == 2 and seq.tokens == [10, 4, 8] and seq.candidates == []
    assert seq.logprobs[1:] == [-1.0, -2.0]  # the verifier's logprobs
    assert seq.windows == [(1, 3)] and seq.rollbacks == 1 and seq.recomputed_tokens == 2
    assert seq.kv_len == 3 + 3 - 1  # canonical KV: the last committed token and candidate 1


def test_all_match_adds_bonus_token() -> None:
    seq = _seq([10, 11], [4, 5, 6])
    m = apply_dvr(dvr_row(seq, W), _verified([4, 5, 6, 7]), _commit)
    assert m == 4 and seq.tokens == [10, 11, 4, 5, 6, 7] and seq.windows == [(2, 6)] and seq.rollbacks == 0
    assert seq.kv_len == 3 + 6 - 1


def test_rolled_back_eos_does_not_finish() -> None:
    seq = _seq([10], [4, EOS, 6])
    apply_dvr(dvr_row(seq, W), _verified([4, 5, 6, 7]), _commit)
    assert seq.tokens == [10, 4, 5] and seq.status == SeqStatus.RUNNING


def test_committed_eos_finishes_and_drops_the_rest() -> None:
    seq = _seq([10], [4, EOS, 6])
    apply_dvr(dvr_row(seq, W), _verified([4, EOS, 6, 7]), _commit)
    assert seq.tokens == [10, 4, EOS] and seq.is_finished and seq.windows == [(1, 3)]


def test_bonus_past_max_tokens_is_dropped() -> None:
    seq = _seq([10], [4, 5], max_tokens=3)
    apply_dvr(dvr_row(seq, W), _verified([4, 5, 6]), _commit)
    assert seq.tokens == [10, 4, 5] and seq.is_finished and seq.windows == [(1, 3)]


def test_every_pass_commits_at_least_one_token() -> None:
    seq = _seq([10], [4, 5, 6, 7])
    apply_dvr(dvr_row(seq, W), _verified([0, 0, 0, 0, 0]), _commit)
    assert seq.tokens == [10, 0] and seq.windows == [(1, 2)] and seq.recomputed_tokens == 4


def test_run_ahead_candidates_survive_when_the_bonus_is_theirs() -> None:
    seq = _seq([10], [4, 5, 6, 7, 8])          # window of 4 holds 3 candidates; 7, 8 ran ahead
    row = dvr_row(seq, 4)
    assert row.tokens == [10, 4, 5, 6]
    kv = seq.kv_len
    m = apply_dvr(row, _verified([4, 5, 6, 7]), _commit)
    assert m == 4 and seq.tokens == [10, 4, 5, 6, 7] and seq.candidates == [8]
    assert seq.rollbacks == 0 and seq.recomputed_tokens == 0 and seq.kv_len == kv  # 8's fast-path KV stays
    assert seq.kv_len == 3 + len(seq.tokens) - 1 + len(seq.candidates)


def test_run_ahead_candidates_roll_back_with_a_different_bonus() -> None:
    seq = _seq([10], [4, 5, 6, 7, 8])
    apply_dvr(dvr_row(seq, 4), _verified([4, 5, 6, 9]), _commit)
    assert seq.tokens == [10, 4, 5, 6, 9] and seq.candidates == []
    assert seq.rollbacks == 1 and seq.recomputed_tokens == 2 and seq.kv_len == 3 + 5 - 1


def test_mismatch_in_the_window_drops_the_run_ahead_too() -> None:
    seq = _seq([10], [4, 5, 6, 7, 8])
    apply_dvr(dvr_row(seq, 4), _verified([4, 0, 6, 7]), _commit)
    assert seq.tokens == [10, 4, 0] and seq.candidates == [] and seq.recomputed_tokens == 2 + 2
