"""The fused row kernels and the fused-weight model on CUDA: batch invariance, closeness, CUDA graphs."""
from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.attention import PassKind, RowSpec, build_metadata, positions_of
from engine.kernels.tiles import rms_norm_rows

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"
BS = 16
MAX_BATCH = 512
DTYPES = [torch.bfloat16, torch.float32]


def _assert_batch_invariant(fn: Callable[[int], torch.Tensor]) -> None:
    """fn(b): the op on the first b rows. Every batch size 1..512 gives each row its full-batch bits."""
    full = fn(MAX_BATCH)
    for b in range(1, MAX_BATCH + 1):
        out = fn(b)
        if not torch.equal(out, full[:b]):
            row = int((out != full[:b]).flatten(1).any(1).nonzero()[0])
            raise AssertionError(f"batch {b}: row {row} differs from the batch-{MAX_BATCH} result")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [128, 576, 4096, 5120, 9000])
def test_add_rms_norm(dtype: torch.dtype, h: int) -> None:
    from engine.kernels import triton_fused as tf

    g = _gen(h)
    x = (4 * torch.randn(MAX_BATCH, h, device=DEV, generator=g)).to(dtype)
    r = torch.randn(MAX_BATCH, h, device=DEV, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(h, device=DEV, generator=g)).to(dtype)
    _assert_batch_invariant(lambda b: torch.cat(tf.add_rms_norm(x[:b], r[:b], w, 1e-5), dim=-1))
    out, summed = tf.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, x + r)
    torch.testing.assert_close(out, rms_norm_rows(summed, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype: torch.dtype) -> None:
    from engine.kernels import triton_fused as tf

    inter = 14336
    gate_up = (2 * torch.randn(MAX_BATCH, 2 * inter, device=DEV, generator=_gen(1))).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)
    _assert_batch_invariant(lambda b: tf.silu_mul(gate[:b], up[:b]))
    ref = (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)
    torch.testing.assert_close(tf.silu_mul(gate, up), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope(dtype: torch.dtype) -> None:
    from engine.kernels import triton_fused as tf
    from engine.kernels.ops import torch_rope
    from engine.models.arch import RopeSpec
    from engine.models.rope import rope_table

    hq, hkv, d = 32, 8, 128
    qkv = torch.randn(MAX_BATCH, (hq + 2 * hkv) * d, device=DEV, generator=_gen(2)).to(dtype)
    q, k, _ = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k = q.view(-1, hq, d), k.view(-1, hkv, d)
    table = rope_table(RopeSpec("default", 500000.0), d, 8192, DEV)
    positions = torch.randint(0, 8192, (MAX_BATCH,), device=DEV, generator=_gen(3))
    cos_sin = table.index_select(0, positions).to(dtype)  # [T, 2, D]

    def both(b: int) -> torch.Tensor:
        q_out, k_out = tf.rope(q[:b], k[:b], cos_sin[:b])
        return torch.cat([q_out.flatten(1), k_out.flatten(1)], dim=1)

    _assert_batch_invariant(both)
    q_ref, k_ref = torch_rope(q.float(), k.float(), cos_sin.float())
    q_out, k_out = tf.rope(q, k, cos_sin)
    torch.testing.assert_close(q_out.float(), q_ref, rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(k_out.float(), k_ref, rtol=1e-2, atol=1e-2)


def _decode_eager_vs_graph(model: torch.nn.Module, n: int, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.cuda_graphs import DecodeGraphs

    nb = -(-(ctx + 8) // BS)
    tables = [list(range(2 + r * nb, 2 + (r + 1) * nb)) for r in range(n)]
    kv = model.allocate_kv_cache(2 + n * nb, BS)
    rows = [RowSpec(t, 0, ctx) for t in tables]
    vocab = model.arch.vocab_size
    ids = torch.randint(0, vocab, (n * ctx,), device=DEV, generator=_gen(4))
    step_ids = torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(5)).tolist()
    drows = [RowSpec(t, ctx, 1) for t in tables]
    with torch.inference_mode():
        model(ids, positions_of(rows, DEV), build_metadata(PassKind.PREFILL, rows, BS, DEV), kv)
        eager = model.compute_logits(model(torch.tensor(step_ids, device=DEV), positions_of(drows, DEV),
                                           build_metadata(PassKind.DECODE, drows, BS, DEV), kv))
    graphs = DecodeGraphs(model, kv, max_batch=n, max_seq_len=nb * BS, scratch_slot=BS, batch_sizes=(n,))
    graphs.capture()
    graphed = graphs.run(step_ids, [ctx] * n, [ctx + 1] * n, tables)
    assert graphed is not None
    return eager, graphed.clone()


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny", "llama-3.1-8b-2-layers"])
def test_synthetic_decode_under_cuda_graphs_equals_eager_bitwise(preset: str) -> None:
    """Same batch (the graph's own size), same kernels: the graphed decode step gives the eager bits."""
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    config = (synthetic_hf_config("llama-3.1-8b", num_hidden_layers=2) if preset == "llama-3.1-8b-2-layers"
              else synthetic_hf_config(preset))
    model = build_synthetic_model(config, torch.bfloat16, DEV, seed=1, attention_backend="triton")
    for n in (1, 8):
        eager, graphed = _decode_eager_vs_graph(model, n, ctx=70)
        assert torch.isfinite(eager).all()
        assert torch.equal(graphed, eager), f"batch {n}: max diff {(graphed - eager).abs().max().item()}"
    del model
    torch.cuda.empty_cache()


def test_fused_ops_stay_close_to_torch_row_ops() -> None:
    """The synthetic 8B shape (2 layers), bf16 prefill: fused Triton row ops vs torch row ops."""
    from engine.kernels import TorchOps
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    model = build_synthetic_model(synthetic_hf_config("llama-3.1-8b", num_hidden_layers=2), torch.bfloat16, DEV,
                                  seed=1, attention_backend="triton")
    plain = model.with_numerics(TorchOps(row_kernels="torch"), model.attention)
    rows = [RowSpec([2, 3, 4], 0, 40), RowSpec([5, 6], 0, 17)]
    ids = torch.randint(0, model.arch.vocab_size, (57,), device=DEV, generator=_gen(6))
    out = []
    for m in (model, plain):
        kv = m.allocate_kv_cache(7, BS)
        with torch.inference_mode():
            out.append(m.compute_logits(m(ids, positions_of(rows, DEV), build_metadata(PassKind.PREFILL, rows, BS,
                                                                                        DEV), kv)))
    assert not torch.equal(out[0], out[1])  # the fused path really ran
    assert (out[0] - out[1]).abs().max().item() < 0.05 * out[1].abs().max().item()
    del model, plain
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37, MAX_BATCH])
def test_rope_write_kv_equals_rope_then_write_kv(dtype: torch.dtype, t: int) -> None:
    """Compiled: the fused K/V write leaves bitwise the q and caches (every slot) of rope + write_kv."""
    from engine.attention.torch_backend import write_kv
    from engine.kernels import triton_fused as tf

    hq, hkv, num_blocks = 32, 8, 64
    for d in (64, 128):
        g = _gen(t + d)
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=DEV, generator=g).to(dtype)
        q, k, v = (x.view(t, -1, d) for x in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))
        cos_sin = torch.randn(t, 2, d, device=DEV, generator=g).to(dtype)
        k_cache = torch.randn(num_blocks, BS, hkv, d, device=DEV, generator=g).to(dtype)
        v_cache = torch.randn(num_blocks, BS, hkv, d, device=DEV, generator=g).to(dtype)
        slots = torch.randperm(num_blocks * BS, device=DEV, generator=g)[:t]
        kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
        q_ref, k_ref = tf.rope(q, k, cos_sin)
        write_kv(k_ref, v, kc_ref, vc_ref, slots)
        q_out = tf.rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots)
        assert torch.equal(q_out, q_ref)
        assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)


def test_fused_kv_write_model_equals_backend_write_bitwise() -> None:
    """The synthetic 8B shape (2 layers), bf16 prefill then decode on the triton backend: K/V written in the
    RoPE launch (kv_prewritten) vs by write_kv in the backend give the same logits and caches."""
    from engine.attention import triton_backend as tb
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    class NotPrewritten(tb.TritonPagedAttention):
        kv_prewritten = False
        forward_rope = None

    class RopeOutsideAttention(tb.TritonPagedAttention):
        forward_rope = None

    model = build_synthetic_model(synthetic_hf_config("llama-3.1-8b", num_hidden_layers=2), torch.bfloat16, DEV,
                                  seed=1, attention_backend="triton")
    off = model.with_numerics(model.ops, NotPrewritten())
    outside = model.with_numerics(model.ops, RopeOutsideAttention())
    prefill = [RowSpec([2, 3, 4], 0, 40), RowSpec([5, 6], 0, 17)]
    decode = [RowSpec([2, 3, 4], 40, 1), RowSpec([5, 6], 17, 1)]
    ids = torch.randint(0, model.arch.vocab_size, (57,), device=DEV, generator=_gen(7))
    step = torch.randint(0, model.arch.vocab_size, (2,), device=DEV, generator=_gen(8))
    logits, caches = [], []
    for m in (model, outside, off):
        kv = m.allocate_kv_cache(8, BS)
        with torch.inference_mode():
            a = m.compute_logits(m(ids, positions_of(prefill, DEV), build_metadata(PassKind.PREFILL, prefill, BS,
                                                                                    DEV), kv))
            b = m.compute_logits(m(step, positions_of(decode, DEV), build_metadata(PassKind.DECODE, decode, BS,
                                                                                    DEV), kv))
        logits.append(torch.cat([a, b]))
        caches.append(torch.stack(kv.k + kv.v))
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1]) and torch.equal(caches[0], caches[1])
    assert torch.equal(logits[0], logits[2]) and torch.equal(caches[0], caches[2])
    del model, off, outside
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rope_in_split_kernel_equals_rope_write_kv_then_decode(dtype: torch.dtype) -> None:
    """Compiled, Llama-8B heads: RoPE and the K/V store inside the split kernel give bitwise the output and
    caches of rope_write_kv then decode_attention, for every split size the backend uses and both merges,
    over rows of 1 to 5000 keys (a program that read its new key before the store would show here), five
    random cases."""
    from engine.attention import triton_paged as tp
    from engine.kernels import triton_fused as tf
    from tests.engine.gpu_reference import check_decode_rope_fusion

    for seed in range(5):
        lens = torch.randint(1, 5000, (40,), generator=torch.Generator().manual_seed(seed)).tolist()
        check_decode_rope_fusion(tf, tp, DEV, dtype, lens + [512, 513, 1, 64, 65], (32, 8, 128, BS),
                                 (64, 128, 256, 512), seed=seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_rope_in_canonical_kernel_equals_rope_write_kv_then_decode(dtype: torch.dtype) -> None:
    """Compiled, Llama-8B heads: the packed canonical kernel with `rope`, in a step with canonical rows beside
    split rows (each kernel storing its own rows' K/V, the canonical ones on the same stream here) and in an
    all-canonical step, gives bitwise the output and caches of rope_write_kv then the kernels (rows of 1 to
    5000 keys, so 1-20 chunks merged by their last program), three random cases."""
    from engine.attention import triton_paged as tp
    from engine.kernels import triton_fused as tf
    from tests.engine.gpu_reference import check_decode_rope_fusion

    for seed in range(3):
        gen = torch.Generator().manual_seed(seed + 10)
        lens = torch.randint(1, 5000, (40,), generator=gen).tolist() + [256, 257, 1, 64, 65]
        mask = (torch.rand(len(lens), generator=gen) < 0.4).int().tolist()
        check_decode_rope_fusion(tf, tp, DEV, dtype, lens, (32, 8, 128, BS), (256, 512), seed=seed, canonical=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_fused_merge_equals_merge_kernel(dtype: torch.dtype) -> None:
    """Compiled: the split kernel's fused merge (atomic counter, last program merges) gives bitwise the
    separate merge kernel's output, launch after launch (a race would show as a differing or NaN row), with
    canonical rows skipped, and leaves every counter at zero."""
    from engine.attention import triton_paged as tp
    from tests.engine.gpu_reference import make_paged_case

    hq, hkv, d = 32, 8, 128
    lens = torch.randint(1, 5000, (48,), generator=torch.Generator().manual_seed(9)).tolist() + [512, 513, 1]
    case = make_paged_case(lens, [1] * len(lens), hq, hkv, d, BS, dtype, DEV, seed=3, spare_blocks=1)
    args = (case["q"], case["k_cache"], case["v_cache"], case["seq_lens"], case["block_tables"], d ** -0.5)
    splits = tp.decode_num_splits(case["block_tables"].shape[1] * BS)
    skip = (torch.arange(len(lens), device=DEV) % 5 == 1).to(torch.int32)
    for skip_rows in (None, skip):
        ref = tp.decode_attention(*args, skip_rows=skip_rows, merge="kernel")
        ws = tp.DecodeWorkspace(len(lens), hq, d, splits, DEV)
        for n in (len(lens), 1, 7):
            for _ in range(10):
                out = tp.decode_attention(*(a[:n] if i in (0, 3, 4) else a for i, a in enumerate(args)),
                                          workspace=ws, skip_rows=None if skip_rows is None else skip_rows[:n])
                keep = slice(None) if skip_rows is None else ~skip_rows[:n].bool()
                assert torch.equal(out[keep], ref[:n][keep])
        assert not ws.done.any()
