"""Synthetic-model builder and KV sizing helpers: these parts run on the CPU too (no gpu marker)."""
from __future__ import annotations

import pytest
import torch

from engine.attention import PassKind, RowSpec, build_metadata, positions_of
from engine.gpu_memory import kv_bytes_per_block
from engine.models.synthetic import (PRESETS, build_synthetic_model, parse_synthetic, synthetic_hf_config,
                                     synthetic_weights_digest, weight_bytes)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    n_blocks = -(-ids.numel() // 16)
    rows = [RowSpec(list(range(2, 2 + n_blocks)), 0, ids.numel())]
    kv = model.allocate_kv_cache(2 + n_blocks, 16)
    meta = build_metadata(PassKind.PREFILL, rows, 16)
    return model.compute_logits(model(ids, positions_of(rows), meta, kv))


def test_presets_translate_to_supported_architectures() -> None:
    from engine.models import arch_from_hf

    big = arch_from_hf(synthetic_hf_config("llama-3.1-8b"))
    assert (big.hidden_size, big.num_layers, big.num_heads, big.num_kv_heads, big.intermediate_size,
            big.vocab_size, big.head_dim) == (4096, 32, 32, 8, 14336, 128256, 128)
    assert big.rope.rope_type == "llama3"
    for name in PRESETS:
        arch_from_hf(synthetic_hf_config(name))
    with pytest.raises(ValueError, match="preset"):
        synthetic_hf_config("gpt-5")


def test_weights_are_a_pure_function_of_the_seed() -> None:
    a = build_synthetic_model("tiny", torch.float32, "cpu", seed=7)
    b = build_synthetic_model("tiny", torch.float32, "cpu", seed=7)
    c = build_synthetic_model("tiny", torch.float32, "cpu", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.layers.0.mlp.gate_up_proj.weight"], sc["model.layers.0.mlp.gate_up_proj.weight"])
    cfg = synthetic_hf_config("tiny")
    assert synthetic_weights_digest(cfg, 7, torch.float32) != synthetic_weights_digest(cfg, 8, torch.float32)


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny"])
def test_forward_is_finite_with_unit_scale_logits(preset: str) -> None:
    model = build_synthetic_model(preset, torch.float32, "cpu", seed=1)
    logits = _logits(model, torch.arange(3, 40))
    assert torch.isfinite(logits).all()
    assert 0.3 < logits.std().item() < 3.0


def test_peaked_logits_predict_the_successor_by_a_wide_margin() -> None:
    config = synthetic_hf_config("tiny", num_hidden_layers=8)
    model = build_synthetic_model(config, torch.float32, "cpu", seed=2, peaked=True)
    ids = torch.randint(0, 512, (30,), generator=torch.Generator().manual_seed(0))
    top = _logits(model, ids).topk(2, dim=-1)
    assert torch.equal(top.indices[:, 0], (ids + 1) % 512)
    assert (top.values[:, 0] - top.values[:, 1]).min().item() > 1.0


def test_sizes_and_names() -> None:
    model = build_synthetic_model("tiny", torch.bfloat16, "cpu", seed=0)
    assert weight_bytes(model) == sum(p.numel() * 2 for p in model.parameters())
    assert parse_synthetic("synthetic:llama-3.1-8b") == "llama-3.1-8b"
    assert parse_synthetic("/models/x.gguf") is None
    # Llama-3.1-8B: 32 layers x 2 (K, V) x 16 slots x 8 heads x 128 dims x 2 bytes = 2 MiB per block
    assert kv_bytes_per_block(32, 8, 128, 16, torch.bfloat16) == 2 * 2**20


def test_engine_serves_a_synthetic_model_by_name() -> None:
    """EngineConfig.model = "synthetic:<preset>[:peaked]": the seed-0 weights of build_synthetic_model, a
    word-level tokenizer over the vocabulary, identity digests that tell peaked from plain."""
    from engine.config import EngineConfig
    from engine.loading import load_model

    loaded = load_model(EngineConfig(model="synthetic:tiny:peaked"))
    reference = build_synthetic_model("tiny", torch.float32, "cpu", seed=0, peaked=True)
    state, ref = loaded.model.state_dict(), reference.state_dict()
    assert state.keys() == ref.keys() and all(torch.equal(state[k], ref[k]) for k in ref)
    info = loaded.info
    assert info.name == "synthetic:tiny:peaked" and info.eos_token_ids == () and info.max_model_len == 1024
    assert loaded.shape.vocab_size == len(loaded.tokenizer) == 512
    assert loaded.tokenizer.encode("t5 t511  t0", add_special_tokens=False) == [5, 511, 0]
    assert loaded.tokenizer.decode([5, 7, 9]) == "t5 t7 t9"
    plain = load_model(EngineConfig(model="synthetic:tiny")).info
    assert plain.weights_digest == synthetic_weights_digest(synthetic_hf_config("tiny"), 0, torch.float32)
    assert plain.weights_digest != info.weights_digest and plain.tokenizer_digest == info.tokenizer_digest
    for bad in ("synthetic:gpt-5", "synthetic:tiny:flat"):
        with pytest.raises(ValueError, match="model: synthetic:"):
            load_model(EngineConfig(model=bad))
