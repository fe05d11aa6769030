"""The HF config translated once into a frozen description of a Llama-family model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class LlamaArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2: bias on q/k/v only; Llama/Qwen3 attention_bias: also on o_proj
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE


def architecture_of(hf_config: Any) -> str:
    """The HF architecture name; ValueError naming `model` when unsupported."""
    names = list(getattr(hf_config, "architectures", None) or [])
    if not names and getattr(hf_config, "model_type", None) in _MODEL_TYPES:
        names = [_MODEL_TYPES[hf_config.model_type]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = names or [getattr(hf_config, "model_type", None)]
    raise ValueError(f"model: unsupported architecture {found}; supported: {list(SUPPORTED_ARCHITECTURES)}")


def arch_from_hf(hf_config: Any) -> LlamaArch:
    """Validate and freeze the fields the forward needs; unsupported features raise ValueError."""
    name = architecture_of(hf_config)
    _reject_unsupported(hf_config)
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    qwen2 = name == "Qwen2ForCausalLM"
    return LlamaArch(
        architecture=name,
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        max_position_embeddings=hf_config.max_position_embeddings,
        rope=rope_spec(hf_config),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        qkv_bias=qwen2 or attention_bias,
        o_bias=attention_bias and not qwen2,
        mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
        qk_norm=name == "Qwen3ForCausalLM",
    )


def rope_spec(hf_config: Any) -> RopeSpec:
    """RoPE parameters from transformers 5 `rope_parameters` (or legacy rope_theta/rope_scaling)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy = getattr(hf_config, "rope_scaling", None)
    if not params and isinstance(legacy, dict):
        params = dict(legacy)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(hf_config, "rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"model: unsupported rope_type {rope_type!r}; supported: {list(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("model: partial_rotary_factor != 1.0 is not supported")
    return RopeSpec(
        rope_type=rope_type,
        theta=float(params["rope_theta"]),
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", hf_config.max_position_embeddings)
        ),
    )


def _reject_unsupported(hf_config: Any) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"model: hidden_act must be 'silu', got {act!r}")
    if getattr(hf_config, "use_sliding_window", False):
        raise ValueError("model: sliding-window attention (use_sliding_window=True) is not supported")
