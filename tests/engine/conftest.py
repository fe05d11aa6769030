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
