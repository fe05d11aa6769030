"""CUDA graphs for decode steps (one graph per padded batch size) and for the fixed-shape verify pass.

A decode step of the 8B model is ~32 layers x ~15 kernels; launched one by one from Python it costs far
more than the ~4 ms the weights take to stream. Each graph replays the whole forward + lm_head for a
padded batch size over STATIC buffers:

    static inputs  ids Long[B] | positions Long[B] | slots Long[B] | seq_lens Int[B] | tables Int[B, NB]
    static output  logits Float32[B, vocab]

`run` copies a step's rows into pinned host staging buffers, moves them with one copy per dtype, pads
the batch to the next captured size and replays: no device allocation per step. Padding rows feed
token 0 at position 0, write their K/V to the scratch block (never read as a key) and attend to key 0
of the zero block (seq_len 1), so they are finite and touch no live sequence.

Requires an attention backend whose decode `plan` needs no host sync (TritonPagedAttention, or the
batch_invariant mode's BatchInvariantAttention). Rows whose block
tables are wider than the captured NB (longer than `max_seq_len`) fall back to eager (`run` -> None).

The verify graph (`VerifyGraph`) has one shape, G x W; whether its logits equal the eager pass bit for
bit is checked at capture (`VerifyGraph.bit_exact`) and it is used only if they do.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata, PassKind

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
GRAPH_SAFE_BACKENDS = ("triton", "batch_invariant")


class _StaticPass:
    """Static device buffers of one pass shape family (rows x tokens-per-row), with pinned staging."""

    def __init__(self, max_rows: int, tokens_per_row: int, max_blocks: int, device: torch.device) -> None:
        n = max_rows * tokens_per_row
        self.max_rows, self.tokens_per_row, self.max_blocks = max_rows, tokens_per_row, max_blocks
        self.i64 = torch.zeros(3, n, dtype=torch.long, device=device)                # ids | positions | slots
        self.i32 = torch.zeros(max_rows * (1 + max_blocks), dtype=torch.int32, device=device)  # lens | tables
        self.host_i64 = torch.zeros(3, n, dtype=torch.long).pin_memory()
        self.host_i32 = torch.zeros(max_rows * (1 + max_blocks), dtype=torch.int32).pin_memory()
        self.qsl = torch.arange(0, n + 1, tokens_per_row, dtype=torch.int32, device=device)  # Int[max_rows+1]
        self.copied = torch.cuda.Event()  # the last H2D copy is done: staging may be overwritten

    def views(self, rows: int) -> tuple[torch.Tensor, ...]:
        n = rows * self.tokens_per_row
        lens = self.i32[: self.max_rows][:rows]
        tables = self.i32[self.max_rows:].view(self.max_rows, self.max_blocks)[:rows]
        return self.i64[0, :n], self.i64[1, :n], self.i64[2, :n], lens, tables, self.qsl[: rows + 1]

    def stage(self, rows: int, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
              seq_lens: Sequence[int], tables: Sequence[Sequence[int]], pad_slot: int, pad_block: int) -> None:
        """Fill staging for `rows` padded rows (real rows first), then one H2D copy per dtype."""
        n_real, n = len(ids), rows * self.tokens_per_row
        h64, h32 = self.host_i64, self.host_i32
        self.copied.synchronize()
        h64[:, :n].zero_()
        h64[0, :n_real] = torch.tensor(ids, dtype=torch.long)
        h64[1, :n_real] = torch.tensor(positions, dtype=torch.long)
        h64[2, :n_real] = torch.tensor(slots, dtype=torch.long)
        h64[2, n_real:n] = pad_slot
        lens = h32[: self.max_rows]
        tab = h32[self.max_rows:].view(self.max_rows, self.max_blocks)
        lens[: len(seq_lens)] = torch.tensor(seq_lens, dtype=torch.int32)
        lens[len(seq_lens):rows] = 1
        tab[:rows].fill_(pad_block)
        for r, t in enumerate(tables):
            tab[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
        # whole buffers: a copy of a strided slice would allocate a contiguous temporary on the device
        self.i64.copy_(h64, non_blocking=True)
        self.i32.copy_(h32, non_blocking=True)
        self.copied.record()


class DecodeGraphs:
    """Captured decode forward + logits for each batch size in `batch_sizes` (up to `max_batch`)."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, max_batch: int, max_seq_len: int,
                 scratch_slot: int, zero_block: int = 0, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> None:
        backend = getattr(getattr(model, "attention", None), "name", None)
        if backend not in GRAPH_SAFE_BACKENDS:
            raise ValueError(f"CUDA graphs need an attention backend whose decode plan needs no host sync "
                             f"({', '.join(GRAPH_SAFE_BACKENDS)}), got {backend!r}")
        self.model, self.kv = model, kv
        self.block_size = kv.block_size
        self.max_blocks = -(-max_seq_len // self.block_size)
        self.sizes = sorted({b for b in batch_sizes if b < max_batch} | {max_batch})
        self.scratch_slot, self.zero_block = scratch_slot, zero_block
        device = kv.k[0].device
        self.static = _StaticPass(max_batch, 1, self.max_blocks, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    @classmethod
    def for_engine(cls, model: torch.nn.Module, kv: KVCache, max_num_seqs: int, max_model_len: int,
                   scratch_block: int, graph_max_len: int = 4096) -> DecodeGraphs:
        """Captured graphs for an engine's model runner (longer rows fall back to eager decode)."""
        graphs = cls(model, kv, max_num_seqs, min(max_model_len, graph_max_len),
                     scratch_slot=scratch_block * kv.block_size)
        graphs.capture()
        return graphs

    def run_rows(self, rows: Sequence[Any]) -> torch.Tensor | None:
        """`run` for model-runner rows (`.tokens` = [last token], `.start_pos`, `.block_table`)."""
        return self.run([r.tokens[0] for r in rows], [r.start_pos for r in rows],
                        [r.start_pos + 1 for r in rows], [r.block_table for r in rows])

    def _forward(self, rows: int) -> torch.Tensor:
        ids, pos, slots, lens, tables, qsl = self.static.views(rows)
        meta = AttentionMetadata(kind=PassKind.DECODE, slot_mapping=slots, query_start_loc=qsl,
                                 seq_lens=lens, block_tables=tables)
        return self.model.compute_logits(self.model(ids, pos, meta, self.kv))

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture largest first so smaller graphs reuse the shared memory pool."""
        self.static.stage(self.static.max_rows, [], [], [], [], [], self.scratch_slot, self.zero_block)
        for rows in sorted(self.sizes, reverse=True):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up: Triton compiles, cuBLAS picks algorithms, workspaces grow
                    self._forward(rows)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[rows] = self._forward(rows)
            self.pool = graph.pool()
            self.graphs[rows] = graph
        torch.cuda.synchronize()

    def padded_size(self, num_rows: int) -> int | None:
        return next((b for b in self.sizes if b >= num_rows), None)

    @torch.inference_mode()
    def run(self, ids: Sequence[int], positions: Sequence[int], seq_lens: Sequence[int],
            tables: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """Logits Float32[len(ids), vocab] (a view of the graph's static output; copy before the next
        run), or None when this step cannot use a graph (batch or block table too large)."""
        rows = self.padded_size(len(ids))
        if rows is None or rows not in self.graphs or any(len(t) > self.max_blocks for t in tables):
            return None
        bs = self.block_size
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions)]
        self.static.stage(rows, ids, positions, slots, seq_lens, tables, self.scratch_slot, self.zero_block)
        self.graphs[rows].replay()
        return self.logits[rows][: len(ids)]


class VerifyGraph:
    """One captured G x W verify pass (forward + logits of all G*W tokens) over static buffers."""

    def __init__(self, model: torch.nn.Module, kv: KVCache, group: int, window: int, max_seq_len: int) -> None:
        self.model, self.kv, self.group, self.window = model, kv, group, window
        self.max_blocks = -(-max_seq_len // kv.block_size)
        self.static = _StaticPass(group, window, self.max_blocks, kv.k[0].device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.bit_exact: bool | None = None

    def _forward(self) -> torch.Tensor:
        ids, pos, slots, lens, tables, qsl = self.static.views(self.group)
        meta = AttentionMetadata(kind=PassKind.VERIFY, slot_mapping=slots, query_start_loc=qsl,
                                 seq_lens=lens, block_tables=tables)
        return self.model.compute_logits(self.model(ids, pos, meta, self.kv))

    def stage(self, ids: Sequence[int], positions: Sequence[int], slots: Sequence[int],
              seq_lens: Sequence[int], tables: Sequence[Sequence[int]]) -> bool:
        """All G*W tokens given (dummies included, as the model runner lays them out). False when a
        block table is wider than the captured one (the caller then runs the pass eagerly)."""
        if len(ids) != self.group * self.window or any(len(t) > self.max_blocks for t in tables):
            return False
        self.static.stage(self.group, ids, positions, slots, seq_lens, tables, 0, 0)
        return True

    def stage_dummy(self, scratch_slot: int, zero_block: int = 0) -> None:
        """Inputs for capture that touch no live sequence: every token writes the scratch slot."""
        n = self.group * self.window
        self.static.stage(self.group, [0] * n, [0] * n, [scratch_slot] * n, [self.window] * self.group,
                          [[zero_block]] * self.group, scratch_slot, zero_block)

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
