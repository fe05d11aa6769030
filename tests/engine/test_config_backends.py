"""EngineConfig: the options a user sets, their checks, and `resolve` (the defaults decided per device)."""
from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from engine.config import (CUDA_SEQ_SIZING_TOKENS, DEFAULT_CUDA_MAX_NUM_SEQS, DEFAULT_DECODE_CUBLASLT_MIN_ROWS,
                           AttentionBackend, Device, DType, DvrDecodeAttention, DvrTuning, EngineConfig,
                           KernelSettings, Mode, TpReduction, VerifyPacking, VerifyTrigger,
                           resolve_decode_cublaslt_min_rows, resolve_max_num_seqs)

CONTEXT = 8192  # the model's context length handed to resolve


def resolved(device: str, **options: Any) -> EngineConfig:
    return EngineConfig.from_options({"device": device, **options}).resolve(model_max_len=CONTEXT,
                                                                            free_kv_blocks=4096)


def none_fields(obj: Any, path: str = "") -> list[str]:
    """The dotted names of every None field of a dataclass, nested dataclasses included."""
    out = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None:
            out.append(path + f.name)
        elif dataclasses.is_dataclass(value):
            out += none_fields(value, f"{path}{f.name}.")
    return out


def test_resolve_leaves_no_none() -> None:
    config = EngineConfig()
    assert "tuning.overlap" in none_fields(config)
    for device in ("cpu", "cuda", torch.device("cpu"), torch.device("cuda")):
        assert none_fields(config.resolve(device, model_max_len=CONTEXT, free_kv_blocks=1000)) == []
    cpu = config.resolve("cpu", model_max_len=CONTEXT)
    assert cpu.resolve() == cpu  # resolving a resolved config changes nothing
    assert EngineConfig(device="cpu").resolve(model_max_len=CONTEXT) == cpu


def test_resolved_cpu_defaults() -> None:
    """The values the engine runs with on the CPU when nothing is set."""
    c = EngineConfig().resolve("cpu", model_max_len=CONTEXT)
    assert (c.device, c.dtype, c.mode, c.attention_backend, c.tp_reduction) == (
        "cpu", "float32", "dvr", "torch", "gather_sum")
    assert (c.window, c.group, c.block_size, c.num_kv_blocks, c.max_num_seqs, c.max_num_batched_tokens,
            c.max_model_len, c.cuda_graphs, c.tensor_parallel_size) == (32, 8, 16, 514, 32, 4096, 8192, False, 1)
    assert c.kernels == KernelSettings(query_tile=16, chunk=256, prefill_pass_tile=16)
    assert c.tuning == DvrTuning(
        canonical_prefill_min_tokens=64, canonical_prefill_chunk_tokens=0, dvr_decode_attention="split",
        dvr_lookahead=31, overlap=False,
        verify_early_decode=False, chained_verify=False, decode_cublaslt_min_rows=0, verify_decode_rows=0,
        verify_packing="padded", verify_max_windows=8, verify_trigger="windows", verify_cadence_steps=20,
        verify_cadence_max_rows=8)
    assert c.num_threads == torch.get_num_threads()
    assert c.cache_dir


def test_resolved_cuda_defaults() -> None:
    """The values the engine runs with on CUDA when nothing is set (resolved without a GPU: the free KV blocks
    are handed in, as the model runner measures them)."""
    c = EngineConfig().resolve("cuda", model_max_len=CONTEXT, free_kv_blocks=64 * CUDA_SEQ_SIZING_TOKENS // 16 + 2)
    assert (c.device, c.dtype, c.attention_backend, c.cuda_graphs, c.max_num_batched_tokens) == (
        "cuda", "bfloat16", "triton", True, 8192)
    assert (c.num_kv_blocks, c.max_num_seqs) == (64 * CUDA_SEQ_SIZING_TOKENS // 16 + 2, 64)
    assert c.tuning == DvrTuning(
        canonical_prefill_min_tokens=2048, canonical_prefill_chunk_tokens=512,
        dvr_decode_attention="canonical_step_short", dvr_lookahead=7 * 32,
        overlap=True, verify_early_decode=True, chained_verify=True, decode_cublaslt_min_rows=32,
        verify_decode_rows=64, verify_packing="packed", verify_max_windows=16, verify_trigger="tokens",
        verify_cadence_steps=8, verify_cadence_max_rows=8)
    with pytest.raises(ValueError, match=r"EngineConfig\.num_kv_blocks: .*free_kv_blocks"):
        EngineConfig().resolve("cuda", model_max_len=CONTEXT)
    with pytest.raises(ValueError, match=r"EngineConfig\.max_model_len: .*model_max_len"):
        EngineConfig().resolve("cpu")
    with pytest.raises(ValueError, match=r"EngineConfig\.device: 'cpu', resolved for cuda"):
        EngineConfig(device="cpu").resolve("cuda")
    assert EngineConfig(max_model_len=100_000).resolve("cpu", model_max_len=CONTEXT).max_model_len == CONTEXT
    assert EngineConfig(max_model_len=100).resolve("cpu", model_max_len=CONTEXT).max_model_len == 100


def test_choices_coerce_from_strings() -> None:
    c = EngineConfig(device="cuda", dtype="float16", mode="nondeterministic", attention_backend="flash",
                     tp_reduction="nccl", tuning={"dvr_decode_attention": "canonical", "verify_packing": "packed",
                                                  "verify_trigger": "windows"})
    assert (c.device, c.dtype, c.mode, c.attention_backend, c.tp_reduction) == (
        Device.CUDA, DType.FLOAT16, Mode.NONDETERMINISTIC, AttentionBackend.FLASH, TpReduction.NCCL)
    assert (c.tuning.dvr_decode_attention, c.tuning.verify_packing, c.tuning.verify_trigger) == (
        DvrDecodeAttention.CANONICAL, VerifyPacking.PACKED, VerifyTrigger.WINDOWS)
    assert c.torch_dtype == torch.float16
    # written out, a choice is its plain string
    assert json.dumps([c.device, c.tuning.verify_packing]) == '["cuda", "packed"]'
    assert f"{c.attention_backend}" == str(c.attention_backend) == c.attention_backend.value == "flash"


@pytest.mark.parametrize("field, options", [
    ("device", {"device": "tpu"}), ("dtype", {"dtype": "int8"}), ("mode", {"mode": "fast"}),
    ("attention_backend", {"attention_backend": "sdpa"}), ("tp_reduction", {"tp_reduction": "tree"}),
    ("tuning.dvr_decode_attention", {"dvr_decode_attention": "sideways"}),
    ("tuning.verify_packing", {"verify_packing": "tight"}), ("tuning.verify_trigger", {"verify_trigger": "rows"}),
])
def test_bad_choice_names_the_field(field: str, options: dict[str, Any]) -> None:
    bad = next(iter(options.values()))
    with pytest.raises(ValueError, match=rf"EngineConfig\.{field}: one of .*, got '{bad}'"):
        EngineConfig.from_options(options)


def test_from_options_routes_tuning_fields() -> None:
    flat = EngineConfig.from_options({"window": 16, "overlap": False, "verify_packing": "packed"})
    nested = EngineConfig.from_options({"window": 16, "tuning": {"overlap": False, "verify_packing": "packed"}})
    assert flat == nested == EngineConfig(window=16, tuning=DvrTuning(overlap=False, verify_packing="packed"))
    with pytest.raises(ValueError, match=r"unknown EngineConfig fields \['windw'\]"):
        EngineConfig.from_options({"windw": 16})
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning: unknown DvrTuning fields \['overlapp'\]"):
        EngineConfig(tuning={"overlapp": True})  # type: ignore[arg-type]


def test_auto_backend_resolves_to_torch_on_cpu() -> None:
    assert resolved("cpu").attention_backend == "torch"
    assert resolved("cpu", mode="batch_invariant").attention_backend == "batch_invariant"


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
    assert none_fields(llm.config) == []


def test_dvr_decode_attention_auto_resolution() -> None:
    """auto: canonical_step_short on CUDA, split on the CPU; lookahead follows (G-1)*W for canonical rows, W-1
    for split ones."""
    cuda = resolved("cuda", window=32, group=8)
    assert (cuda.tuning.dvr_decode_attention, cuda.tuning.dvr_lookahead) == ("canonical_step_short", 7 * 32)
    with pytest.raises(ValueError, match="dvr_decode_attention.*'sideways'"):
        EngineConfig(device="cpu", tuning=DvrTuning(dvr_decode_attention="sideways"))
    cpu = resolved("cpu", window=32, group=8)
    assert (cpu.tuning.dvr_decode_attention, cpu.tuning.dvr_lookahead) == ("split", 31)


def test_decode_cublaslt_min_rows_is_cuda_only_and_checked() -> None:
    assert resolved("cpu").tuning.decode_cublaslt_min_rows == 0
    # the default: cuBLASLt from DEFAULT_DECODE_CUBLASLT_MIN_ROWS rows when CUDA decode graphs are on, else never
    default = resolved("cuda", cuda_graphs=True).tuning.decode_cublaslt_min_rows
    assert default == DEFAULT_DECODE_CUBLASLT_MIN_ROWS == 32
    assert resolved("cuda", cuda_graphs=False).tuning.decode_cublaslt_min_rows == 0
    assert resolved("cuda", cuda_graphs=True, decode_cublaslt_min_rows=0).tuning.decode_cublaslt_min_rows == 0
    assert resolved("cuda", cuda_graphs=True, decode_cublaslt_min_rows=32).tuning.decode_cublaslt_min_rows == 32
    # the one rule the engine and the bench share
    assert [resolve_decode_cublaslt_min_rows(v, g) for v, g in ((None, True), (None, False), (0, True), (8, False))] \
        == [DEFAULT_DECODE_CUBLASLT_MIN_ROWS, 0, 0, 8]
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.decode_cublaslt_min_rows.*CUDA only"):
        EngineConfig(device="cpu", tuning=DvrTuning(decode_cublaslt_min_rows=32))
    with pytest.raises(ValueError, match=r"EngineConfig\.tuning\.decode_cublaslt_min_rows.*>= 0"):
        EngineConfig(device="cuda", tuning=DvrTuning(decode_cublaslt_min_rows=-1))


def test_blas_library_context_restores_the_preference() -> None:
    """engine.cuda_graphs.blas_library: None leaves torch's BLAS preference alone; a library is set inside
    and the previous preference comes back on exit, also when the body raises ("ck" here, a library other
    than the default that a CPU build of torch accepts; it refuses cuBLASLt)."""
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
    running-sequence limit sized from the KV budget the runner measures; the CPU keeps its small defaults."""
    cuda = EngineConfig().resolve("cuda", model_max_len=CONTEXT, free_kv_blocks=10**6)
    assert (cuda.cuda_graphs, cuda.max_num_seqs, cuda.max_num_batched_tokens) == (True, 256, 8192)
    cpu = resolved("cpu")
    assert (cpu.cuda_graphs, cpu.max_num_seqs, cpu.max_num_batched_tokens) == (False, 32, 4096)
    explicit = resolved("cuda", cuda_graphs=False, max_num_seqs=8, max_num_batched_tokens=1024)
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
