"""SHA-256 of the sm_90 LLVM IR of the attention kernels, lowered on the CPU (no GPU needed).

    python bench/kernel_ir.py [SOURCE_ROOT]      # default: this checkout

SOURCE_ROOT is a checkout (or `git archive` of a commit) whose engine/ is imported. Triton lowers each
kernel through its TTIR, TTGIR and LLVM passes for an sm_90 target with the launch's warps and stages;
only ptxas is left, so equal hashes at two commits mean the GPU runs the same code. Debug metadata
(source lines) is stripped before hashing. Kernels a checkout lacks print as "absent".
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from pathlib import Path
from typing import Any

PTRS = {"seq_lens_ptr": "*i32", "bt_ptr": "*i32", "row_mask_ptr": "*i32", "qsl_ptr": "*i32", "mid_o_ptr": "*fp32",
        "mid_lse_ptr": "*fp32", "cnt_ptr": "*i32", "slot_ptr": "*i64", "mid_m_ptr": "*fp32", "mid_l_ptr": "*fp32", "mid_acc_ptr": "*fp32"}
PAGED = dict(BLOCK_SIZE=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_M=64, BLOCK_N=64, DOT_PRECISION=None,
             HAS_ROW_MASK=True, CHUNK=256, GROUP=4, FUSE_ROPE=False)
SPLIT = dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, BLOCK_D=128, BLOCK_N=64, SPLIT=512,
             DOT_PRECISION=None, HAS_ROW_MASK=True, NUM_SPLITS=8, FUSED_MERGE=True, MERGE_PAD=4, FUSE_ROPE=False)
KERNELS = [  # (name, module, attribute, constexprs: the Llama-3.1-8B shapes, as the engine launches them)
    ("decode_split", "engine.attention.triton_paged_kernels", "_decode_split_kernel", SPLIT),
    ("decode_split_nomask", "engine.attention.triton_paged_kernels", "_decode_split_kernel",
     dict(SPLIT, HAS_ROW_MASK=False)),
    ("decode_split_rope", "engine.attention.triton_paged_kernels", "_decode_split_kernel",  # RoPE + K/V store fused
     dict(SPLIT, HAS_ROW_MASK=False, FUSE_ROPE=True)),
    ("prefill", "engine.attention.triton_paged_kernels", "_prefill_kernel", PAGED),
    ("canonical_decode", "engine.attention.triton_canonical_decode", "_canonical_decode_kernel", PAGED),
    ("canonical_decode_rope", "engine.attention.triton_canonical_decode", "_canonical_decode_kernel",
     dict(PAGED, FUSE_ROPE=True)),
]


def lower(kernel: Any, constexprs: dict[str, Any], types: dict[str, str] | None = None, *, llvm: bool = False,
          warps: int = 4, stages: int = 2) -> str:
    """Triton IR of `kernel` for sm_90 (the front end), or with llvm=True its LLVM IR (the TTIR, TTGIR and
    LLVM passes: layouts, pipelining, shared-memory allocation); only ptxas needs the GPU. Pointer
    arguments default to bf16 (PTRS and `types` override), `qk_scale` / `eps` / `scale` to fp32, the rest
    to i32; constexprs the kernel does not declare are ignored. Also used by tests/engine/test_triton_lowering.py."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import Language, make_backend

    params = inspect.signature(kernel.fn).parameters
    consts = {k: v for k, v in constexprs.items() if k in params}
    types = {**PTRS, **(types or {})}
    signature = {n: "constexpr" if n in consts else types.get(n, "*bf16" if n.endswith("_ptr") else
                                                                 "fp32" if n in ("qk_scale", "eps", "scale")
                                                                 else "i32")
                 for n in params}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": warps, "num_stages": stages})
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    module = ASTSource(fn=kernel, signature=signature, constexprs=consts).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
    if not llvm:
        return str(module)
    passes: dict[str, Any] = {}
    backend.add_stages(passes, options, Language.TRITON)
    md: dict[str, Any] = {}
    return str(passes["llir"](passes["ttgir"](passes["ttir"](module, md), md), md))


def llvm_ir(kernel: Any, constexprs: dict[str, Any]) -> str:
    """lower(..., llvm=True) without debug metadata (source lines), for hashing."""
    text = re.sub(r", !dbg ![0-9]+", "", lower(kernel, constexprs, llvm=True))
    return "\n".join(line for line in text.splitlines() if not line.startswith("!"))


def main() -> None:
    root = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]).resolve()
    sys.path.insert(0, str(root))
    for name, module, attr, consts in KERNELS:
        kernel = getattr(importlib.import_module(module), attr, None) if importlib.util.find_spec(module) else None
        if kernel is None:  # a checkout from before this kernel (a missing triton still raises)
            print(f"{name:22s} absent")
            continue
        print(f"{name:22s} {hashlib.sha256(llvm_ir(kernel, consts).encode()).hexdigest()[:16]}")


if __name__ == "__main__":
    main()
