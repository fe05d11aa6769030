"""Per-step host work of the model runner and the decode-graph staging, checked on the CPU.

The vectorized `ModelRunner._layout` must give exactly what the per-token reference loop gives (same
ids, positions, slots, query_start_loc, seq_lens, padded block tables) for prefill, decode and padded
verify passes; `_forward`'s single staging buffer must carry the same tensors (dtypes, shapes, values)
as building each one from lists, plus canonical_rows for DVR decode passes; the static decode staging
must pad exactly as documented. No timings are asserted here.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch

from engine.attention.metadata import AttentionMetadata, PassKind
from engine.config import SCRATCH_BLOCK, ZERO_BLOCK, EngineConfig
from engine.cuda_graphs import _StaticPass
from engine.model_runner import DUMMY_TOKEN, ModelRunner, ModelShape, Row

BS = 16
MAX_LEN = 300


class Recorder:
    """A model that records what the runner hands it and returns zeros."""

    def __init__(self) -> None:
        self.calls: list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]] = []

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv: Any) -> torch.Tensor:
        self.calls.append((input_ids.clone(), positions.clone(), meta))
        return torch.zeros(input_ids.shape[0], 4)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], 8)


def runner(**cfg: Any) -> tuple[ModelRunner, Recorder]:
    model = Recorder()
    config = EngineConfig.from_options({"num_kv_blocks": 200, "block_size": BS, "window": 8, "group": 4, **cfg})
    return ModelRunner(config, model, ModelShape(1, 1, 4, 8, MAX_LEN), torch.float32, torch.device("cpu")), model


def reference_layout(rows: list[Row], pad_to: tuple[int, int] | None) -> tuple[list[int], ...]:
    """The per-token loop the vectorized layout replaced."""
    ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
    all_rows = list(rows) + ([Row([], 0, [])] * (pad_to[0] - len(rows)) if pad_to else [])
    for row in all_rows:
        n = len(row.tokens) if pad_to is None else pad_to[1]
        for i in range(n):
            p = row.start_pos + i
            real = i < len(row.tokens)
            ids.append(row.tokens[i] if real else DUMMY_TOKEN)
            pos.append(min(p, MAX_LEN - 1))
            slots.append(row.block_table[p // BS] * BS + p % BS if real else SCRATCH_BLOCK * BS + len(slots) % BS)
        starts.append(starts[-1] + n)
        lens.append(row.start_pos + n)
        tables.append(row.block_table or [ZERO_BLOCK])
    width = max(len(t) for t in tables)
    padded = [t + [ZERO_BLOCK] * (width - len(t)) for t in tables]
    return ids, pos, slots, starts, lens, padded


def random_rows(rng: random.Random, kind: PassKind, num: int, window: int) -> list[Row]:
    rows = []
    for _ in range(num):
        if kind == PassKind.PREFILL:
            n, start = rng.randint(1, 40), 0
        elif kind == PassKind.DECODE:
            n, start = 1, rng.randint(0, MAX_LEN - 2)
        else:
            n, start = rng.randint(1, window), rng.randint(0, MAX_LEN - window - 1)
        blocks = rng.sample(range(2, 200), -(-(start + n) // BS) + rng.randint(0, 2))
        rows.append(Row([rng.randrange(8) for _ in range(n)], start, blocks, rng.random() < 0.5))
    return rows


@pytest.mark.parametrize("kind", [PassKind.PREFILL, PassKind.DECODE, PassKind.VERIFY])
def test_layout_matches_the_per_token_loop(kind: PassKind) -> None:
    run, _ = runner()
    rng = random.Random(kind.value)
    for trial in range(30):
        pad_to = (4, 8) if kind == PassKind.VERIFY else None
        rows = random_rows(rng, kind, rng.randint(1, 4 if pad_to else 12), 8)
        lay = run._layout(rows, pad_to)
        ids, pos, slots, starts, lens, tables = reference_layout(rows, pad_to)
        assert lay.ids.tolist() == ids and lay.positions.tolist() == pos and lay.slots.tolist() == slots
        assert lay.query_start_loc.tolist() == starts and lay.seq_lens.tolist() == lens
        assert lay.block_tables.tolist() == tables, trial


def test_layout_refuses_a_table_too_short() -> None:
    run, _ = runner()
    with pytest.raises(ValueError, match="row 1: tokens up to position 32 need 3 blocks of 16, its table has 2"):
        run._layout([Row([1], 5, [2]), Row([1, 2], 31, [3, 4])], None)


@pytest.mark.parametrize("mode,attention,expect", [("dvr", "canonical", True), ("dvr", "split", False),
                                                   ("dvr", "canonical_step", True),
                                                   ("dvr", "canonical_step_short", True),
                                                   ("nondeterministic", "canonical", False)])
def test_forward_tensors_and_canonical_rows(mode: str, attention: str, expect: bool) -> None:
    run, model = runner(mode=mode, dvr_decode_attention=attention)
    rows = random_rows(random.Random(3), PassKind.DECODE, 7, 8)
    run.decode(rows)
    input_ids, positions, meta = model.calls[-1]
    ids, pos, slots, starts, lens, tables = reference_layout(rows, None)
    assert input_ids.dtype == positions.dtype == meta.slot_mapping.dtype == torch.long
    assert meta.query_start_loc.dtype == meta.seq_lens.dtype == meta.block_tables.dtype == torch.int32
    assert input_ids.tolist() == ids and positions.tolist() == pos and meta.slot_mapping.tolist() == slots
    assert meta.query_start_loc.tolist() == starts and meta.seq_lens.tolist() == lens
    assert meta.block_tables.tolist() == tables and meta.block_tables.is_contiguous()
    if expect:
        assert meta.canonical_rows is not None and meta.canonical_rows.dtype == torch.int32
        assert meta.canonical_rows.tolist() == [int(r.canonical) for r in rows]
        # canonical_step_short steps canonically only in the short graph family: eager steps keep the split
        assert meta.canonical_step == (attention == "canonical_step")
    else:
        assert meta.canonical_rows is None and not meta.canonical_step
    run.verify(rows[:3])  # verify passes never carry canonical_rows
    assert model.calls[-1][2].canonical_rows is None and model.calls[-1][2].kind == PassKind.VERIFY


def test_static_staging_pads_rows() -> None:
    """The CUDA-graph staging on the CPU: real rows first, then padding rows (token 0 at position 0,
    scratch slot, seq_len 1, table of the pad block, not canonical); lists and padded arrays agree."""
    static = _StaticPass(max_rows=6, tokens_per_row=1, max_blocks=5, device=torch.device("cpu"))
    tables = [[7, 8, 9], [4], [11, 12]]
    static.stage(4, [5, 6, 7], [40, 3, 20], [9 * BS + 8, 4 * BS + 3, 12 * BS + 4], [41, 4, 21], tables,
                 pad_slot=BS, pad_block=0, canonical=[1, 0, 1])
    ids, pos, slots, lens, tabs, qsl = static.views(4)
    assert ids.tolist() == [5, 6, 7, 0] and pos.tolist() == [40, 3, 20, 0]
    assert slots.tolist() == [9 * BS + 8, 4 * BS + 3, 12 * BS + 4, BS]
    assert lens.tolist() == [41, 4, 21, 1] and qsl.tolist() == [0, 1, 2, 3, 4]
    assert tabs.tolist() == [[7, 8, 9, 0, 0], [4, 0, 0, 0, 0], [11, 12, 0, 0, 0], [0] * 5]
    assert static.canonical_rows(4).tolist() == [1, 0, 1, 0]
    before = [t.clone() for t in static.views(4)]
    array = np.array([[7, 8, 9], [4, 0, 0], [11, 12, 0]], np.int32)
    static.stage(4, np.array([5, 6, 7]), [40, 3, 20], [9 * BS + 8, 4 * BS + 3, 12 * BS + 4], [41, 4, 21], array,
                 pad_slot=BS, pad_block=0)
    assert all(torch.equal(a, b) for a, b in zip(before, static.views(4)))
    assert static.canonical_rows(4).tolist() == [0, 0, 0, 0]  # no flags given: every row uses any kernel


def test_static_staging_of_query_starts() -> None:
    """With staged_qsl (a packed verify pass's graph) the query starts are staged with the rest, in the same
    buffer; without it they are the fixed tokens_per_row steps and staging them is refused."""
    static = _StaticPass(max_rows=4, tokens_per_row=3, max_blocks=2, device=torch.device("cpu"), staged_qsl=True)
    static.stage(4, [5, 6, 7, 8], [0, 1, 2, 9], [BS] * 4, [3, 1, 0, 10], [[2], [3], [], [4]], pad_slot=BS,
                 pad_block=0, qsl=[0, 3, 3, 3, 4])
    assert static.qsl.tolist() == [0, 3, 3, 3, 4]
    assert static.qsl.data_ptr() == static.i32[-5:].data_ptr()  # a view of the staged buffer: one copy
    ids, _, _, lens, tabs = static.token_views(4, 4)
    assert ids.tolist() == [5, 6, 7, 8] and lens.tolist() == [3, 1, 0, 10]
    assert tabs.tolist() == [[2, 0], [3, 0], [0, 0], [4, 0]]
    fixed = _StaticPass(max_rows=4, tokens_per_row=3, max_blocks=2, device=torch.device("cpu"))
    assert fixed.qsl.tolist() == [0, 3, 6, 9, 12]
    with pytest.raises(AssertionError, match="query starts need staged_qsl"):
        fixed.stage(1, [5], [0], [BS], [1], [[2]], pad_slot=BS, pad_block=0, qsl=[0, 1])


def test_static_staging_rewrites_only_changed_tables_correctly() -> None:
    """Incremental table staging (rows compared with what they hold) equals staging from scratch over a
    random sequence of steps: tables grow, shrink (rollback), change row, and the batch shrinks / grows."""
    rng = random.Random(5)
    kept = _StaticPass(max_rows=8, tokens_per_row=1, max_blocks=6, device=torch.device("cpu"))
    tables = [rng.sample(range(2, 60), rng.randint(1, 6)) for _ in range(8)]
    for step in range(60):
        for t in tables:
            if rng.random() < 0.3:
                t.append(rng.randrange(2, 60)) if len(t) < 6 else t.pop()
        if rng.random() < 0.2:
            rng.shuffle(tables)
        n = rng.randint(1, 8)
        rows = 8 if n > 4 else 4
        args = ([1] * n, [0] * n, [16] * n, [1] * n, tables[:n], 16, 0)
        fresh = _StaticPass(max_rows=8, tokens_per_row=1, max_blocks=6, device=torch.device("cpu"))
        fresh.stage(rows, *args)
        kept.stage(rows, *args)
        assert kept.views(rows)[4].tolist() == fresh.views(rows)[4].tolist(), step
