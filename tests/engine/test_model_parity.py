"""Our paged forward vs transformers' own model: prefill, decode steps and a verify pass through the cache.

Tolerances (max |our logit - transformers logit|): 1e-4 for the tiny float32 models, 5e-4 for SmolLM2
float32 (30 layers, logits of magnitude ~20). In bfloat16 our error against the float32 reference
must stay within 2x (+0.01) of transformers' own bfloat16 error. Different reduction orders make bit
equality impossible; the bound is stated.
"""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine.attention import PassKind, RowSpec, build_metadata, positions_of
from engine.models import arch_from_hf, build_model

BLOCK = 16
TOL_TINY_FP32 = 1e-4
TOL_SMOLLM2_FP32 = 5e-4
BF16_ERROR_RATIO = 2.0

_SMALL = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
TINY_CONFIGS = {
    "llama-tied": lambda: LlamaConfig(**_SMALL, tie_word_embeddings=True),
    "llama3-rope-bias": lambda: LlamaConfig(
        **_SMALL, tie_word_embeddings=False, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "qwen2-qkv-bias": lambda: Qwen2Config(**_SMALL, tie_word_embeddings=False),
    "qwen3-qk-norm": lambda: Qwen3Config(**_SMALL, head_dim=24, tie_word_embeddings=True),
}


def _random_hf_model(config: object, seed: int) -> torch.nn.Module:
    """A transformers model with every parameter random (biases and norms too, so they matter)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else 0.15 * noise)
    return model


def _pass(model, kv, kind: PassKind, rows: list[RowSpec], tokens: list[list[int]]) -> torch.Tensor:
    meta = build_metadata(kind, rows, BLOCK)
    ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long)
    return model.compute_logits(model(ids, positions_of(rows), meta, kv))


def _paged_logits(model, seq: list[int], n_prefill: int, n_decode: int, window: int) -> torch.Tensor:
    """Logits for every position of `seq`: a prefill in two chunks (the second continues from the cache,
    beside another prompt), decode steps (co-batched), then one 2-row verify pass.

    The sequence owns shuffled blocks; a second sequence rides along in the later passes.
    """
    kv = model.allocate_kv_cache(num_blocks=16, block_size=BLOCK)
    table, other = [7, 2, 9, 4, 11], [5, 13]
    cut = n_prefill // 2
    out = [_pass(model, kv, PassKind.PREFILL, [RowSpec(table, 0, cut)], [seq[:cut]])]
    rows = [RowSpec(other, 0, 5), RowSpec(table, cut, n_prefill - cut)]
    out.append(_pass(model, kv, PassKind.PREFILL, rows, [[4, 5, 6, 7, 8], seq[cut:n_prefill]])[5:])
    for p in range(n_prefill, n_prefill + n_decode):
        rows = [RowSpec(other, p - n_prefill, 1), RowSpec(table, p, 1)]
        out.append(_pass(model, kv, PassKind.DECODE, rows, [[3], [seq[p]]])[1:])
    start = n_prefill + n_decode
    rows = [RowSpec(other, 0, window), RowSpec(table, start, window)]
    out.append(_pass(model, kv, PassKind.VERIFY, rows, [[1] * window, seq[start : start + window]])[window:])
    return torch.cat(out)


def _our_model(hf_model: torch.nn.Module, dtype: torch.dtype):
    model = build_model(hf_model.config, dtype, "cpu")
    model.load_weights(hf_model.state_dict().items())
    return model


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_tiny_model_matches_transformers_fp32(name: str) -> None:
    hf = _random_hf_model(TINY_CONFIGS[name](), seed=7)
    seq = torch.randint(0, 160, (45,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    ours = _paged_logits(_our_model(hf, torch.float32), seq, n_prefill=27, n_decode=8, window=10)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() <= TOL_TINY_FP32


def test_tiny_config_features_are_exercised() -> None:
    """The parity cases above really cover llama3 RoPE, biases, q/k norm and head_dim != hidden/heads."""
    archs = {name: arch_from_hf(make()) for name, make in TINY_CONFIGS.items()}
    assert archs["llama3-rope-bias"].rope.rope_type == "llama3"
    assert archs["llama3-rope-bias"].o_bias and archs["llama3-rope-bias"].mlp_bias
    assert archs["qwen2-qkv-bias"].qkv_bias and not archs["qwen2-qkv-bias"].o_bias
    assert archs["qwen3-qk-norm"].qk_norm and archs["qwen3-qk-norm"].head_dim == 24
    assert archs["llama-tied"].tie_word_embeddings and not archs["qwen2-qkv-bias"].tie_word_embeddings


def test_tiny_model_bfloat16_close_to_fp32_reference() -> None:
    hf = _random_hf_model(TINY_CONFIGS["qwen3-qk-norm"](), seed=11)
    seq = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0].float()
    ours = _paged_logits(_our_model(hf, torch.bfloat16), seq, n_prefill=20, n_decode=4, window=16)
    with torch.no_grad():
        hf_bf16 = hf.to(torch.bfloat16)(torch.tensor([seq])).logits[0].float()
    assert ours.dtype == torch.float32
    hf_error = (hf_bf16 - ref).abs().max().item()
    assert (ours - ref).abs().max().item() <= BF16_ERROR_RATIO * hf_error + 0.01


def test_smollm2_matches_transformers_fp32(smollm2_source, smollm2_model) -> None:
    tok = smollm2_source.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=True, add_generation_prompt=True, return_dict=False)
    seq = list(prompt)
    kv = smollm2_model.allocate_kv_cache(num_blocks=8, block_size=BLOCK)
    table = [3, 6, 1, 5]
    logits = [_pass(smollm2_model, kv, PassKind.PREFILL, [RowSpec(table, 0, len(seq))], [seq])]
    for _ in range(6):  # greedy decode through the paged cache
        seq.append(int(logits[-1][-1].argmax()))
        logits.append(_pass(smollm2_model, kv, PassKind.DECODE, [RowSpec(table, len(seq) - 1, 1)], [seq[-1:]]))
    ours = torch.cat(logits)  # [len(seq) - 1 + 1, vocab]: every position but the last token's own
    hf = AutoModelForCausalLM.from_pretrained(smollm2_source.folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]
    assert (ours - ref[: ours.shape[0]]).abs().max().item() <= TOL_SMOLLM2_FP32
    assert torch.equal(ours.argmax(-1), ref[: ours.shape[0]].argmax(-1))


def test_load_weights_refuses_missing_and_misshaped() -> None:
    hf = _random_hf_model(TINY_CONFIGS["qwen2-qkv-bias"](), seed=1)
    state = dict(hf.state_dict())
    model = build_model(hf.config, torch.float32, "cpu")
    missing = {k: v for k, v in state.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    with pytest.raises(ValueError, match="1 weights missing.*k_proj.bias"):
        model.load_weights(missing.items())
    misshaped = dict(state, **{"model.norm.weight": torch.ones(3)})
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\), expected \(64,\)"):
        model.load_weights(misshaped.items())
    with pytest.raises(ValueError, match="unexpected weight 'model.extra'"):
        model.load_weights([*state.items(), ("model.extra", torch.ones(1))])


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
                                  {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}])
def test_unsupported_rope_type_is_refused(rope: dict) -> None:
    config = LlamaConfig(**_SMALL)
    config.rope_parameters = rope
    with pytest.raises(ValueError, match=r"^model: unsupported rope_type"):
        build_model(config, torch.float32, "cpu")


def test_sliding_window_is_refused() -> None:
    config = Qwen2Config(**_SMALL, use_sliding_window=True, sliding_window=16)
    with pytest.raises(ValueError, match="^model: sliding-window"):
        build_model(config, torch.float32, "cpu")
