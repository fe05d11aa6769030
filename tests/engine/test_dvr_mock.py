"""DVR protocol on a tiny mock model whose fast path depends on the batch (fast, many cases)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.sequence import SeqKind
from tests.engine.dvr_cases import (assert_same, assert_windows_cover, det_workload, fast_params,
                                    one_at_a_time, record_verify_kinds, replay_requests, staggered)

VOCAB = 64


@pytest.fixture
def workload():
    return det_workload(16, VOCAB, max_tokens=(8, 30), seed=1)


def test_mock_fast_path_really_depends_on_load(make_mock_llm, workload) -> None:
    """Sanity: without DVR the same requests give different tokens alone vs batched."""
    prompts, params = workload
    nd = [replace(p, deterministic=False) for p in params]
    alone = one_at_a_time(make_mock_llm(mode="nondeterministic"), prompts, nd)
    batched = make_mock_llm(mode="nondeterministic").generate(prompts, nd)
    assert [o.token_ids for o in alone] != [o.token_ids for o in batched]


def test_determinism_alone_batched_staggered(make_mock_llm, workload) -> None:
    prompts, params = workload
    ref = one_at_a_time(make_mock_llm(), prompts, params)
    assert_same(ref, make_mock_llm().generate(prompts, params))
    for max_seqs in (3, 12):
        assert_same(ref, staggered(make_mock_llm(max_num_seqs=max_seqs), prompts, params, seed=max_seqs))
    assert sum(o.rollbacks for o in ref) > 0
    for o in ref:
        assert_windows_cover(o, 8)


@pytest.mark.parametrize("rate", [0.05, 0.3, 1.0])
def test_fault_injection_does_not_change_output(make_mock_llm, workload, rate: float) -> None:
    prompts, params = workload
    ref = make_mock_llm().generate(prompts, params)
    llm = make_mock_llm(fault_rate=rate, fault_seed=5)
    replaced = {"n": 0}
    fault = llm.core._maybe_fault

    def counting(seq: Any, token: int) -> int:
        out = fault(seq, token)
        replaced["n"] += out != token
        return out

    llm.core._maybe_fault = counting
    faulty = llm.generate(prompts, params)
    assert_same(ref, faulty)
    # the knob really replaced candidates (how many more rollbacks that makes depends on the schedule: a
    # replaced candidate in a window the noisy fast path already breaks earlier adds none)
    assert replaced["n"] > 0, replaced
    for o in faulty:
        assert_windows_cover(o, 8)
        assert all(e > s for s, e in o.windows)  # every pass commits >= 1 token
    if rate == 1.0:  # every candidate differs from the fast path's token: almost always one token per pass
        # (a replaced candidate can still equal the verifier's token by chance when the noisy fast path was
        # wrong, ~1/VOCAB per window; without faults windows hold up to W tokens)
        windows = [w for o in faulty for w in o.windows]
        assert sum(e - s > 1 for s, e in windows) <= max(2, len(windows) // 20), windows


def test_window_starts_move_but_output_does_not(make_mock_llm, workload) -> None:
    prompts, params = workload
    runs = [make_mock_llm(fault_rate=0.3, fault_seed=s).generate(prompts, params) for s in (1, 2)]
    assert_same(runs[0], runs[1])
    assert_same(runs[0], make_mock_llm().generate(prompts, params))  # and both equal the fault-free run
    assert [o.windows for o in runs[0]] != [o.windows for o in runs[1]]


def test_preemption_rebuilds_canonical_state(make_mock_llm, workload) -> None:
    prompts, params = workload
    ref = make_mock_llm().generate(prompts, params)
    small = make_mock_llm(num_kv_blocks=2 + 16, block_size=4, fault_rate=0.2)
    out = small.generate(prompts, params)
    assert small.core.scheduler.preemptions > 0
    assert_same(ref, out)
    small.core.scheduler.blocks.check()
    assert small.core.scheduler.blocks.num_free == small.core.scheduler.blocks.num_usable


def test_nondeterministic_never_verified(make_mock_llm, workload) -> None:
    prompts, params = workload
    llm = make_mock_llm(max_num_seqs=8)
    kinds = record_verify_kinds(llm)
    outs = staggered(llm, prompts, params, seed=3)
    assert kinds and set(kinds) == {SeqKind.DVR}
    fast = llm.generate(prompts[:4], [fast_params(seed=i) for i in range(4)])
    assert all(o.verify_passes == 0 and o.windows == [] and not o.deterministic for o in fast)
    for o in outs:
        assert_windows_cover(o, 8)


def test_nondeterministic_mode_ignores_the_flag(make_mock_llm, workload) -> None:
    prompts, params = workload
    llm = make_mock_llm(mode="nondeterministic")
    kinds = record_verify_kinds(llm)
    outs = llm.generate(prompts, params)
    assert kinds == [] and all(not o.deterministic and o.windows == [] for o in outs)


def test_replay_reproduces_and_locates_mismatch(make_mock_llm, workload) -> None:
    prompts, params = workload
    outs = staggered(make_mock_llm(fault_rate=0.3, fault_seed=9), prompts, params, seed=4)
    reqs = replay_requests(prompts, params, outs)
    results = make_mock_llm().replay(reqs)
    for o, r in zip(outs, results):
        assert r.first_mismatch is None and r.window_index is None
        assert r.token_ids == o.token_ids and r.token_logprobs == o.token_logprobs
    victim = max(range(len(outs)), key=lambda i: len(outs[i].token_ids))
    pos = len(outs[victim].token_ids) // 2 + 1
    tokens = list(reqs[victim].token_ids)
    tokens[pos] = (tokens[pos] + 1) % VOCAB
    bad = replace(reqs[victim], token_ids=tokens)
    res = make_mock_llm().replay([bad, reqs[0]])
    assert res[0].first_mismatch == pos
    s, e = bad.windows[res[0].window_index]
    assert s <= pos < e
    assert res[1].first_mismatch is None


def test_replays_survive_preemption(make_mock_llm, workload) -> None:
    prompts, params = workload
    outs = make_mock_llm(fault_rate=0.2).generate(prompts, params)
    small = make_mock_llm(num_kv_blocks=2 + 14, block_size=4)
    results = small.replay(replay_requests(prompts, params, outs))
    assert small.core.scheduler.preemptions > 0
    assert [r.token_ids for r in results] == [o.token_ids for o in outs]
    assert [r.token_logprobs for r in results] == [o.token_logprobs for o in outs]


def test_stop_token_ids_and_max_tokens_judged_on_committed(make_mock_llm, workload) -> None:
    prompts, params = workload
    ref = make_mock_llm().generate(prompts, params)
    i = max(range(len(ref)), key=lambda k: len(ref[k].token_ids))
    stop_at = 5
    stop_id = ref[i].token_ids[stop_at]
    first = ref[i].token_ids.index(stop_id)
    p = replace(params[i], stop_token_ids=[stop_id])
    out = make_mock_llm(fault_rate=0.5).generate([prompts[i]], [p])[0]
    assert out.token_ids == ref[i].token_ids[: first + 1] and out.finish_reason == "stop"
    assert out.windows[-1][1] == len(out.token_ids)


def test_replay_is_not_starved_by_fast_traffic(make_mock_llm, workload) -> None:
    prompts, params = workload
    outs = make_mock_llm().generate(prompts[:2], params[:2])
    llm = make_mock_llm(max_num_seqs=16)
    core = llm.core
    seqs = [core.add_replay(f"rp{i}", p, o.token_ids, replace(sp, seed=o.seed), o.windows)
            for i, (p, sp, o) in enumerate(zip(prompts[:2], params[:2], outs))]
    for i in range(10):  # long-running non-deterministic traffic keeps the fast path busy
        core.add_request(f"bg{i}", [5, 6, 7], fast_params(seed=i, max_tokens=400))
    for _ in range(400):
        if all(s.is_finished for s in seqs):
            break
        core.step()
    assert all(s.is_finished for s in seqs)
    assert [s.replay.predicted for s in seqs] == [o.token_ids for o in outs]


def test_run_ahead_changes_speed_not_bits(make_mock_llm, workload) -> None:
    """DVR rows waiting for their verify pass keep decoding (dvr_lookahead, default W-1): the committed
    bits equal those of rows that wait idle (lookahead 0), and they really decoded ahead. (Whether that
    saves steps depends on the rollback rate: this mock's noisy fast path discards most run-ahead
    candidates; on SmolLM2 with canonical DVR rows nothing is rolled back.) Verify cadence off: it would
    verify the small batch before the rows run ahead."""
    prompts, params = workload
    idle = make_mock_llm(dvr_lookahead=0, group=8, verify_cadence_steps=0)
    ahead = make_mock_llm(group=8, verify_cadence_steps=0)
    out_idle, out_ahead = idle.generate(prompts, params), ahead.generate(prompts, params)
    assert_same(out_idle, out_ahead)
    assert ahead.core.totals.decode_passes > idle.core.totals.decode_passes, (ahead.core.totals, idle.core.totals)


@pytest.mark.parametrize("attention", ["canonical", "canonical_step", "canonical_step_short", "split"])
def test_decode_rows_canonical_only_for_dvr(make_mock_llm, workload, attention: str) -> None:
    """dvr_decode_attention="canonical": each decode step marks exactly its DVR rows canonical (fast rows
    keep the split kernel); "split": no row is marked."""
    prompts, params = workload
    mixed = [replace(p, deterministic=i % 2 == 0) for i, p in enumerate(params)]
    llm = make_mock_llm(dvr_decode_attention=attention)
    core = llm.core
    seen: list[tuple[list[bool], list[bool] | None]] = []  # per decode step: (row is DVR, row.canonical)
    decode_pass, run_decode = core._decode, core.runner.decode

    def record_plan(plan: Any) -> Any:
        seen.append(([s.kind == SeqKind.DVR for s in plan.decode], None))
        return decode_pass(plan)

    def record_rows(rows: Any, **kw: Any) -> Any:
        seen[-1] = (seen[-1][0], [r.canonical for r in rows])
        return run_decode(rows, **kw)

    core._decode, core.runner.decode = record_plan, record_rows
    llm.generate(prompts, mixed)
    assert any(any(dvr) and not all(dvr) for dvr, _ in seen), "no decode step mixed fast and DVR rows"
    for dvr, flags in seen:
        assert flags == (dvr if attention != "split" else [False] * len(dvr))
    # which decode passes run a flagged step all canonical: every one (canonical_step), the graphs of rows
    # up to GRAPH_MAX_LEN only (canonical_step_short: this flag is what that family is captured with)
    runner = core.runner
    assert (runner.canonical_step, runner.canonical_step_short) == {
        "canonical": (False, False), "canonical_step": (True, True), "canonical_step_short": (False, True),
        "split": (False, False)}[attention]
