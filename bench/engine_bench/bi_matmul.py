"""Probe of the batch-invariant Triton GEMM's tile configurations on a CUDA GPU (issue 6).

    python -m bench bi-matmul --out DIR

For the Llama-3.1-8B linear shapes it records, per tile configuration (BLOCK_M, BLOCK_N, BLOCK_K,
warps, stages): the median time at M in {1, 16, 64, 128, 256, 512, 2048, 4096} next to cuBLAS, and
whether its output is bitwise equal to every other configuration's (same K order, other tile shape).
That equality decides whether the tile shape may follow the batch size without breaking invariance:
each output element's reduction is the K loop in increasing order either way, but the MMA
instruction follows the tile shape, and only the hardware says whether its bits do too.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from bench.results import write_result

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
MS = (1, 16, 64, 128, 256, 512, 2048, 4096)
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)
    (128, 32, 64, 4, 3),  # a narrow-N tile
    (128, 128, 64, 8, 3),  # a wide-N tile (the fixed fallback, _FIXED)
    (64, 32, 64, 4, 4),
    (64, 64, 64, 4, 4),
    (64, 64, 128, 4, 3),
    (64, 128, 64, 4, 4),
    (64, 256, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 128, 128, 8, 3),
    (16, 64, 128, 4, 4),
    (32, 64, 128, 4, 4),
]


def _time(fn, reps: int = 15) -> float:
    from bench.engine_bench.common import time_cuda

    return time_cuda(fn, reps=reps, warmup=1)["median_ms"]


def _launch(kernel, x, w, out, cfg):
    import triton

    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    kernel[grid](x, w, x, out, m, n, k, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                 out.stride(0), out.stride(1), HAS_BIAS=False, IEEE=False,
                 BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def main(argv: list[str] | None = None) -> int:
    from engine.kernels.triton_matmul import _matmul_kernel

    p = argparse.ArgumentParser(prog="python -m bench bi-matmul", description=__doc__.split("\n")[0])
    p.add_argument("--out", default=".")
    p.add_argument("--shapes", default=",".join(SHAPES))
    a = p.parse_args(argv)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    result: dict = {"device": torch.cuda.get_device_name(), "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                    "torch": torch.__version__, "command": " ".join(["python", *sys.orig_argv[1:]]),
                    "configs": [list(c) for c in CONFIGS], "shapes": {}}
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device=dev, generator=g) * 0.02).to(torch.bfloat16)
        x = torch.randn(max(MS), k, device=dev, generator=g).to(torch.bfloat16)
        ref_bits = {}
        bits_equal = {}
        for cfg in CONFIGS:
            out = torch.empty(512, n, device=dev, dtype=torch.bfloat16)
            _launch(_matmul_kernel, x[:512], w, out, cfg)
            one = torch.empty(1, n, device=dev, dtype=torch.bfloat16)
            _launch(_matmul_kernel, x[:1], w, one, cfg)
            key = "x".join(map(str, cfg))
            ref_bits[key] = out
            bits_equal[key] = {"self_m1_vs_m512_row0": bool(torch.equal(one[0], out[0]))}
        keys = list(ref_bits)
        for key in keys:
            bits_equal[key]["equal_to"] = [o for o in keys if torch.equal(ref_bits[key], ref_bits[o])]
        del ref_bits
        times: dict = {"cublas": {}}
        for m in MS:
            xm = x[:m].contiguous()
            times["cublas"][m] = _time(lambda: torch.matmul(xm, w.t()))
        for cfg in CONFIGS:
            key = "x".join(map(str, cfg))
            times[key] = {}
            for m in MS:
                xm = x[:m].contiguous()
                out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
                try:
                    times[key][m] = _time(lambda: _launch(_matmul_kernel, xm, w, out, cfg))
                except Exception as e:  # noqa: BLE001 - e.g. out of shared memory for a tile shape
                    times[key][m] = f"error: {type(e).__name__}: {str(e)[:120]}"
        result["shapes"][name] = {"N": n, "K": k, "bits": bits_equal, "ms": times}
        print(name, json.dumps(bits_equal)[:2000], flush=True)
        for key, row in times.items():
            print(f"  {key:>16}", " ".join(f"{v:8.3f}" if isinstance(v, float) else " err" for v in row.values()),
                  flush=True)
        del w, x
        torch.cuda.empty_cache()
    write_result(result, a.out, "bi-matmul-probe")
    return 0
