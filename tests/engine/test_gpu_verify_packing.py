"""Packed verify passes on CUDA (DvrTuning.verify_packing = "packed").

Packing moves a window to another row offset of the pass (not only a multiple of W), so it rests on two
device properties: the Triton verify kernel's tiles are absolute (a query's bits do not depend on its
row's offset or length), and a cuBLAS GEMM of fixed shape gives a row the same bits wherever it sits.
The second is checked directly at the Llama-3.1-8B linear shapes and the pass's M; then SmolLM2 runs the
same requests padded and packed, eager and under the verify graph (captured bit-exact with staged query
starts), and must give the same bits.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.engine.dvr_cases import assert_same, staggered
from tests.engine.test_gpu_dvr import make_real_llm, smollm2_model, smollm2_source  # noqa: F401
from tests.engine.test_gpu_verify_carry import _workload
from tests.engine.test_verify_packing import _verify_plans

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# (N, K) of the 8B's linear layers, fused and unfused (q, k/v, qkv, o, gate / up, gate_up, down, lm head)
LLAMA_8B_LINEARS = [(4096, 4096), (1024, 4096), (6144, 4096), (14336, 4096), (28672, 4096), (4096, 14336),
                    (128256, 4096)]


@pytest.mark.parametrize("m", [256, 320])  # G*W, and G*W + D with D = 64 (the CUDA default)
def test_gemm_rows_do_not_depend_on_their_offset(m: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(3)
    for n, k in LLAMA_8B_LINEARS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k ** -0.5
        y = F.linear(x, w)
        for shift in (1, 5, 17, 31, 100):
            moved = F.linear(torch.roll(x, shift, 0), w)
            assert torch.equal(torch.roll(y, shift, 0), moved), f"(M, N, K) = {(m, n, k)}: a row moved by {shift}"


@pytest.mark.parametrize("graphs", [False, True])
def test_packed_equals_padded_on_cuda(make_real_llm: Any, smollm2_source: Any, graphs: bool) -> None:  # noqa: F811
    prompts, params = _workload(smollm2_source.tokenizer)
    params = [replace(p, max_tokens=5 + 9 * i) for i, p in enumerate(params)]  # partial last windows
    cfg = dict(window=16, group=4, num_kv_blocks=600, cuda_graphs=graphs, max_num_seqs=16)
    padded = make_real_llm(verify_packing="padded", **cfg)  # CUDA's default is packed
    ref = staggered(padded, prompts, params, every=2, seed=3)
    llm = make_real_llm(verify_packing="packed", **cfg)
    runner = llm.core.runner
    print(f"[packing] graphs={graphs} status={runner.graphs_status}")
    if graphs:  # the packed verify graph was captured and matched the eager pass bit for bit
        assert "+verify" in runner.graphs_status, runner.graphs_status
        assert runner.verify_graph.packed
    plans = _verify_plans(llm)
    got = staggered(llm, prompts, params, every=2, seed=3)
    assert_same(ref, got)
    print(f"[packing] window lengths per pass: {plans}")
    assert any(len(p) > 4 for p in plans), plans
