"""Synthetic models: a supported architecture at any shape, seeded random weights made on the device.

For GPU work at realistic size without a download (no hub here). Random weights give flat logits, so
use them for kernel, memory and scheduling costs, never for rollback rates (those come from SmolLM2).

    model = build_synthetic_model("llama-3.1-8b", torch.bfloat16, "cuda", seed=0)   # ~16 GB, on device

Weight scale: every projection ~ N(0, 1/fan_in) so activations keep unit scale through a layer, norms 1,
embeddings N(0, 1); the residual stream then grows only ~sqrt(num_layers), and the bf16 forward of the
8B shape stays finite. The lm_head gets `logit_scale / sqrt(hidden)`, so logits ~ N(0, logit_scale²).
The weights are a pure function of (shape, seed, device type): one generator, HF-named tensors in order
(`LlamaForCausalLM.hf_weights`: fused qkv / gate_up weights are drawn part by part, as separate ones).

`peaked=True` makes the logits far from flat: lm_head row v is the embedding of token v-1, so the input
token's embedding (still dominant in the residual stream) votes for its successor by a margin far above
bf16 noise. Fast path and verifier then agree (no natural rollbacks) and a benchmark sets the rollback
rate with the engine's fault injection instead.
"""
from __future__ import annotations

import hashlib
import json
import math
from typing import Any

import torch

from engine.models import build_model
from engine.models.llama import LlamaForCausalLM

SYNTHETIC_PREFIX = "synthetic:"

PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=False,
    ),
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0}, tie_word_embeddings=True,
    ),
    "qwen3-tiny": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3",
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, head_dim=32,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
    ),
    "tiny": dict(
        architectures=["LlamaForCausalLM"], model_type="llama",
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    ),
}

_CONFIG_CLASSES = {"llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}


def synthetic_hf_config(preset: str = "llama-3.1-8b", **overrides: Any) -> Any:
    """A transformers config of the preset's shape (fields overridable, e.g. num_hidden_layers=2)."""
    if preset not in PRESETS:
        raise ValueError(f"synthetic preset must be one of {sorted(PRESETS)}, got {preset!r}")
    import transformers

    fields = {**PRESETS[preset], **overrides}
    config_cls = getattr(transformers, _CONFIG_CLASSES[fields["model_type"]])
    return config_cls(**{k: v for k, v in fields.items() if k != "model_type"})


def parse_synthetic(name: str) -> str | None:
    """'synthetic:llama-3.1-8b' -> 'llama-3.1-8b'; anything else -> None (a real model name)."""
    return name[len(SYNTHETIC_PREFIX):] if name.startswith(SYNTHETIC_PREFIX) else None


@torch.no_grad()
def fill_random_(model: LlamaForCausalLM, seed: int, logit_scale: float = 1.0, peaked: bool = False) -> None:
    """Overwrite every parameter in place with seeded random values drawn on its own device."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    # HF names in parameter order (deterministic; tied weights once): a fused qkv / gate_up weight is
    # drawn part by part, so the values are those of separate q/k/v and gate/up weights
    for name, param in model.hf_weights().items():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        elif name == "model.embed_tokens.weight":
            param.normal_(0.0, 1.0, generator=gen)
        elif name == "lm_head.weight":
            param.normal_(0.0, logit_scale / math.sqrt(param.shape[1]), generator=gen)
        else:  # [out, in] projection; peaked: residual branches scaled by 1/sqrt(2L), as GPT-2 initialises
            branch = peaked and name.endswith(("o_proj.weight", "down_proj.weight"))
            scale = 1.0 / math.sqrt(2 * model.arch.num_layers) if branch else 1.0
            param.normal_(0.0, scale / math.sqrt(param.shape[1]), generator=gen)
    if peaked:
        if model.arch.tie_word_embeddings:
            raise ValueError("peaked synthetic logits need an untied lm_head")
        embed = model.model.embed_tokens.weight
        model.lm_head.weight.copy_(torch.roll(embed, 1, dims=0) * (logit_scale / math.sqrt(embed.shape[1])))


def build_synthetic_model(
    preset_or_config: str | Any,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    attention_backend: str = "torch",
    logit_scale: float = 1.0,
    peaked: bool = False,
) -> LlamaForCausalLM:
    """Build the architecture and fill it on `device` (no host copy of the weights is ever made)."""
    hf_config = synthetic_hf_config(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    model = build_model(hf_config, dtype, device, attention_backend)
    fill_random_(model, seed, logit_scale, peaked)
    return model


def synthetic_weights_digest(hf_config: Any, seed: int, dtype: torch.dtype, logit_scale: float = 1.0) -> str:
    """Identity of a synthetic model (its recipe, not its bytes): SHA-256 over shape, seed, dtype."""
    recipe = {"config": hf_config.to_dict(), "seed": seed, "dtype": str(dtype), "logit_scale": logit_scale,
              "recipe": "verbatim-synthetic-v1"}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True, default=str).encode()).hexdigest()


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of distinct parameters (tied weights counted once): what a decode step must read."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total
