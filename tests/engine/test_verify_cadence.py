"""Verify cadence (DvrTuning.verify_cadence_steps / verify_cadence_max_rows): while the running batch is
small, a verify pass is due once a deterministic row took k candidates since its last commit, and every pass
takes each deterministic row's unfinished window too. It moves window boundaries, never a committed bit:
token ids and logprobs are compared exactly across cadences, with faults, preemption and overlap, and
outputs made under one cadence replay under another."""
from __future__ import annotations

from typing import Any

import pytest

from engine.config import DvrTuning, EngineConfig
from engine.llm import LLM
from engine.scheduler import StepKind
from engine.sequence import RequestOutput
from engine.verifier import RowKind
from tests.engine.configs import resolved
from tests.engine.dvr_cases import (assert_same, assert_windows_cover, det_workload, one_at_a_time, replay_requests,
                                    staggered)

VOCAB = 64
W, G = 8, 4  # make_mock_llm's verify shape
CADENCES = (1, 3, 6, 20)  # small, mid, W-2 (the largest that shortens a window), beyond W (stops and caps only)
OVERLAP = dict(overlap=True, verify_early_decode=True, chained_verify=True)


@pytest.fixture
def workload():
    return det_workload(12, VOCAB, max_tokens=(8, 30), seed=8)


def record_verify_plans(llm: LLM) -> list[tuple[int, list[tuple[int, int, bool]]]]:
    """Every verify pass planned (by `schedule` or, with overlap, `chained_verify`): (running sequences at
    planning, [(candidates in the window, candidates a full window holds, ends at a stop candidate)] per DVR
    row)."""
    sched, eos = llm.core.scheduler, llm.core.eos_ids
    plans: list[tuple[int, list[tuple[int, int, bool]]]] = []

    def wrap(planner: Any) -> Any:
        def planned(*args: Any, **kw: Any) -> Any:
            plan = planner(*args, **kw)
            if plan is not None and plan.kind == StepKind.VERIFY:
                rows = []
                for r in plan.verify:
                    if r.kind != RowKind.DVR:
                        continue
                    full = min(W - 1, r.seq.params.max_tokens - len(r.seq.tokens) - r.index * W)
                    stop = r.seq.params.is_stop_token(r.tokens[-1], eos) and len(r.tokens) > 1
                    rows.append((len(r.tokens) - 1, full, stop))
                plans.append((len(sched.running), rows))
            return plan
        return planned

    sched.schedule = wrap(sched.schedule)  # type: ignore[method-assign]
    sched.chained_verify = wrap(sched.chained_verify)  # type: ignore[method-assign]
    return plans


def unfinished_windows(plans: list[tuple[int, list[tuple[int, int, bool]]]]) -> list[int]:
    """The running counts of the passes that took an unfinished window (short of full, not at a stop)."""
    return [running for running, rows in plans if any(n < full and not stop for n, full, stop in rows)]


def test_cadence_config_defaults_and_checks() -> None:
    cpu = resolved(device="cpu")
    assert cpu.tuning.verify_cadence_steps > 0 and cpu.tuning.verify_cadence_max_rows == cpu.group
    assert resolved(device="cpu", group=4, tuning=DvrTuning(verify_cadence_steps=0)).tuning.verify_cadence_steps == 0
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.verify_cadence_steps: must be an int >= 0"):
        EngineConfig(device="cpu", tuning=DvrTuning(verify_cadence_steps=-1))
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.verify_cadence_max_rows: must be an int >= 1"):
        EngineConfig(device="cpu", tuning=DvrTuning(verify_cadence_max_rows=0))


def test_cadence_changes_windows_not_bits(make_mock_llm, workload) -> None:
    """Alone, batched and staggered among fast requests, at every cadence and batch limit: the bits of the
    cadence-off run; a lone row commits at least every k decode steps (its windows hold <= k candidates)."""
    prompts, params = workload
    ref = one_at_a_time(make_mock_llm(verify_cadence_steps=0), prompts, params)
    windows = [o.windows for o in ref]
    for k in CADENCES:
        alone = one_at_a_time(make_mock_llm(verify_cadence_steps=k), prompts, params)
        assert_same(ref, alone)
        for o in alone:
            assert_windows_cover(o, W)
            assert all(e - s <= k + 1 for s, e in o.windows), (k, o.windows)
        if k < W - 1:
            assert [o.windows for o in alone] != windows, k
        for rows in (2, 32):
            llm = make_mock_llm(verify_cadence_steps=k, verify_cadence_max_rows=rows)
            assert_same(ref, llm.generate(prompts, params))
            busy = make_mock_llm(verify_cadence_steps=k, verify_cadence_max_rows=rows, max_num_seqs=6)
            assert_same(ref, staggered(busy, prompts, params, seed=k))


@pytest.mark.parametrize("k", [1, 3, 6])
def test_cadence_with_faults_preemption_and_overlap(make_mock_llm, workload, k: int) -> None:
    """Injected faults, KV preemption (rebuilds replay the windows the cadence made), overlap with early decode
    and chained passes (padded, and packed with carried rows), all at once where they combine: the bits of the
    fault-free cadence-off run, and every row's windows cover its output."""
    prompts, params = workload
    ref = make_mock_llm(verify_cadence_steps=0).generate(prompts, params)
    variants: dict[str, dict[str, Any]] = {
        "faults": dict(fault_rate=0.3, fault_seed=7),
        "preemption": dict(num_kv_blocks=2 + 16, block_size=4, fault_rate=0.2, fault_seed=1),
        "overlap": dict(OVERLAP, fault_rate=0.1, fault_seed=2),
        "overlap_packed": dict(OVERLAP, verify_packing="packed", verify_decode_rows=3, decode_noise=0.0),
        "overlap_packed_faults": dict(OVERLAP, verify_packing="packed", verify_decode_rows=3, fault_rate=0.2),
    }
    for name, kw in variants.items():
        llm = make_mock_llm(verify_cadence_steps=k, verify_cadence_max_rows=32, **kw)
        plans = record_verify_plans(llm)
        out = llm.generate(prompts, params)
        assert_same(ref, out)
        for o in out:
            assert_windows_cover(o, W)
        assert unfinished_windows(plans), (name, k)
        if name == "preemption":
            assert llm.core.scheduler.preemptions > 0
            llm.core.scheduler.blocks.check()
        if "fault_rate" in kw:
            assert sum(o.rollbacks for o in out) > 0, name
        if "overlap" in name:
            stats = llm.core.stats()
            assert stats.chained_verify_passes + stats.early_decode_steps > 0, (name, stats)
        assert all(s.inflight == 0 and s.stale_inflight == 0 for s in llm.core.seqs.values())


def test_cadence_only_while_the_batch_is_small(make_mock_llm, workload) -> None:
    """With more than verify_cadence_max_rows sequences running, passes take full windows only (as with the
    cadence off); unfinished windows appear once the batch shrinks to the limit."""
    prompts, params = workload
    for kw in ({}, OVERLAP):
        llm = make_mock_llm(verify_cadence_steps=2, verify_cadence_max_rows=3, max_num_seqs=12, **kw)
        plans = record_verify_plans(llm)
        llm.generate(prompts, params)
        short = unfinished_windows(plans)
        assert short and max(short) <= 3, (kw, short)
        assert max(running for running, _ in plans) > 3
        off = make_mock_llm(verify_cadence_steps=0, max_num_seqs=12, **kw)
        off_plans = record_verify_plans(off)
        off.generate(prompts, params)
        assert not unfinished_windows(off_plans)


def test_outputs_replay_under_another_cadence(make_mock_llm, workload) -> None:
    """Windows recorded under one cadence re-execute teacher-forced on an engine with another (replay never
    decodes): the predictions are the committed tokens and logprobs, bit for bit."""
    prompts, params = workload
    made = {k: make_mock_llm(verify_cadence_steps=k, fault_rate=0.2, fault_seed=k).generate(prompts, params)
            for k in (0, 2)}
    assert [o.windows for o in made[0]] != [o.windows for o in made[2]]
    for k, outs in made.items():
        replayer = make_mock_llm(verify_cadence_steps=2 - k)
        results = replayer.replay(replay_requests(prompts, params, outs))
        assert [r.token_ids for r in results] == [o.token_ids for o in outs]
        assert [r.token_logprobs for r in results] == [o.token_logprobs for o in outs] and all(r.match for r in results)


def _real_reference(make_real_llm: Any, prompts: list[list[int]], params: Any) -> list[RequestOutput]:
    return make_real_llm(window=8, group=2, verify_cadence_steps=0).generate(prompts, params)


@pytest.mark.slow
def test_real_model_cadence_with_faults_overlap_and_preemption(make_real_llm) -> None:
    """SmolLM2 (fp32, CPU): token ids and logprobs under cadence 2 with faults and overlap (early decode,
    chained passes, carried rows) and under cadence 5 with faults and preemption (W=8, G=2) equal the
    cadence-off run's; the windows really differ. Replays under the other cadence reproduce them."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6], [100, 200, 300, 400, 500]]
    from engine.sampling import SamplingParams

    params = [SamplingParams(max_tokens=20, temperature=0.0 if i % 2 == 0 else 0.8, seed=40 + i,
                             deterministic=True, ignore_eos=True) for i in range(len(prompts))]
    ref = _real_reference(make_real_llm, prompts, params)
    busy = make_real_llm(window=8, group=2, verify_cadence_steps=2, fault_rate=0.2, fault_seed=2,
                         verify_decode_rows=2, max_num_seqs=8, **OVERLAP)
    out = busy.generate(prompts, params)
    assert_same(ref, out)
    assert [o.windows for o in out] != [o.windows for o in ref]
    small = make_real_llm(window=8, group=2, verify_cadence_steps=5, num_kv_blocks=2 + 6, block_size=8,
                          fault_rate=0.1, fault_seed=5)
    assert_same(ref, small.generate(prompts, params))
    assert small.core.scheduler.preemptions > 0
    replayed = make_real_llm(window=8, group=2, verify_cadence_steps=0).replay(
        replay_requests(prompts, params, out))
    assert [r.token_ids for r in replayed] == [o.token_ids for o in out]
    assert [r.token_logprobs for r in replayed] == [o.token_logprobs for o in out]
