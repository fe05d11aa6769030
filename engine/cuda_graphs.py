"""CUDA graphs for decode steps (one graph per padded batch size) and for the fixed-shape verify pass.

A decode step of the 8B model is ~32 layers x ~15 kernels; launched one by one from Python it costs far
more than the ~4 ms the weights take to stream. Each graph replays the whole forward + lm_head for a
padded batch size over STATIC buffers:

    static inputs  ids Long[B] | positions Long[B] | slots Long[B] | seq_lens Int[B] | canonical Int[B]
                   | tables Int[B, NB]
    static output  logits Float32[B, vocab]

`run` copies a step's rows into pinned host staging buffers (numpy views, no per-row tensor ops), moves
them with one copy per dtype, pads the batch to the next captured size and replays: no device
allocation per step. Padding rows feed token 0 at position 0, write their K/V to the scratch block
(never read as a key), attend to key 0 of the zero block (seq_len 1) and are not canonical, so they are
finite and touch no live sequence. Graphs captured with `canonical=True` (DVR mode with
dvr_decode_attention="canonical") pass the canonical buffer as AttentionMetadata.canonical_rows; such a
family also captures each size without it (`plain`), replayed for steps with no canonical row, so that a
DVR engine's steps without deterministic rows launch no canonical branch (with the canonical branch in every
step, dvr with 0 deterministic requests ran 2.5 % slower than nondeterministic on the H200).

Requires an attention backend whose decode `plan` needs no host sync (TritonPagedAttention, or the
batch_invariant mode's BatchInvariantAttention). Rows whose block
tables are wider than the captured NB (longer than `max_seq_len`) get None from `run`: the model runner then
tries its second family (rows up to max_model_len), then an eager pass.

The verify graph (`VerifyGraph`) has one shape, G x W; whether its logits equal the eager pass bit for
bit is checked at capture (`VerifyGraph.bit_exact`) and it is used only if they do.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata, PassKind

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
GRAPH_SAFE_BACKENDS = ("triton", "batch_invariant")
GRAPH_MAX_LEN = 4096  # an engine's first decode-graph family covers rows up to this many tokens; a model runner
#                       captures a second family for longer rows (up to its max_model_len)


class _StaticPass:
    """Static device buffers of one pass shape family (rows x tokens-per-row), with host staging (pinned
    on CUDA) that is filled through numpy views and moved with one copy per dtype.

        i64  ids | positions | slots                   Int64[3, max_rows * tokens_per_row]
        i32  seq_lens | canonical rows | block tables  Int32[R4 + R4 + max_rows * max_blocks]  (R4: max_rows
             rounded up to 4, so every region starts on a 16-byte boundary)
             | query starts                            Int32[max_rows + 1], only with `staged_qsl` (rows of
             varying length, staged with the rest; else `qsl` is fixed: tokens_per_row per row)
    """

    def __init__(self, max_rows: int, tokens_per_row: int, max_blocks: int, device: torch.device,
                 staged_qsl: bool = False) -> None:
        n = max_rows * tokens_per_row
        self.max_rows, self.tokens_per_row, self.max_blocks = max_rows, tokens_per_row, max_blocks
        self.r4 = r4 = -(-max_rows // 4) * 4
        cuda = device.type == "cuda"
        self.i64 = torch.zeros(3, n, dtype=torch.long, device=device)
        tables_end = 2 * r4 + max_rows * max_blocks
        q_off = -(-tables_end // 4) * 4
        size = q_off + max_rows + 1 if staged_qsl else tables_end
        self.i32 = torch.zeros(size, dtype=torch.int32, device=device)
        self.host_i64 = torch.zeros(3, n, dtype=torch.long, pin_memory=cuda)
        self.host_i32 = torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
        self.np64 = self.host_i64.numpy()                                   # [3, n]
        self.np_lens = self.host_i32.numpy()[:max_rows]
        self.np_canonical = self.host_i32.numpy()[r4: r4 + max_rows]
        self.np_tables = self.host_i32.numpy()[2 * r4: tables_end].reshape(max_rows, max_blocks)
        self.np_qsl: np.ndarray | None = None
        if staged_qsl:  # Int[max_rows+1]: a view of the staged buffer
            self.np_qsl = self.host_i32.numpy()[q_off:]
            self.qsl = self.i32[q_off:]
        else:
            self.qsl = torch.arange(0, n + 1, tokens_per_row, dtype=torch.int32, device=device)  # Int[max_rows+1]
        # what each host table row holds: a copy of the block list staged there (the rest is staged_pad), or
        # None when unknown
        self.staged: list[list[int] | None] = [None] * max_rows
        self.staged_pad: int | None = None
        # the last H2D copy is done: staging may be overwritten
        self.copied = torch.cuda.Event() if cuda else None

    def views(self, rows: int) -> tuple[torch.Tensor, ...]:
        """ids, positions, slots, seq_lens, block_tables, query_start_loc of the first `rows` rows."""
        return (*self.token_views(rows, rows * self.tokens_per_row), self.qsl[: rows + 1])

    def token_views(self, rows: int, tokens: int) -> tuple[torch.Tensor, ...]:
        """ids, positions, slots of the first `tokens` tokens, seq_lens and block_tables of the first `rows`
        rows (a pass whose rows are not all tokens_per_row long brings its own query starts)."""
        lens = self.i32[: self.max_rows][:rows]
        tables = self.i32[2 * self.r4: 2 * self.r4 + self.max_rows * self.max_blocks].view(
            self.max_rows, self.max_blocks)[:rows]
        return self.i64[0, :tokens], self.i64[1, :tokens], self.i64[2, :tokens], lens, tables

    def _stage_tables(self, rows: int, tables: Sequence[Sequence[int]] | np.ndarray, pad_block: int) -> None:
        """Rows of block lists are rewritten only where they differ from what the row already holds
        (`self.staged`, compared by value): from one decode step to the next most tables are unchanged,
        so a step converts a few rows instead of every table."""
        tab = self.np_tables
        if isinstance(tables, np.ndarray):
            tab[:rows] = pad_block
            tab[: tables.shape[0], : tables.shape[1]] = tables
            self.staged[:rows] = [None] * rows
            return
        if pad_block != self.staged_pad:
            self.staged, self.staged_pad = [None] * self.max_rows, pad_block
        staged, empty = self.staged, []
        for r in range(rows):
            t = tables[r] if r < len(tables) else empty  # padding rows hold only pad_block
            if staged[r] != t:
                row = tab[r]
                row[:] = pad_block
                row[: len(t)] = t
                staged[r] = list(t)

    def canonical_rows(self, rows: int) -> torch.Tensor:
        """Int32[rows]: the canonical-row flags (padding rows 0)."""
        return self.i32[self.r4: self.r4 + rows]

    def stage(self, rows: int, ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
              slots: Sequence[int] | np.ndarray, seq_lens: Sequence[int] | np.ndarray,
              tables: Sequence[Sequence[int]] | np.ndarray, pad_slot: int, pad_block: int,
              canonical: Sequence[int] | np.ndarray | None = None,
              qsl: Sequence[int] | np.ndarray | None = None) -> None:
        """Fill staging for `rows` padded rows (real rows first), then one H2D copy per dtype.
        `qsl` (with `staged_qsl` only): the rows' query starts, Int[rows + 1].

        `tables`: one block list per real row, or an Int[real rows, NB] array already padded with
        `pad_block`. Padding: token 0 at position 0 writing `pad_slot`, seq_len 1, table of `pad_block`,
        canonical flag 0."""
        n_real, n = len(ids), rows * self.tokens_per_row
        if self.copied is not None:
            self.copied.synchronize()
        h64 = self.np64
        h64[:, n_real:n] = 0
        h64[0, :n_real] = ids
        h64[1, :n_real] = positions
        h64[2, :n_real] = slots
        h64[2, n_real:n] = pad_slot
        r_real = len(seq_lens)
        self.np_lens[:r_real] = seq_lens
        self.np_lens[r_real:rows] = 1
        self.np_canonical[:rows] = 0
        if canonical is not None:
            self.np_canonical[: len(canonical)] = canonical
        self._stage_tables(rows, tables, pad_block)
        if qsl is not None:
            assert self.np_qsl is not None and len(qsl) == rows + 1, "query starts need staged_qsl, one per row + 1"
            self.np_qsl[: rows + 1] = qsl
        # whole buffers: a copy of a strided slice would allocate a contiguous temporary on the device
        self.i64.copy_(self.host_i64, non_blocking=True)
        self.i32.copy_(self.host_i32, non_blocking=True)
        if self.copied is not None:
            self.copied.record(torch.cuda.current_stream(self.i64.device))


@contextlib.contextmanager
def blas_library(library: str | None) -> Iterator[None]:
    """torch's preferred BLAS library ("cublas" / "cublaslt") for the GEMMs launched (or captured) inside;
    None leaves it. The previous preference is restored on exit."""
    if library is None:
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(library)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def _widest(tables: Sequence[Sequence[int]] | np.ndarray) -> int:
    if isinstance(tables, np.ndarray):
        return tables.shape[1]
    return max(map(len, tables), default=0)


class DecodeGraphs:
    """Captured decode forward + logits for each batch size in `batch_sizes` (up to `max_batch`)."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, max_batch: int, max_seq_len: int,
                 scratch_slot: int, zero_block: int = 0, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
                 canonical: bool = False, canonical_step: bool = False, cublaslt_min_rows: int = 0) -> None:
        backend = getattr(getattr(model, "attention", None), "name", None)
        if backend not in GRAPH_SAFE_BACKENDS:
            raise ValueError(f"CUDA graphs need an attention backend whose decode plan needs no host sync "
                             f"({', '.join(GRAPH_SAFE_BACKENDS)}), got {backend!r}")
        self.model, self.kv = model, kv
        self.block_size = kv.block_size
        self.max_blocks = -(-max_seq_len // self.block_size)
        self.sizes = sorted({b for b in batch_sizes if b < max_batch} | {max_batch})
        self.scratch_slot, self.zero_block = scratch_slot, zero_block
        self.canonical = canonical  # captured forwards read static canonical_rows (DVR, canonical decode)
        self.canonical_step = canonical_step  # and their canonical graphs run every row canonical
        # sizes of at least this many rows capture their GEMMs with cuBLASLt (0: none); see blas_for
        self.cublaslt_min_rows = cublaslt_min_rows
        device = kv.k[0].device
        self.static = _StaticPass(max_batch, 1, self.max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # canonical families: the same sizes captured without the canonical branch (steps with no such row)
        self.plain_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.plain_logits: dict[int, torch.Tensor] = {}
        self.pool = None

    @classmethod
    def for_engine(cls, model: torch.nn.Module, kv: KVCache, max_num_seqs: int, max_model_len: int,
                   scratch_block: int, graph_max_len: int = GRAPH_MAX_LEN, canonical: bool = False,
                   pool: Any = None, canonical_step: bool = False, cublaslt_min_rows: int = 0) -> DecodeGraphs:
        """Captured graphs for an engine's model runner, rows up to min(max_model_len, graph_max_len) tokens
        (`run` returns None for longer ones: the runner tries its next family, then eager decode).
        `canonical`: the engine is in DVR mode with dvr_decode_attention="canonical" (or "canonical_step":
        `canonical_step`, the canonical graphs send every row through the canonical kernel). `pool`: another
        family's graph memory pool to share (graphs replay one at a time on one stream).
        `cublaslt_min_rows`: DvrTuning.decode_cublaslt_min_rows."""
        graphs = cls(model, kv, max_num_seqs, min(max_model_len, graph_max_len),
                     scratch_slot=scratch_block * kv.block_size, canonical=canonical,
                     canonical_step=canonical_step, cublaslt_min_rows=cublaslt_min_rows)
        graphs.pool = pool
        graphs.capture()
        return graphs

    def run_rows(self, rows: Sequence[Any], patch_ids: Callable[[torch.Tensor], None] | None = None
                 ) -> torch.Tensor | None:
        """`run` for model-runner rows (`.tokens` = [last token], `.start_pos`, `.block_table`, `.canonical`)."""
        starts = [r.start_pos for r in rows]
        return self.run([r.tokens[0] for r in rows], starts, [p + 1 for p in starts], [r.block_table for r in rows],
                        [r.canonical for r in rows] if self.canonical else None, patch_ids)

    def _forward(self, rows: int, canonical: bool) -> torch.Tensor:
        ids, pos, slots, lens, tables, qsl = self.static.views(rows)
        meta = AttentionMetadata(kind=PassKind.DECODE, slot_mapping=slots, query_start_loc=qsl,
                                 seq_lens=lens, block_tables=tables,
                                 canonical_rows=self.static.canonical_rows(rows) if canonical else None,
                                 canonical_step=canonical and self.canonical_step)
        return self.model.compute_logits(self.model(ids, pos, meta, self.kv))

    def blas_for(self, rows: int) -> str | None:
        """The BLAS library the graph of `rows` padded rows is captured with (None: torch's preference)."""
        return "cublaslt" if self.cublaslt_min_rows and rows >= self.cublaslt_min_rows else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture largest first so smaller graphs reuse the shared memory pool (a canonical family: each
        size with and without the canonical branch)."""
        self.static.stage(self.static.max_rows, [], [], [], [], [], self.scratch_slot, self.zero_block)
        variants = [(True, self.graphs, self.logits)] if self.canonical else []
        variants.append((False, self.plain_graphs if self.canonical else self.graphs,
                         self.plain_logits if self.canonical else self.logits))
        for rows in sorted(self.sizes, reverse=True):
            for canonical, graphs, logits in variants:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with blas_library(self.blas_for(rows)):
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks algorithms, workspaces grow
                            self._forward(rows, canonical)
                    torch.cuda.current_stream().wait_stream(stream)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        logits[rows] = self._forward(rows, canonical)
                self.pool = graph.pool()
                graphs[rows] = graph
        torch.cuda.synchronize()

    def padded_size(self, num_rows: int) -> int | None:
        return next((b for b in self.sizes if b >= num_rows), None)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], positions: Sequence[int], seq_lens: Sequence[int],
            tables: Sequence[Sequence[int]], canonical: Sequence[int] | None = None,
            patch_ids: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Logits Float32[len(ids), vocab] (a view of the graph's static output; copy before the next
        run), or None when this step cannot use a graph (batch or block table too large). Stages into
        the static buffers and replays: nothing is allocated on the device. `canonical`: per-row flags
        for AttentionMetadata.canonical_rows (used only by graphs captured with `canonical=True`).
        `patch_ids(ids)`: rewrites the staged input ids Int64[rows] on the device before the replay
        (ids taken from the previous step's device tokens)."""
        rows = self.padded_size(len(ids))
        if rows is None or rows not in self.graphs or _widest(tables) > self.max_blocks:
            return None
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        self.static.stage(rows, ids, positions, slots, seq_lens, tables, self.scratch_slot, self.zero_block,
                          canonical)
        if patch_ids is not None:
            patch_ids(self.static.i64[0, : len(ids)])
        if self.canonical and not any(canonical or ()):  # no canonical row: the graph without that branch
            self.plain_graphs[rows].replay()
            return self.plain_logits[rows][: len(ids)]
        self.graphs[rows].replay()
        return self.logits[rows][: len(ids)]


class VerifyGraph:
    """One captured verify pass (forward + logits of all its tokens) over static buffers: G rows of W tokens,
    then `carried` one-token decode rows (DvrTuning.verify_decode_rows; 0: none). Packed
    (`max_windows`, DvrTuning.verify_packing): the G*W verify tokens sit in max_windows + G rows of
    0 .. W tokens each, whose query starts are staged with every pass."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, group: int, window: int, max_seq_len: int,
                 carried: int = 0, max_windows: int | None = None) -> None:
        self.model, self.kv, self.group, self.window, self.carried = model, kv, group, window, carried
        self.max_blocks = -(-max_seq_len // kv.block_size)
        device = kv.k[0].device
        self.packed = max_windows is not None
        verify_rows = max_windows + group if max_windows is not None else group
        self.rows, self.tokens = verify_rows + carried, group * window + carried
        self.static = _StaticPass(self.rows, window, self.max_blocks, device, staged_qsl=self.packed)
        # padded: G rows of W tokens then the carried rows, fixed; packed: staged with every pass (these are the
        # capture's: G full rows, empty rows, the carried rows)
        self.starts = [r * window for r in range(group + 1)] + [group * window] * (verify_rows - group)
        self.starts += [group * window + i for i in range(1, carried + 1)]
        self.qsl = self.static.qsl if self.packed else torch.tensor(self.starts, dtype=torch.int32, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.bit_exact: bool | None = None

    def _forward(self) -> torch.Tensor:
        ids, pos, slots, lens, tables = self.static.token_views(self.rows, self.tokens)
        meta = AttentionMetadata(kind=PassKind.VERIFY, slot_mapping=slots, query_start_loc=self.qsl,
                                 seq_lens=lens, block_tables=tables, carried_rows=self.carried,
                                 verify_window=self.window if self.packed else 0)
        return self.model.compute_logits(self.model(ids, pos, meta, self.kv))

    def stage(self, ids: Sequence[int] | np.ndarray, positions: Sequence[int] | np.ndarray,
              slots: Sequence[int] | np.ndarray, seq_lens: Sequence[int] | np.ndarray,
              tables: Sequence[Sequence[int]] | np.ndarray, qsl: Sequence[int] | np.ndarray | None = None) -> bool:
        """All G*W + D tokens of every row given (dummies included, as the model runner lays them out);
        tables as lists or an Int[rows, NB] array padded with block 0; `qsl` (packed only) the rows' query
        starts. False when a block table is wider than the captured one (the caller then runs the pass
        eagerly)."""
        if len(ids) != self.tokens or len(seq_lens) != self.rows or _widest(tables) > self.max_blocks:
            return False
        assert (qsl is not None) == self.packed, "a packed verify pass stages its query starts, a padded one none"
        self.static.stage(self.rows, ids, positions, slots, seq_lens, tables, 0, 0, qsl=qsl)
        return True

    def input_ids(self) -> torch.Tensor:
        """The staged input ids Int64[G*W + D] on the device (a chained pass patches its carried rows')."""
        return self.static.i64[0, : self.tokens]

    def stage_dummy(self, scratch_slot: int, zero_block: int = 0) -> None:
        """Inputs for capture that touch no live sequence: every token writes the scratch slot."""
        n = self.tokens
        empty = self.rows - self.group - self.carried  # packed: rows past the G full ones hold no token
        self.static.stage(self.rows, [0] * n, [0] * n, [scratch_slot] * n,
                          [self.window] * self.group + [0] * empty + [1] * self.carried, [[zero_block]] * self.rows,
                          scratch_slot, zero_block, qsl=self.starts if self.packed else None)

    @torch.inference_mode()
    def eager(self) -> torch.Tensor:
        return self._forward().clone()

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture over the currently staged inputs and compare with an eager pass, bit for bit.

        The K/V the pass writes are a pure function of the inputs, so running it twice is harmless."""
        expected = self.eager()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        self.graph.replay()
        torch.cuda.synchronize()
        self.bit_exact = bool(torch.equal(self.logits, expected))

    @torch.inference_mode()
    def replay(self) -> torch.Tensor:
        if self.graph is None or self.logits is None:
            raise RuntimeError("VerifyGraph.replay before capture")
        self.graph.replay()
        return self.logits
