"""The split-KV decode kernel (the fast path) with short splits: the backend's split size by batch, and the
fused merge that skips splits past a row's keys.

With merge="fused" a split program past the row's keys exits at once and the last active program merges
the active splits only; merge="kernel" stores every split (an empty one as lse = -inf) and merges them all.
Both must give the same bits, whatever the split size and however wide the block table (more empty
splits), and stay close to float64 attention. The CPU check runs the kernels under the Triton
interpreter (a subprocess, as in test_canonical_decode); the gpu-marked one uses realistic shapes.
"""
from __future__ import annotations

import pytest
import torch

from tests.engine.gpu_reference import make_paged_case, reference_attention


def check_split_decode(device: str, dtype: torch.dtype, shape: tuple[int, int, int, int], lens: list[int],
                       split_sizes: tuple[int, ...], tol: float) -> None:
    from engine.attention import triton_paged as tp

    h, hkv, d, bs = shape
    case = make_paged_case(lens, [1] * len(lens), h, hkv, d, bs, dtype, device, seed=21, spare_blocks=6)
    q, kc, vc, sl, bt = case["q"], case["k_cache"], case["v_cache"], case["seq_lens"], case["block_tables"]
    scale = d ** -0.5
    ref = reference_attention(q, kc, vc, case["query_start_loc"], sl, bt, scale).to(q.device)
    # a wider table (zero-block padding): more splits in the grid, all past every row's keys
    wide = torch.cat([bt, torch.zeros(bt.shape[0], 8, dtype=bt.dtype, device=bt.device)], dim=1)
    for split in split_sizes:
        fused = tp.decode_attention(q, kc, vc, sl, bt, scale, split_size=split, merge="fused")
        kernel = tp.decode_attention(q, kc, vc, sl, bt, scale, split_size=split, merge="kernel")
        assert torch.equal(fused, kernel), f"split {split}: fused merge differs from the merge kernel"
        ws = tp.DecodeWorkspace(len(lens), h, d, tp.decode_num_splits(wide.shape[1] * bs, split), device)
        for _ in range(2):  # twice through one workspace: the merging programs reset their counters
            again = tp.decode_attention(q, kc, vc, sl, wide, scale, workspace=ws, split_size=split)
            assert torch.equal(again, fused), f"split {split}: a wider table changed the bits"
        err = ((fused.double() - ref.double()).norm() / ref.double().norm()).item()
        assert err < tol, f"split {split}: relative error {err}"
        # one row alone, through the same split size: its own keys only
        alone = tp.decode_attention(q[2:3], kc, vc, sl[2:3], bt[2:3], scale, split_size=split)
        assert torch.equal(alone, fused[2:3])


def check_backend_split_by_rows(device: str) -> None:
    """The default backend picks the split size by the padded batch; a fixed one keeps it for every batch."""
    from engine.attention import triton_backend as tb
    from engine.attention import triton_paged as tp
    from engine.attention.metadata import AttentionMetadata, PassKind

    h, hkv, d, bs = 4, 2, 16, 16
    for rows in (1, 3, 9):
        lens = [40 + 29 * r for r in range(rows)]
        case = make_paged_case(lens, [1] * rows, h, hkv, d, bs, torch.float32, device, seed=rows)
        last = case["seq_lens"].long() - 1
        slots = case["block_tables"].long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
        meta = AttentionMetadata(PassKind.DECODE, slots, case["query_start_loc"], case["seq_lens"],
                                 case["block_tables"])
        for backend, split in ((tb.TritonPagedAttention(), tp.decode_split_for_rows(rows)),
                               (tb.TritonPagedAttention(split_size=256), 256)):
            out = backend.forward(case["q"], None, None, case["k_cache"], case["v_cache"], backend.plan(meta, bs),
                                  d ** -0.5)
            expected = tp.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens"],
                                           case["block_tables"], d ** -0.5, split_size=split)
            assert torch.equal(out, expected), f"{rows} rows: not the split-{split} kernel"
            width = case["block_tables"].shape[1] * bs
            assert [k[3] for k in backend._workspaces] == [tp.decode_num_splits(width, split)]


def test_split_size_by_rows() -> None:
    from engine.attention import triton_paged as tp

    assert [tp.decode_split_for_rows(r) for r in (1, 2, 3, 8, 9, 32, 33, 64, 256)] == \
        [64, 64, 128, 128, 256, 256, 512, 512, 512]
    assert all(s % tp.DECODE_BLOCK_N == 0 for _, s in tp.DECODE_SPLITS_BY_ROWS)


def _interpreter_main() -> None:
    from tests.engine.test_canonical_decode import patch_interpreter

    patch_interpreter()
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        # 64-key splits over rows of 1 key to 3 splits, and 128-key splits
        check_split_decode("cpu", dtype, (4, 2, 16, 16), [1, 70, 9, 130, 64, 65], (64, 128), tol)
    check_backend_split_by_rows("cpu")
    print("interpreter ok")


@pytest.mark.slow
def test_split_decode_under_the_triton_interpreter() -> None:
    from tests.engine.test_canonical_decode import run_under_triton_interpreter

    run_under_triton_interpreter("tests.engine.test_decode_splits")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_split_decode_short_splits() -> None:
    for shape in ((32, 8, 128, 16), (9, 3, 64, 16)):
        check_split_decode("cuda", torch.bfloat16, shape, [1, 17, 300, 511, 1000, 2000, 64, 4097], (64, 128, 256, 512),
                           1e-2)
    check_backend_split_by_rows("cuda")
