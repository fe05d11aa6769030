"""Canonical decode rows (AttentionMetadata.canonical_rows) on the Triton and torch backends.

A DECODE pass that flags rows gives each flagged row bitwise the verifier's attention output for its
position (Triton: the prefill kernel on that query, alone or as the last token of a longer verify window;
torch: the last token of a verify window) and each unflagged row bitwise the plain decode output.

The CPU check runs the Triton kernels under the interpreter (TRITON_INTERPRET=1) in a subprocess, since
the interpreter is chosen when triton is first imported; the gpu-marked checks use realistic shapes and
a CUDA graph whose mask changes between replays.
"""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from engine.attention.metadata import AttentionMetadata, PassKind
from engine.config import DEFAULT_KERNEL_SETTINGS, KernelSettings
from tests.engine.configs import resolved
from tests.engine.gpu_reference import make_paged_case

REPO = Path(__file__).resolve().parents[2]
WINDOW = 8  # verify window width of the "last token of a window" check


def _decode_meta(case: dict, mask: torch.Tensor | None) -> AttentionMetadata:
    """A DECODE pass: row r's one query sits at seq_lens[r] - 1 (its K/V slot already holds the case's)."""
    bs = case["k_cache"].shape[1]
    last = case["seq_lens"].long() - 1
    slots = case["block_tables"].long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    return AttentionMetadata(PassKind.DECODE, slots, case["query_start_loc"], case["seq_lens"],
                             case["block_tables"], canonical_rows=mask)


def _kv_at(case: dict, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's own K/V at `slots`, so the backend's write-first is a no-op."""
    kc, vc = case["k_cache"], case["v_cache"]
    return kc.view(-1, *kc.shape[2:])[slots].clone(), vc.view(-1, *vc.shape[2:])[slots].clone()


def _verify_last(tp: ModuleType, case: dict, r: int, scale: float, rows: int, settings: KernelSettings
                 ) -> torch.Tensor:
    """Row r's decode query as the last token of a WINDOW-token verify window, in verify row `rows - 1`
    of a pass whose other rows (and the window's earlier queries) are random."""
    dev, q = case["q"].device, case["q"]
    seq_len = int(case["seq_lens"][r])
    g = torch.Generator(device="cpu").manual_seed(r)
    qs = torch.randn(rows * WINDOW, *q.shape[1:], generator=g).to(q.dtype).to(dev)
    qs[-1] = q[r]
    lens = [max(WINDOW, int(s)) for s in case["seq_lens"][:rows - 1].tolist()] + [seq_len]
    tables = torch.cat([case["block_tables"][:rows - 1], case["block_tables"][r:r + 1]])
    qsl = torch.arange(rows + 1, dtype=torch.int32, device=dev) * WINDOW
    out = tp.prefill_attention(qs, case["k_cache"], case["v_cache"], qsl,
                               torch.tensor(lens, dtype=torch.int32, device=dev), tables, scale, WINDOW,
                               settings=settings)
    return out[-1]


def check_canonical_decode(device: str, dtype: torch.dtype, shape: tuple[int, int, int, int],
                           lens: list[int], mask: list[int], split_size: int,
                           settings: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> None:
    """Every bitwise claim of engine.attention.triton_backend's doc, on one random paged cache."""
    from engine.attention import triton_backend as tb
    from engine.attention import triton_paged as tp

    h, hkv, d, bs = shape
    assert min(lens) >= WINDOW
    case = make_paged_case(lens, [1] * len(lens), h, hkv, d, bs, dtype, device, seed=11, spare_blocks=2)
    scale = d ** -0.5
    rows = torch.tensor(mask, dtype=torch.int32, device=device)
    meta = _decode_meta(case, rows)
    k, v = _kv_at(case, meta.slot_mapping)

    backend = tb.TritonPagedAttention(split_size=split_size, settings=settings)
    plan = backend.plan(meta, bs)
    assert plan.one_query_per_row and plan.canonical_rows is rows
    out = backend.forward(case["q"], k, v, case["k_cache"], case["v_cache"], plan, scale)

    split = tp.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens"],
                                case["block_tables"], scale, split_size=split_size)
    skipped = tp.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens"],
                                  case["block_tables"], scale, out=torch.full_like(case["q"], float("nan")),
                                  split_size=split_size, skip_rows=rows)
    flagged = rows.bool()
    assert skipped[flagged].isnan().all() and torch.equal(skipped[~flagged], split[~flagged])
    plain = backend.forward(case["q"], k, v, case["k_cache"], case["v_cache"],
                            backend.plan(_decode_meta(case, None), bs), scale)
    assert torch.equal(plain, split)
    canonical = tb.TritonPagedAttention(split_size=split_size, decode="canonical", settings=settings)
    everywhere = canonical.forward(case["q"], k, v, case["k_cache"], case["v_cache"],
                                   canonical.plan(meta, bs), scale)
    # dvr_decode_attention="canonical_step": a step with flagged rows runs every row canonical, one launch
    step_plan = backend.plan(dataclasses.replace(meta, canonical_step=True), bs)
    assert step_plan.canonical_decode and not step_plan.one_query_per_row
    whole = backend.forward(case["q"], k, v, case["k_cache"], case["v_cache"], step_plan, scale)
    assert torch.equal(whole, everywhere), "a canonical step differs from decode='canonical'"
    no_flags = backend.plan(dataclasses.replace(_decode_meta(case, None), canonical_step=True), bs)
    assert no_flags.one_query_per_row and not no_flags.canonical_decode  # nothing flagged: the split kernel
    for r, flagged in enumerate(mask):
        if not flagged:
            assert torch.equal(out[r], split[r]), f"unflagged row {r} differs from the split decode"
            continue
        alone = tp.prefill_attention(case["q"][r:r + 1], case["k_cache"], case["v_cache"],
                                     case["query_start_loc"][:2], case["seq_lens"][r:r + 1],
                                     case["block_tables"][r:r + 1], scale, 1, settings=settings)
        assert torch.equal(out[r], alone[0]), f"flagged row {r} differs from its 1-token window"
        assert torch.equal(out[r], _verify_last(tp, case, r, scale, 3, settings)), f"row {r} vs its verify window"
        assert torch.equal(out[r], everywhere[r]), f"row {r} differs from decode='canonical'"
    if dtype == torch.float32 or device != "cpu":  # tiny bf16 cases round both to the same bits
        assert not torch.equal(out, split), "the case is too easy: canonical and split rows agree bitwise"


def check_prefill_pass_tile(device: str, dtype: torch.dtype) -> None:
    """KernelSettings.prefill_pass_tile: a PREFILL pass of the split-decode backend takes that tile (the
    prefill kernel's bits at that block_m), a VERIFY pass and every pass of decode="canonical" keep the
    canonical tile, and the kernel id names the prefill tile only where it differs."""
    from engine.attention import triton_backend as tb
    from engine.attention import triton_paged as tp

    h, hkv, d, bs = 4, 2, 16, 16
    lens = [70, 9, 40]
    case = make_paged_case(lens, [30, 9, 20], h, hkv, d, bs, dtype, device, seed=3)
    scale = d ** -0.5
    qsl, sl, bt = case["query_start_loc"], case["seq_lens"], case["block_tables"]
    tile = DEFAULT_KERNEL_SETTINGS.query_tile
    other = 64 if tile != 64 else 16
    at = {m: tp.prefill_attention(case["q"], case["k_cache"], case["v_cache"], qsl, sl, bt, scale,
                                  case["max_query_len"], block_m=m) for m in (tile, other)}
    rows = torch.repeat_interleave(torch.arange(len(lens)), (qsl[1:] - qsl[:-1]).long().cpu())
    pos = torch.cat([torch.arange(s - n, s) for s, n in zip(lens, [30, 9, 20])])
    slots = (bt.long().cpu()[rows, pos // bs] * bs + pos % bs).to(device)
    kc, vc = case["k_cache"], case["v_cache"]
    k, v = kc.view(-1, hkv, d)[slots].clone(), vc.view(-1, hkv, d)[slots].clone()
    base = DEFAULT_KERNEL_SETTINGS.kernel_id()
    settings = KernelSettings(prefill_pass_tile=other)
    assert settings.kernel_id() == base + f"-p{other}" and settings.canonical_kernel_id() == base
    split = tb.TritonPagedAttention(settings=settings)
    canonical = tb.TritonPagedAttention(decode="canonical", settings=settings)
    assert split.kernel_id == settings.kernel_id() and canonical.kernel_id == base
    meta = AttentionMetadata(PassKind.PREFILL, slots, qsl, sl, bt)
    assert torch.equal(split.forward(case["q"], k, v, kc, vc, split.plan(meta, bs), scale), at[other])
    assert torch.equal(canonical.forward(case["q"], k, v, kc, vc, canonical.plan(meta, bs), scale), at[tile])
    assert KernelSettings(prefill_pass_tile=tile).kernel_id() == base  # the same tile: no suffix


def check_chunk_programs(device: str, dtype: torch.dtype, settings: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> None:
    """KernelSettings.chunk_programs: P programs per (row, KV head) sharing its key chunks give the
    prefill kernel's bits for every P from 1 to the table's chunk count, and with `rope` (the program that
    holds the step's key stores it first) the bits and cache of rope_write_kv then the kernel."""
    from engine.attention import triton_canonical_decode as packed
    from engine.attention import triton_paged as tp
    from engine.kernels import triton_fused as tf

    h, hkv, d, bs = 6, 2, 16, 16
    lens = [70, 9, 130, 200, 64, 65, 257]
    case = make_paged_case(lens, [1] * len(lens), h, hkv, d, bs, dtype, device, seed=13, spare_blocks=2)
    q, kc, vc, sl, bt = case["q"], case["k_cache"], case["v_cache"], case["seq_lens"], case["block_tables"]
    scale = d ** -0.5
    ref = tp.prefill_attention(q, kc, vc, case["query_start_loc"], sl, bt, scale, 1, settings=settings)
    g = torch.Generator(device="cpu").manual_seed(5)
    k_new, v_new = (torch.randn(len(lens), hkv, d, generator=g).to(dtype).to(device) for _ in range(2))
    angles = torch.rand(len(lens), 1, d // 2, generator=g).double() * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], dim=1).repeat(1, 1, 2).to(dtype).to(device)
    last = sl.long() - 1
    slots = bt.long().gather(1, (last // bs)[:, None])[:, 0] * bs + last % bs
    kc_ref, vc_ref = kc.clone(), vc.clone()
    q_rot = tf.rope_write_kv(q, k_new, v_new, cos_sin, kc_ref, vc_ref, slots)
    chunks = -(-bt.shape[1] * bs // settings.chunk)
    assert chunks >= 4, "the case needs rows of several chunks"
    one_per_chunk = dataclasses.replace(settings, chunk_programs=0)
    assert packed.chunk_programs(len(lens), hkv, chunks, 0) == chunks
    rope_ref = packed.canonical_decode_attention(q_rot, kc_ref, vc_ref, sl, bt, scale, settings=one_per_chunk)
    for p in range(1, chunks + 1):
        each = dataclasses.replace(settings, chunk_programs=len(lens) * hkv * p)
        assert packed.chunk_programs(len(lens), hkv, chunks, each.chunk_programs) == p
        got = packed.canonical_decode_attention(q, kc, vc, sl, bt, scale, settings=each)
        bad = [lens[r] for r in range(len(lens)) if not torch.equal(got[r], ref[r])]
        assert not bad, f"P = {p}: rows of these lengths differ from the prefill kernel: {bad}"
        kc2, vc2 = kc.clone(), vc.clone()
        fused = packed.canonical_decode_attention(q, kc2, vc2, sl, bt, scale, settings=each,
                                                  rope=tp.DecodeRope(k_new, v_new, cos_sin, slots))
        assert torch.equal(fused, rope_ref) and torch.equal(kc2, kc_ref) and torch.equal(vc2, vc_ref), f"rope, P = {p}"
    assert not torch.equal(rope_ref, ref), "the rope case is too easy"


def _patch_interpreter_index() -> None:
    """Triton 3.6's interpreter turns a scalar (a 1-element array there) into a Python int with
    `int(array)`, which NumPy >= 2.4 refuses for ndim > 0; `range()` over loaded bounds needs it."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:  # noqa: ANN001 (triton internals)
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patched


def _patch_interpreter_dot() -> None:
    """Give the interpreter's `tl.dot` the MMA property the packed kernel relies on: an output row's bits
    depend only on that row of `a`, on `b` and on that row of the accumulator, never on the row's index
    or on the other rows.

    Triton 3.6's `create_dot` is `np.matmul(a, b, dtype=acc) + acc`, i.e. BLAS sgemm for fp32 operands,
    and BLAS makes no such promise: OpenBLAS's Haswell sgemm kernel (the one it picks on AVX2 CPUs, AMD
    Zen included; NumPy 2.3's OpenBLAS 0.3.30 as 2.4's 0.3.31) gives rows 6..11 of every 12 rows of a
    [64, 16] @ [16, 64] product (and, with a transposed `b`, the last 4 of 64) other bits than the same
    row at index 0 (its Sandybridge kernel does not), so the packed kernel's queries in rows 0..GROUP-1
    and the prefill kernel's query in row p % 64 differed in the last bits for p % 12 >= 6 (fp32),
    whatever the kernels did. Here each element is the fixed left-to-right sum over k of rounded
    products (elementwise numpy ops: IEEE-exact, no BLAS, no FMA contraction), the same for every row,
    CPU and thread count. bfloat16 operands (stored as uint16 by the interpreter, whose `create_dot` then
    multiplied the raw bit patterns: triton-lang/triton#11584) are widened to float32 first, exactly.
    Bitwise agreement of two kernels here therefore still means the same arithmetic per live row."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):  # noqa: ANN001, ANN202, ARG001
        acc_t = d.data.dtype
        operands = []
        for x in (a, b):
            data = x.data
            if x.dtype == tl.bfloat16 or (x.dtype.primitive_bitwidth == 8 and x.dtype.is_floating()):
                wide = tl.float32 if x.dtype == tl.bfloat16 else tl.float16  # fp8: as the stock create_dot
                data = interpreter._convert_float(data, x.dtype, wide, None).view(interpreter._get_np_dtype(wide))
            operands.append(data.astype(acc_t))
        a_data, b_data = operands
        out = np.zeros(d.data.shape, dtype=acc_t)
        for k in range(a_data.shape[-1]):  # k in increasing order, one rounding per product and per sum
            out += a_data[..., :, k, None] * b_data[..., None, k, :]
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


def patch_lang_once(original):  # noqa: ANN001, ANN201 (triton internals)
    """Triton 3.6's interpreter patches triton.language (inspect.getmembers over each of its modules) on
    every call of a @triton.jit helper inside a kernel, a fifth of an interpreted launch's time, and never
    restores it; the launch around the call has already patched those modules with the same builder. The
    returned `_patch_lang` skips a helper call's patching where the running launch (or an earlier helper
    call of it) has patched its modules."""
    import inspect

    import triton.language as tl

    launch: set[int] = set()

    class _LaunchScope:
        def __init__(self, scope) -> None:  # noqa: ANN001 (triton internals)
            self.scope = scope

        def restore(self) -> None:
            launch.clear()
            self.scope.restore()

    class _Nothing:
        def restore(self) -> None:
            pass

    def patch_lang(fn):  # noqa: ANN001, ANN202 (triton internals)
        langs = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if launch and langs <= launch:
            return _Nothing()
        scope = original(fn)
        first = not launch
        launch.update(langs)
        return _LaunchScope(scope) if first else scope

    return patch_lang


def interpreter_shortcuts(mp: pytest.MonkeyPatch | None = None) -> None:
    """Three costs of Triton 3.6's interpreter that change no result, about half of an interpreted launch:

    - `InterpreterOptions.sanitize_overflow` is True, so every 32-bit integer add, sub and mul is redone in
      int64 and compared with the type's range, only to reach `device_assert`, which returns at once
      because the interpreter's `debug` is False (it is never set). Turned off while `debug` is off: the
      comparison was computed and thrown away, so no check is lost.
    - `_get_np_dtype` builds its 19-entry type table on every call (every tensor handle made); the same
      lookup against a table built once.
    - Every `tl.tuple` (the shape of each tensor made) formats its `tuple_type`, a name string over its
      values, when built, and most are never asked for it; here the type is built from the values on first
      use. The values are not changed in between: `tuple._setitem`, the one writer, sets the type itself.

    With `mp`, every replacement goes through it, so the MonkeyPatch's undo restores the interpreter."""
    import dataclasses

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    def replace(obj: object, name: str, value: object) -> None:
        if mp is not None:
            mp.setattr(obj, name, value, raising=False)
        else:
            setattr(obj, name, value)

    builder = interpreter.interpreter_builder
    if not builder.options.debug:
        replace(builder, "options", dataclasses.replace(builder.options, sanitize_overflow=False))

    original = interpreter._get_np_dtype
    table = {t: original(t) for t in (tl.int1, tl.float16, tl.float32, tl.float64, tl.int8, tl.uint8, tl.int16,
                                      tl.uint16, tl.int32, tl.uint32, tl.int64, tl.uint64, tl.bfloat16, tl.float8e5,
                                      tl.float8e5b16, tl.float8e4nv, tl.float8e4b8, tl.float8e4b15)}
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):  # noqa: ANN001, ANN202 (triton internals)
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
            if isinstance(tt_dtype, tl.pointer_type):
                return pointer
        return table[tt_dtype]

    replace(interpreter, "_get_np_dtype", get_np_dtype)

    core = tl.core

    def tuple_init(self, args, type=None):  # noqa: ANN001, ANN202, A002 (triton.language.core.tuple.__init__)
        self.values = list(args)
        if isinstance(type, core.tuple_type):
            self._type = type
        elif type is not None:
            self._type = core.tuple_type(type)
        else:
            self._type = None  # _type_for_tuple_values(self.values), made on first use

    def tuple_type_of(self):  # noqa: ANN001, ANN202
        if self._type is None:
            self._type = core._type_for_tuple_values(self.values)
        return self._type

    def set_tuple_type(self, value):  # noqa: ANN001, ANN202
        self._type = value

    replace(core.tuple, "__init__", tuple_init)
    replace(core.tuple, "type", property(tuple_type_of, set_tuple_type))


def patch_interpreter() -> None:
    """The interpreter patches every TRITON_INTERPRET=1 check of these tests runs under."""
    _patch_interpreter_index()
    _patch_interpreter_dot()
    interpreter_shortcuts()
    from triton.runtime import interpreter

    interpreter._patch_lang = patch_lang_once(interpreter._patch_lang)


def packed_unchecked(dtype: torch.dtype, group: int, head_dim: int,
                     settings: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> None:
    """The backend takes the packed canonical kernel on the CPU for these shapes without its per-device
    check (`packed_matches_prefill`, half a minute of interpreted launches per key; `_interpreter_main`
    asserts it for both query tiles at the 64-key chunk, in both dtypes between them), so the caller's bitwise claims
    hold of the packed kernel itself."""
    from engine.attention import triton_canonical_decode as packed

    packed._CHECKED[packed.check_key("cpu", dtype, group, head_dim, settings)] = True


def _interpreter_main(part: str = "tiles") -> None:
    """Entry of the TRITON_INTERPRET=1 subprocess (tiny shapes: the interpreter runs numpy). Two parts, each
    its own subprocess and test: "tiles" (the default settings in both dtypes, the 64-row query tile and the
    prefill pass tile) and "chunks" (the packed kernel's 64-key chunks and their programs). A setting whose
    check takes the interpreter long runs in one dtype; both dtypes run in every part. The packed kernel's
    own check (`packed_matches_prefill`, about 25 s of interpreted launches each) is asserted once per tile
    and dtype pair that covers both: the 64-row tile in float32 ("tiles"), the 16-row tile with 64-key chunks
    in bfloat16 ("chunks"); the default settings' rows run the packed kernel without it."""
    patch_interpreter()
    from engine.attention import triton_canonical_decode as packed

    # chunks of 64 keys (the real 256 would leave these tiny rows in one chunk)
    small = KernelSettings(chunk=64)
    tall = KernelSettings(chunk=64, query_tile=64)  # the 64-row query tile: queries at rows p % 64
    lens, mask = [70, 9, 130, 200, 64, 65], [1, 1, 1, 0, 1, 1]
    if part == "tiles":
        for dtype in (torch.float32, torch.bfloat16):
            packed_unchecked(dtype, 2, 16)
            # 2 query heads per KV head, 16-key blocks, 64-key splits: rows of 1, 2 and 3 splits / key tiles
            check_canonical_decode("cpu", dtype, (4, 2, 16, 16), [70, 9, 130, 40], [0, 1, 1, 0],
                                   split_size=64)
            check_prefill_pass_tile("cpu", dtype)
        check_canonical_decode("cpu", torch.float32, (6, 2, 16, 16), lens, mask, split_size=64, settings=tall)
        assert packed.packed_matches_prefill(torch.device("cpu"), torch.float32, 3, 16, tall)
    else:
        # the packed kernel's parallel chunks merged by their last program give the prefill kernel's serial merge
        check_canonical_decode("cpu", torch.bfloat16, (6, 2, 16, 16), lens, mask, split_size=64, settings=small)
        check_chunk_programs("cpu", torch.float32, small)
        assert packed.packed_matches_prefill(torch.device("cpu"), torch.bfloat16, 3, 16, small)
    print("interpreter ok")


def run_under_triton_interpreter(module: str, *args: str) -> None:
    """`module._interpreter_main(*args)` in a subprocess with TRITON_INTERPRET=1 (the interpreter is chosen when
    triton is first imported); it must print "interpreter ok"."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    code = f"from {module} import _interpreter_main; _interpreter_main(*{args!r})"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and "interpreter ok" in proc.stdout, proc.stdout + proc.stderr


def test_query_tile_changes_the_kernel_identity() -> None:
    """The query tile and chunk are part of the committed bits: the kernel id (hence the fingerprint of a
    triton config) names them, only the documented values are accepted, and the packed kernel's per-device
    check is keyed by them."""
    from engine.attention import triton_backend as tb
    from engine.attention import triton_canonical_decode as packed
    from engine.fingerprint import runtime_fingerprint

    base = DEFAULT_KERNEL_SETTINGS.kernel_id()
    assert DEFAULT_KERNEL_SETTINGS.query_tile == 16 and "-m16n" in base and base.endswith("c256")
    tall = KernelSettings(query_tile=64)
    assert "-m64n" in tall.kernel_id() and tall.kernel_id() != base
    assert tb.TritonPagedAttention(settings=tall).kernel_id == tall.kernel_id()
    assert KernelSettings(chunk=512).kernel_id().endswith("c512")
    args = ("cpu", torch.float32, 2, 16)
    assert packed.check_key(*args, tall) != packed.check_key(*args, DEFAULT_KERNEL_SETTINGS)
    with pytest.raises(ValueError, match=r"kernels.query_tile: one of \(16, 32, 64\), got 48"):
        KernelSettings(query_tile=48)
    with pytest.raises(ValueError, match="kernels.chunk"):
        KernelSettings(chunk=100)
    # the fingerprint of an engine on the triton backend names its kernels' id (CUDA configs only: here the
    # config's own method, which the fingerprint calls)
    config = resolved(device="cpu", kernels=tall)
    assert config.kernels.kernel_id() == tall.kernel_id()
    assert "attention_kernel" not in runtime_fingerprint(config)  # the CPU runs the torch backend


@pytest.mark.slow
def test_canonical_rows_under_the_triton_interpreter() -> None:
    """The "tiles" part; test_canonical_decode_chunks.py runs the "chunks" part (a file of its own, so
    another worker takes it)."""
    run_under_triton_interpreter("tests.engine.test_canonical_decode", "tiles")


def test_prefill_pass_tile_checks_its_value() -> None:
    with pytest.raises(ValueError, match=r"kernels.prefill_pass_tile: None or one of \(16, 32, 64\), got 8"):
        KernelSettings(prefill_pass_tile=8)
    assert KernelSettings().prefill_tile == 16 and KernelSettings(prefill_pass_tile=64).prefill_tile == 64


def test_plan_rejects_a_mask_of_the_wrong_shape_or_dtype() -> None:
    from engine.attention import triton_backend as tb

    case = make_paged_case([20, 30], [1, 1], 4, 2, 16, 16, torch.float32, "cpu")
    backend = tb.TritonPagedAttention()
    for bad in (torch.ones(3, dtype=torch.int32), torch.ones(2, dtype=torch.bool)):
        with pytest.raises(ValueError, match="row mask"):
            backend.plan(_decode_meta(case, bad), 16)
    # decode="canonical" sends every row through the prefill kernel: the mask is not needed
    assert tb.TritonPagedAttention(decode="canonical").plan(_decode_meta(case, None), 16).canonical_rows is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(9, 3, 64, 16), (4, 4, 64, 16), (8, 2, 32, 8)])
def test_torch_backend_canonical_rows_equal_the_verifier(shape: tuple[int, int, int, int],
                                                         dtype: torch.dtype) -> None:
    """TorchAttention: a flagged decode row = the last token of a verify window (W = 8 and 32, the middle
    row of 3); an unflagged row = the plain (SDPA) decode; a row shorter than its padding stays finite."""
    from engine.attention import TorchAttention

    h, hkv, d, bs = shape
    lens, mask = [70, 3, 130, 200, 40], [1, 1, 0, 1, 0]
    case = make_paged_case(lens, [1] * len(lens), h, hkv, d, bs, dtype, "cpu", seed=13)
    scale, att = d ** -0.5, TorchAttention()
    meta = _decode_meta(case, torch.tensor(mask, dtype=torch.int32))
    k, v = _kv_at(case, meta.slot_mapping)
    out = att.forward(case["q"], k, v, case["k_cache"], case["v_cache"], att.plan(meta, bs), scale)
    plain = att.forward(case["q"], k, v, case["k_cache"], case["v_cache"], att.plan(_decode_meta(case, None), bs),
                        scale)
    assert torch.equal(out[[2, 4]], plain[[2, 4]])
    # 3 keys: the padding queries sit at negative positions, fully masked; the decode query is not
    torch.testing.assert_close(out[1].float(), plain[1].float(), atol=3e-2, rtol=3e-2)
    g = torch.Generator(device="cpu").manual_seed(5)
    for r, width in ((0, 8), (0, 32), (3, 8), (3, 32)):
        rows = [2, r, 4]
        tables, ends = case["block_tables"][rows], case["seq_lens"][rows]
        slots = torch.cat([t.long()[p // bs] * bs + p % bs
                           for t, p in ((t, torch.arange(e - width, e)) for t, e in zip(tables, ends.tolist()))])
        vmeta = AttentionMetadata(PassKind.VERIFY, slots, torch.arange(4, dtype=torch.int32) * width, ends, tables)
        qs = torch.randn(3 * width, h, d, generator=g).to(dtype)
        qs[2 * width - 1] = case["q"][r]
        vk, vv = _kv_at(case, slots)
        vo = att.forward(qs, vk, vv, case["k_cache"], case["v_cache"], att.plan(vmeta, bs), scale)
        assert torch.equal(out[r], vo[2 * width - 1]), f"flagged row {r}, window {width}"
        if dtype == torch.float32:
            assert not torch.equal(out[r], plain[r]), f"row {r}: the case is too easy (SDPA gives the same bits)"


# --- CUDA ---------------------------------------------------------------------------------------------

GPU_SHAPES = [(32, 8, 128, 16), (9, 3, 64, 16)]  # Llama-3.1-8B, SmolLM2-135M
GPU_LENS = [8, 700, 1500, 64, 2047, 333, 512, 513]


@pytest.mark.parametrize("shape", GPU_SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_canonical_rows(shape: tuple[int, int, int, int], dtype: torch.dtype,
                            kernel_settings: KernelSettings) -> None:
    check_canonical_decode("cuda", dtype, shape, GPU_LENS, [1, 0, 1, 1, 0, 0, 1, 0], split_size=512,
                           settings=kernel_settings)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_canonical_rows_through_a_cuda_graph() -> None:
    """One captured decode step; the static mask buffer changes between replays, no allocation."""
    from engine.attention import triton_backend as tb
    from engine.attention import triton_paged as tp

    h, hkv, d, bs = GPU_SHAPES[0]
    case = make_paged_case(GPU_LENS, [1] * len(GPU_LENS), h, hkv, d, bs, torch.bfloat16, "cuda", seed=12,
                           spare_blocks=8)
    scale = d ** -0.5
    mask = torch.zeros(len(GPU_LENS), dtype=torch.int32, device="cuda")
    meta = _decode_meta(case, mask)
    k, v = _kv_at(case, meta.slot_mapping)
    backend = tb.TritonPagedAttention(split_size=tp.DECODE_SPLIT_SIZE)  # the split below uses the default
    out = torch.empty_like(case["q"])

    def step() -> None:
        out.copy_(backend.forward(case["q"], k, v, case["k_cache"], case["v_cache"], backend.plan(meta, bs),
                                  scale))

    split = tp.decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens"],
                                case["block_tables"], scale)
    canonical = tp.prefill_attention(case["q"], case["k_cache"], case["v_cache"], case["query_start_loc"],
                                     case["seq_lens"], case["block_tables"], scale, 1)
    assert not torch.equal(split, canonical)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for flags in ([0] * 8, [1, 0, 1, 1, 0, 0, 1, 0], [1] * 8, [0, 1, 0, 0, 1, 1, 0, 1], [0] * 8):
        mask.copy_(torch.tensor(flags, dtype=torch.int32))
        out.fill_(float("nan"))
        torch.cuda.synchronize()
        before = torch.cuda.memory_stats()["allocation.all.allocated"]
        graph.replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_stats()["allocation.all.allocated"] == before
        for r, flagged in enumerate(flags):
            assert torch.equal(out[r], (canonical if flagged else split)[r]), f"mask {flags}, row {r}"


@pytest.mark.parametrize("shape", GPU_SHAPES + [(64, 1, 128, 16), (8, 8, 64, 16)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_packed_canonical_decode_is_used_and_equals_the_prefill_kernel(
        shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
    """The GQA-packed one-query kernel gives the prefill kernel's bits on this GPU (so the backend uses
    it: use_packed), for queries at every MMA row index of the prefill tile and across many key tiles.
    A query-head group wider than the prefill tile (64 heads on one KV head) is not packed: the backend
    runs the prefill kernel itself there."""
    from engine.attention import triton_canonical_decode as packed
    from engine.attention import triton_paged as tp

    h, hkv, d, bs = shape
    lens = list(range(1, 130)) + GPU_LENS
    case = make_paged_case(lens, [1] * len(lens), h, hkv, d, bs, dtype, "cuda", seed=21, spare_blocks=2)
    fits = h // hkv <= DEFAULT_KERNEL_SETTINGS.query_tile
    assert packed.use_packed(case["q"], case["k_cache"]) == fits, (h // hkv, DEFAULT_KERNEL_SETTINGS.query_tile)
    if not fits:
        return
    scale = d ** -0.5
    ref = tp.prefill_attention(case["q"], case["k_cache"], case["v_cache"], case["query_start_loc"],
                               case["seq_lens"], case["block_tables"], scale, 1)
    got = packed.canonical_decode_attention(case["q"], case["k_cache"], case["v_cache"], case["seq_lens"],
                                            case["block_tables"], scale)
    bad = [lens[r] for r in range(len(lens)) if not torch.equal(ref[r], got[r])]
    assert not bad, f"rows of these lengths differ: {bad[:20]}"



def test_chunk_workspace_grows_by_doubling_and_serves_smaller_calls() -> None:
    from engine.attention import triton_canonical_decode as packed

    dev = torch.device("cpu")
    packed._WORKSPACES.pop((str(dev), 4, 2, 16), None)
    first = packed.workspace(10, 4, 2, 3, 16, dev)
    assert first.mid_m.shape[:2] == (64, 4) and first.num_chunks == 3
    assert packed.workspace(64, 4, 2, 2, 16, dev) is first            # fits: no new allocation
    grown = packed.workspace(65, 4, 2, 4, 16, dev)
    assert grown is not first and grown.mid_m.shape[0] == 128 and grown.num_chunks == 6
    assert first in packed._RETIRED and bool((grown.cnt == 0).all())
    assert packed.workspace(100, 4, 2, 5, 16, dev) is grown
