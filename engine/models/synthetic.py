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

Served by name (`EngineConfig.model`, hence `python -m auditor serve` with VERBATIM_MODEL):
`synthetic:<preset>` or `synthetic:<preset>:peaked` loads `build_synthetic_model(preset, seed=0)` with a
word-level tokenizer over its vocabulary (token v is the word `t<v>`, words joined by spaces), no EOS
token, and a context of at most SYNTHETIC_MAX_MODEL_LEN tokens (`load_synthetic`).
"""
from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from engine.config import DEFAULT_KERNEL_SETTINGS, KernelSettings
from engine.kernels import TORCH_OPS, Ops
from engine.models import build_model
from engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.parallel import TensorParallel

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


def _draw_(name: str, param: torch.Tensor, gen: torch.Generator, num_layers: int, logit_scale: float,
           peaked: bool) -> None:
    """Fill HF weight `name` in place with its seeded random values (the next draws of `gen`)."""
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
        scale = 1.0 / math.sqrt(2 * num_layers) if branch else 1.0
        param.normal_(0.0, scale / math.sqrt(param.shape[1]), generator=gen)


def _peaked_head(embed: torch.Tensor, logit_scale: float) -> torch.Tensor:
    """lm_head row v = the embedding of token v-1, scaled (the peaked logits)."""
    return torch.roll(embed, 1, dims=0) * (logit_scale / math.sqrt(embed.shape[1]))


@torch.no_grad()
def fill_random_(model: LlamaForCausalLM, seed: int, logit_scale: float = 1.0, peaked: bool = False) -> None:
    """Overwrite every parameter in place with seeded random values drawn on its own device."""
    gen = torch.Generator(device=model.device).manual_seed(seed)
    if peaked and model.arch.tie_word_embeddings:
        raise ValueError("peaked synthetic logits need an untied lm_head")
    # HF names in parameter order (deterministic; tied weights once): a fused qkv / gate_up weight is
    # drawn part by part, so the values are those of separate q/k/v and gate/up weights
    for name, param in model.hf_weights().items():
        _draw_(name, param, gen, model.arch.num_layers, logit_scale, peaked)
    if peaked:
        model.lm_head.weight.copy_(_peaked_head(model.model.embed_tokens.weight, logit_scale))


@torch.no_grad()
def random_hf_weights(hf_config: Any, seed: int, dtype: torch.dtype, device: torch.device | str,
                      logit_scale: float = 1.0, peaked: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) with the values `fill_random_` gives a whole model, one tensor at a time on
    `device`: a tensor-parallel rank loads them and keeps its slices (`LlamaForCausalLM.load_weights`)."""
    from engine.attention import get_backend
    from engine.models import arch_from_hf

    arch = arch_from_hf(hf_config)
    if peaked and arch.tie_word_embeddings:
        raise ValueError("peaked synthetic logits need an untied lm_head")
    with torch.device("meta"):  # the whole model's names and shapes, no memory
        whole = LlamaForCausalLM(arch, dtype, get_backend("torch"))
    if arch.tie_word_embeddings:
        whole.lm_head.weight = whole.model.embed_tokens.weight
    gen = torch.Generator(device=device).manual_seed(seed)
    embed = None
    for name, meta in whole.hf_weights().items():
        if peaked and name == "lm_head.weight":  # the last weight: its draws would be overwritten
            assert embed is not None
            yield name, _peaked_head(embed, logit_scale)
            continue
        tensor = torch.empty(meta.shape, dtype=dtype, device=device)
        _draw_(name, tensor, gen, arch.num_layers, logit_scale, peaked)
        if name == "model.embed_tokens.weight":
            embed = tensor
        yield name, tensor


def build_synthetic_model(
    preset_or_config: str | Any,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int = 0,
    attention_backend: str = "torch",
    logit_scale: float = 1.0,
    peaked: bool = False,
    kernels: KernelSettings = DEFAULT_KERNEL_SETTINGS,
) -> LlamaForCausalLM:
    """Build the architecture and fill it on `device` (no host copy of the weights is ever made)."""
    hf_config = synthetic_hf_config(preset_or_config) if isinstance(preset_or_config, str) else preset_or_config
    model = build_model(hf_config, dtype, device, attention_backend, kernels=kernels)
    fill_random_(model, seed, logit_scale, peaked)
    return model


def synthetic_weights_digest(hf_config: Any, seed: int, dtype: torch.dtype, logit_scale: float = 1.0,
                             peaked: bool = False) -> str:
    """Identity of a synthetic model (its recipe, not its bytes): SHA-256 over shape, seed, dtype (and
    `peaked` when set, so the digests of plain models stay what they were)."""
    recipe: dict[str, Any] = {"config": hf_config.to_dict(), "seed": seed, "dtype": str(dtype),
                              "logit_scale": logit_scale, "recipe": "verbatim-synthetic-v1"}
    if peaked:
        recipe["peaked"] = True
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


# random weights have no use for a long context; the engine bench serves the synthetic 8B at this length too
SYNTHETIC_MAX_MODEL_LEN = 8192
_SYNTHETIC_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def synthetic_recipe(spec: str) -> tuple[str, bool]:
    """`parse_synthetic`'s result -> (preset, peaked): 'llama-3.1-8b' or 'llama-3.1-8b:peaked'."""
    preset, _, option = spec.partition(":")
    if preset not in PRESETS or option not in ("", "peaked"):
        raise ValueError(f"model: {SYNTHETIC_PREFIX}{spec!r} is not {SYNTHETIC_PREFIX}<preset>[:peaked] "
                         f"with a preset in {sorted(PRESETS)}")
    return preset, option == "peaked"


def synthetic_tokenizer(vocab_size: int) -> Any:
    """A transformers fast tokenizer over the synthetic vocabulary: token v is the word `t<v>`; text is split
    on whitespace and decoded words are joined by single spaces. It has no special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({f"t{v}": v for v in range(vocab_size)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0")
    tokenizer.chat_template = _SYNTHETIC_CHAT_TEMPLATE
    return tokenizer


def load_synthetic(spec: str, dtype: torch.dtype, device: torch.device, attention_backend: str,
                   ops: Ops = TORCH_OPS, tp: TensorParallel | None = None,
                   kernels: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> tuple[LlamaForCausalLM, Any, Any, Any]:
    """(model, hf_config, tokenizer, loader.ModelInfo) of `synthetic:<spec>` (`synthetic_recipe`), seed 0;
    with `tp`, this rank's shard of the same weights."""
    from engine.loader import ModelInfo, sha256_bytes

    preset, peaked = synthetic_recipe(spec)
    hf_config = synthetic_hf_config(preset)
    model = build_model(hf_config, dtype, device, attention_backend, ops, tp, kernels)
    if tp is None:
        fill_random_(model, seed=0, peaked=peaked)
    else:
        model.load_weights(random_hf_weights(hf_config, 0, dtype, device, peaked=peaked))
    tokenizer = synthetic_tokenizer(hf_config.vocab_size)
    info = ModelInfo(
        name=SYNTHETIC_PREFIX + spec,
        weights_digest=synthetic_weights_digest(hf_config, 0, dtype, peaked=peaked),
        tokenizer_digest=sha256_bytes(tokenizer.backend_tokenizer.to_str().encode()),
        chat_template_digest=sha256_bytes(_SYNTHETIC_CHAT_TEMPLATE.encode()),
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=min(int(hf_config.max_position_embeddings), SYNTHETIC_MAX_MODEL_LEN),
        eos_token_ids=(),
    )
    return model, hf_config, tokenizer, info
