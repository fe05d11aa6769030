"""KernelSettings.prefill_pass_tile on CUDA: plain prefill passes at their own query tile.

The 16-row canonical tile may cost long prompts' prefill. Only the verifier's
kernels must share a tile, so a plain PREFILL pass may take 64 rows again; a DVR prompt's first token and K/V
then come from that tile, in the original run, its rebuilds and its replays alike. Checked here: the kernel
claims of the CPU interpreter check at real shapes, and DVR alone = among other traffic = replayed, bitwise.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import KernelSettings
from tests.engine.dvr_cases import assert_same, one_at_a_time, replay_requests, staggered
from tests.engine.test_gpu_dvr import make_real_llm, smollm2_model, smollm2_source  # noqa: F401
from tests.engine.test_gpu_verify_carry import _workload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_prefill_pass_tile_kernel_claims(dtype: torch.dtype) -> None:
    from tests.engine.test_canonical_decode import check_prefill_pass_tile

    check_prefill_pass_tile("cuda", dtype)


def test_dvr_bits_with_a_64_row_prefill_pass(make_real_llm: Any, smollm2_source: Any) -> None:  # noqa: F811
    kernels = KernelSettings(prefill_pass_tile=64)
    assert kernels.kernel_id().endswith("-p64")
    prompts, params = _workload(smollm2_source.tokenizer)
    cfg = dict(window=16, group=4, num_kv_blocks=600, cuda_graphs=True, kernels=kernels)
    alone = one_at_a_time(make_real_llm(**cfg), prompts, params)
    batched = staggered(make_real_llm(max_num_seqs=16, **cfg), prompts, params, every=2, seed=5)
    assert_same(alone, batched)
    results = make_real_llm(**cfg).replay(replay_requests(prompts, params, batched))
    assert all(r.first_mismatch is None and r.token_logprobs == o.token_logprobs for r, o in zip(results, batched))
