"""Engine overlap on CUDA (SmolLM2, bfloat16): the device sampler's deferred results, input ids chained
on the device (eager and inside decode graphs), canonical DVR rows on the side stream."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.sampling import SamplingParams, sample_rows, sample_rows_deferred
from tests.engine.dvr_cases import assert_same
from tests.engine.test_gpu_dvr import make_real_llm, smollm2_model, smollm2_source  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_deferred_device_samples_equal_sample_rows() -> None:
    g = torch.Generator(device="cpu").manual_seed(5)
    logits = (torch.randn(24, 50_000, generator=g) * 4).cuda()
    specs = [(SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, max_tokens=4), 1000 + i, 7 + i)
             for i in range(24)]
    pending = sample_rows_deferred(logits, specs)
    assert pending is not None and pending.tokens is not None and pending.tokens.is_cuda
    assert pending.results() == sample_rows(logits, specs)
    assert pending.tokens.tolist() == [r.token for r in pending.results()]
    # every parameter is sampled on the device: filtered rows and top logprobs stay in flight too
    filtered = [(SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.02, logprobs=3), 1 + i, 1 + i)
                for i in range(24)]
    deferred = sample_rows_deferred(logits, filtered)
    assert deferred.tokens is not None and deferred.tokens.is_cuda
    assert deferred.results() == sample_rows(logits, filtered)


@pytest.mark.parametrize("graphs", [False, True])
def test_fast_rows_chained_on_the_device_equal_the_sync_engine(make_real_llm: Any, graphs: bool) -> None:
    """Same batches in both runs (no stops; rows leave at max_tokens, so their indices shift between
    steps): the same bits only if every input id copied device to device is that sequence's token of the
    previous step."""
    prompts = [[1, 2, 3, 4 + i, 5, 6] for i in range(6)]
    params = [SamplingParams(max_tokens=10 + 4 * i, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
              for i in range(6)]
    kw = {"mode": "nondeterministic", "cuda_graphs": graphs, "max_num_seqs": 8}
    ref = make_real_llm(overlap=False, **kw).generate(prompts, params)
    got = make_real_llm(overlap=True, **kw).generate(prompts, params)
    assert_same(ref, got)


@pytest.mark.parametrize("graphs", [False, True])
def test_dvr_bits_with_overlap_and_concurrent_canonical_rows(make_real_llm: Any, graphs: bool) -> None:
    """Deterministic requests among fast co-traffic, overlap on (canonical rows on the side stream) give
    a lone sync run's token ids and logprobs."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6], [100, 200, 300, 400, 500], [42] * 12]
    det = [SamplingParams(max_tokens=60, temperature=0.0 if i % 2 == 0 else 0.7, seed=11 + i,
                          deterministic=True, ignore_eos=True) for i in range(len(prompts))]
    ref = [make_real_llm(window=8, group=2, overlap=False).generate([p], [sp])[0] for p, sp in zip(prompts, det)]
    llm = make_real_llm(window=8, group=2, overlap=True, cuda_graphs=graphs, max_num_seqs=8)
    assert llm.core.runner.model.attention.concurrent_canonical
    fast = [SamplingParams(max_tokens=30 + 9 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    outs = llm.generate(prompts + [p[::-1] for p in prompts], det + fast)
    assert_same(ref, outs[: len(prompts)])


def test_side_stream_canonical_rows_equal_one_stream() -> None:
    from engine.attention.triton_backend import TritonPagedAttention
    from tests.engine.test_canonical_decode import _decode_meta, _kv_at
    from tests.engine.gpu_reference import make_paged_case

    lens = [300, 40, 1100, 64, 700, 33]
    case = make_paged_case(lens, [1] * len(lens), 32, 8, 128, 16, torch.bfloat16, "cuda", seed=3)
    rows = torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.int32, device="cuda")
    meta = _decode_meta(case, rows)
    k, v = _kv_at(case, meta.slot_mapping)
    outs = []
    for concurrent in (True, False):
        backend = TritonPagedAttention()
        backend.concurrent_canonical = concurrent
        outs.append(backend.forward(case["q"], k, v, case["k_cache"], case["v_cache"], backend.plan(meta, 16),
                                    128 ** -0.5))
    torch.cuda.synchronize()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("graphs", [False, True])
def test_chained_verify_windows_ending_in_flight_keep_the_bits(make_real_llm: Any, graphs: bool) -> None:
    """chained_verify on CUDA (packed passes, carried rows, early decode: the CUDA defaults): verify passes
    launched behind the decode step in flight, whose windows may end at its tokens (input ids taken on the
    device, in the verify graph's staged ids too), give a lone sync run's token ids and logprobs."""
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6], [100, 200, 300, 400, 500], [42] * 12]
    det = [SamplingParams(max_tokens=60, temperature=0.0 if i % 2 == 0 else 0.7, seed=11 + i,
                          deterministic=True, ignore_eos=True) for i in range(len(prompts))]
    ref = [make_real_llm(window=8, group=2, overlap=False).generate([p], [sp])[0] for p, sp in zip(prompts, det)]
    llm = make_real_llm(window=8, group=2, overlap=True, cuda_graphs=graphs, max_num_seqs=8, chained_verify=True)
    runner = llm.core.runner
    verify, seen = runner.verify, {"row_chains": 0}

    def counted(rows: Any, carried: Any = None, chain: Any = None, row_chain: Any = None) -> Any:
        seen["row_chains"] += len(row_chain or ())
        return verify(rows, carried, chain=chain, row_chain=row_chain)

    runner.verify = counted
    fast = [SamplingParams(max_tokens=30 + 9 * i, temperature=1.0, seed=i, ignore_eos=True) for i in range(4)]
    outs = llm.generate(prompts + [p[::-1] for p in prompts], det + fast)
    assert_same(ref, outs[: len(prompts)])
    stats = llm.core.stats()
    print(f"[chained] graphs={runner.graphs_status} passes={stats.verify_passes} "
          f"chained={stats.chained_verify_passes} inputs in flight={seen['row_chains']}")
    assert stats.chained_verify_passes > 0 and seen["row_chains"] > 0, (stats, seen)
