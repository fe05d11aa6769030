"""Several windows of one DVR row in one verify pass (run-ahead past the window, `dvr_lookahead`).

A row that decoded ahead while it waited holds candidates for more than one window; the pass takes them
as consecutive rows of its G x W shape (window j's first input is window j-1's bonus slot). Committed bits
must not change with the lookahead (any window split gives the same bits), a later window must be dropped
when an earlier one rolls back, and with a clean fast path the passes get fewer and fuller.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.config import DvrTuning
from engine.sampling import SamplingParams
from engine.scheduler import StepKind, dvr_windows
from engine.sequence import Sequence, SeqKind, SeqStatus
from engine.verifier import dvr_row, window_applies
from tests.engine.configs import resolved
from tests.engine.dvr_cases import (assert_same, assert_windows_cover, det_workload, one_at_a_time,
                                    replay_requests, staggered)

VOCAB = 64
W, G = 8, 4
EOS = 1


@pytest.fixture
def workload():
    prompts, params = det_workload(16, VOCAB, max_tokens=(20, 60), seed=11)
    return prompts, params


def _seq(candidates: list[int], committed: int = 3, max_tokens: int = 100, stop: list[int] | None = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, seed=1, deterministic=True, ignore_eos=True,
                            stop_token_ids=stop or [])
    seq = Sequence("r", [9, 9, 9, 9], params, 1, SeqKind.DVR, 0, status=SeqStatus.RUNNING)
    seq.tokens = [20 + i for i in range(committed)]
    seq.candidates = list(candidates)
    seq.kv_len = seq.prompt_len + committed - 1 + len(candidates)
    return seq


def test_window_count_follows_the_candidates() -> None:
    full = W - 1  # candidates of window 0; window j >= 1 takes its input from window j-1's bonus slot
    assert dvr_windows(_seq(list(range(30, 30 + full - 1))), W, {EOS}, G) == 0
    assert dvr_windows(_seq(list(range(30, 30 + full))), W, {EOS}, G) == 1
    assert dvr_windows(_seq(list(range(30, 30 + full + W - 1))), W, {EOS}, G) == 1   # window 1 one short
    assert dvr_windows(_seq(list(range(30, 30 + full + W))), W, {EOS}, G) == 2
    assert dvr_windows(_seq(list(range(30, 30 + 10 * W))), W, {EOS}, G) == G       # capped by the pass
    # a stop candidate ends the last window early
    assert dvr_windows(_seq([*range(30, 30 + full + 3), 5], stop=[5]), W, {EOS}, G) == 2
    # max_tokens: 3 committed, 10 allowed -> window 0 takes 7, window 1 would commit past max_tokens
    assert dvr_windows(_seq(list(range(30, 30 + full)), max_tokens=10), W, {EOS}, G) == 1
    assert dvr_windows(_seq(list(range(30, 30 + full + 2)), max_tokens=12), W, {EOS}, G) == 2


def test_later_window_rows_are_the_row_after_earlier_windows_commit() -> None:
    cands = list(range(30, 30 + 2 * W + 3))
    seq = _seq(cands)
    w0, w1, w2 = (dvr_row(seq, W, j) for j in range(3))
    assert w0.tokens == [seq.tokens[-1], *cands[: W - 1]] and w0.start_pos == seq.prompt_len + 2
    assert w1.tokens == cands[W - 1: 2 * W - 1] and w1.start_pos == w0.start_pos + W and w1.index == 1
    assert w2.tokens == cands[2 * W - 1: 2 * W + 3] and w2.start_pos == w1.start_pos + W
    assert not window_applies(w1)  # windows 0 has not committed yet
    seq.tokens += cands[:W]        # window 0 committed in full, its bonus equal to the candidate
    seq.candidates = cands[W:]
    assert window_applies(w1)
    seq.candidates = []            # ... or it rolled back
    assert not window_applies(w1)


def _verify_plans(llm: Any) -> list[list[tuple[str, int]]]:
    plans: list[list[tuple[str, int]]] = []
    sched = llm.core.scheduler
    original = sched.schedule

    def schedule() -> Any:
        plan = original()
        if plan.kind == StepKind.VERIFY:
            plans.append([(row.seq.request_id, row.index) for row in plan.verify])
        return plan

    sched.schedule = schedule  # type: ignore[method-assign]
    return plans


def test_default_lookahead_lets_one_row_fill_a_pass_with_canonical_rows() -> None:
    assert resolved(device="cpu", window=W, group=G,
                    tuning=DvrTuning(dvr_decode_attention="canonical")).tuning.dvr_lookahead == (G - 1) * W
    assert resolved(device="cpu", window=W, group=G,
                    tuning=DvrTuning(dvr_decode_attention="split")).tuning.dvr_lookahead == W - 1
    assert resolved(device="cpu", window=W, group=G,
                    tuning=DvrTuning(dvr_decode_attention="canonical_step")).tuning.dvr_lookahead == (G - 1) * W
    assert resolved(device="cpu", window=W, group=G, tuning=DvrTuning(dvr_lookahead=3)).tuning.dvr_lookahead == 3


@pytest.mark.parametrize("noise", [0.0, 0.3])
def test_lookahead_changes_passes_not_bits(make_mock_llm, workload, noise: float) -> None:
    """Clean fast path (noise 0) and noisy one (rollbacks): lookahead 0, W-1 and (G-1)*W commit the same
    bits, alone, batched and staggered."""
    prompts, params = workload
    ref = one_at_a_time(make_mock_llm(decode_noise=noise, dvr_lookahead=0), prompts, params)
    for lookahead in (W - 1, (G - 1) * W, 5 * W):
        llm = make_mock_llm(decode_noise=noise, dvr_lookahead=lookahead)
        assert_same(ref, llm.generate(prompts, params))
        assert_same(ref, staggered(make_mock_llm(decode_noise=noise, dvr_lookahead=lookahead, max_num_seqs=6),
                                   prompts, params, seed=lookahead))
    for o in ref:
        assert_windows_cover(o, W)


def test_clean_fast_path_fills_passes_with_several_windows_of_a_row(make_mock_llm, workload) -> None:
    """Verify cadence off: two rows are a small batch, which it would verify before they run ahead."""
    prompts, params = workload
    one = make_mock_llm(decode_noise=0.0, dvr_lookahead=W - 1, verify_cadence_steps=0)
    many = make_mock_llm(decode_noise=0.0, dvr_lookahead=(G - 1) * W, verify_cadence_steps=0)
    plans = _verify_plans(many)
    a, b = one.generate(prompts[:2], params[:2]), many.generate(prompts[:2], params[:2])
    assert_same(a, b)
    assert sum(o.rollbacks for o in b) == 0
    assert any(len({rid for rid, _ in p}) < len(p) for p in plans), plans  # one row, several windows
    for p in plans:  # a request's windows sit in the pass in order: 0, 1, 2, ...
        for r in {rid for rid, _ in p}:
            idx = [i for rid, i in p if rid == r]
            assert idx == list(range(len(idx))), plans
    assert many.core.totals.verify_passes < one.core.totals.verify_passes, (many.core.totals, one.core.totals)
    assert [o.windows for o in a] == [o.windows for o in b]  # same window record: full windows either way


def test_a_rolled_back_window_drops_the_later_ones(make_mock_llm, workload, monkeypatch) -> None:
    """Faults in the fast path: later windows of a row whose earlier window rolled back in the same pass
    are not applied (window_applies False), and the committed output is the fault-free one. Verify cadence
    off: it verifies the batch's tail before the rows run ahead."""
    prompts, params = workload
    ref = make_mock_llm(decode_noise=0.0, dvr_lookahead=0).generate(prompts, params)
    llm = make_mock_llm(decode_noise=0.0, dvr_lookahead=(G - 1) * W, fault_rate=0.05, fault_seed=3,
                        verify_cadence_steps=0)
    import engine.apply as apply_mod
    skipped = {"n": 0}
    original = apply_mod.window_applies

    def counting(row: Any) -> bool:
        ok = original(row)
        skipped["n"] += not ok
        return ok

    monkeypatch.setattr(apply_mod, "window_applies", counting)
    out = llm.generate(prompts, params)
    assert_same(ref, out)
    assert skipped["n"] > 0 and sum(o.rollbacks for o in out) > 0
    for o in out:
        assert_windows_cover(o, W)
        assert all(e > s for s, e in o.windows)


def test_multi_window_transcripts_replay_and_survive_preemption(make_mock_llm, workload) -> None:
    prompts, params = workload
    outs = make_mock_llm(decode_noise=0.0, dvr_lookahead=(G - 1) * W).generate(prompts, params)
    results = make_mock_llm(decode_noise=0.0).replay(replay_requests(prompts, params, outs))
    assert [r.token_ids for r in results] == [o.token_ids for o in outs]
    assert [r.token_logprobs for r in results] == [o.token_logprobs for o in outs]
    assert all(r.first_mismatch is None for r in results)
    small = make_mock_llm(decode_noise=0.0, dvr_lookahead=(G - 1) * W, num_kv_blocks=2 + 24, block_size=4)
    assert_same(outs, small.generate(prompts, params))
    assert small.core.scheduler.preemptions > 0


def test_multi_window_under_overlap(make_mock_llm, workload) -> None:
    prompts, params = workload
    plain = [replace(p, top_p=1.0, top_k=0) for p in params]  # rows that chain (no host sampler)
    ref = make_mock_llm(decode_noise=0.0, dvr_lookahead=0).generate(prompts, plain)
    for noise in (0.0, 0.3):
        llm = make_mock_llm(decode_noise=noise, dvr_lookahead=(G - 1) * W, overlap=True)
        assert_same(ref, staggered(llm, prompts, plain, seed=7))


def test_verify_trigger_counts_windows_and_bounds_the_wait() -> None:
    """>= G windows (not rows) trigger a pass; a ready row that still decodes may wait up to W + lookahead
    steps (it gathers windows meanwhile), one that cannot decode (stop, run-ahead cap) at most W steps."""
    from engine.scheduler import Scheduler

    config = resolved(device="cpu", window=W, group=G, num_kv_blocks=64, tuning=DvrTuning(dvr_lookahead=3 * W))
    sched = Scheduler(config, {EOS})
    other = _seq([], committed=1)  # something else still decoding
    two = _seq(list(range(30, 30 + 2 * W)))  # 2 full windows
    assert dvr_windows(two, W, {EOS}, G) == 2
    step = 100
    two.ready_since = step
    assert not sched._verify_due([two], [two, other], step)               # 2 windows < G, just ready
    other_two = _seq(list(range(40, 40 + 2 * W)))
    other_two.ready_since = step
    assert sched._verify_due([two, other_two], [two, other_two, other], step)  # 4 windows = G
    two.ready_since = step - W
    assert not sched._verify_due([two], [two, other], step)               # still decoding: may wait on
    two.ready_since = step - (W + 3 * W)
    assert sched._verify_due([two], [two, other], step)                   # ... but not past W + lookahead
    stopped = _seq([*range(30, 30 + 3), EOS])
    stopped.params = replace(stopped.params, ignore_eos=False)
    stopped.ready_since = step - (W - 1)
    assert not sched._verify_due([stopped], [other], step)
    stopped.ready_since = step - W
    assert sched._verify_due([stopped], [other], step)                    # cannot decode: W steps at most
    assert sched._verify_due([stopped], [], step)                         # nothing else to decode: now
