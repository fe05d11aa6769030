"""Verify passes that carry a decode step, on CUDA (SmolLM2, bfloat16, Triton attention, D = 64 by default).

The verify rows go through the prefill kernel exactly as in a pass without carried rows, the carried rows
through the canonical decode kernel, and every GEMM has M = G*W + D whatever is carried: DVR outputs
made among other traffic (real carried rows) must equal the same requests alone (dummy carried rows), bit
for bit, eager and under the verify graph, whose capture must be bit-exact with D rows too.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import DEFAULT_VERIFY_DECODE_ROWS
from engine.sampling import SamplingParams
from tests.engine.configs import CONTEXT, FREE_KV_BLOCKS
from tests.engine.dvr_cases import assert_same, one_at_a_time, staggered
from tests.engine.test_gpu_dvr import gpu_config, make_real_llm, smollm2_model, smollm2_source  # noqa: F401
from tests.engine.test_verify_carry import test_real_model_alone_equals_batched_with_carried_rows  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TEXTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "Roses are red,",
         "2 + 2 =", "The quick brown fox", "List three prime numbers:", "In 1969, the first humans"]


def _workload(tok: Any) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts = [list(tok.encode(t)) for t in TEXTS]
    params = [SamplingParams(max_tokens=20 + 7 * i, temperature=0.8 if i % 2 else 0.0, seed=500 + i,
                             deterministic=True, ignore_eos=True) for i in range(len(TEXTS))]
    return prompts, params


def test_default_carries_64_rows_on_triton() -> None:
    def carried(**cfg: Any) -> int | None:
        return gpu_config(**cfg).resolve(model_max_len=CONTEXT, free_kv_blocks=FREE_KV_BLOCKS).tuning.verify_decode_rows

    assert carried() == DEFAULT_VERIFY_DECODE_ROWS == 64
    assert carried(mode="nondeterministic") == 0


@pytest.mark.parametrize("graphs", [False, True])
def test_carried_rows_change_no_committed_bit_on_cuda(make_real_llm: Any, smollm2_source: Any,  # noqa: F811
                                                      graphs: bool) -> None:
    prompts, params = _workload(smollm2_source.tokenizer)
    cfg = dict(window=16, group=4, num_kv_blocks=600, cuda_graphs=graphs)
    alone = one_at_a_time(make_real_llm(**cfg), prompts, params)
    llm = make_real_llm(max_num_seqs=16, **cfg)
    runner = llm.core.runner
    print(f"[carry] graphs={graphs} status={runner.graphs_status}")
    if graphs:  # the G*W + D verify graph was captured and matched the eager pass bit for bit
        assert "+verify" in runner.graphs_status, runner.graphs_status
        assert runner.verify_graph.carried == DEFAULT_VERIFY_DECODE_ROWS
    batched = staggered(llm, prompts, params, every=2, seed=3)
    assert_same(alone, batched)
    stats = llm.core.stats()
    print(f"[carry] carried rows {stats.carried_decode_rows} in {stats.verify_passes} passes, "
          f"{stats.decode_passes} decode passes, {stats.rollbacks} rollbacks")
    assert stats.carried_decode_rows > 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_carried_attention_on_cuda(dtype: torch.dtype) -> None:
    """Llama-3.1-8B heads (32 q / 8 KV, 128 dims), W = 32: the kernel-level claims of the CPU check."""
    from tests.engine.test_verify_carry import check_carried_attention

    check_carried_attention("triton", "cuda", dtype, (32, 8, 128, 16), [300, 1000, 64, 2000],
                            [5, 4097, 700, 1, 256, 257], window=32)


def test_concurrent_carried_rows_give_the_same_bits(make_real_llm: Any, smollm2_source: Any) -> None:  # noqa: F811
    """KernelSettings.concurrent_carried (off by default): the
    carried rows' kernel on the side stream, eager and captured in the verify graph, changes no bit."""
    from engine.config import KernelSettings

    prompts, params = _workload(smollm2_source.tokenizer)
    cfg = dict(window=16, group=4, num_kv_blocks=600, cuda_graphs=True, max_num_seqs=16)
    want = staggered(make_real_llm(**cfg), prompts, params, every=2, seed=3)
    concurrent = KernelSettings(concurrent_carried=True)
    llm = make_real_llm(kernels=concurrent, **cfg)
    assert llm.core.runner.model.attention.settings.concurrent_carried
    assert "+verify" in llm.core.runner.graphs_status, llm.core.runner.graphs_status
    got = staggered(llm, prompts, params, every=2, seed=3)
    eager = staggered(make_real_llm(kernels=concurrent, **{**cfg, "cuda_graphs": False}), prompts, params, every=2,
                      seed=3)
    assert_same(want, got)
    assert_same(want, eager)
    # the fast path's tokens (the carried rows' candidates) are the same too: same kernels, same inputs
    assert [o.rollbacks for o in want] == [o.rollbacks for o in got]
