"""The ops a model calls for its GEMMs and row reductions, as an explicit argument (no monkeypatching).

A model takes an `ops` object and never calls `F.linear`, RMSNorm or log-softmax directly:

    class LlamaMLP:
        def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:  # x [T, H]
            gate = ops.linear(x, self.gate_w)                              # [T, I]
            up = ops.linear(x, self.up_w)                                  # [T, I]
            return ops.linear(ops.silu_mul(gate, up), self.down_w)        # [T, H]

    h = ops.rms_norm(x, self.norm_w, eps)
    logprobs = ops.log_softmax(logits.float())

The engine builds one object from the config, once: `TORCH_OPS` for `dvr` / `nondeterministic`
(plain torch, shape-dependent, fast), `BatchInvariantOps()` for `batch_invariant`, and hands it to the
model (constructor or forward argument). Every GEMM (q/k/v/o, gate/up/down, lm_head), every norm and
the SwiGLU must go through it; one stray `x @ w.T` breaks the mode. Inputs may be [T, H] or [..., H].

Attention is not in here (it belongs to the attention backend). In `batch_invariant` mode the backend
should call `engine.kernels.bi_paged_attention` for EVERY pass kind (prefill, decode): a query's bits
there depend only on its absolute position and the cache, so chunked prefill, decode and a prefill of
the same tokens agree bitwise, whatever the batch.
"""

from __future__ import annotations

from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from engine.kernels import tiles
from engine.kernels.tiles import rms_norm_rows

Backend = Literal["auto", "triton", "tiles"]


class Ops(Protocol):
    name: str

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...


class TorchOps:
    """Plain torch: the normal (shape-dependent) path. Same semantics as BatchInvariantOps."""

    name = "torch"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_rows(x, weight, eps)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float(), dim=-1).to(x.dtype)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return (F.silu(gate.float()) * up.float()).to(gate.dtype)


TORCH_OPS = TorchOps()


class BatchInvariantOps:
    """Ops whose per-row result never depends on the number or content of the other rows.

    backend="auto": Triton kernels for CUDA tensors, fixed-shape torch tiles elsewhere (CPU);
    "triton" / "tiles" force one (tiles work on any device: slow, but invariant there too).
    """

    name = "batch_invariant"

    def __init__(self, backend: Backend = "auto") -> None:
        if backend not in ("auto", "triton", "tiles"):
            raise ValueError(f"unknown backend {backend!r}; expected auto, triton or tiles")
        self.backend = backend

    def _use_triton(self, x: torch.Tensor) -> bool:
        if self.backend == "triton" and not x.is_cuda:
            raise ValueError(f"backend='triton' needs CUDA tensors, got device {x.device}")
        return self.backend == "triton" or (self.backend == "auto" and x.is_cuda)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight [N, K].T (+ bias) -> [..., N] in x's dtype, fp32 accumulation."""
        if not self._use_triton(x):
            return tiles.tile_linear(x, weight, bias)
        from engine.kernels.triton_matmul import triton_linear

        rows = x.reshape(-1, x.shape[-1])
        return triton_linear(rows, weight, bias).reshape(*x.shape[:-1], weight.shape[0])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._use_triton(x):
            return tiles.tile_rms_norm(x, weight, eps)
        from engine.kernels.triton_rows import triton_rms_norm

        return triton_rms_norm(x, weight, eps)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        if not self._use_triton(x):
            return tiles.tile_log_softmax(x)
        from engine.kernels.triton_rows import triton_log_softmax

        return triton_log_softmax(x)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if not self._use_triton(gate):
            return tiles.tile_silu_mul(gate, up)
        from engine.kernels.triton_rows import triton_silu_mul

        return triton_silu_mul(gate, up)


def bi_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N], batch invariant (Triton on CUDA, fixed tiles on CPU)."""
    return BatchInvariantOps().linear(x, w)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return BatchInvariantOps().rms_norm(x, weight, eps)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    return BatchInvariantOps().log_softmax(x)


def bi_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return BatchInvariantOps().silu_mul(gate, up)
