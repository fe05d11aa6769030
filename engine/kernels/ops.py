"""The ops a model calls for its GEMMs, row reductions and RoPE, as an explicit argument (no monkeypatching).

A model takes an `ops` object and never calls `F.linear`, RMSNorm or log-softmax directly:

    class LlamaMLP:
        def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:  # x [T, H]
            gate_up = ops.linear(x, self.gate_up_w)                        # [T, 2I], one fused GEMM
            gate, up = gate_up.chunk(2, dim=-1)                            # [T, I] views
            return ops.linear(ops.silu_mul(gate, up), self.down_w)        # [T, H]

    h, residual = ops.add_rms_norm(x, residual, self.norm_w, eps)      # norm(x + residual), x + residual
    logprobs = ops.log_softmax(logits.float())

The engine builds one object from the config, once: `TORCH_OPS` for `dvr` / `nondeterministic`
(torch GEMMs, fast), `BatchInvariantOps()` for `batch_invariant`, and hands it to the
model (constructor or forward argument). Every GEMM (qkv/o, gate_up/down, lm_head), every norm and
the SwiGLU must go through it; one stray `x @ w.T` breaks the mode. Inputs may be [T, H] or [..., H].

TorchOps on CUDA runs the row ops (RMSNorm with the residual add fused in, SwiGLU, RoPE of q and k in
one launch) as the Triton kernels of `triton_fused` (one launch each instead of several torch
elementwise kernels, and row-wise, so batch invariant as a bonus); on the CPU it runs plain torch ops
(the SwiGLU computed in fp32 as g / (1 + exp(-g)) and rounded once, as the kernel does).
`TorchOps(row_kernels="torch")` forces torch everywhere (A/B). On that Triton path TorchOps also offers
`rope_write_kv` (see Ops): RoPE that writes K and V into the paged KV cache itself, saving the two
index_copy_ launches of write_kv per layer.

ChunkedOps wraps either (the model runner wraps TorchOps, in a weight-sharing model view, for the body of a
canonical prefill pass when DvrTuning.canonical_prefill_chunk_tokens = C > 0): every GEMM runs on C-row slices
of its input, so its M is C whatever the pass size; every other op is the wrapped object's.

BatchInvariantOps on CUDA: the Triton GEMM of triton_matmul (no split-K, tile shape by batch bucket, its
bits checked shape-independent), triton_fused's row kernels (batch invariant by construction) and
triton_rows' log-softmax; on the CPU the fixed-shape torch tiles.

Attention is not in here (it belongs to the attention backend). In `batch_invariant` mode a query's
bits must depend only on its absolute position and the cache, for EVERY pass kind, so that chunked
prefill, decode and a prefill of the same tokens agree bitwise whatever the batch
(engine.attention.batch_invariant: the Triton paged kernels with canonical decode on CUDA,
`engine.kernels.bi_paged_attention` tiles elsewhere).
"""

from __future__ import annotations

from types import ModuleType
from typing import Literal, Protocol

import torch
import torch.nn.functional as F

from engine.kernels import tiles
from engine.kernels.tiles import rms_norm_rows, rope_rows

Backend = Literal["auto", "triton", "tiles"]
# TorchOps' row ops on the CPU (named in the runtime fingerprint: a change of formula changes the bits);
# v2: SwiGLU as g / (1 + exp(-g)), whose ops round the same in torch's vector body and scalar tail (F.silu's do not)
CPU_ROW_OPS_ID = "torch-cpu-rows-v2-silu-exp"
RowKernels = Literal["auto", "torch"]


class Ops(Protocol):
    """The ops every implementation has. One more is optional (look it up with getattr; TorchOps and
    BatchInvariantOps have it):

        rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots) -> q | None

    `rope`, with the rotated k and v [T, Hkv, D] written into the layer's paged caches [num_blocks,
    block_size, Hkv, D] at `slots` (Long[T], block * block_size + offset, the plan's slot_mapping) instead
    of returned; the caches get the bits `rope` + write_kv would leave there, and the call stays CUDA-graph
    capturable. It returns the rotated q, or None (having touched nothing) where this object has no fused
    path for these tensors. The model uses it only with an attention backend that declares
    `kv_prewritten = True` (it then calls `backend.forward(q, None, None, ...)`).

        triton_rope(x) -> bool

    Whether `rope` of tensors like x is triton_fused's kernel. Where it is, the model first offers a
    backend with `forward_rope` (TritonPagedAttention) the step's q, k, v before RoPE: the backend may
    repeat that kernel's arithmetic inside its attention launch and write K/V itself (decode steps).
    """

    name: str

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...
    def log_softmax(self, x: torch.Tensor) -> torch.Tensor: ...
    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor: ...
    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]: ...
    def rope(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def torch_add_rms_norm(ops: Ops, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference semantics of add_rms_norm: the sum rounded to x's dtype, then ops.rms_norm of it."""
    summed = x + residual  # [..., H]
    return ops.rms_norm(summed, weight, eps), summed


def torch_rope(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D], cos_sin [T, 2, D] in q's dtype -> rotated q, k (torch, in q's dtype)."""
    cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]  # [T, 1, D]
    return rope_rows(q, cos, sin), rope_rows(k, cos, sin)


class _FusedRowOps:
    """The row ops both ops objects run as the Triton kernels of `triton_fused` where their `_fused(x)`
    says so (CUDA), and otherwise as the subclass's reference (`_rms_norm_ref`, `_silu_mul_ref`)."""

    def _fused(self, x: torch.Tensor) -> ModuleType | None:
        raise NotImplementedError

    def _rms_norm_ref(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        raise NotImplementedError

    def _silu_mul_ref(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        fused = self._fused(x)
        return self._rms_norm_ref(x, weight, eps) if fused is None else fused.rms_norm(x, weight, eps)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        fused = self._fused(gate)
        return self._silu_mul_ref(gate, up) if fused is None else fused.silu_mul(gate, up)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype first (one IEEE add per
        element, invariant anywhere); on CUDA both in the one fused row kernel."""
        fused = self._fused(x)
        if fused is None:
            return torch_add_rms_norm(self, x, residual, weight, eps)  # type: ignore[arg-type]
        return fused.add_rms_norm(x, residual, weight, eps)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Elementwise multiplies and adds (torch, or one Triton launch): the same bits in any position."""
        fused = self._fused(q)
        return torch_rope(q, k, cos_sin) if fused is None else fused.rope(q, k, cos_sin)

    def triton_rope(self, x: torch.Tensor) -> bool:
        """Whether `rope` of tensors like x runs triton_fused's kernel (the optional Ops method, see Ops)."""
        return self._fused(x) is not None

    def rope_write_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor | None:
        """rope with the rotated k and v written into the paged caches at `slots` in the same launch
        (the optional Ops method, see Ops) -> the rotated q; None, touching nothing, where the row ops are
        not the Triton kernels: the caller then does rope + the backend's write."""
        fused = self._fused(q)
        return None if fused is None else fused.rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots)


class TorchOps(_FusedRowOps):
    """torch GEMMs: the normal (shape-dependent) path. Same semantics as BatchInvariantOps.

    row_kernels="auto": the row ops of CUDA tensors run as Triton kernels (engine.kernels.triton_fused);
    "torch": torch ops on every device.
    """

    name = "torch"

    def __init__(self, row_kernels: RowKernels = "auto") -> None:
        if row_kernels not in ("auto", "torch"):
            raise ValueError(f"unknown row_kernels {row_kernels!r}; expected auto or torch")
        self.row_kernels = row_kernels

    def _fused(self, x: torch.Tensor) -> ModuleType | None:
        """engine.kernels.triton_fused when x's row ops run as Triton kernels (CUDA, "auto"), else None."""
        if not x.is_cuda or self.row_kernels != "auto":
            return None
        from engine.kernels import triton_fused  # lazily: a CPU-only process never imports triton

        return triton_fused

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def _rms_norm_ref(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm_rows(x, weight, eps)

    def _silu_mul_ref(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """silu as g / (1 + exp(-g)) in fp32, rounded once (the Triton kernel's formula): F.silu's scalar
        tail rounds differently from its vector body, and with several threads the chunk ends fall inside
        rows, so a row's bits depended on its place in a verify pass (tile_silu_mul's docstring)."""
        g = gate.float()
        return (g / (1.0 + torch.exp(-g)) * up.float()).to(gate.dtype)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(x.float(), dim=-1).to(x.dtype)


TORCH_OPS = TorchOps()


class BatchInvariantOps(_FusedRowOps):
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

    def _fused(self, x: torch.Tensor) -> ModuleType | None:
        """engine.kernels.triton_fused where this object runs Triton (its row kernels are batch invariant
        by construction: one row per program, block sizes from the row width), else None (tiles)."""
        if not self._use_triton(x):
            return None
        from engine.kernels import triton_fused

        return triton_fused

    def _rms_norm_ref(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return tiles.tile_rms_norm(x, weight, eps)

    def _silu_mul_ref(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return tiles.tile_silu_mul(gate, up)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        if not self._use_triton(x):
            return tiles.tile_log_softmax(x)
        from engine.kernels.triton_rows import triton_log_softmax

        return triton_log_softmax(x)


class ChunkedOps:
    """`inner` with every GEMM run on slices of exactly `rows` rows (DvrTuning.canonical_prefill_chunk_tokens):
    the ops of a chunked canonical prefill pass, whose token count is a multiple of `rows`. A torch GEMM's bits
    depend on its M (cuBLAS and the CPU BLAS pick their kernels and splits by shape); with M = `rows` whatever
    the pass size, a row's bits depend only on its own inputs. Every other op (the optional ones too) is
    `inner`'s: row-wise, the same bits in a pass of any size."""

    def __init__(self, inner: Ops, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"ChunkedOps: rows must be >= 1, got {rows}")
        self.inner, self.chunk_rows = inner, rows
        self.name = f"{inner.name}-chunked{rows}"

    def __getattr__(self, name: str) -> object:
        """The optional Ops methods (rope_write_kv, triton_rope) where `inner` has them."""
        if name == "inner":  # not set yet (copy / unpickle): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] @ weight [N, K].T (+ bias) -> [..., N]: one GEMM per `rows`-row slice of the flattened x
        (the last slice shorter when the row count is not a multiple), each written into its rows of one
        output; the bias is added afterwards, element-wise."""
        flat = x.reshape(-1, x.shape[-1])                      # [T, K]
        out = flat.new_empty(flat.shape[0], weight.shape[0])   # [T, N]
        w_t = weight.t()                                       # [K, N] view
        for start in range(0, flat.shape[0], self.chunk_rows):
            end = start + self.chunk_rows
            torch.mm(flat[start:end], w_t, out=out[start:end])
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.inner.rms_norm(x, weight, eps)

    def log_softmax(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner.log_softmax(x)

    def silu_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.inner.silu_mul(gate, up)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.add_rms_norm(x, residual, weight, eps)

    def rope(self, q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.rope(q, k, cos_sin)


def bi_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ w [N, K].T -> [M, N], batch invariant (Triton on CUDA, fixed tiles on CPU)."""
    return BatchInvariantOps().linear(x, w)


def bi_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return BatchInvariantOps().rms_norm(x, weight, eps)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    return BatchInvariantOps().log_softmax(x)


def bi_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return BatchInvariantOps().silu_mul(gate, up)
