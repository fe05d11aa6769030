"""DVR on the real default model with long windows (test_dvr_real.py's workload, a file of its own so that
another worker takes it): the default W=32, G=8, and several windows of one request in one verify pass."""
from __future__ import annotations

from dataclasses import replace

import pytest

from tests.engine.dvr_cases import assert_same, assert_windows_cover, replay_requests, staggered
from tests.engine.test_dvr_real import SMALL, workload  # noqa: F401 - workload is the shared fixture

pytestmark = pytest.mark.slow


def test_default_window_and_group(make_real_llm, workload) -> None:
    """W=32, G=8 (the defaults): three requests of 33 to 37 tokens batched with faults (rolled back at least
    once, at the default verify cadence) equal a fault-free run under a batch limit of two with the cadence
    off, whose windows hold up to 32 tokens, and replays match."""
    prompts, params = workload
    params = [replace(p, max_tokens=33 + i * 2, ignore_eos=True) for i, p in enumerate(params[:3])]
    prompts = prompts[:3]
    a = make_real_llm(fault_rate=0.1, fault_seed=4).generate(prompts, params)
    assert sum(o.rollbacks for o in a) > 0
    b = make_real_llm(max_num_seqs=2, verify_cadence_steps=0).generate(prompts[::-1], params[::-1])[::-1]
    assert_same(a, b)
    assert any(e - s == 32 for o in b for s, e in o.windows)
    assert all(o.window_shape == (8, 32) for o in a)
    for o in a:
        assert_windows_cover(o, 32)
    res = make_real_llm().replay(replay_requests(prompts, params, a))
    assert all(r.first_mismatch is None and r.token_logprobs == o.token_logprobs for r, o in zip(res, a))


def test_multi_window_passes_on_the_real_model(make_real_llm, workload) -> None:
    """Canonical DVR decode rows and the default run-ahead ((G-1)*W): rows verified several windows per
    pass, staggered among non-deterministic traffic, commit the reference bits."""
    prompts, params = workload
    longer = [replace(p, max_tokens=p.max_tokens + 20) for p in params[:6]]
    ref = make_real_llm(dvr_lookahead=0, **SMALL).generate(prompts[:6], longer)
    llm = make_real_llm(dvr_decode_attention="canonical", **SMALL)
    assert llm.config.tuning.dvr_lookahead == (SMALL["group"] - 1) * SMALL["window"]
    passes: list[int] = []
    sched = llm.core.scheduler

    def recording(original):  # type: ignore[no-untyped-def]
        def plan_and_record():  # type: ignore[no-untyped-def]
            plan = original()
            if plan is not None and plan.verify:
                passes.append(len(plan.verify) - len({id(r.seq) for r in plan.verify}))  # later windows in it
            return plan
        return plan_and_record

    # plans come from `schedule` and, with overlap and chained verify passes (the CUDA default), `chained_verify`
    sched.schedule = recording(sched.schedule)  # type: ignore[method-assign]
    sched.chained_verify = recording(sched.chained_verify)  # type: ignore[method-assign]
    assert_same(ref, staggered(llm, prompts[:6], longer, seed=3))
    assert sum(passes) > 0, passes  # some pass held two or more windows of one request
