"""Model registry: HF config -> own forward with a paged KV cache."""
from __future__ import annotations

from typing import Any

import torch

from engine.attention import get_backend
from engine.models.arch import SUPPORTED_ARCHITECTURES, LlamaArch, arch_from_hf
from engine.models.llama import LlamaForCausalLM

_REGISTRY = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def build_model(
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: str = "torch",
) -> LlamaForCausalLM:
    """An unloaded model (uninitialised parameters on `device`); call load_weights next."""
    arch = arch_from_hf(hf_config)
    backend = get_backend(attention_backend)
    with torch.device("meta"):
        model = _REGISTRY[arch.architecture](arch, dtype, backend)
    model.materialize(device)
    return model.eval()


__all__ = ["SUPPORTED_ARCHITECTURES", "LlamaArch", "LlamaForCausalLM", "arch_from_hf", "build_model"]
