"""Every Triton kernel of the engine's CUDA path lowers to Triton IR for an sm_90 target, on the CPU.

The Triton interpreter (how the CPU tests run these kernels) executes Python and never runs the
compiler's front end, so a kernel can pass every interpreted test and still fail to compile on the GPU
(e.g. a variable that changes shape inside an `if`). This lowers each kernel with the constexpr sets the
engine launches it with, for a Hopper target, without a GPU; code generation for the device itself
(ptxas) still happens only on the H200.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

triton = pytest.importorskip("triton")


def _load_kernel_ir() -> Any:
    spec = importlib.util.spec_from_file_location("kernel_ir", ROOT / "bench" / "kernel_ir.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROOT = Path(__file__).resolve().parents[2]
_lower = _load_kernel_ir().lower  # bench/kernel_ir.py's lowering (Triton IR, or LLVM IR with llvm=True)



@pytest.mark.parametrize("fused_merge", [True, False])
@pytest.mark.parametrize("fuse_rope", [True, False])
@pytest.mark.parametrize("group,head_dim", [(4, 128), (3, 64), (1, 64)])
def test_decode_split_kernel_lowers(fused_merge: bool, fuse_rope: bool, group: int, head_dim: int) -> None:
    from engine.attention import triton_paged_kernels as k

    consts = dict(BLOCK_SIZE=16, GROUP=group, GROUP_PAD=16, HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_N=64,
                  SPLIT=512, DOT_PRECISION=None, HAS_ROW_MASK=not fuse_rope, NUM_SPLITS=8, FUSED_MERGE=fused_merge,
                  MERGE_PAD=triton.next_power_of_2(group), FUSE_ROPE=fuse_rope)
    assert "tt.func" in _lower(k._decode_split_kernel, consts, {"slot_ptr": "*i64"})


@pytest.mark.parametrize("row_mask", [True, False])
def test_prefill_and_canonical_decode_kernels_lower(row_mask: bool) -> None:
    from engine.attention import triton_canonical_decode as cd
    from engine.attention import triton_paged_kernels as k

    common = dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, DOT_PRECISION=None,
                  HAS_ROW_MASK=row_mask, CHUNK=256)
    assert "tt.func" in _lower(k._prefill_kernel, dict(common, GROUP=4))
    for fuse_rope in (False, True):
        assert "tt.func" in _lower(cd._canonical_decode_kernel, dict(common, GROUP=4, FUSE_ROPE=fuse_rope),
                                   {"slot_ptr": "*i64"})


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
                 HAS_ROW_MASK=True, CHUNK=256, GROUP=4, FUSE_ROPE=False)
    split = dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, SPLIT=512,
                 DOT_PRECISION=None, HAS_ROW_MASK=True, NUM_SPLITS=8, FUSED_MERGE=True, MERGE_PAD=4, FUSE_ROPE=False)
    for kernel, consts in ((k._prefill_kernel, paged), (cd._canonical_decode_kernel, paged),
                           (k._decode_split_kernel, split),
                           (k._decode_split_kernel, dict(split, HAS_ROW_MASK=False, FUSE_ROPE=True)),
                           (cd._canonical_decode_kernel, dict(paged, FUSE_ROPE=True)),
                           # the default 16-row query tile (KernelSettings.query_tile): no wgmma-sized M
                           (k._prefill_kernel, dict(paged, BLOCK_M=16)),
                           (cd._canonical_decode_kernel, dict(paged, BLOCK_M=16, FUSE_ROPE=True))):
        assert "define ptx_kernel void" in _lower(kernel, consts, llvm=True)


def test_kernel_ir_script_hashes_every_attention_kernel_of_this_checkout() -> None:
    """`python bench/kernel_ir.py`: whether two checkouts' kernels are the same code on the GPU."""
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_ir.py")], capture_output=True, text=True,
                         timeout=600, check=True).stdout.split("\n")
    hashes = dict(line.split() for line in out if line.strip())
    assert set(hashes) == {"decode_split", "decode_split_nomask", "decode_split_rope", "prefill",
                           "canonical_decode", "canonical_decode_rope"}, out
    assert all(len(h) == 16 and h != "absent" for h in hashes.values()), hashes
    assert hashes["decode_split"] != hashes["decode_split_nomask"] != hashes["decode_split_rope"]
