"""Engine overlap (EngineConfig.tuning.overlap): a decode step is planned and launched while the previous one's
tokens are still unread, its input ids taken from them on the device. On the CPU the same bookkeeping runs
(the "device" tokens are host tensors), so these tests exercise every path the GPU takes."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from engine.sampling import SamplingParams
from engine.scheduler import StepKind
from tests.engine.configs import resolved
from tests.engine.dvr_cases import assert_same, assert_windows_cover, det_workload, staggered

VOCAB = 64


def _plain(params: list[SamplingParams], keep_filtered: int = 0) -> list[SamplingParams]:
    """Drop top-k / top-p (those rows take the host sampler, which ends a chain) except every
    `keep_filtered`-th request."""
    return [p if keep_filtered and i % keep_filtered == 0 else replace(p, top_p=1.0, top_k=0)
            for i, p in enumerate(params)]


def _count_chained(llm: Any) -> dict[str, int]:
    """Counts decode steps launched with the previous step's tokens still in flight, and the rows whose
    input id was copied on the device."""
    core, counts = llm.core, {"chained_steps": 0, "chained_rows": 0, "decode_steps": 0}
    chained, run_decode = core.scheduler.chained_decode, core.runner.decode

    def record_chained(**kw: Any) -> Any:
        plan = chained(**kw)
        if plan is not None:
            assert plan.kind == StepKind.DECODE
            counts["chained_steps"] += 1
        return plan

    def record_decode(rows: Any, chain: Any = None) -> Any:
        counts["decode_steps"] += 1
        if chain is not None:
            counts["chained_rows"] += len(chain[1])
        return run_decode(rows, chain=chain)

    core.scheduler.chained_decode, core.runner.decode = record_chained, record_decode
    return counts


@pytest.fixture
def workload():
    prompts, params = det_workload(16, VOCAB, max_tokens=(8, 30), seed=3)
    return prompts, _plain(params)


def test_overlap_is_off_on_the_cpu_by_default_and_on_when_asked(make_mock_llm) -> None:
    assert make_mock_llm().config.tuning.overlap is False
    assert make_mock_llm(overlap=True).config.tuning.overlap is True
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.overlap"):
        make_mock_llm(overlap="yes")


def test_dvr_outputs_are_the_same_with_and_without_overlap(make_mock_llm, workload) -> None:
    prompts, params = workload
    ref = make_mock_llm().generate(prompts, params)
    llm = make_mock_llm(overlap=True)
    counts = _count_chained(llm)
    got = llm.generate(prompts, params)
    assert_same(ref, got)
    for o in got:
        assert_windows_cover(o, 8)
    assert counts["chained_steps"] > 0 and counts["chained_rows"] > 0, counts


def test_overlap_under_staggered_arrivals_and_faults(make_mock_llm, workload) -> None:
    """Arrivals between steps (each ends a chain), fast co-traffic, injected faults: the committed
    deterministic outputs still equal a lone run's."""
    prompts, params = workload
    ref = make_mock_llm().generate(prompts, params)
    for max_seqs, rate in ((3, 0.0), (12, 0.3)):
        llm = make_mock_llm(overlap=True, max_num_seqs=max_seqs, fault_rate=rate, fault_seed=2)
        counts = _count_chained(llm)
        assert_same(ref, staggered(llm, prompts, params, seed=max_seqs))
        assert counts["chained_steps"] > 0, counts


def test_host_sampled_rows_end_the_chain_but_not_correctness(make_mock_llm) -> None:
    """top-k / top-p rows are sampled on the host: a step holding one is read at once (no chain)."""
    prompts, params = det_workload(12, VOCAB, max_tokens=(8, 24), seed=4)
    params = _plain(params, keep_filtered=4)
    ref = make_mock_llm().generate(prompts, params)
    assert_same(ref, make_mock_llm(overlap=True).generate(prompts, params))


def test_fast_requests_stop_exactly_at_eos_and_max_tokens(make_mock_llm) -> None:
    """A non-deterministic row that finished in the in-flight step rides one more step; that token is
    dropped, never committed: outputs end at the first stop id or at max_tokens."""
    stops = [2, 3, 4, 5]
    prompts = [[5 + i, 9, 3 + i] for i in range(10)]
    params = [SamplingParams(max_tokens=20 + i, temperature=1.0, seed=i, stop_token_ids=stops) for i in range(10)]
    llm = make_mock_llm(mode="nondeterministic", overlap=True, max_num_seqs=10)
    counts = _count_chained(llm)
    outs = llm.generate(prompts, params)
    assert counts["chained_steps"] > 0, counts
    stopped = 0
    for o, p in zip(outs, params):
        assert len(o.token_ids) == len(o.token_logprobs) <= p.max_tokens
        if o.finish_reason == "stop":
            stopped += 1
            assert [t in stops for t in o.token_ids].index(True) == len(o.token_ids) - 1, o.token_ids
        else:
            assert o.finish_reason == "length" and len(o.token_ids) == p.max_tokens
            assert not set(stops) & set(o.token_ids), o.token_ids
    assert stopped > 0, "the case never hit EOS"
    while llm.core.has_work():  # a step may still be in flight for requests that already finished
        llm.core.step()
    assert llm.core.scheduler.blocks.num_free == llm.core.scheduler.blocks.num_usable


def test_dvr_row_past_a_stop_candidate_drops_the_extra_token(make_mock_llm) -> None:
    """DVR rows that reach EOS: the in-flight step past the stop candidate is dropped, the outputs equal
    the sync engine's, and every KV block comes back."""
    prompts, params = det_workload(12, VOCAB, max_tokens=(20, 40), seed=6)
    params = [replace(p, stop_token_ids=[2, 3, 4]) for p in _plain(params)]
    ref = make_mock_llm().generate(prompts, params)
    assert any(o.finish_reason == "stop" for o in ref), "the case never hit EOS"
    llm = make_mock_llm(overlap=True)
    core, step = llm.core, llm.core.step
    stops = {2, 3, 4}
    dropped = {"n": 0}

    def checked_step() -> Any:
        before = {s.key: (len(s.candidates), s.inflight) for s in core.scheduler.running}
        out = step()
        for s in core.scheduler.running:  # no candidate ever follows a stop candidate
            assert not stops & set(s.candidates[:-1]), (s.request_id, s.candidates)
            n, inflight = before.get(s.key, (0, 0))
            if s.candidates and s.candidates[-1] in stops and len(s.candidates) == n and s.inflight < inflight:
                dropped["n"] += 1  # an in-flight token after the stop candidate was read and dropped
        return out

    core.step = checked_step
    assert_same(ref, llm.generate(prompts, params))
    while core.has_work():
        core.step()
    assert dropped["n"] > 0, "no step ran past a stop candidate"
    llm.core.scheduler.blocks.check()
    assert llm.core.scheduler.blocks.num_free == llm.core.scheduler.blocks.num_usable


def test_abort_with_a_step_in_flight(make_mock_llm, workload) -> None:
    prompts, params = workload
    llm = make_mock_llm(overlap=True)
    core = llm.core
    seqs = [core.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
    for _ in range(6):
        core.step()
    assert core._inflight is not None, "no step in flight to abort under"
    victim = next(s for s in core._inflight.seqs if not s.is_finished)
    fast = core.add_request("fast", [3, 4, 5], SamplingParams(max_tokens=30, temperature=1.0, seed=1))
    while not (core._inflight is not None and fast in core._inflight.seqs and fast.tokens):
        core.step()
    kept = {s.key: (list(s.tokens), list(s.logprobs)) for s in (victim, fast)}
    core.abort(victim.request_id)
    core.abort(fast.request_id)  # both have a token in flight now
    while core.has_work():
        core.step()
    for s in (victim, fast):  # the in-flight token was dropped, never committed
        assert (s.tokens, s.logprobs) == kept[s.key], s.request_id
        assert s.finish_reason is not None and s.finish_reason.value == "abort"
    ref = make_mock_llm().generate(prompts, params)
    rest = [(core.output(s), r) for s, r in zip(seqs, ref) if s is not victim]
    assert_same([a for a, _ in rest], [b for _, b in rest])
    core.scheduler.blocks.check()
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_usable


REAL_PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6], [100, 200, 300, 400, 500], [42] * 12]
REAL_DET = [SamplingParams(max_tokens=20, temperature=0.0 if i % 2 == 0 else 0.7, seed=11 + i,
                           deterministic=True, ignore_eos=True) for i in range(len(REAL_PROMPTS))]


@pytest.fixture(scope="module")
def real_alone_reference(make_real_llm) -> list[Any]:
    """Each deterministic request of the real-model test alone, overlap off (shared by its parametrizations)."""
    return [make_real_llm(window=8, group=2).generate([p], [sp])[0] for p, sp in zip(REAL_PROMPTS, REAL_DET)]


@pytest.mark.parametrize("early", [False, True])
@pytest.mark.slow
def test_real_model_dvr_bits_with_overlap(make_real_llm, real_alone_reference, early: bool) -> None:
    """SmolLM2 (fp32, CPU): deterministic requests among fast co-traffic give the same token ids and
    logprobs with overlap on as a lone run with overlap off; also with carried rows, the early decode
    step after each verify pass (verify_early_decode) and verify passes launched behind the step in
    flight (chained_verify)."""
    extra = dict(verify_early_decode=True, verify_decode_rows=4, chained_verify=True) if early else {}
    llm = make_real_llm(window=8, group=2, overlap=True, max_num_seqs=8, **extra)
    counts = _count_chained(llm)
    fast = [SamplingParams(max_tokens=14 + 3 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    outs = llm.generate(REAL_PROMPTS + [p[::-1] for p in REAL_PROMPTS], REAL_DET + fast)
    assert_same(real_alone_reference, outs[: len(REAL_PROMPTS)])
    assert counts["chained_steps"] > 0 and counts["chained_rows"] > 0, counts
    if early:
        stats = llm.core.stats()
        assert stats.early_decode_steps > 0 and stats.chained_verify_passes > 0, stats


def test_chained_input_ids_are_the_previous_steps_tokens(make_mock_llm) -> None:
    """Non-deterministic requests that all run the same steps (same length, no stops) see the same
    batches with and without overlap, so the mock model's batch-dependent fast path gives the same
    tokens only if every chained input id is the right row's token of the previous step."""
    prompts = [[5 + i, 9, 3 + i, 7] for i in range(8)]
    # rows leave the batch one by one (max_tokens differ), so a row's index changes between steps: the
    # chained id must come from the row the sequence had in the previous step, not the same index
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=1.0 if i % 2 else 0.0, seed=i, ignore_eos=True)
              for i in range(8)]
    ref = make_mock_llm(mode="nondeterministic", max_num_seqs=8).generate(prompts, params)
    llm = make_mock_llm(mode="nondeterministic", overlap=True, max_num_seqs=8)
    counts = _count_chained(llm)
    assert_same(ref, llm.generate(prompts, params))
    # every decode step but the first chains all its rows (a row at max_tokens is not planned again)
    assert counts["chained_rows"] == sum(p.max_tokens - 2 for p in params), counts


def test_a_ready_dvr_row_is_verified_while_fast_rows_keep_the_chain_going(make_mock_llm) -> None:
    """Chained planning still honours the verify trigger (a ready row waits at most W steps): a short
    deterministic request among long fast ones finishes long before they do."""
    llm = make_mock_llm(overlap=True, group=4, max_num_seqs=8)
    core = llm.core
    det = core.add_request("det", [7, 8, 9], SamplingParams(max_tokens=20, temperature=0.0, deterministic=True,
                                                           ignore_eos=True))
    fast = [core.add_request(f"f{i}", [3 + i, 5, 6], SamplingParams(max_tokens=120, temperature=1.0, seed=i,
                                                                     ignore_eos=True)) for i in range(6)]
    counts = _count_chained(llm)
    steps = 0
    while not det.is_finished:
        core.step()
        steps += 1
    assert counts["chained_steps"] > 0, counts
    assert not any(f.is_finished for f in fast), (steps, [len(f.tokens) for f in fast])


@pytest.mark.parametrize(("carry", "fault_rate", "noise"), [(0, 0.0, 0.3), (4, 0.0, 0.3), (4, 0.3, 0.3),
                                                          (16, 0.3, 0.3), (4, 0.0, 0.0)])
def test_decode_launched_before_verify_samples_are_read_keeps_every_bit(make_mock_llm, carry: int,
                                                                        fault_rate: float, noise: float) -> None:
    """verify_early_decode: a verify pass launches its samples and the next decode step (chained from the
    rows it carries) before reading them (`EngineCore._early_decode`). Rows of the pass with run-ahead
    candidates past their windows decode on speculatively; a rollback voids that token (dropped at the
    settle). Deterministic outputs are bitwise those of the overlap-off engine, with and without carried
    rows, under rollbacks (faults, the mock's noisy fast path) and without any (noise 0); the early steps
    ran, held pass rows only where they had run ahead, and both outcomes of a speculation occurred."""
    prompts, params = det_workload(10, VOCAB, max_tokens=(12, 40), seed=6)
    params = _plain(params)
    # every third request non-deterministic: they ride the early steps beside the DVR rows
    params = [replace(p, deterministic=False) if i % 3 == 2 else p for i, p in enumerate(params)]
    kw = dict(max_num_seqs=10, fault_rate=fault_rate, fault_seed=3, verify_decode_rows=carry, decode_noise=noise)
    ref = make_mock_llm(overlap=False, verify_early_decode=True, **kw).generate(prompts, params)
    llm = make_mock_llm(overlap=True, verify_early_decode=True, **kw)
    core = llm.core
    seen = {"speculated": 0, "void": 0}
    early_decode, settle = core._early_decode, core._settle

    def record_early(verify: Any) -> Any:
        ends: dict[Any, int] = {}
        for r in verify.verify:
            ends[r.seq] = max(ends.get(r.seq, -1), r.start_pos + len(r.tokens) - 1)
        before = core.scheduler.step_index
        out = early_decode(verify)
        if core.scheduler.step_index != before:  # a step was launched: pass rows in it had run ahead
            for s in set(core._inflight.seqs) & set(ends):
                assert s.kv_len - 1 > ends[s], (s.request_id, s.kv_len, ends[s])
                seen["speculated"] += 1
        return out

    def record_settle() -> Any:
        seen["void"] += sum(1 for s in (core._inflight.seqs if core._inflight else []) if s.stale_inflight)
        return settle()

    core._early_decode, core._settle = record_early, record_settle
    got = llm.generate(prompts, params)
    det = [i for i, p in enumerate(params) if p.deterministic]  # the mock's fast path is batch-dependent
    assert_same([ref[i] for i in det], [got[i] for i in det])
    for i, (o, p) in enumerate(zip(got, params)):
        assert o.finished and (len(o.token_ids) == p.max_tokens or o.finish_reason == "stop"), (i, o)
    stats = core.stats()
    assert stats.early_decode_steps > 0 and stats.verify_passes > 0, stats
    assert seen["speculated"] > 0, seen
    if fault_rate:
        assert stats.rollbacks > 0 and seen["void"] > 0, (stats, seen)
    assert all(s.stale_inflight == 0 and s.inflight == 0 for s in core.seqs.values())


def test_no_early_decode_by_default_without_overlap_and_filtered_rows_decode_early(make_mock_llm) -> None:
    """verify_early_decode off (the CPU default; on for CUDA) or overlap off (the CPU default): the verify samples
    are read first. A pass holding top-k rows is sampled like any other (every parameter is on the device), so
    it launches the early decode step too. The outputs are the same either way."""
    prompts, params = det_workload(8, VOCAB, max_tokens=(10, 24), seed=7)
    default = make_mock_llm(overlap=True, verify_decode_rows=4)
    assert default.config.tuning.verify_early_decode is False
    cuda = resolved(device="cuda").tuning
    assert cuda.verify_early_decode is True and cuda.overlap
    by_default = default.generate(prompts, _plain(params))
    assert default.core.stats().early_decode_steps == 0 and default.core.stats().verify_passes > 0
    off = make_mock_llm(overlap=False, verify_early_decode=True, verify_decode_rows=4)
    assert_same(off.generate(prompts, _plain(params)), by_default)  # every request here is deterministic
    assert off.core.stats().early_decode_steps == 0
    filtered = [replace(p, top_k=5, temperature=1.0) for p in _plain(params)]
    on = make_mock_llm(overlap=True, verify_early_decode=True, verify_decode_rows=4)
    got = on.generate(prompts, filtered)
    assert on.core.stats().early_decode_steps > 0 and on.core.stats().verify_passes > 0
    off_filtered = make_mock_llm(overlap=False, verify_early_decode=True, verify_decode_rows=4)
    assert_same(off_filtered.generate(prompts, filtered), got)


@pytest.mark.parametrize(("carry", "fault_rate", "noise", "early"),
                         [(0, 0.0, 0.3, False), (4, 0.0, 0.3, False), (4, 0.3, 0.3, False), (16, 0.3, 0.3, True),
                          (4, 0.0, 0.0, True), (4, 0.3, 0.0, True)])
def test_verify_pass_launched_behind_the_step_in_flight_keeps_every_bit(make_mock_llm, carry: int, fault_rate: float,
                                                                       noise: float, early: bool) -> None:
    """chained_verify: a verify pass due while a decode step is in flight is planned before that step is read
    and launched behind it; carried rows, and windows that end at a token in flight, take their input ids from
    that step's tokens on the device. The deterministic outputs are bitwise those of the overlap-off engine
    (with carried rows, rollbacks, the noisy fast path, and with the early decode after the pass as well);
    chained passes ran, windows ended at in-flight tokens (without faults; with faults, which rewrite
    candidates on the host, they hold known candidates only), and chained carried rows whose last token was
    in flight."""
    prompts, params = det_workload(10, VOCAB, max_tokens=(12, 40), seed=6)
    params = [replace(p, deterministic=False) if i % 3 == 2 else p for i, p in enumerate(_plain(params))]
    kw = dict(max_num_seqs=10, fault_rate=fault_rate, fault_seed=3, verify_decode_rows=carry, decode_noise=noise,
              verify_early_decode=early)
    ref = make_mock_llm(overlap=False, chained_verify=True, **kw).generate(prompts, params)
    llm = make_mock_llm(overlap=True, chained_verify=True, **kw)
    core = llm.core
    seen = {"chained_rows": 0, "inflight_pass_rows": 0, "inflight_inputs": 0, "row_chains": 0}
    chained_verify, run_verify = core.scheduler.chained_verify, core.runner.verify

    def record_plan() -> Any:
        plan = chained_verify()
        if plan is not None:
            assert core._inflight is not None
            for r in plan.verify:
                seq = r.seq
                # the last known token sits at kv_len - inflight; an in-flight one, at kv_len, may end a window
                # (only its last input), except with faults
                last = r.start_pos + len(r.tokens) - 1
                assert last <= seq.kv_len - (seq.inflight if fault_rate else 0), (seq.request_id, seq.kv_len, last)
                seen["inflight_pass_rows"] += seq.inflight
                seen["inflight_inputs"] += int(seq.inflight > 0 and last == seq.kv_len)
        return plan

    def record_verify(rows: Any, carried: Any = None, chain: Any = None, row_chain: Any = None) -> Any:
        if chain is not None:
            seen["chained_rows"] += len(chain[1])
        seen["row_chains"] += len(row_chain or ())
        return run_verify(rows, carried, chain=chain, row_chain=row_chain)

    core.scheduler.chained_verify, core.runner.verify = record_plan, record_verify
    got = llm.generate(prompts, params)
    det = [i for i, p in enumerate(params) if p.deterministic]  # the mock's fast path is batch-dependent
    assert_same([ref[i] for i in det], [got[i] for i in det])
    if not noise and not fault_rate:  # no rollback: every window is full (W-1 candidates), whatever the timing
        assert [ref[i].windows for i in det] == [got[i].windows for i in det]
    for i, (o, p) in enumerate(zip(got, params)):
        assert o.finished and (len(o.token_ids) == p.max_tokens or o.finish_reason == "stop"), (i, o)
    stats = core.stats()
    assert stats.chained_verify_passes > 0 and stats.verify_passes > stats.chained_verify_passes // 2, stats
    assert seen["inflight_pass_rows"] > 0, seen
    assert seen["row_chains"] == seen["inflight_inputs"], seen  # each window ending in flight took the device id
    assert (seen["inflight_inputs"] > 0) == (not fault_rate), seen
    if carry:
        assert seen["chained_rows"] > 0, seen
    if fault_rate:
        assert stats.rollbacks > 0, stats
    elif not noise:  # the fast path is the verifier's: a carried row that read a wrong input id would roll back
        assert stats.rollbacks == 0, stats
    assert all(s.stale_inflight == 0 and s.inflight == 0 for s in core.seqs.values())


def test_no_chained_verify_by_default_or_without_overlap(make_mock_llm) -> None:
    """chained_verify off (the CPU default; on for CUDA) or overlap off: every verify pass is planned after the
    step before it was read; the outputs are the same as with it on."""
    prompts, params = det_workload(8, VOCAB, max_tokens=(10, 24), seed=7)
    params = _plain(params)
    default = make_mock_llm(overlap=True, verify_decode_rows=4)
    assert default.config.tuning.chained_verify is False
    assert resolved(device="cuda").tuning.chained_verify is True
    by_default = default.generate(prompts, params)
    assert default.core.stats().chained_verify_passes == 0 and default.core.stats().verify_passes > 0
    off = make_mock_llm(overlap=False, chained_verify=True, verify_decode_rows=4)
    assert_same(off.generate(prompts, params), by_default)  # every request here is deterministic
    assert off.core.stats().chained_verify_passes == 0
    on = make_mock_llm(overlap=True, chained_verify=True, verify_decode_rows=4)
    assert_same(on.generate(prompts, params), by_default)
    assert on.core.stats().chained_verify_passes > 0
    with pytest.raises(ValueError, match="chained_verify"):
        make_mock_llm(chained_verify="yes")


@pytest.mark.parametrize("verify_packing", ["padded", "packed"])
def test_prefill_pass_launched_before_the_first_tokens_before_it_are_read(make_mock_llm, verify_packing: str) -> None:
    """With overlap, a prefill pass that follows a prefill pass is planned and launched before the first tokens
    of the one before it are read (Scheduler.chained_prefill), which are applied after. Deterministic outputs
    are bitwise the overlap-off engine's, among fast requests, requests that finish at their first token (their
    KV freed one step later) and a top-k request (the host sampler: its pass is read at once); every KV block
    comes back."""
    prompts, params = det_workload(14, VOCAB, max_tokens=(6, 24), seed=9)
    params = [replace(p, deterministic=False) if i % 3 == 2 else p for i, p in enumerate(_plain(params, 7))]
    params = [replace(p, max_tokens=1) if i % 5 == 4 else p for i, p in enumerate(params)]
    kw = dict(max_num_seqs=14, max_num_batched_tokens=24, verify_packing=verify_packing, verify_decode_rows=2,
              num_kv_blocks=128)
    ref = make_mock_llm(overlap=False, **kw).generate(prompts, params)
    llm = make_mock_llm(overlap=True, chained_verify=True, verify_early_decode=True, **kw)
    core, counts = llm.core, {"chained_prefill": 0}
    chained_prefill = core.scheduler.chained_prefill

    def record() -> Any:
        plan = chained_prefill()
        if plan is not None:
            assert core._inflight_prefill is not None and core._inflight is None
            counts["chained_prefill"] += 1
        return plan

    core.scheduler.chained_prefill = record
    got = llm.generate(prompts, params)
    det = [i for i, p in enumerate(params) if p.deterministic]
    assert_same([ref[i] for i in det], [got[i] for i in det])
    for o, p in zip(got, params):
        assert o.finished and (len(o.token_ids) == p.max_tokens or o.finish_reason == "stop"), o
    assert counts["chained_prefill"] >= 3, counts
    assert core._inflight_prefill is None and not core.has_work()
    core.scheduler.blocks.check()
    assert core.scheduler.blocks.num_free == core.scheduler.blocks.num_usable


@pytest.mark.parametrize("fault_rate", [0.0, 0.3])
def test_chained_verify_with_sampled_stops_keeps_every_bit(make_mock_llm, fault_rate: float) -> None:
    """Sampled rows (temperature, top-k, top logprobs) stop on sampled EOS candidates: a chained verify pass never
    counts a token in flight past a stop candidate, or one a rollback voided, as the window's input; the
    committed bits are those of the overlap-off engine."""
    prompts, params = det_workload(16, VOCAB, max_tokens=(20, 48), seed=11)
    sampled = [replace(p, temperature=1.2, top_k=(0, 8)[i % 2], logprobs=(None, 2)[i % 3 == 0], ignore_eos=False)
               for i, p in enumerate(params)]
    ref = make_mock_llm(overlap=False, verify_decode_rows=4, fault_rate=fault_rate).generate(prompts, sampled)
    on = make_mock_llm(overlap=True, chained_verify=True, verify_early_decode=True, verify_decode_rows=4,
                       fault_rate=fault_rate)
    assert_same(on.generate(prompts, sampled), ref)
    assert on.core.stats().chained_verify_passes > 0
    assert any(o.finish_reason == "stop" for o in ref), [o.finish_reason for o in ref]
