"""Chunked canonical prefill passes on CUDA (canonical_prefill_chunk_tokens = C > 0), on a synthetic SmolLM2
in bfloat16 with the Triton backend: every body GEMM of a canonical pass has C rows, and a DVR prompt's
committed bits are the same alone (a pass of its own size) and packed with others (a larger pass, another
offset), in eager and graphed engines."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.model_runner import ModelRunner, Row
from engine.sampling import SamplingParams
from engine.scheduler import CANONICAL_PREFILL_ROWS
from tests.engine.configs import resolved
from tests.engine.dvr_cases import assert_same, one_at_a_time
from tests.engine.test_canonical_prefill_chunks import _GemmRows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

C = 256
LENGTHS = [5, 37, 120, 300, 700]


@pytest.fixture(scope="module")
def synthetic() -> tuple[Any, Any]:
    from bench.engine_bench.common import engine_shape
    from engine.models.synthetic import build_synthetic_model

    model = build_synthetic_model("smollm2-135m", torch.bfloat16, "cuda", seed=11, attention_backend="triton")
    return model, engine_shape(model, 8192)


def _llm(synthetic: tuple[Any, Any], **cfg: Any) -> LLM:
    model, shape = synthetic
    options = {"device": "cuda", "attention_backend": "triton", "num_kv_blocks": 600, "max_num_seqs": 32,
               "window": 16, "group": 4, "canonical_prefill_chunk_tokens": C, **cfg}
    return LLM.from_parts(EngineConfig.from_options(options), model, shape, {2})


def _workload() -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in LENGTHS]
    params = [SamplingParams(max_tokens=20, temperature=0.9 if i % 2 else 0.0, seed=40 + i, deterministic=True,
                             ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


def _record_passes(llm: LLM) -> list[int | None]:
    passes: list[int | None] = []
    prefill = llm.core.runner.prefill_with_prompts
    llm.core.runner.prefill_with_prompts = lambda rows, p, lp: passes.append(p) or prefill(rows, p, lp)  # type: ignore
    return passes


def test_every_body_gemm_of_a_canonical_pass_has_c_rows(synthetic: tuple[Any, Any]) -> None:
    model, shape = synthetic
    cfg = resolved(device="cuda", attention_backend="triton", num_kv_blocks=64, cuda_graphs=False,
                   tuning={"canonical_prefill_chunk_tokens": C})
    runner = ModelRunner(cfg, model, shape, torch.bfloat16, torch.device("cuda"))
    vocab_weight = (model.lm_head.out_features, model.lm_head.in_features)
    with _GemmRows(model.linear_shapes()) as seen:
        runner.prefill([Row(list(range(10, 310)), 0, list(range(2, 21))), Row([9] * 7, 0, [21])],
                       pass_tokens=2 * C)
    assert {m for w, m in seen.rows if w != vocab_weight} == {C}
    assert [m for w, m in seen.rows if w == vocab_weight] == [CANONICAL_PREFILL_ROWS]


@pytest.mark.parametrize("graphs", [False, True])
def test_dvr_bits_alone_and_packed(synthetic: tuple[Any, Any], graphs: bool) -> None:
    prompts, params = _workload()
    alone_llm = _llm(synthetic, cuda_graphs=graphs)
    alone_passes = _record_passes(alone_llm)
    alone = one_at_a_time(alone_llm, prompts, params)
    assert alone_passes == [C, C, C, 2 * C, 3 * C]
    llm = _llm(synthetic, cuda_graphs=graphs)
    passes = _record_passes(llm)
    head = torch.randint(3, 49152, (500,), generator=torch.Generator().manual_seed(6)).tolist()
    fast = SamplingParams(max_tokens=4, temperature=1.0, seed=1)
    mixed = llm.generate([head] + prompts, [fast] + params)
    assert passes == [-(-(500 + sum(LENGTHS)) // C) * C]
    assert_same(mixed[1:], alone)
