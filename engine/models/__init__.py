"""Model registry: HF config -> own forward with a paged KV cache."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from engine.attention import get_backend
from engine.config import DEFAULT_KERNEL_SETTINGS, KernelSettings
from engine.kernels import TORCH_OPS, BatchInvariantOps, Ops, check_linear_shapes
from engine.models.arch import SUPPORTED_ARCHITECTURES, LlamaArch, arch_from_hf
from engine.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from engine.parallel import TensorParallel

_REGISTRY = {name: LlamaForCausalLM for name in SUPPORTED_ARCHITECTURES}


def build_model(
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device | str,
    attention_backend: str = "torch",
    ops: Ops = TORCH_OPS,
    tp: TensorParallel | None = None,
    kernels: KernelSettings = DEFAULT_KERNEL_SETTINGS,
) -> LlamaForCausalLM:
    """An unloaded model (uninitialised parameters on `device`); call load_weights next.

    `ops` carries every GEMM, RMSNorm and SwiGLU (engine.kernels); BatchInvariantOps with
    attention_backend="batch_invariant" makes the whole forward batch invariant. `tp`: this rank's shard
    of the model (engine.parallel; load_weights then takes the full tensors). `kernels` are the launch
    settings of the backend's Triton kernels (EngineConfig.kernels).
    """
    arch = arch_from_hf(hf_config)
    backend = get_backend(attention_backend, kernels)
    with torch.device("meta"):
        model = _REGISTRY[arch.architecture](arch, dtype, backend, ops, tp)
    model.materialize(device)
    return model.eval()


def batch_invariant_view(model: LlamaForCausalLM,
                         kernels: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> LlamaForCausalLM:
    """`model` with BatchInvariantOps and batch-invariant attention (a weight-sharing view unless it is
    one already), after probing its GEMM shapes once on this machine (RuntimeError naming the shape)."""
    bi = "batch_invariant"
    if model.ops.name != bi or model.attention.name != bi:  # both protocols name their numerics
        model = model.with_numerics(BatchInvariantOps(), get_backend(bi, kernels))
    model = model.with_kernels(kernels)
    check_linear_shapes(model.ops, model.linear_shapes(), model.dtype, model.device)
    return model


__all__ = [
    "SUPPORTED_ARCHITECTURES", "LlamaArch", "LlamaForCausalLM", "arch_from_hf", "batch_invariant_view", "build_model",
]
