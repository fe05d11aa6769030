"""The fused row kernels (engine/kernels/triton_fused.py) on the CPU, under the Triton interpreter.

A private copy of the module is loaded with TRITON_INTERPRET=1 set (triton decides interpreted vs
compiled when a kernel is decorated, and imports parts of itself lazily at the first launch, so the
variable stays set while these tests run and is restored after). Skipped where CUDA is present: the gpu
tests (test_fused_gpu.py) run the same kernels compiled, and the interpreter's lazily imported modules
would stay behind in that process. bfloat16 is not checked here: the interpreter truncates fp32 to
bf16 where the GPU rounds to nearest; float16 rounds correctly in both, so it stands in for bf16.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

import engine.kernels
from engine.attention import PassKind, RowSpec, build_metadata, positions_of
from engine.kernels import TorchOps
from engine.kernels.tiles import rms_norm_rows

# Run by tests/engine/test_fused_kernels_subprocess.py in a fresh interpreter with TRITON_INTERPRET=1 set
# from the start: in a long pytest process, kernels other tests decorated earlier (compiled mode) must not mix
# with these interpreted ones.
INSIDE = os.environ.get("VERBATIM_FUSED_INTERPRETED") == "1"
pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: test_fused_gpu.py runs these"),
              pytest.mark.skipif(not INSIDE, reason="runs in its own process (test_fused_kernels_subprocess.py)")]

_SOURCE = Path(engine.kernels.__file__).with_name("triton_fused.py")
DTYPES = [torch.float32, torch.float16]


@pytest.fixture(scope="module")
def tf() -> Iterator[ModuleType]:
    """triton_fused, interpreted; installed as engine.kernels.triton_fused for the model-level tests."""
    from tests.engine.test_canonical_decode import interpreter_shortcuts, patch_lang_once

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        from triton.runtime import interpreter

        mp.setattr(interpreter, "_patch_lang", patch_lang_once(interpreter._patch_lang))
        interpreter_shortcuts(mp)  # restored on exit like the rest
        spec = importlib.util.spec_from_file_location("engine.kernels.triton_fused", _SOURCE)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        mp.setitem(sys.modules, "engine.kernels.triton_fused", module)
        mp.setattr(engine.kernels, "triton_fused", module, raising=False)
        yield module


def _assert_rows_invariant(fn: Callable[[int], torch.Tensor], m: int) -> None:
    """fn(b) computes the first b rows; each batch size gives row i the bits it has in the full batch."""
    full = fn(m)
    for b in (1, 2, 3, m - 1):
        assert torch.equal(fn(b), full[:b]), f"batch {b} of {m} differs"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [96, 5000, 9000])  # one (masked) block; two 8192-lane chunks, masked tail
def test_add_rms_norm_matches_reference_and_is_row_invariant(tf: ModuleType, dtype: torch.dtype, h: int) -> None:
    g = torch.Generator().manual_seed(h)
    x, r = (3 * torch.randn(7, h, generator=g)).to(dtype), torch.randn(7, h, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(h, generator=g)).to(dtype)
    out, summed = tf.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(summed, x + r)  # one IEEE add in the dtype, as torch does it
    s = summed.double()
    ref = w.double() * s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    torch.testing.assert_close(out, rms_norm_rows(summed, w, 1e-5), rtol=tol, atol=tol)
    _assert_rows_invariant(lambda b: torch.cat(tf.add_rms_norm(x[:b], r[:b], w, 1e-5), dim=-1), 7)
    alone, same = tf.add_rms_norm(x, None, w, 1e-5)
    assert same is x
    torch.testing.assert_close(alone, rms_norm_rows(x, w, 1e-5), rtol=tol, atol=tol)


def test_add_rms_norm_takes_leading_dims_and_strided_rows(tf: ModuleType) -> None:
    qkv = torch.randn(5, 3 * 64)
    q = qkv[:, :128].view(5, 2, 64)  # head rows with a token stride of 192: reshaped to a copy
    w = torch.randn(64)
    torch.testing.assert_close(tf.rms_norm(q, w, 1e-6), rms_norm_rows(q, w, 1e-6), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual"):
        tf.add_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_on_fused_gate_up_views(tf: ModuleType, dtype: torch.dtype) -> None:
    inter = 2500  # three 1024-wide programs per row, the last one masked
    gate_up = (2 * torch.randn(6, 2 * inter, generator=torch.Generator().manual_seed(1))).to(dtype)
    gate, up = gate_up.split(inter, dim=-1)  # [6, I] views, row stride 2I
    out = tf.silu_mul(gate, up)
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    _assert_rows_invariant(lambda b: tf.silu_mul(gate[:b], up[:b]), 6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [24, 64])  # half of 24 is not a power of two: masked lanes
def test_rope_rotates_q_and_k_in_one_launch(tf: ModuleType, dtype: torch.dtype, d: int) -> None:
    from engine.kernels.ops import torch_rope

    t, hq, hkv = 5, 4, 2
    g = torch.Generator().manual_seed(d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, _ = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hkv, d)
    angles = torch.rand(t, 1, d // 2, generator=g).double() * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).repeat(1, 1, 2).to(dtype)  # [T, 2, D]
    q_out, k_out = tf.rope(q, k, cos_sin)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    q_ref, k_ref = torch_rope(q.double(), k.double(), cos_sin.double())
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(q_out.double(), q_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(k_out.double(), k_ref, rtol=tol, atol=tol)
    _assert_rows_invariant(lambda b: torch.cat([x.flatten(1) for x in tf.rope(q[:b], k[:b], cos_sin[:b])], 1), t)


class _InterpretedFusedOps(TorchOps):
    """TorchOps taking its CUDA path (the fused kernels) on CPU tensors."""

    def _fused(self, x: torch.Tensor) -> ModuleType:
        return engine.kernels.triton_fused  # the interpreted module the `tf` fixture installed


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny", "qwen2-tiny"])
def test_model_forward_through_fused_kernels_matches_torch_ops(
    tf: ModuleType, preset: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model's wiring of the fused ops (residual stream, q/k norm, qkv bias, strided views)."""
    from engine.attention import get_backend
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    config = (synthetic_hf_config("tiny", model_type="qwen2", architectures=["Qwen2ForCausalLM"])
              if preset == "qwen2-tiny" else synthetic_hf_config(preset))
    model = build_synthetic_model(config, torch.float32, "cpu", seed=5)
    fused = model.with_numerics(_InterpretedFusedOps(), get_backend("torch"))
    calls: list[str] = []

    def spy(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object) -> object:  # add_rms_norm(x, residual, ...): name the residual-add form apart
            calls.append(name + ("+residual" if name == "add_rms_norm" and args[1] is not None else ""))
            return fn(*args)

        return call

    for name in ("add_rms_norm", "silu_mul", "rope"):
        monkeypatch.setattr(tf, name, spy(name, getattr(tf, name)))
    rows = [RowSpec([2, 3], 0, 20), RowSpec([4, 5], 0, 9)]
    ids = torch.randint(0, 512, (29,), generator=torch.Generator().manual_seed(2))
    logits = []
    for m in (model, fused):
        kv = m.allocate_kv_cache(6, 16)
        meta = build_metadata(PassKind.PREFILL, rows, 16)
        logits.append(m.compute_logits(m(ids, positions_of(rows), meta, kv)))
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    layers = model.arch.num_layers
    assert calls.count("rope") == calls.count("silu_mul") == layers
    # the residual add fused into every norm but the first layer's input norm (embeddings, no residual yet):
    # post-attention per layer, input of layers 1.., the final norm; q/k norms have none
    assert calls.count("add_rms_norm+residual") == 2 * layers
    assert calls.count("add_rms_norm") == 1 + (2 * layers if model.arch.qk_norm else 0)


@pytest.fixture
def paged_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The paged attention kernels' loops over loaded bounds need a scalar's __index__ in the interpreter
    (see test_canonical_decode._patch_interpreter_index); patched for one test."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor: object, scope: object) -> None:
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))  # type: ignore[attr-defined]

    monkeypatch.setattr(interpreter, "_patch_lang_tensor", patched)


_TABLES = [[2, 3], [4, 5]]
_PREFILL = [RowSpec(_TABLES[0], 0, 19), RowSpec(_TABLES[1], 0, 7)]
_DECODE = [RowSpec(_TABLES[0], 19, 1), RowSpec(_TABLES[1], 7, 1)]


def _prefill_then_decode(model: torch.nn.Module, seed: int, canonical_rows: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny model's prefill of two rows (19 and 7 random tokens) then one decode step (canonical_rows in its
    metadata) on a fresh 6-block cache -> (the logits of both passes, the K/V caches stacked)."""
    import dataclasses

    ids = torch.randint(0, 512, (26,), generator=torch.Generator().manual_seed(seed))
    meta = dataclasses.replace(build_metadata(PassKind.DECODE, _DECODE, 16), canonical_rows=canonical_rows)
    kv = model.allocate_kv_cache(6, 16)
    logits = [model.compute_logits(model(ids, positions_of(_PREFILL), build_metadata(PassKind.PREFILL, _PREFILL, 16),
                                         kv)),
              model.compute_logits(model(torch.tensor([11, 12]), positions_of(_DECODE), meta, kv))]
    return torch.cat(logits), torch.stack(kv.k + kv.v)


def _rope_write_case(dtype: torch.dtype, t: int, d: int, seed: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]:
    """q, k, v (strided views of one qkv, GQA Hq = 4 Hkv), cos_sin, random k/v caches [7, 16, Hkv, D] (so an
    untouched slot is checked too) and T distinct slots scattered over the blocks (the scratch block too)."""
    hq, hkv, num_blocks, block_size = 8, 2, 7, 16
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split((hq * d, hkv * d, hkv * d), dim=-1))
    angles = torch.rand(t, 1, d // 2, generator=g).double() * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).repeat(1, 1, 2).to(dtype)  # [T, 2, D]
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]  # Long[T], distinct
    return q, k, v, cos_sin, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: both sides round in the interpreter
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("t", [1, 13])  # 13 slots: the scratch block among the blocks written, in both cases
def test_rope_write_kv_equals_rope_then_write_kv(tf: ModuleType, dtype: torch.dtype, d: int, t: int) -> None:
    """The fused K/V write gives bitwise rope's q and the caches rope + write_kv leave, every slot."""
    from engine.attention.torch_backend import write_kv

    q, k, v, cos_sin, k_cache, v_cache, slots = _rope_write_case(dtype, t, d, seed=d + t)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    q_ref, k_ref = tf.rope(q, k, cos_sin)
    write_kv(k_ref, v, kc_ref, vc_ref, slots)
    before = k_cache.clone()
    q_out = tf.rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots)
    assert q_out.is_contiguous() and torch.equal(q_out, q_ref)
    assert torch.equal(k_cache, kc_ref) and torch.equal(v_cache, vc_ref)
    written = torch.zeros(k_cache.shape[0] * k_cache.shape[1], dtype=torch.bool)
    written[slots] = True
    changed = (k_cache != before).flatten(2).any(2).flatten()  # per slot
    assert changed[written].all() and not changed[~written].any()  # the test really writes, only there
    # int32 slots address the same rows
    k2, v2 = before.clone(), torch.zeros_like(v_cache)
    tf.rope_write_kv(q, k, v, cos_sin, k2, v2, slots.to(torch.int32))
    assert torch.equal(k2, kc_ref) and torch.equal(v2.view(-1, *v2.shape[2:])[slots], v)


def test_rope_write_kv_rejects_mismatched_caches_and_slots(tf: ModuleType) -> None:
    q, k, v, cos_sin, k_cache, v_cache, slots = _rope_write_case(torch.float32, 3, 64, seed=0)
    with pytest.raises(ValueError, match="caches"):
        tf.rope_write_kv(q, k, v, cos_sin, k_cache[..., :32], v_cache[..., :32], slots)
    with pytest.raises(ValueError, match="slots"):
        tf.rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots[:2])
    with pytest.raises(ValueError, match="slots"):
        tf.rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots.float())
    assert TorchOps().rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots) is None  # CPU: torch row ops
    assert TorchOps(row_kernels="torch").rope_write_kv(q, k, v, cos_sin, k_cache, v_cache, slots) is None


def test_model_with_fused_kv_write_equals_rope_then_write_kv(tf: ModuleType, paged_loops: None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Llama on the triton backend (interpreted), prefill then decode: the fused K/V write (backend
    kv_prewritten) gives the logits and KV cache bits of rope + write_kv in the backend."""
    from engine.attention import triton_backend as tb
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    class NotPrewritten(tb.TritonPagedAttention):
        kv_prewritten = False
        forward_rope = None

    class RopeOutsideAttention(tb.TritonPagedAttention):
        forward_rope = None

    model = build_synthetic_model(synthetic_hf_config("tiny"), torch.float32, "cpu", seed=3)
    on = model.with_numerics(_InterpretedFusedOps(), tb.TritonPagedAttention())
    outside = model.with_numerics(_InterpretedFusedOps(), RopeOutsideAttention())
    off = model.with_numerics(_InterpretedFusedOps(), NotPrewritten())
    counts = {"rope_write_kv": 0, "write_kv": 0, "decode_attention_rope": 0}

    def counted(name: str, fn: Callable[..., object]) -> Callable[..., object]:
        def call(*args: object) -> object:
            counts[name] += 1
            return fn(*args)

        return call

    monkeypatch.setattr(tf, "rope_write_kv", counted("rope_write_kv", tf.rope_write_kv))
    monkeypatch.setattr(tb, "write_kv", counted("write_kv", tb.write_kv))
    plain_decode = tb.decode_attention

    def decode_attention(*args: object, **kw: object) -> object:
        counts["decode_attention_rope"] += kw.get("rope") is not None
        return plain_decode(*args, **kw)

    monkeypatch.setattr(tb, "decode_attention", decode_attention)
    logits, caches = zip(*(_prefill_then_decode(m, seed=2) for m in (on, outside, off)), strict=True)
    layers = model.arch.num_layers
    # on: prefill rope_write_kv, decode RoPE in the split kernel; outside: rope_write_kv twice; off: write_kv
    assert counts == {"rope_write_kv": 3 * layers, "write_kv": 2 * layers, "decode_attention_rope": layers}
    assert torch.isfinite(logits[0]).all() and caches[0].abs().sum() > 0
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    assert torch.equal(caches[0], caches[1]) and torch.equal(caches[0], caches[2])


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("decode", ["mixed", "canonical", "batch_invariant"])
def test_model_with_rope_in_canonical_kernel_equals_it_off(tf: ModuleType, paged_loops: None, decode: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """KernelSettings.fuse_rope_canonical on vs off, a tiny Llama (interpreted) prefilling then decoding: a
    step with one canonical row beside a split row, a decode="canonical" backend, and the batch_invariant
    backend's CUDA path: the same logits and caches, and on runs the packed kernel with `rope` (off never)."""
    from engine.attention import batch_invariant as bi
    from engine.attention import triton_backend as tb
    from engine.attention import triton_canonical_decode as packed
    from engine.config import KernelSettings
    from engine.models.synthetic import build_synthetic_model, synthetic_hf_config

    model = build_synthetic_model(synthetic_hf_config("tiny"), torch.float32, "cpu", seed=5)
    arch = model.arch
    group = arch.num_heads // arch.num_kv_heads
    # the packed kernel's agreement is checked elsewhere; its check would call the spied function below
    monkeypatch.setitem(packed._CHECKED, packed.check_key("cpu", torch.float32, group, arch.head_dim,
                                                          KernelSettings()), True)

    def view_with(settings: KernelSettings) -> object:
        if decode == "batch_invariant":
            backend = bi.BatchInvariantAttention(backend="triton", settings=settings)
            backend._triton = tb.TritonPagedAttention(decode="canonical", settings=settings)
            backend._paged = lambda device: backend._triton
        else:
            backend = tb.TritonPagedAttention(decode="canonical" if decode == "canonical" else "split",
                                              settings=settings)
        return model.with_numerics(_InterpretedFusedOps(), backend)

    fused_calls = []
    plain = packed.canonical_decode_attention

    def spy(*args: object, **kw: object) -> object:
        fused_calls.append(kw.get("rope") is not None)
        return plain(*args, **kw)

    monkeypatch.setattr(packed, "canonical_decode_attention", spy)
    mask = torch.tensor([1, 0], dtype=torch.int32) if decode == "mixed" else None
    logits, caches, calls = [], [], []
    for on in (True, False):
        fused_calls.clear()
        out, cache = _prefill_then_decode(view_with(KernelSettings(fuse_rope_canonical=on)), seed=4,
                                          canonical_rows=mask)
        logits.append(out)
        caches.append(cache)
        calls.append(list(fused_calls))
    layers = arch.num_layers
    assert calls[0] == [True] * layers and calls[1] == [False] * layers, calls
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1]) and torch.equal(caches[0], caches[1])


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # log2(0) of an empty split, masked after
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: both sides round in the interpreter
def test_decode_rope_in_split_kernel_equals_rope_write_kv_then_decode(tf: ModuleType, paged_loops: None,
                                                                     dtype: torch.dtype) -> None:
    """RoPE and the K/V store inside the split-KV kernel (decode_attention's `rope`) give the output and
    caches of rope_write_kv then decode_attention, bitwise: rows of 1 key to 3 splits, GQA 4, both merges."""
    from engine.attention import triton_paged as tp
    from tests.engine.gpu_reference import check_decode_rope_fusion

    check_decode_rope_fusion(tf, tp, "cpu", dtype, [1, 70, 9, 130, 64, 65], (8, 2, 64, 16), (64, 128), seed=4)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rope_in_canonical_kernel_equals_rope_write_kv_then_decode(
        tf: ModuleType, paged_loops: None, dtype: torch.dtype) -> None:
    """The same in the packed canonical decode kernel: a step with canonical rows (split kernel for the
    others, each kernel storing its own rows' K/V) and an all-canonical step, bitwise against rope_write_kv
    then the kernels; 64-key chunks so that rows span 1-3 chunks merged by their last program."""
    from engine.attention import triton_paged as tp
    from engine.config import KernelSettings
    from tests.engine.gpu_reference import check_decode_rope_fusion

    check_decode_rope_fusion(tf, tp, "cpu", dtype, [1, 70, 9, 130, 64, 65], (8, 2, 64, 16), (64,), seed=6,
                             canonical=[1, 1, 0, 1, 0, 1], settings=KernelSettings(chunk=64))


def test_decode_rope_rejects_misshaped_inputs(paged_loops: None) -> None:
    from engine.attention import triton_paged as tp
    from tests.engine.gpu_reference import make_paged_case

    case = make_paged_case([5, 9], [1, 1], 8, 2, 64, 16, torch.float32, "cpu")
    q = case["q"]
    k = torch.zeros(2, 2, 64)
    rope = tp.DecodeRope(k, k, torch.zeros(2, 2, 64), torch.tensor([4, 24]))
    args = (q, case["k_cache"], case["v_cache"], case["seq_lens"], case["block_tables"], 0.125)
    with pytest.raises(ValueError, match="dtype"):
        tp.decode_attention(*args, rope=tp.DecodeRope(k.half(), k, rope.cos_sin, rope.slots))
    with pytest.raises(ValueError, match="cos_sin"):
        tp.decode_attention(*args, rope=tp.DecodeRope(k, k, torch.zeros(2, 64), rope.slots))
    with pytest.raises(ValueError, match="slots"):
        tp.decode_attention(*args, rope=tp.DecodeRope(k, k, rope.cos_sin, rope.slots.float()))


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")  # log2(0) of an empty split, masked after
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_fused_merge_equals_merge_kernel(paged_loops: None, dtype: torch.dtype, group: int) -> None:
    """The split kernel's fused merge (last split program of a (row, KV head) merges) gives bitwise the
    separate merge kernel's output, with skipped rows, rows of 1..4 splits (some empty), twice in a row on one
    workspace (the counters come back to zero)."""
    from engine.attention import triton_paged as tp
    from tests.engine.gpu_reference import make_paged_case

    hkv, d, bs, split = 2, 64, 16, 64
    lens = [70, 9, 200, 64, 130]
    case = make_paged_case(lens, [1] * len(lens), group * hkv, hkv, d, bs, dtype, "cpu", seed=group, spare_blocks=2)
    args = (case["q"], case["k_cache"], case["v_cache"], case["seq_lens"], case["block_tables"], d ** -0.5)
    splits = tp.decode_num_splits(case["block_tables"].shape[1] * bs, split)
    assert splits == 4  # rows use 1, 2, 3 or all 4 of them: empty trailing splits in most rows
    skip = torch.tensor([0, 1, 0, 0, 1], dtype=torch.int32)
    for skip_rows in (None, skip):
        ws = tp.DecodeWorkspace(len(lens), group * hkv, d, splits, "cpu")
        ref = tp.decode_attention(*args, split_size=split, skip_rows=skip_rows, merge="kernel",
                                  out=torch.full_like(case["q"], float("nan")))
        for _ in range(2):
            fused = tp.decode_attention(*args, workspace=ws, split_size=split, skip_rows=skip_rows,
                                        out=torch.full_like(case["q"], float("nan")))
            assert torch.equal(fused.isnan(), ref.isnan()) and torch.equal(fused.nan_to_num(), ref.nan_to_num())
            assert not ws.done.any()
        assert ref.isnan().any() == (skip_rows is not None)  # skipped rows untouched by both
    with pytest.raises(ValueError, match="merge"):
        tp.decode_attention(*args, merge="both")
