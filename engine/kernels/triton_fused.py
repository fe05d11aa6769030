"""Fused row kernels of every CUDA pass (TorchOps and BatchInvariantOps): residual add + RMSNorm, SwiGLU,
RoPE on q and k (optionally writing K and V into the paged cache in the same launch).

Imported lazily (engine.kernels.ops loads it on the first CUDA call); under TRITON_INTERPRET=1 the
kernels also run on CPU tensors, which is how the CPU tests check them.

Every kernel is batch invariant by construction: a program owns one row (or one row chunk / one head
of one token), block sizes come from the row width alone, and a row is reduced in a fixed lane layout
and chunk order. So a row's bits never depend on how many rows share the launch, which also keeps the
fast decode path and the verifier of DVR in agreement more often. None of them syncs with the host;
outputs are allocated with torch.empty, so all are CUDA-graph capturable.

Numerics (one rounding to the model dtype per value, as a torch op in that dtype would):
- add_rms_norm: s = round(x + residual); out = round(round(s * rstd) * w), rstd from the fp32 sum of s²
  (the semantics of tiles.rms_norm_rows; the reduction order is this kernel's own).
- silu_mul: round(g / (1 + exp(-g)) * u) in fp32.
- rope: round(x * cos + rotate_half(x) * sin) in fp32, cos/sin given in the model dtype.
- rope_write_kv: rope, with the rotated k and v stored straight into the paged KV cache at the plan's
  slots (the bits `rope` then write_kv's index_copy_ would leave there) instead of returned.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.triton_rows import as_rows

KERNEL_ID = "verbatim-fused-rows-v1"

_MAX_NORM_BLOCK = 8192  # a Llama-size hidden row (4096, 5120, 8192) in one block, read once
_SILU_BLOCK = 1024


def _norm_block(width: int) -> int:
    return min(triton.next_power_of_2(width), _MAX_NORM_BLOCK)


def _norm_warps(block: int) -> int:
    """A function of the row width only (the reduction tree depends on it): <= 16 fp32 lanes a thread."""
    return max(1, min(16, block // 512))


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_out, stride_sum, eps,
                         H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # H is a compile-time constant: one specialisation per row width (hidden size, head_dim)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    if H <= BLOCK:  # the row fits one block: read it once and keep it in registers
        mask = offs < H
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
            x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(sum_ptr + row * stride_sum + offs, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, axis=0) / H + eps))
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # normalise in fp32, round to the dtype, scale: a product of two bf16 values is exact in fp32
        y = (xf * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
        tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # per-lane partial sums over the chunks in order, reduced once; then a second pass to scale
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, H, BLOCK):
            mask = start + offs < H
            x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(r_ptr + row * stride_r + start + offs, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
                tl.store(sum_ptr + row * stride_sum + start + offs, x, mask=mask)
            xf = x.to(tl.float32)
            sq += xf * xf
        rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(sq, axis=0) / H + eps))
        for start in range(0, H, BLOCK):
            mask = start + offs < H
            x = tl.load(x_ptr + row * stride_x + start + offs, mask=mask, other=0.0)
            if HAS_RESIDUAL:  # recomputed, not re-read from sum_ptr: no thread reads another thread's store
                r = tl.load(r_ptr + row * stride_r + start + offs, mask=mask, other=0.0)
                x = (x.to(tl.float32) + r.to(tl.float32)).to(out_ptr.dtype.element_ty)
            w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
            y = (x.to(tl.float32) * rstd).to(out_ptr.dtype.element_ty).to(tl.float32) * w
            tl.store(out_ptr + row * stride_out + start + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, I, stride_g, stride_u, stride_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < I
    g = tl.load(g_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + row * stride_out + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, cs_ptr, q_out_ptr, k_out_ptr, HQ, D,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cst, stride_csw,
                 stride_qot, stride_qoh, stride_kot, stride_koh,
                 v_ptr, slot_ptr, kc_ptr, vc_ptr, stride_vt, stride_vh, stride_kcs, stride_kch, stride_vcs, stride_vch,
                 HALF_BLOCK: tl.constexpr, WRITE_KV: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = D // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < half
    if head < HQ:
        src = q_ptr + tok * stride_qt + head * stride_qh
        dst = q_out_ptr + tok * stride_qot + head * stride_qoh
    else:
        src = k_ptr + tok * stride_kt + (head - HQ) * stride_kh
        dst = k_out_ptr + tok * stride_kot + (head - HQ) * stride_koh
    cos = cs_ptr + tok * stride_cst
    sin = cos + stride_csw
    x1 = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(cos + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos + half + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin + half + offs, mask=mask, other=0.0).to(tl.float32)
    # rotate-half (HF Llama): [x1, x2] -> [x1 c1 - x2 s1, x2 c2 + x1 s2]
    y1 = (x1 * c1 - x2 * s1).to(q_out_ptr.dtype.element_ty)
    y2 = (x2 * c2 + x1 * s2).to(q_out_ptr.dtype.element_ty)
    if WRITE_KV:
        if head < HQ:
            tl.store(dst + offs, y1, mask=mask)
            tl.store(dst + half + offs, y2, mask=mask)
        else:
            # k head h of this token: its roped K (rounded as k_out would be, then to the cache dtype, as
            # write_kv's k.to(cache dtype)) and its V go to cache row `slot` (flattened [blocks*block_size])
            kvh = head - HQ
            slot = tl.load(slot_ptr + tok).to(tl.int64)
            kc = kc_ptr + slot * stride_kcs + kvh * stride_kch
            tl.store(kc + offs, y1.to(k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=mask)
            tl.store(kc + half + offs, y2.to(k_ptr.dtype.element_ty).to(kc_ptr.dtype.element_ty), mask=mask)
            vs = v_ptr + tok * stride_vt + kvh * stride_vh
            vc = vc_ptr + slot * stride_vcs + kvh * stride_vch
            v1 = tl.load(vs + offs, mask=mask, other=0.0)
            v2 = tl.load(vs + half + offs, mask=mask, other=0.0)
            tl.store(vc + offs, v1.to(vc_ptr.dtype.element_ty), mask=mask)
            tl.store(vc + half + offs, v2.to(vc_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + offs, y1, mask=mask)
        tl.store(dst + half + offs, y2, mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), both [..., H] in x's dtype; residual None: (rms_norm(x), x)."""
    rows = as_rows(x)
    m, h = rows.shape
    out = torch.empty_like(rows)
    if residual is None:
        res, summed = rows, rows
    else:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match x "
                             f"{tuple(x.shape)} {x.dtype}")
        res, summed = as_rows(residual), torch.empty_like(rows)
    block = _norm_block(h)
    if m:
        _add_rms_norm_kernel[(m,)](
            rows, res, weight.contiguous(), out, summed, rows.stride(0), res.stride(0), out.stride(0),
            summed.stride(0), eps, H=h, HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_norm_warps(block),
        )
    return out.reshape(x.shape), (x if residual is None else summed.reshape(x.shape))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return add_rms_norm(x, None, weight, eps)[0]


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, [..., I] each (strided views of one fused gate_up output are fine) -> [..., I]."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    g, u = as_rows(gate), as_rows(up)
    m, i = g.shape
    out = torch.empty((m, i), dtype=gate.dtype, device=gate.device)
    if m:
        grid = (m, triton.cdiv(i, _SILU_BLOCK))
        _silu_mul_kernel[grid](g, u, out, i, g.stride(0), u.stride(0), out.stride(0), BLOCK=_SILU_BLOCK)
    return out.reshape(gate.shape)


def _check_rope(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[int, int, int, int]:
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape != (t, hkv, d) or cos_sin.shape != (t, 2, d) or d % 2:
        raise ValueError(f"rope: q {tuple(q.shape)}, k {tuple(k.shape)}, cos_sin {tuple(cos_sin.shape)} "
                         "need [T, H, D], [T, Hkv, D], [T, 2, D] with D even")
    if q.stride(2) != 1 or k.stride(2) != 1 or cos_sin.stride(2) != 1:
        raise ValueError("rope: head_dim must be the contiguous dimension of q, k and cos_sin")
    return t, hq, hkv, d


def rope(q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hkv, D] (any token/head strides, unit last stride) by
    cos_sin [T, 2, D] (cos then sin, in q's dtype) in one launch -> new contiguous q, k."""
    t, hq, hkv, d = _check_rope(q, k, cos_sin)
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    k_out = torch.empty((t, hkv, d), dtype=k.dtype, device=k.device)
    if t:
        _rope_kernel[(t, hq + hkv)](
            q, k, cos_sin, q_out, k_out, hq, d, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos_sin.stride(0), cos_sin.stride(1), q_out.stride(0), q_out.stride(1), k_out.stride(0),
            k_out.stride(1), q, q, q, q, 0, 0, 0, 0, 0, 0,  # no cache write: unused
            HALF_BLOCK=triton.next_power_of_2(d // 2), WRITE_KV=False, num_warps=1,
        )
    return q_out, k_out


def rope_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """rope(q, k, cos_sin) with the rotated k and v [T, Hkv, D] written straight into the paged caches
    [num_blocks, block_size, Hkv, D] at `slots` (Long[T], block * block_size + offset), in the same launch
    -> the rotated q (new, contiguous). The caches get exactly the bits of `rope` followed by
    `index_copy_` of k.to(cache dtype) and v.to(cache dtype) (write_kv): k heads are rounded as k_out
    would be, then to the cache dtype. No host sync, allocates only q's output: CUDA-graph capturable.
    Repeated slots (dummy tokens sent to one scratch slot) leave one of their writes, unspecified which,
    as index_copy_ does."""
    t, hq, hkv, d = _check_rope(q, k, cos_sin)
    if v.shape != k.shape or v.stride(2) != 1:
        raise ValueError(f"rope_write_kv: v {tuple(v.shape)} must be shaped as k {tuple(k.shape)}, head_dim contiguous")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or tuple(k_cache.shape[2:]) != (hkv, d):
        raise ValueError(f"rope_write_kv: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} must both be "
                         f"[num_blocks, block_size, {hkv}, {d}]")
    if slots.shape != (t,) or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rope_write_kv: slots must be Long[{t}], got {slots.dtype}{list(slots.shape)}")
    kc, vc = k_cache.view(-1, hkv, d), v_cache.view(-1, hkv, d)  # [slots, Hkv, D], as write_kv's view
    if kc.stride(2) != 1 or vc.stride(2) != 1:
        raise ValueError("rope_write_kv: head_dim must be the contiguous dimension of the caches")
    q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    if t:
        _rope_kernel[(t, hq + hkv)](
            q, k, cos_sin, q_out, q_out, hq, d, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            cos_sin.stride(0), cos_sin.stride(1), q_out.stride(0), q_out.stride(1), 0, 0,  # no k_out
            v, slots, kc, vc, v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), vc.stride(0), vc.stride(1),
            HALF_BLOCK=triton.next_power_of_2(d // 2), WRITE_KV=True, num_warps=1,
        )
    return q_out
