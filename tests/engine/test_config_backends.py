"""EngineConfig's backend / KV-budget fields on the CPU: resolution and clear errors."""
from __future__ import annotations

import pytest

from engine.config import (CUDA_SEQ_SIZING_TOKENS, DEFAULT_CUDA_MAX_NUM_SEQS, DEFAULT_DECODE_CUBLASLT_MIN_ROWS,
                           EngineConfig, resolve_decode_cublaslt_min_rows, resolve_max_num_seqs)


def test_auto_backend_resolves_to_torch_on_cpu() -> None:
    assert EngineConfig(device="cpu").attention_backend == "torch"
    assert EngineConfig(device="cpu", mode="batch_invariant").attention_backend == "batch_invariant"


@pytest.mark.parametrize("backend", ["triton", "flash"])
def test_gpu_backends_refused_on_cpu(backend: str) -> None:
    with pytest.raises(ValueError, match="attention_backend.*CUDA only"):
        EngineConfig(device="cpu", attention_backend=backend)


def test_unknown_backend_named() -> None:
    with pytest.raises(ValueError, match="attention_backend.*'sdpa'"):
        EngineConfig(device="cpu", attention_backend="sdpa")


@pytest.mark.parametrize("share", [0.0, -0.1, 1.5])
def test_kv_memory_share_bounds(share: float) -> None:
    with pytest.raises(ValueError, match="kv_memory_share"):
        EngineConfig(device="cpu", kv_memory_share=share)


def test_cpu_kv_budget_default(tiny_llama_dir) -> None:
    from engine.llm import LLM

    llm = LLM(EngineConfig(model=str(tiny_llama_dir), device="cpu", num_threads=1))
    assert llm.config.num_kv_blocks == 514 == llm.core.runner.kv.k[0].shape[0]
    assert llm.core.runner.graphs_status == "eager"


def test_dvr_decode_attention_auto_resolution() -> None:
    """auto: canonical_step_short on CUDA (one canonical launch for a step holding a DVR row when its rows
    are short; measured on the H200), split on the CPU; lookahead follows (G-1)*W for canonical
    rows, W-1 for split ones."""
    cuda = EngineConfig(device="cuda", window=32, group=8)
    assert (cuda.dvr_decode_attention, cuda.dvr_lookahead) == ("canonical_step_short", 7 * 32)
    with pytest.raises(ValueError, match="dvr_decode_attention.*'sideways'"):
        EngineConfig(device="cpu", dvr_decode_attention="sideways")
    cpu = EngineConfig(device="cpu", window=32, group=8)
    assert (cpu.dvr_decode_attention, cpu.dvr_lookahead) == ("split", 31)


def test_decode_cublaslt_min_rows_is_cuda_only_and_checked() -> None:
    assert EngineConfig(device="cpu").decode_cublaslt_min_rows == 0
    # the default: cuBLASLt from DEFAULT_DECODE_CUBLASLT_MIN_ROWS rows when CUDA decode graphs are on, else never
    default = EngineConfig(device="cuda", cuda_graphs=True).decode_cublaslt_min_rows
    assert default == DEFAULT_DECODE_CUBLASLT_MIN_ROWS == 32
    assert EngineConfig(device="cuda", cuda_graphs=False).decode_cublaslt_min_rows == 0
    assert EngineConfig(device="cuda", cuda_graphs=True, decode_cublaslt_min_rows=0).decode_cublaslt_min_rows == 0
    assert EngineConfig(device="cuda", cuda_graphs=True, decode_cublaslt_min_rows=32).decode_cublaslt_min_rows == 32
    # the one rule the engine and the bench share
    assert [resolve_decode_cublaslt_min_rows(v, g) for v, g in ((None, True), (None, False), (0, True), (8, False))] \
        == [DEFAULT_DECODE_CUBLASLT_MIN_ROWS, 0, 0, 8]
    with pytest.raises(ValueError, match="decode_cublaslt_min_rows.*CUDA only"):
        EngineConfig(device="cpu", decode_cublaslt_min_rows=32)
    with pytest.raises(ValueError, match="decode_cublaslt_min_rows.*>= 0"):
        EngineConfig(device="cuda", decode_cublaslt_min_rows=-1)


def test_blas_library_context_restores_the_preference() -> None:
    """engine.cuda_graphs.blas_library: None leaves torch's BLAS preference alone; a library is set inside
    and the previous preference comes back on exit, also when the body raises ("ck" here, a library other
    than the default that a CPU build of torch accepts; it refuses cuBLASLt)."""
    import torch

    from engine.cuda_graphs import DecodeGraphs, blas_library

    before = torch.backends.cuda.preferred_blas_library()
    with blas_library(None):
        assert torch.backends.cuda.preferred_blas_library() == before
    with pytest.raises(RuntimeError, match="inside"):
        with blas_library("ck"):
            assert torch.backends.cuda.preferred_blas_library() == torch._C._BlasBackend.Ck != before
            raise RuntimeError("inside")
    assert torch.backends.cuda.preferred_blas_library() == before
    # which sizes a family captures with cuBLASLt
    from types import SimpleNamespace

    assert [DecodeGraphs.blas_for(SimpleNamespace(cublaslt_min_rows=32), b) for b in (1, 31, 32, 256)] == \
        [None, None, "cublaslt", "cublaslt"]
    assert DecodeGraphs.blas_for(SimpleNamespace(cublaslt_min_rows=0), 256) is None


def test_cuda_defaults_take_the_fast_path() -> None:
    """EngineConfig() on CUDA is what `serve` runs with no options: CUDA graphs on, the GPU prefill budget, and a
    running-sequence limit sized from the KV budget once the runner knows it; the CPU keeps its small defaults."""
    cuda = EngineConfig(device="cuda")
    assert (cuda.cuda_graphs, cuda.max_num_seqs, cuda.max_num_batched_tokens) == (True, None, 8192)
    cpu = EngineConfig(device="cpu")
    assert (cpu.cuda_graphs, cpu.max_num_seqs, cpu.max_num_batched_tokens) == (False, 32, 4096)
    explicit = EngineConfig(device="cuda", cuda_graphs=False, max_num_seqs=8, max_num_batched_tokens=1024)
    assert (explicit.cuda_graphs, explicit.max_num_seqs, explicit.max_num_batched_tokens) == (False, 8, 1024)
    # sized from the budget: the full limit while it holds CUDA_SEQ_SIZING_TOKENS slots a sequence, fewer below
    assert resolve_max_num_seqs(None, 10**7) == DEFAULT_CUDA_MAX_NUM_SEQS == 256
    assert resolve_max_num_seqs(None, 64 * CUDA_SEQ_SIZING_TOKENS + 5) == 64
    assert resolve_max_num_seqs(None, 10) == 1
    assert resolve_max_num_seqs(12, 10) == 12
    with pytest.raises(ValueError, match="cuda_graphs.*bool"):
        EngineConfig(device="cuda", cuda_graphs="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_num_seqs.*>= 1"):
        EngineConfig(device="cuda", max_num_seqs=0)
