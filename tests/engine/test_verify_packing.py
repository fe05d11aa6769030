"""Packed verify passes (`DvrTuning.verify_packing = "packed"`).

A padded pass gives every window W token slots, so the last window of each request (cut by a stop or
max_tokens) leaves slots empty. A packed pass lays its windows back to back and takes as many as fit in
its G*W tokens (at most verify_max_windows), dummy rows filling the rest. The pass keeps its token count,
so every GEMM keeps its shape, and each query keeps its attention tiles: the committed bits must equal the
padded engine's, bit for bit, under load, rollbacks, carried rows, overlap, preemption and replay, while
the pass count drops.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.config import DvrTuning, EngineConfig
from engine.fingerprint import runtime_fingerprint
from engine.sampling import SamplingParams
from engine.scheduler import StepKind
from tests.engine.configs import resolved
from tests.engine.dvr_cases import (assert_same, assert_windows_cover, det_workload, one_at_a_time,
                                    real_workload, replay_requests, staggered)

VOCAB = 64
W, G = 8, 4


@pytest.fixture
def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    # short outputs of every length mod W: most requests end in a partial window
    return det_workload(24, VOCAB, max_tokens=(3, 30), seed=21)


def _verify_plans(llm: Any) -> list[list[int]]:
    """Record each verify plan's window lengths: plans the scheduler makes in `schedule` and, with overlap and
    chained verify passes (the CUDA default), in `chained_verify`."""
    seen: list[list[int]] = []
    sched = llm.core.scheduler

    def recording(original: Any) -> Any:
        def plan_and_record() -> Any:
            plan = original()
            if plan is not None and plan.kind == StepKind.VERIFY:
                seen.append([len(r.tokens) for r in plan.verify])
            return plan
        return plan_and_record

    sched.schedule = recording(sched.schedule)  # type: ignore[method-assign]
    sched.chained_verify = recording(sched.chained_verify)  # type: ignore[method-assign]
    return seen


def test_config_defaults_and_limits() -> None:
    padded = resolved(device="cpu")  # the CPU default
    assert padded.tuning.verify_packing == "padded" and padded.tuning.verify_max_windows == padded.group
    cuda = resolved(device="cuda")  # the CUDA default (a config only: building it needs no GPU)
    assert cuda.tuning.verify_packing == "packed" and cuda.tuning.verify_max_windows == 2 * cuda.group
    assert resolved(device="cuda", tuning=DvrTuning(verify_packing="padded")).tuning.verify_max_windows == cuda.group
    packed = resolved(device="cpu", group=4, tuning=DvrTuning(verify_packing="packed"))
    assert packed.tuning.verify_max_windows == 8
    assert resolved(device="cpu", group=4,
                    tuning=DvrTuning(verify_packing="packed", verify_max_windows=12)).tuning.verify_max_windows == 12
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.verify_packing: one of padded/packed, got 'tight'"):
        EngineConfig(device="cpu", tuning=DvrTuning(verify_packing="tight"))
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.verify_max_windows: must be an int >= G = 4, got 3"):
        EngineConfig(device="cpu", group=4, tuning=DvrTuning(verify_packing="packed", verify_max_windows=3))
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.verify_max_windows: a padded verify pass holds exactly"):
        EngineConfig(device="cpu", group=4, tuning=DvrTuning(verify_max_windows=8))


def test_packing_is_not_part_of_the_runtime_identity() -> None:
    """It never changes a committed bit, so a transcript made either way replays under the other."""
    assert runtime_fingerprint(resolved(device="cpu")) == runtime_fingerprint(
        resolved(device="cpu", tuning=DvrTuning(verify_packing="packed")))


@pytest.mark.parametrize("d", [0, 3])
@pytest.mark.parametrize("overlap", [False, True])
def test_packed_equals_padded_bit_for_bit(make_mock_llm: Any, workload: Any, d: int, overlap: bool) -> None:
    prompts, params = workload
    padded = make_mock_llm(verify_decode_rows=d, overlap=overlap)
    ref = padded.generate(prompts, params)
    packed = make_mock_llm(verify_decode_rows=d, overlap=overlap, verify_packing="packed")
    plans = _verify_plans(packed)
    out = packed.generate(prompts, params)
    assert_same(out, ref)
    for o in out:
        assert_windows_cover(o, W)
    assert all(sum(p) <= G * W and len(p) <= 2 * G for p in plans)
    assert any(len(p) > G for p in plans), plans  # a pass took more windows than a padded one holds


def test_packing_takes_fewer_passes(make_mock_llm: Any) -> None:
    """No rollback (the fast path equals the verifier): padded passes of G full windows are full either way,
    the partial last windows of requests share packed passes."""
    prompts, params = det_workload(32, VOCAB, max_tokens=(3, 30), seed=21)
    padded = make_mock_llm(decode_noise=0.0, max_num_seqs=32, num_kv_blocks=128)
    packed = make_mock_llm(decode_noise=0.0, max_num_seqs=32, num_kv_blocks=128, verify_packing="packed")
    assert_same(packed.generate(prompts, params), padded.generate(prompts, params))
    assert packed.core.stats().verify_passes < padded.core.stats().verify_passes


def test_packed_under_load_faults_and_preemption(make_mock_llm: Any, workload: Any) -> None:
    prompts, params = workload
    ref = make_mock_llm().generate(prompts, params)
    alone = one_at_a_time(make_mock_llm(verify_packing="packed"), prompts, params)
    assert_same(alone, ref)
    faulty = make_mock_llm(verify_packing="packed", verify_decode_rows=2, fault_rate=0.3, fault_seed=5,
                           overlap=True)
    assert_same(staggered(faulty, prompts, params, every=3, seed=2), ref)
    assert faulty.core.stats().rollbacks > 0
    tight = make_mock_llm(verify_packing="packed", num_kv_blocks=20)  # KV pressure: preemptions and rebuilds
    assert_same(tight.generate(prompts, params), ref)
    assert tight.core.stats().preemptions > 0
    wide = make_mock_llm(verify_packing="packed", verify_max_windows=16)
    assert_same(wide.generate(prompts, params), ref)


def test_transcripts_replay_across_packings(make_mock_llm: Any, workload: Any) -> None:
    prompts, params = workload
    for make_with, replay_with in (("packed", "padded"), ("padded", "packed")):
        made = staggered(make_mock_llm(verify_packing=make_with, overlap=True), prompts, params, seed=9)
        results = make_mock_llm(verify_packing=replay_with).replay(replay_requests(prompts, params, made))
        for o, r in zip(made, results):
            assert r.first_mismatch is None
            assert r.token_ids == o.token_ids and r.token_logprobs == o.token_logprobs


def test_real_model_packed_equals_padded(make_real_llm: Any, smollm2_source: Any) -> None:
    """SmolLM2 on the CPU (float32, torch backend, which computes a packed pass's rows as the padded pass
    does): the same bits packed and padded, with carried rows and among non-deterministic traffic."""
    prompts, params = real_workload(smollm2_source.tokenizer, lambda i: 5 + 3 * i)
    cfg = dict(window=8, group=2, verify_decode_rows=2, max_num_seqs=8)
    ref = make_real_llm(**cfg).generate(prompts, params)
    llm = make_real_llm(verify_packing="packed", **cfg)
    plans = _verify_plans(llm)
    out = staggered(llm, prompts, params, every=2, seed=4)
    assert_same(out, ref)
    assert any(len(p) > 2 for p in plans), plans


def test_packed_trigger_counts_tokens_or_windows() -> None:
    """Packed, verify_trigger="tokens" (the default): a pass is due at G*W tokens of ready windows or
    verify_max_windows windows, so G short windows do not trigger it; "windows": G windows of any length
    do (the padded rule), and the pass still packs every ready window that fits."""
    from engine.scheduler import Scheduler
    from tests.engine.test_multi_window import _seq

    stop = 5
    other = _seq([], committed=1)  # something else still decoding
    short = [_seq([*range(30 + i, 33 + i), stop], stop=[stop]) for i in range(G)]  # G windows of 5 tokens
    for s in short:
        s.params = replace(s.params, ignore_eos=False)
    step = 100
    for s in short:
        s.ready_since = step
    by_tokens = Scheduler(resolved(device="cpu", window=W, group=G, num_kv_blocks=64,
                                   tuning=DvrTuning(verify_packing="packed")),
                          {1})
    assert by_tokens.config.tuning.verify_trigger == "tokens"
    assert not by_tokens._verify_due(short, [other], step)  # 4 windows, 20 tokens < G*W = 32
    full = [_seq(list(range(40 + 10 * i, 40 + 10 * i + W - 1))) for i in range(3)]  # 3 full windows (24 tokens)
    for s in full:
        s.ready_since = step
    assert by_tokens._verify_due(short[:2] + full, [other], step)  # 10 + 24 tokens >= 32
    by_windows = Scheduler(resolved(device="cpu", window=W, group=G, num_kv_blocks=64,
                                    tuning=DvrTuning(verify_packing="packed", verify_trigger="windows")), {1})
    assert by_windows._verify_due(short, [other], step)  # G windows
    picks, used = by_windows._pick_windows(short + full)
    assert len(picks) == 5 and used == 4 * 5 + 8, (picks, used)  # the 4 short ones and one full one fit in 32
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.verify_trigger: one of tokens/windows, got 'rows'"):
        EngineConfig(device="cpu", tuning=DvrTuning(verify_trigger="rows"))


def test_window_trigger_changes_no_committed_bit(make_mock_llm: Any, workload: Any) -> None:
    prompts, params = workload
    ref = make_mock_llm(verify_decode_rows=3, overlap=True).generate(prompts, params)
    llm = make_mock_llm(verify_decode_rows=3, overlap=True, verify_packing="packed", verify_trigger="windows")
    assert_same(staggered(llm, prompts, params, every=2, seed=6), ref)
