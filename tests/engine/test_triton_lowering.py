"""Every Triton kernel of the engine's CUDA path lowers to Triton IR for an sm_90 target, on the CPU.

The Triton interpreter (how the CPU tests run these kernels) executes Python and never runs the
compiler's front end, so a kernel can pass every interpreted test and still fail to compile on the GPU
(e.g. a variable that changes shape inside an `if`). This lowers each kernel with the constexpr sets the
engine launches it with, for a Hopper target, without a GPU; code generation for the device itself
(ptxas) still happens only on the H200.
"""
from __future__ import annotations

import inspect
from typing import Any

import pytest

triton = pytest.importorskip("triton")


def _lower(kernel: Any, constexprs: dict[str, Any], types: dict[str, str] | None = None, *, llvm: bool = False,
           warps: int = 4, stages: int = 2) -> str:
    """Triton IR of `kernel` for sm_90 (the front end), or with llvm=True its LLVM IR (the TTIR, TTGIR
    and LLVM passes: layouts, pipelining, shared-memory allocation); only ptxas needs the GPU."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import Language, make_backend

    types = types or {}
    signature: dict[str, str] = {}
    for name in inspect.signature(kernel.fn).parameters:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            signature[name] = "*bf16"
        elif name in ("qk_scale", "eps", "scale"):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": warps, "num_stages": stages})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    module = ASTSource(fn=kernel, signature=signature, constexprs=constexprs).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
    if not llvm:
        return str(module)
    passes: dict[str, Any] = {}
    backend.add_stages(passes, options, Language.TRITON)
    metadata: dict[str, Any] = {}
    return str(passes["llir"](passes["ttgir"](passes["ttir"](module, metadata), metadata), metadata))


PAGED_PTRS = {"seq_lens_ptr": "*i32", "bt_ptr": "*i32", "row_mask_ptr": "*i32", "qsl_ptr": "*i32",
              "mid_o_ptr": "*fp32", "mid_lse_ptr": "*fp32", "cnt_ptr": "*i32", "mid_m_ptr": "*fp32",
              "mid_l_ptr": "*fp32", "mid_acc_ptr": "*fp32"}


@pytest.mark.parametrize("fused_merge", [True, False])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (3, 64), (1, 64)])
def test_decode_split_kernel_lowers(fused_merge: bool, group: int, head_dim: int) -> None:
    from engine.attention import triton_paged_kernels as k

    consts = dict(BLOCK_SIZE=16, GROUP=group, GROUP_PAD=16, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=64,
                  SPLIT=512, DOT_PRECISION=None, HAS_ROW_MASK=True, NUM_SPLITS=8, FUSED_MERGE=fused_merge,
                  MERGE_PAD=triton.next_power_of_2(group))
    assert "tt.func" in _lower(k._decode_split_kernel, consts, PAGED_PTRS)


@pytest.mark.parametrize("row_mask", [True, False])
def test_prefill_and_canonical_decode_kernels_lower(row_mask: bool) -> None:
    from engine.attention import triton_canonical_decode as cd
    from engine.attention import triton_paged_kernels as k

    common = dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, DOT_PRECISION=None,
                  HAS_ROW_MASK=row_mask, CHUNK=256)
    assert "tt.func" in _lower(k._prefill_kernel, dict(common, GROUP=4), PAGED_PTRS)
    assert "tt.func" in _lower(cd._canonical_decode_kernel, dict(common, GROUP=4), PAGED_PTRS)


@pytest.mark.parametrize("write_kv", [True, False])
def test_rope_kernel_lowers(write_kv: bool) -> None:
    from engine.kernels import triton_fused as f

    types = {"slot_ptr": "*i64"}
    assert "tt.func" in _lower(f._rope_kernel, dict(HALF_BLOCK=64, WRITE_KV=write_kv), types)


@pytest.mark.parametrize("has_residual", [True, False])
@pytest.mark.parametrize("h", [4096, 576, 16384])
def test_norm_kernel_lowers(has_residual: bool, h: int) -> None:
    from engine.kernels import triton_fused as f

    block = f._norm_block(h)
    assert "tt.func" in _lower(f._add_rms_norm_kernel, dict(H=h, HAS_RESIDUAL=has_residual, BLOCK=block))


def test_silu_mul_kernel_lowers() -> None:
    from engine.kernels import triton_fused as f

    assert "tt.func" in _lower(f._silu_mul_kernel, dict(BLOCK=f._SILU_BLOCK))


def test_batch_invariant_matmul_lowers_for_every_tile() -> None:
    from engine.kernels import triton_matmul as tm

    tiles = [tile for _, tile in tm._BUCKETS] + list(tm._FIXED.values())
    for bm, bn, bk, _, _ in tiles:
        consts = dict(HAS_BIAS=True, IEEE=False, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=tm._GROUP_M)
        assert "tt.func" in _lower(tm._matmul_kernel, consts)


def test_the_check_catches_a_shape_changing_branch() -> None:
    """Control: the front end rejects what the interpreter runs happily."""

    @triton.jit
    def bad(x_ptr, flag):
        acc = triton.language.zeros([16], triton.language.float32)
        if flag > 0:  # a run-time branch: both shapes must agree
            acc = triton.language.zeros([4], triton.language.float32)
        triton.language.store(x_ptr + triton.language.arange(0, 16), acc)

    with pytest.raises(Exception, match="redefines"):
        _lower(bad, {}, {"x_ptr": "*fp32"})


def test_attention_kernels_reach_llvm_ir_for_sm90() -> None:
    """The whole lowering but ptxas, with the launch's warps and stages, for the kernels the decode and
    verify passes run (layout, pipelining and shared-memory decisions happen here, not in the front end)."""
    from engine.attention import triton_canonical_decode as cd
    from engine.attention import triton_paged_kernels as k

    paged = dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, DOT_PRECISION=None,
                 HAS_ROW_MASK=True, CHUNK=256, GROUP=4)
    split = dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, SPLIT=512,
                 DOT_PRECISION=None, HAS_ROW_MASK=True, NUM_SPLITS=8, FUSED_MERGE=True, MERGE_PAD=4)
    for kernel, consts in ((k._prefill_kernel, paged), (cd._canonical_decode_kernel, paged),
                           (k._decode_split_kernel, split)):
        assert "define ptx_kernel void" in _lower(kernel, consts, PAGED_PTRS, llvm=True)
