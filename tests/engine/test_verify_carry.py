"""Verify passes that carry a decode step (`DvrTuning.verify_decode_rows` = D).

A verify pass runs its G x W verify tokens and then D one-token decode rows of other running requests in
one forward, so both share one read of the weights. The pass is always G*W + D tokens (dummy rows where
fewer are carried), so a verify row's bits depend on D but never on what is carried: DVR outputs made
under load with real carried rows must equal the same requests run alone (every carried slot a dummy),
bit for bit, with rollbacks, overlap, preemption and replay. The mock model gives carried rows fast-path
noise (so their candidates roll back) and verify rows none.
"""
from __future__ import annotations

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


@pytest.fixture
def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    return det_workload(16, VOCAB, max_tokens=(20, 60), seed=11)


@pytest.fixture
def reference(make_mock_llm: Any, workload: Any) -> list[Any]:
    """All 16 together, nothing carried (D = 0)."""
    prompts, params = workload
    return make_mock_llm(verify_decode_rows=0).generate(prompts, params)


def _carried_plans(llm: Any) -> list[tuple[int, set[str], set[str]]]:
    """Record each verify plan: (carried rows, keys verified, keys carried)."""
    seen: list[tuple[int, set[str], set[str]]] = []
    sched = llm.core.scheduler
    original = sched.schedule

    def schedule() -> Any:
        plan = original()
        if plan.kind == StepKind.VERIFY:
            seen.append((len(plan.decode), {r.seq.key for r in plan.verify}, {s.key for s in plan.decode}))
        return plan

    sched.schedule = schedule  # type: ignore[method-assign]
    return seen


def test_config_resolves_and_checks_the_field() -> None:
    assert resolved(device="cpu").tuning.verify_decode_rows == 0  # torch backend: off unless asked
    assert resolved(device="cpu", tuning=DvrTuning(verify_decode_rows=5)).tuning.verify_decode_rows == 5
    # no verify passes outside dvr: nothing to carry, whatever was asked
    assert resolved(device="cpu", mode="nondeterministic",
                    tuning=DvrTuning(verify_decode_rows=5)).tuning.verify_decode_rows == 0
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.verify_decode_rows: must be an int >= 0"):
        EngineConfig(device="cpu", tuning=DvrTuning(verify_decode_rows=-1))


def test_fingerprint_names_the_carried_rows() -> None:
    assert "verify_decode_rows" not in runtime_fingerprint(resolved(device="cpu"))
    assert runtime_fingerprint(resolved(device="cpu",
                                        tuning=DvrTuning(verify_decode_rows=4)))["verify_decode_rows"] == 4


@pytest.mark.parametrize("d", [1, 3, 8])
@pytest.mark.parametrize("overlap", [False, True])
def test_carried_rows_change_no_committed_bit(make_mock_llm: Any, workload: Any, reference: Any, d: int,
                                              overlap: bool) -> None:
    prompts, params = workload
    llm = make_mock_llm(verify_decode_rows=d, overlap=overlap)
    plans = _carried_plans(llm)
    out = staggered(llm, prompts, params, every=2, seed=d)  # with non-deterministic companions
    assert_same(out, reference)
    for o in out:
        assert_windows_cover(o, 8)
    stats = llm.core.stats()
    assert stats.carried_decode_rows == sum(n for n, _, _ in plans) > 0
    assert all(n <= d for n, _, _ in plans)
    assert all(not (verified & carried) for _, verified, carried in plans)  # a row is verified or carried
    assert stats.rollbacks > 0  # carried candidates are fast-path ones: they still get checked


def test_carrying_saves_decode_steps(make_mock_llm: Any, workload: Any) -> None:
    prompts, params = workload
    off = make_mock_llm(verify_decode_rows=0)
    on = make_mock_llm(verify_decode_rows=16)
    assert_same(off.generate(prompts, params), on.generate(prompts, params))
    assert on.core.stats().decode_passes < off.core.stats().decode_passes


def test_alone_equals_batched_with_faults_and_preemption(make_mock_llm: Any, workload: Any, reference: Any) -> None:
    prompts, params = workload
    alone = one_at_a_time(make_mock_llm(verify_decode_rows=4), prompts, params)  # every carried slot a dummy
    assert_same(alone, reference)
    faulty = make_mock_llm(verify_decode_rows=4, fault_rate=0.3, fault_seed=5, overlap=True)
    assert_same(staggered(faulty, prompts, params, every=3, seed=2), reference)
    tight = make_mock_llm(verify_decode_rows=4, num_kv_blocks=24)  # KV pressure: preemptions and rebuilds
    assert_same(tight.generate(prompts, params), reference)
    assert tight.core.stats().preemptions > 0


def test_transcripts_replay_under_carried_rows(make_mock_llm: Any, workload: Any, reference: Any) -> None:
    prompts, params = workload
    made = staggered(make_mock_llm(verify_decode_rows=3, overlap=True), prompts, params, seed=9)
    llm = make_mock_llm(verify_decode_rows=3)
    results = llm.replay(replay_requests(prompts, params, made))
    for o, r in zip(made, results):
        assert r.first_mismatch is None
        assert r.token_ids == o.token_ids and r.token_logprobs == o.token_logprobs


@pytest.mark.slow
def test_real_model_alone_equals_batched_with_carried_rows(make_real_llm: Any, smollm2_source: Any) -> None:
    """SmolLM2 on the CPU (float32, torch backend), D = 4: a request alone, and the same requests among
    non-deterministic ones with real carried rows, give the same bits; and so does a replay."""
    prompts, params = real_workload(smollm2_source.tokenizer, lambda i: 5 + 2 * i)
    prompts, params = prompts[:4], params[:4]  # two greedy, two sampled
    cfg = dict(window=8, group=4, verify_decode_rows=4)
    alone = one_at_a_time(make_real_llm(**cfg), prompts, params)
    llm = make_real_llm(max_num_seqs=6, **cfg)
    batched = staggered(llm, prompts, params, every=2, seed=4)
    assert_same(alone, batched)
    assert llm.core.stats().carried_decode_rows > 0
    results = make_real_llm(**cfg).replay(replay_requests(prompts, params, batched))
    assert all(r.first_mismatch is None and r.token_logprobs == o.token_logprobs
               for r, o in zip(results, batched))


# ---- the attention backends on a verify pass with carried rows -----------------------------------------
def check_carried_attention(backend_name: str, device: str, dtype: Any, shape: tuple[int, int, int, int],
                            verify_lens: list[int], carried_lens: list[int], window: int) -> None:
    """One pass of G rows of `window` queries then D one-query rows over a random paged cache: the verify
    rows' output is bitwise the same pass without carried rows (with other carried rows too), and each
    carried row's is its own one-query canonical output (Triton: bitwise, the prefill kernel's bits; torch:
    close, the rows are tiled together as one group and their bits are a fast path's)."""
    import torch

    from engine.attention.metadata import AttentionMetadata, PassKind
    from tests.engine.gpu_reference import make_paged_case

    h, hkv, hd, bs = shape
    g, d = len(verify_lens), len(carried_lens)
    lens = verify_lens + carried_lens
    case = make_paged_case(lens, [window] * g + [1] * d, h, hkv, hd, bs, dtype, device, seed=5, spare_blocks=1)
    qsl, sl, bt = case["query_start_loc"], case["seq_lens"], case["block_tables"]
    pos = torch.cat([torch.arange(s - n, s) for s, n in zip(lens, [window] * g + [1] * d)]).to(device)
    rows = torch.repeat_interleave(torch.arange(g + d, device=device), (qsl[1:] - qsl[:-1]).long())
    slots = bt.long()[rows, pos // bs] * bs + pos % bs
    kc, vc = case["k_cache"], case["v_cache"]
    k = kc.view(-1, *kc.shape[2:])[slots].clone()  # the cache's own K/V: the backend's write is a no-op
    v = vc.view(-1, *vc.shape[2:])[slots].clone()
    scale = hd ** -0.5
    if backend_name == "triton":
        from engine.attention.triton_backend import TritonPagedAttention

        backend: Any = TritonPagedAttention()
    else:
        from engine.attention.torch_backend import TorchAttention

        backend = TorchAttention()
    meta = AttentionMetadata(PassKind.VERIFY, slots, qsl, sl, bt, carried_rows=d)
    out = backend.forward(case["q"], k, v, kc, vc, backend.plan(meta, bs), scale)
    tv = g * window
    plain = AttentionMetadata(PassKind.VERIFY, slots[:tv], qsl[: g + 1], sl[:g], bt[:g])
    alone = backend.forward(case["q"][:tv], k[:tv], v[:tv], kc, vc, backend.plan(plain, bs), scale)
    assert torch.equal(out[:tv], alone), "the carried rows changed a verify row's bits"
    # other carried queries: the verify rows keep their bits
    q2 = case["q"].clone()
    q2[tv:] = torch.randn(q2[tv:].shape, generator=torch.Generator().manual_seed(9)).to(dtype).to(device)
    out2 = backend.forward(q2, k, v, kc, vc, backend.plan(meta, bs), scale)
    assert torch.equal(out2[:tv], alone)
    for r in range(d):
        i = tv + r
        one = AttentionMetadata(PassKind.VERIFY, slots[i:i + 1], torch.tensor([0, 1], dtype=qsl.dtype, device=device),
                                sl[g + r:g + r + 1], bt[g + r:g + r + 1])
        ref = backend.forward(case["q"][i:i + 1], k[i:i + 1], v[i:i + 1], kc, vc, backend.plan(one, bs), scale)
        if backend_name == "triton":  # the canonical decode kernel: the verifier's bits for that query
            assert torch.equal(out[i], ref[0]), f"carried row {r} differs from its one-query canonical output"
        else:  # torch: the carried rows are one tiled group (CPU BLAS batches them): a fast path's numerics
            torch.testing.assert_close(out[i], ref[0], rtol=1e-5, atol=1e-6)


def _interpreter_main() -> None:
    """Entry of the TRITON_INTERPRET=1 subprocess: the Triton backend's carried rows (tiny shapes)."""
    import torch

    from tests.engine.test_canonical_decode import packed_unchecked, patch_interpreter

    patch_interpreter()
    packed_unchecked(torch.bfloat16, 2, 16)
    # bfloat16, the dtype served on GPUs (both dtypes of the kernels run in test_canonical_decode's checks)
    check_carried_attention("triton", "cpu", torch.bfloat16, (4, 2, 16, 16), [40, 75], [9, 130, 1], window=8)
    print("interpreter ok")


def test_carried_attention_torch_backend() -> None:
    import torch

    check_carried_attention("torch", "cpu", torch.float32, (4, 2, 16, 16), [40, 75, 20], [9, 130, 1, 64], window=8)


def test_carried_attention_under_the_triton_interpreter() -> None:
    from tests.engine.test_canonical_decode import run_under_triton_interpreter

    run_under_triton_interpreter("tests.engine.test_verify_carry")


def test_carrying_never_preempts_and_skips_rows_without_a_free_slot() -> None:
    """Scheduler._carried: rows in running order, at most D, not the pass's own rows; a row whose next slot
    needs a block that is not free is left to a later decode step (no preemption, nothing allocated)."""
    from engine.scheduler import Scheduler, seq_key
    from engine.sequence import Sequence, SeqKind, SeqStatus

    config = resolved(device="cpu", window=4, group=2, block_size=4, num_kv_blocks=6,
                      tuning=DvrTuning(verify_decode_rows=2))
    sched = Scheduler(config, {1})
    seqs = []
    for i, prompt_len in enumerate([4, 3, 3, 2]):
        s = Sequence(f"r{i}", [5] * prompt_len, SamplingParams(max_tokens=20), i, SeqKind.FAST, i,
                     status=SeqStatus.RUNNING)
        s.tokens = [7]  # the next decode step writes position prompt_len: slot prompt_len + 1 needed
        s.kv_len = prompt_len
        sched.blocks.ensure(seq_key(s), prompt_len + 1 if prompt_len < 4 else 4)
        sched.running.append(s)
        seqs.append(s)
    assert sched.blocks.num_free == 0  # 4 usable blocks, one per row
    # r0 (4 prompt tokens) needs a second block for its fifth slot, none is free: skipped; r1 is verified
    carried = sched._carried(seqs, {seqs[1]})
    assert carried == [seqs[2], seqs[3]] and sched.preemptions == 0
    assert len(sched.blocks.table(seq_key(seqs[0]))) == 1
    assert sched._carried(seqs, set()) == [seqs[1], seqs[2]]  # at most D, running order
