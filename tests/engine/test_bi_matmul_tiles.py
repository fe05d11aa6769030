"""Tile-shape choice of the batch-invariant GEMM (engine.kernels.triton_matmul), checked without a GPU:
the bucket table is ordered and covers every M, and a device whose tile shapes disagree gets the one
fixed shape for every M (the kernels themselves run in tests/engine/test_batch_invariant_gpu.py)."""
from __future__ import annotations

import pytest
import torch

tm = pytest.importorskip("engine.kernels.triton_matmul")


def test_buckets_increase_and_cover_every_m() -> None:
    limits = [limit for limit, _ in tm._BUCKETS]
    assert limits == sorted(limits) and limits[-1] >= 1 << 40
    for limit, (bm, bn, bk, warps, stages) in tm._BUCKETS:
        assert bk % 16 == 0 and bm >= 16 and bn >= 16 and warps in (4, 8) and stages >= 2, limit


def test_tile_for_follows_m_when_shapes_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda", 0)
    monkeypatch.setitem(tm._AGREE, (str(dev), torch.bfloat16), True)
    assert tm.tile_for(1, torch.bfloat16, dev) == tm._BUCKETS[0][1]
    assert tm.tile_for(tm._BUCKETS[0][0] + 1, torch.bfloat16, dev) == tm._BUCKETS[1][1]
    assert tm.tile_for(10**6, torch.bfloat16, dev) == tm._BUCKETS[-1][1]
    assert tm.tile_for(1, torch.float32, dev) == tm._FIXED[torch.float32]


def test_disagreeing_device_gets_one_fixed_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    dev = torch.device("cuda", 0)
    monkeypatch.setitem(tm._AGREE, (str(dev), torch.bfloat16), False)
    shapes = {tm.tile_for(m, torch.bfloat16, dev) for m in (1, 64, 129, 513, 4096)}
    assert shapes == {tm._FIXED[torch.bfloat16]}


def test_kernel_id_names_every_16_bit_tile() -> None:
    for tile in [tile for _, tile in tm._BUCKETS] + [tm._FIXED[torch.bfloat16], tm._FIXED[torch.float16]]:
        assert "x".join(map(str, tile)) in tm.KERNEL_ID


def test_unchecked_device_under_graph_capture_gets_the_fixed_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """The agreement check syncs, which a CUDA-graph capture forbids: an unchecked device then uses the
    fixed shape, whose bits are right whether or not the bucket shapes agree."""
    dev = torch.device("cuda", 7)
    monkeypatch.delitem(tm._AGREE, (str(dev), torch.bfloat16), raising=False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tm.tile_for(1, torch.bfloat16, dev) == tm._FIXED[torch.bfloat16]
    assert (str(dev), torch.bfloat16) not in tm._AGREE
