"""Runtime fingerprint (DESIGN §4): everything outside the weights that can change the bits.

On the CPU the GEMM blocking follows the instruction set and the thread count, so both are part of it;
the KV block size is too, because the attention tiles are multiples of it. Under tensor parallelism the rank
count and the all-reduce (engine.parallel) are; at one rank neither field is present.
"""
from __future__ import annotations

import hashlib
import platform
from pathlib import Path

import numpy as np
import rfc8785
import torch

from engine.config import AttentionBackend, EngineConfig, Mode, TpReduction
from engine.kernels import DEFAULT_SPLIT_SIZE
from engine.kernels.ops import CPU_ROW_OPS_ID
from engine.kernels.tiles import TILE_ROWS
from engine.grammar import GRAMMAR_LIBRARY
from engine.processors import PROCESSORS_ID
from engine.scheduler import CANONICAL_PREFILL_ROWS
from engine.sampling import SAMPLER_ID, sampler_impl

ENGINE_VERSION = "0.2.0"
_ISA_PREFIXES = ("avx2", "avx512", "amx", "fma", "f16c", "avx_vnni")


def cpu_model() -> str:
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_isa_flags() -> str:
    """GEMM-relevant ISA flags, sorted, space-separated (e.g. 'avx2 avx512bw avx512f fma')."""
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            flags = line.split(":", 1)[1].split()
            return " ".join(sorted({f for f in flags if f.startswith(_ISA_PREFIXES)}))
    return ""


def _cpuinfo_lines() -> list[str]:
    path = Path("/proc/cpuinfo")
    return path.read_text().splitlines() if path.is_file() else []


def _nvidia_driver() -> str:
    path = Path("/proc/driver/nvidia/version")
    if not path.is_file():
        return "unknown"
    first = path.read_text().splitlines()[0]
    parts = [p for p in first.split() if p[:1].isdigit() and "." in p]
    return parts[0] if parts else first.strip()


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(triton.__version__)


def runtime_fingerprint(config: EngineConfig) -> dict[str, str | int]:
    """JSON-safe dict of the runtime fields of a resolved config (EngineConfig.resolve); the same machine,
    software and config give the same dict."""
    if config.max_num_batched_tokens is None or config.tuning.canonical_prefill_min_tokens is None \
            or config.tuning.canonical_prefill_chunk_tokens is None:
        raise ValueError("runtime_fingerprint: the config must be resolved (EngineConfig.resolve)")
    device = config.torch_device
    fp: dict[str, str | int] = {
        "engine_version": ENGINE_VERSION,
        "torch_version": torch.__version__,
        "numpy_version": np.__version__,
        "device_type": device.type,
        "attention_backend": config.attention_backend.value,
        "mode": config.mode.value,
        "window": config.window,
        "group": config.group,
        "kv_block_size": config.block_size,
        # the canonical pass's logits GEMM has a fixed row count: it shapes a deterministic prompt's first token
        "canonical_prefill_rows": CANONICAL_PREFILL_ROWS,
        "sampler": SAMPLER_ID,
        "sampler_impl": sampler_impl(device),
        # penalties, biases and grammar masks before the sampler; the grammar library's version fixes the masks
        "processors": PROCESSORS_ID,
        "grammar": GRAMMAR_LIBRARY,
        "dtype": str(config.torch_dtype).removeprefix("torch."),
    }
    chunk = config.tuning.canonical_prefill_chunk_tokens
    if chunk:  # every GEMM of a canonical pass has C rows: the pass size (min, budget cap) shapes no bit
        fp["canonical_prefill_chunk_tokens"] = chunk
    else:  # the canonical pass size (the GEMMs' M): its smallest value and its cap, the prefill budget
        fp["canonical_prefill_min_tokens"] = config.tuning.canonical_prefill_min_tokens
        fp["canonical_prefill_max_tokens"] = config.max_num_batched_tokens
    if config.tensor_parallel_size > 1:  # every GEMM's shape per rank and the all-reduce's order
        from engine.parallel import reduction_id

        fp["tensor_parallel_size"] = config.tensor_parallel_size
        fp["tp_reduction"] = reduction_id(config.tp_reduction.value)
        if config.tp_reduction == TpReduction.NCCL:
            fp["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
    if config.tuning.verify_decode_rows:  # the verify pass's token count (its GEMM shape) is G*W + D
        fp["verify_decode_rows"] = config.tuning.verify_decode_rows
    if config.mode == Mode.BATCH_INVARIANT and device.type == "cuda":
        # the GEMM's tile table (its bits measured shape-independent), the paged kernels' tile shapes
        from engine.kernels.triton_matmul import KERNEL_ID as BI_MATMUL_ID

        fp["batch_invariant_kernels"] = "triton-paged-canonical"
        fp["bi_matmul"] = BI_MATMUL_ID
        fp["attention_kernel"] = config.kernels.canonical_kernel_id()  # every pass at the verifier's tile
    elif config.mode == Mode.BATCH_INVARIANT:  # the split size and the tile kernels fix the reduction order
        fp["attention_split_size"] = DEFAULT_SPLIT_SIZE
        fp["batch_invariant_kernels"] = f"torch-tiles-{TILE_ROWS}"
    if config.attention_backend == AttentionBackend.TRITON:  # its tile shapes fix the prefill / verify reduction order
        fp["attention_kernel"] = config.kernels.kernel_id()
    if device.type == "cuda":  # fused norm / rope / SwiGLU row kernels (both ops objects run them on CUDA)
        from engine.kernels.triton_fused import KERNEL_ID as FUSED_KERNEL_ID

        fp["row_kernels"] = FUSED_KERNEL_ID
    elif config.mode != Mode.BATCH_INVARIANT:  # TorchOps' CPU formulas (batch_invariant names its tiles above)
        fp["row_kernels"] = CPU_ROW_OPS_ID
    if device.type == "cuda":
        fp["cuda_version"] = torch.version.cuda or "unknown"
        fp["triton_version"] = _triton_version()
        fp["driver_version"] = _nvidia_driver()
        fp["device_name"] = torch.cuda.get_device_name(device)
    else:
        fp["cuda_version"] = "none"
        fp["device_name"] = cpu_model()
        fp["cpu_isa"] = cpu_isa_flags()
        fp["torch_threads"] = torch.get_num_threads()
    return fp


def system_fingerprint(fingerprint: dict[str, str | int]) -> str:
    """'fp_' + first 12 hex of SHA-256 over the RFC 8785 canonical JSON of the fingerprint."""
    return "fp_" + hashlib.sha256(rfc8785.dumps(fingerprint)).hexdigest()[:12]
