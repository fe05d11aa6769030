"""The model's ops (see ops.py): TorchOps (fused Triton row kernels on CUDA, triton_fused.py) and the
batch-invariant ops for mode="batch_invariant".

Nothing here imports triton at import time; the Triton kernels load on the first CUDA call.
"""

from engine.kernels.attention import DEFAULT_SPLIT_SIZE, bi_paged_attention, query_layout
from engine.kernels.ops import (
    TORCH_OPS,
    BatchInvariantOps,
    ChunkedOps,
    Ops,
    TorchOps,
    bi_log_softmax,
    bi_matmul,
    bi_rms_norm,
    bi_silu_mul,
)
from engine.kernels.selfcheck import check_linear_shapes

__all__ = [
    "DEFAULT_SPLIT_SIZE",
    "TORCH_OPS",
    "BatchInvariantOps",
    "ChunkedOps",
    "Ops",
    "TorchOps",
    "bi_log_softmax",
    "bi_matmul",
    "bi_paged_attention",
    "bi_rms_norm",
    "bi_silu_mul",
    "check_linear_shapes",
    "query_layout",
]
