"""Triton paged attention vs a float64 reference, and its bitwise invariances (CUDA only)."""
from __future__ import annotations

import pytest
import torch

from engine.attention import triton_backend as tb
from engine.attention import triton_paged as tp
from engine.config import KernelSettings
from tests.engine.gpu_reference import make_paged_case, reference_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEVICE = "cuda"

SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (32, 8, 128, 16),   # Llama-3.1-8B
    (9, 3, 64, 16),     # SmolLM2-135M
    (4, 4, 64, 32),     # MHA
]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in kernel output"
    return ((out.double().cpu() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-3)])
def test_prefill_matches_reference(shape: tuple, dtype: torch.dtype, tol: float, kernel_settings: KernelSettings) -> None:
    h, hkv, d, bs = shape
    case = make_paged_case([200, 7, 64, 300], [200, 3, 33, 32], h, hkv, d, bs, dtype, DEVICE, seed=1)
    out = torch.full_like(case["q"], float("nan"))
    tp.prefill_attention(case["q"], case["k_cache"], case["v_cache"], case["query_start_loc"],
                         case["seq_lens"], case["block_tables"], d ** -0.5, case["max_query_len"], out=out,
                         settings=kernel_settings)
    ref = reference_attention(case["q"], case["k_cache"], case["v_cache"], case["query_start_loc"],
                              case["seq_lens"], case["block_tables"], d ** -0.5)
    assert _rel_err(out, ref) < tol


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-3)])
def test_decode_matches_reference(shape: tuple, dtype: torch.dtype, tol: float, kernel_settings: KernelSettings) -> None:
    h, hkv, d, bs = shape
    lens = [1, 17, 511, 512, 513, 2000]
    case = make_paged_case(lens, [1] * len(lens), h, hkv, d, bs, dtype, DEVICE, seed=2)
    out = torch.full_like(case["q"], float("nan"))
    tp.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens"], case["block_tables"],
                        d ** -0.5, out=out, settings=kernel_settings)
    ref = reference_attention(case["q"], case["k_cache"], case["v_cache"], case["query_start_loc"],
                              case["seq_lens"], case["block_tables"], d ** -0.5)
    assert _rel_err(out, ref) < tol


def _verify_window(case: dict, start: int, width: int, d: int, settings: KernelSettings) -> torch.Tensor:
    """Attention output of queries [start, start+width) of row 0 when they form one verify row."""
    q_all = case["q"]  # [seq_len, H, D]: one query per position of row 0
    q = q_all[start:start + width].contiguous()
    qsl = torch.tensor([0, width], dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([start + width], dtype=torch.int32, device=DEVICE)
    return tp.prefill_attention(q, case["k_cache"], case["v_cache"], qsl, seq_lens, case["block_tables"][:1],
                                d ** -0.5, width, settings=settings)


@pytest.mark.parametrize("shape", SHAPES[:2])
def test_verify_window_start_invariance(shape: tuple, kernel_settings: KernelSettings) -> None:
    """The same positions verified in windows starting at different offsets give bitwise equal outputs."""
    h, hkv, d, bs = shape
    n = 400
    case = make_paged_case([n], [n], h, hkv, d, bs, torch.bfloat16, DEVICE, seed=3)
    width = 32
    base = _verify_window(case, 200, width, d, kernel_settings)   # positions 200..231
    for start in (169, 185, 190, 199, 201, 213, 223):
        other = _verify_window(case, start, width, d, kernel_settings)
        lo, hi = max(start, 200), min(start + width, 200 + width)
        assert torch.equal(other[lo - start:hi - start], base[lo - 200:hi - 200]), f"window start {start}"
    # and the whole prompt as one prefill gives the same bits for those positions
    full = tp.prefill_attention(case["q"], case["k_cache"], case["v_cache"], case["query_start_loc"],
                                case["seq_lens"], case["block_tables"], d ** -0.5, n, settings=kernel_settings)
    assert torch.equal(full[200:232], base)


def test_verify_row_and_batch_invariance(kernel_settings: KernelSettings) -> None:
    """A verify row gives the same bits alone, as row 5 of 8, or next to different co-rows."""
    h, hkv, d, bs = SHAPES[0]
    lens = [96 + 37 * i for i in range(8)]
    case = make_paged_case(lens, [32] * 8, h, hkv, d, bs, torch.bfloat16, DEVICE, seed=4)
    full = tp.prefill_attention(case["q"], case["k_cache"], case["v_cache"], case["query_start_loc"],
                                case["seq_lens"], case["block_tables"], d ** -0.5, 32, settings=kernel_settings)
    r = 5
    alone = tp.prefill_attention(case["q"][32 * r:32 * r + 32].contiguous(), case["k_cache"], case["v_cache"],
                                 case["query_start_loc"][:2], case["seq_lens"][r:r + 1],
                                 case["block_tables"][r:r + 1], d ** -0.5, 32, settings=kernel_settings)
    assert torch.equal(alone, full[32 * r:32 * r + 32])


def test_decode_batch_invariance() -> None:
    """Fixed split SIZE: a row's decode output does not depend on the batch or on the table width."""
    h, hkv, d, bs = SHAPES[0]
    lens = [5, 700, 1500, 64, 2047, 333]
    case = make_paged_case(lens, [1] * len(lens), h, hkv, d, bs, torch.bfloat16, DEVICE, seed=5, spare_blocks=40)
    full = tp.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens"],
                               case["block_tables"], d ** -0.5)
    for r in range(len(lens)):
        n_blocks = (lens[r] + bs - 1) // bs
        alone = tp.decode_attention(case["q"][r:r + 1], case["k_cache"], case["v_cache"],
                                    case["seq_lens"][r:r + 1], case["block_tables"][r:r + 1, :n_blocks].contiguous(),
                                    d ** -0.5)
        assert torch.equal(alone, full[r:r + 1]), f"row {r}"


def test_decode_cuda_graph_replay_allocates_nothing() -> None:
    h, hkv, d, bs = SHAPES[0]
    lens = [100, 900, 40]
    case = make_paged_case(lens, [1] * 3, h, hkv, d, bs, torch.bfloat16, DEVICE, seed=6, spare_blocks=8)
    ws = tp.DecodeWorkspace(3, h, d, tp.decode_num_splits(case["block_tables"].shape[1] * bs), DEVICE)
    out = torch.empty_like(case["q"])

    def step() -> None:
        tp.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens"],
                            case["block_tables"], d ** -0.5, workspace=ws, out=out)

    step()
    eager = out.clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.zero_()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
    assert torch.equal(out, eager)
    case["seq_lens"].add_(1)  # new lengths through the same graph
    graph.replay()
    step_ref = reference_attention(case["q"], case["k_cache"], case["v_cache"], case["query_start_loc"],
                                   case["seq_lens"], case["block_tables"], d ** -0.5)
    assert _rel_err(out, step_ref) < 1e-2


def test_canonical_decode_equals_the_verifier_bitwise(kernel_settings: KernelSettings) -> None:
    """decode="canonical": a decode query gets exactly the bits the verify kernel gives that position."""
    from engine.attention.metadata import AttentionMetadata, PassKind

    h, hkv, d, bs = SHAPES[0]
    n = 300
    case = make_paged_case([n], [n], h, hkv, d, bs, torch.bfloat16, DEVICE, seed=7)
    window = _verify_window(case, 260, 32, d, kernel_settings)     # positions 260..291 as one verify row
    backend = tb.TritonPagedAttention(decode="canonical", settings=kernel_settings)
    for p in (260, 275, 291):
        q = case["q"][p:p + 1].contiguous()
        seq_lens = torch.tensor([p + 1], dtype=torch.int32, device=DEVICE)
        meta = AttentionMetadata(PassKind.DECODE, torch.zeros(1, dtype=torch.long, device=DEVICE),
                                 torch.tensor([0, 1], dtype=torch.int32, device=DEVICE), seq_lens,
                                 case["block_tables"][:1])
        plan = backend.plan(meta, bs)
        out = tp.prefill_attention(q, case["k_cache"], case["v_cache"], plan.query_start_loc, plan.seq_lens,
                                   plan.block_tables, d ** -0.5, plan.max_query_len, settings=kernel_settings)
        assert not plan.one_query_per_row
        assert torch.equal(out[0], window[p - 260]), f"position {p}"


def test_canonical_rows_equal_the_verifier_bitwise(kernel_settings: KernelSettings) -> None:
    """decode="split" with canonical_rows: flagged rows get the verify window's bits, the others the split
    decode's, within one decode batch (rows at positions 260, 275, 291 of the same cache)."""
    from engine.attention.metadata import AttentionMetadata, PassKind

    h, hkv, d, bs = SHAPES[0]
    n = 300
    case = make_paged_case([n], [n], h, hkv, d, bs, torch.bfloat16, DEVICE, seed=7)
    window = _verify_window(case, 260, 32, d, kernel_settings)     # positions 260..291 as one verify row
    positions = [260, 275, 291, 270]
    q = case["q"][positions].contiguous()
    seq_lens = torch.tensor([p + 1 for p in positions], dtype=torch.int32, device=DEVICE)
    tables = case["block_tables"][[0] * len(positions)].contiguous()
    split = tp.decode_attention(q, case["k_cache"], case["v_cache"], seq_lens, tables, d ** -0.5,
                                settings=kernel_settings)
    # the split above uses the default split size
    backend = tb.TritonPagedAttention(split_size=tp.DECODE_SPLIT_SIZE, settings=kernel_settings)
    mask = torch.tensor([1, 0, 1, 0], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor(positions, device=DEVICE)
    slots = tables[0].long()[pos // bs] * bs + pos % bs
    meta = AttentionMetadata(PassKind.DECODE, slots, torch.arange(5, dtype=torch.int32, device=DEVICE), seq_lens,
                             tables, canonical_rows=mask)
    kv = case["k_cache"].view(-1, hkv, d)[slots], case["v_cache"].view(-1, hkv, d)[slots]
    out = backend.forward(q, *kv, case["k_cache"], case["v_cache"], backend.plan(meta, bs), d ** -0.5)
    for r, p in enumerate(positions):
        expected = window[p - 260] if mask[r] else split[r]
        assert torch.equal(out[r], expected), f"row {r} (position {p}, flag {int(mask[r])})"
