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
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
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
