"""Turns a step plan into tensors, runs the model, returns float32 logits.

Three pass shapes (T tokens in R rows; AttentionMetadata from engine.attention):
  PREFILL  R rows of whole prompts; logits of each row's last token        -> [R, vocab]
  DECODE   R rows of one token;   logits of every row                      -> [R, vocab]
  VERIFY   exactly G*W tokens (G rows of W, or packed rows); logits of all of them (fixed GEMM shape)
Verify padding: a real row's dummy tokens and whole dummy rows write their K/V to the scratch block,
so they never touch a live sequence; dummy rows read only the zero block.
"""
from __future__ import annotations

import array
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from engine import progress
from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata, PassKind
from engine.config import (SCRATCH_BLOCK, ZERO_BLOCK, Device, DvrDecodeAttention, EngineConfig, KernelSettings, Mode,
                           VerifyPacking)
from engine.scheduler import CANONICAL_PREFILL_ROWS
from engine.sequence import PromptLogprobs

if TYPE_CHECKING:
    from engine.parallel import TensorParallel


class PagedModel(Protocol):
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv: KVCache) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know about a model to size its KV cache and validate requests."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int


@dataclass(frozen=True)
class Row:
    tokens: list[int]        # real input tokens
    start_pos: int           # absolute position of tokens[0]
    block_table: list[int]   # physical blocks of the sequence
    canonical: bool = False  # DECODE: attention with the verifier's numerics (AttentionMetadata.canonical_rows)


DUMMY_TOKEN = 0


def prompt_logprobs_of(model: PagedModel, hidden: torch.Tensor, start: int, tokens: list[int], n: int
                       ) -> PromptLogprobs:
    """A prompt's logprobs from its prefill hidden states hidden[start : start + len(tokens)].

    The logits GEMM runs on chunks of exactly CANONICAL_PREFILL_ROWS rows (the last one padded), as the
    canonical pass's own logits GEMM does, so the bits depend only on the hidden states (for a deterministic
    request, those of its canonical prefill: reproducible). Per position, with x = float64(float32 logits):
    logprob = float32(x[next] - logsumexp(x)); the top n are the first n ids in the order x descending, lower
    id first on ties, with their logprobs (the sampler's rules, engine.sampling)."""
    m = len(tokens) - 1
    out: list[float] = []
    top: list[dict[int, float]] | None = [] if n else None
    chunk = CANONICAL_PREFILL_ROWS
    nxt_all = torch.tensor(tokens[1:], dtype=torch.int64)
    for c in range(0, m, chunk):
        k = min(chunk, m - c)
        idx = torch.full((chunk,), start, dtype=torch.int64)
        idx[:k] = torch.arange(start + c, start + c + k)
        x = model.compute_logits(hidden[idx.to(hidden.device)]).float()[:k].double()  # [k, vocab]
        lp = x - torch.logsumexp(x, dim=-1, keepdim=True)
        nxt = nxt_all[c: c + k].to(x.device)
        out += lp.gather(1, nxt[:, None])[:, 0].float().tolist()
        if top is not None:
            order = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :n]
            vals = lp.gather(1, order).float().tolist()
            top += [dict(zip(ids, v)) for ids, v in zip(order.tolist(), vals)]
    return PromptLogprobs(out, top)

Chain = tuple["torch.Tensor | None", list[int], list[int]]
"""(tokens Int64[R'] of the previous decode step on the device, dst rows, src rows): see ModelRunner.decode."""


@dataclass(frozen=True)
class Layout:
    """One pass's inputs on the host, T tokens in R rows (NB = the widest block table):

        ids, positions, slots Int64[T]  (row r's token i at index query_start_loc[r] + i)
        query_start_loc Int32[R+1] | seq_lens Int32[R] | block_tables Int32[R, NB] (padding -> ZERO_BLOCK)
    """

    ids: np.ndarray
    positions: np.ndarray
    slots: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray


class ModelRunner:
    def __init__(self, config: EngineConfig, model: PagedModel, shape: ModelShape, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel | None = None) -> None:
        """`tp`: this rank's place in a tensor-parallel group (`model` is its shard, `shape.num_kv_heads` its
        KV heads); every rank builds its runner with the same config, and they agree on the KV budget and
        on which CUDA graphs to use. `config` may be unresolved: the runner resolves it for `device`, the
        model's context length and (CUDA) the KV blocks the free memory holds."""
        free = free_kv_blocks(config, shape, dtype, device)
        if tp is not None and free is not None:  # the scheduler's block tables index every rank's cache
            free = tp.agree_min(free)
        self.config = config = config.resolve(device, model_max_len=shape.max_model_len, free_kv_blocks=free)
        # the attention kernels run under config.kernels, the settings the runtime fingerprint names
        bi = config.mode == Mode.BATCH_INVARIANT
        self.model = batch_invariant(model, config.kernels) if bi else with_kernels(model, config.kernels)
        # canonical prefill passes' body (DvrTuning.canonical_prefill_chunk_tokens > 0): GEMMs of C rows each;
        # mode batch_invariant's GEMMs are invariant to their row count already
        chunk = config.tuning.canonical_prefill_chunk_tokens
        self.canonical_model = chunked_gemms(self.model, chunk) if chunk and not bi else self.model
        self.shape = shape
        self.device = device
        self.tp = tp
        self.max_model_len = config.max_model_len  # served context
        self.num_kv_blocks = config.num_kv_blocks
        self.kv = KVCache.allocate(shape.num_layers, self.num_kv_blocks, config.block_size,
                                   shape.num_kv_heads, shape.head_dim, dtype, device)
        # DECODE passes carry AttentionMetadata.canonical_rows (the DVR rows) only in this configuration
        dvr = config.mode == Mode.DVR
        attention = config.tuning.dvr_decode_attention
        self.canonical_decode = dvr and attention != DvrDecodeAttention.SPLIT
        # and with canonical_step, a step holding a DVR row sends every row through the canonical kernel (in
        # every pass); canonical_step_short: only in the decode graphs of rows up to GRAPH_MAX_LEN tokens
        self.canonical_step = dvr and attention == DvrDecodeAttention.CANONICAL_STEP
        short_rows = attention == DvrDecodeAttention.CANONICAL_STEP_SHORT
        self.canonical_step_short = self.canonical_step or (dvr and short_rows)
        self.decode_graphs: object | None = None   # engine.cuda_graphs.DecodeGraphs when captured (rows up to
        #                                            GRAPH_MAX_LEN tokens)
        self.long_decode_graphs: object | None = None  # rows past GRAPH_MAX_LEN, up to max_model_len
        self.verify_graph: object | None = None    # engine.cuda_graphs.VerifyGraph when bit-exact
        self.graphs_status = "eager"
        if config.cuda_graphs and device.type == "cuda":
            with progress.stage("engine: capturing CUDA graphs (decode steps per batch size, the verify pass)"):
                self._capture_graphs()
                if tp is not None:
                    self._agree_on_graphs(tp)
            progress.log.info("engine: graphs %s", self.graphs_status)

    def prefill(self, rows: list[Row], pass_tokens: int | None = None) -> torch.Tensor:
        """Float32[len(rows), vocab]: the logits of each row's last token (`prefill_with_prompts`)."""
        return self.prefill_with_prompts(rows, pass_tokens, {})[0]

    @torch.inference_mode()
    def prefill_with_prompts(self, rows: list[Row], pass_tokens: int | None, prompt_logprobs: dict[int, int]
                             ) -> tuple[torch.Tensor, dict[int, PromptLogprobs]]:
        """(Float32[len(rows), vocab]: the logits of each row's last token, the prompt logprobs of the rows
        `prompt_logprobs` names, {row: their top count}: `prompt_logprobs_of`).

        pass_tokens: a canonical pass — dummy rows (<= DUMMY_PREFILL_ROW tokens each, K/V to the scratch
        block, keys from the zero block) pad it to exactly that many tokens, and the logits GEMM runs on
        exactly CANONICAL_PREFILL_ROWS rows, so a row's bits depend only on its tokens and these two sizes.
        With canonical_prefill_chunk_tokens = C > 0, pass_tokens is a multiple of C and the body's GEMMs run on
        C-row slices (`canonical_model`): a row's bits then depend on its tokens and C, not on pass_tokens.
        """
        if pass_tokens is None:
            hidden, meta = self._forward(PassKind.PREFILL, rows, pad_to=None)
            starts = meta.query_start_loc[:-1].tolist() if prompt_logprobs else []
            last = meta.query_start_loc[1:].long() - 1
            logits = self.model.compute_logits(hidden[last]).float()
        else:
            assert len(rows) <= CANONICAL_PREFILL_ROWS, (len(rows), CANONICAL_PREFILL_ROWS)
            lay = self._layout(rows, pad_to=None)
            real = len(lay.ids)
            chunk = self.config.tuning.canonical_prefill_chunk_tokens
            assert real <= pass_tokens and (not chunk or pass_tokens % chunk == 0), (real, pass_tokens, chunk)
            lay = _pad_rows(lay, pass_tokens - real, DUMMY_PREFILL_ROW, self.config.block_size)
            input_ids, positions, meta = self._to_device(PassKind.PREFILL, lay, None)
            hidden = self.canonical_model(input_ids, positions, meta, self.kv)
            last = np.zeros(CANONICAL_PREFILL_ROWS, np.int64)
            last[: len(rows)] = lay.query_start_loc[1: len(rows) + 1] - 1
            starts = lay.query_start_loc[: len(rows)].tolist()
            idx = torch.from_numpy(last).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[idx]).float()[: len(rows)]
        return logits, {r: prompt_logprobs_of(self.model, hidden, starts[r], rows[r].tokens, n)
                        for r, n in prompt_logprobs.items()}

    @torch.inference_mode()
    def decode(self, rows: list[Row], chain: Chain | None = None) -> torch.Tensor:
        """Float32[len(rows), vocab]. Under CUDA graphs a view of the graph's static output, so it is valid
        only until the next `decode` call: consume it (sample) before then, or copy it.

        chain = (tokens, dst, src): row dst[i]'s input id is tokens[src[i]], a token of the previous step
        still on the device (engine overlap); those rows' host ids are placeholders."""
        assert all(len(r.tokens) == 1 for r in rows)
        for graphs in (self.decode_graphs, self.long_decode_graphs):
            if graphs is not None:
                # None: batch or block table past the captured sizes
                logits = graphs.run_rows(rows, lambda ids: self._chain_ids(ids, chain))
                if logits is not None:
                    return logits.float()  # already float32: no copy
        hidden, _ = self._forward(PassKind.DECODE, rows, pad_to=None, chain=chain)
        return self.model.compute_logits(hidden).float()

    def _chain_ids(self, ids: torch.Tensor, chain: Chain | None) -> None:
        """ids[dst] = tokens[src] on the device (queued behind the step that samples `tokens`)."""
        if chain is None or not chain[1]:
            return
        tokens, dst, src = chain
        assert tokens is not None, "a chained decode needs the previous step's device tokens"
        index = torch.tensor([dst, src], dtype=torch.int64).to(ids.device, non_blocking=True)  # [2, n], one copy
        ids.index_copy_(0, index[0], tokens.index_select(0, index[1]))

    @torch.inference_mode()
    def verify(self, rows: list[Row], carried: list[Row] | None = None, chain: Chain | None = None,
               row_chain: list[tuple[int, int]] | None = None) -> tuple[torch.Tensor, list[int], torch.Tensor | None]:
        """Exactly G x W verify tokens, then D = verify_decode_rows one-token decode rows (`carried`, dummy
        rows after them). Padded (DvrTuning.verify_packing): row r takes tokens [r W, r W + W), dummies
        after its own, dummy rows up to G. Packed: the rows back to back (at most verify_max_windows), then
        dummy rows of at most W tokens up to G x W, then empty rows up to verify_max_windows + G rows.
        Returns ([G*W, vocab] logits of the verify tokens, the first token of each row among them,
        [len(carried), vocab] logits of the carried rows or None when D = 0). Under the verify graph both
        are views of its output, valid until the next verify: the caller samples them at once.
        chain = (tokens, dst, src): carried row dst[i]'s input id is tokens[src[i]] (as `decode`'s).
        row_chain = [(r, src)]: verify row r's last input id is chain's tokens[src] (a chained pass's window
        that ends at a token in flight)."""
        g, w, d = self.config.group, self.config.window, self.config.tuning.verify_decode_rows
        packed = self.config.tuning.verify_packing == VerifyPacking.PACKED
        carried = carried or []
        assert 1 <= len(rows) <= self.config.tuning.verify_max_windows and all(1 <= len(r.tokens) <= w for r in rows), \
            "verify shape"
        assert len(carried) <= d and all(len(r.tokens) == 1 for r in carried), "carried decode rows"
        if packed:
            lay = self._layout(rows, pad_to=None)
            assert len(lay.ids) <= g * w, ("packed verify rows past G*W tokens", len(lay.ids))
            # dummy rows of at most W tokens up to G*W, then empty rows up to the graph's fixed row count
            lay = _pad_rows(lay, g * w - len(lay.ids), w, self.config.block_size,
                            rows=self.config.tuning.verify_max_windows + g)
            starts = lay.query_start_loc[: len(rows)].tolist()
        else:
            lay = self._layout(rows, pad_to=(g, w))
            starts = list(range(0, len(rows) * w, w))
        if d:
            lay = _concat_layouts(lay, self._carried_layout(carried, d, g * w))
        if chain is not None:  # carried rows follow the G x W verify tokens
            assert all(0 <= j < len(carried) for j in chain[1]), "a chained row that is not carried"
            ends = [starts[r] + len(rows[r].tokens) - 1 for r, _ in row_chain or ()]
            chain = (chain[0], ends + [g * w + j for j in chain[1]], [src for _, src in row_chain or ()] + chain[2])
        assert chain is not None or not row_chain, "a verify input in flight needs the chain's tokens"
        logits = None
        if self.verify_graph is not None and self.verify_graph.stage(
                lay.ids, lay.positions, lay.slots, lay.seq_lens, lay.block_tables,
                lay.query_start_loc if packed else None):
            self._chain_ids(self.verify_graph.input_ids(), chain)
            logits = self.verify_graph.replay().float()
        if logits is None:
            input_ids, positions, meta = self._to_device(PassKind.VERIFY, lay, None, carried_rows=d,
                                                         verify_window=w if packed else 0)
            self._chain_ids(input_ids, chain)
            hidden = self.model(input_ids, positions, meta, self.kv)
            assert hidden.shape[0] == g * w + d, hidden.shape
            logits = self.model.compute_logits(hidden).float()  # [G*W + D, vocab], one fixed GEMM shape
        return logits[: g * w], starts, (logits[g * w: g * w + len(carried)] if d else None)

    def _carried_layout(self, carried: list[Row], d: int, first_index: int) -> Layout:
        """The D one-token rows a verify pass carries: the real ones (their decode layout), then dummy rows
        (token DUMMY_TOKEN at position 0, K/V to the scratch block, one key read from the zero block)."""
        bs = self.config.block_size
        real = self._layout(carried, pad_to=None) if carried else None
        n = d - len(carried)
        index = first_index + len(carried) + np.arange(n)
        dummy = Layout(ids=np.full(n, DUMMY_TOKEN, np.int64), positions=np.zeros(n, np.int64),
                       slots=SCRATCH_BLOCK * bs + index % bs, query_start_loc=np.arange(n + 1, dtype=np.int32),
                       seq_lens=np.ones(n, np.int32), block_tables=np.full((n, 1), ZERO_BLOCK, np.int32))
        return dummy if real is None else _concat_layouts(real, dummy)

    def _capture_graphs(self) -> None:
        """Decode graphs per padded batch size; the G x W verify graph only if it is bit-exact with the
        eager pass (a graph that changed committed bits would break the DVR invariants). A capture that
        fails leaves that pass eager and says why in `graphs_status` (named in the fingerprint)."""
        from engine.cuda_graphs import GRAPH_MAX_LEN, DecodeGraphs, VerifyGraph

        try:
            self.decode_graphs = DecodeGraphs.for_engine(self.model, self.kv, self.config.max_num_seqs,
                                                         self.max_model_len, SCRATCH_BLOCK,
                                                         graph_max_len=GRAPH_MAX_LEN, canonical=self.canonical_decode,
                                                         canonical_step=self.canonical_step_short,
                                                         cublaslt_min_rows=self.config.tuning.decode_cublaslt_min_rows)
            self.graphs_status = "decode"
        except (ValueError, RuntimeError) as exc:
            self.graphs_status = f"eager (decode graphs failed: {type(exc).__name__})"
            return
        if self.max_model_len > GRAPH_MAX_LEN:
            # a second family for rows past GRAPH_MAX_LEN (its split and chunk grids are sized for the whole
            # context, which would slow short rows down), sharing the first family's memory pool
            try:
                self.long_decode_graphs = DecodeGraphs.for_engine(
                    self.model, self.kv, self.config.max_num_seqs, self.max_model_len, SCRATCH_BLOCK,
                    graph_max_len=self.max_model_len, canonical=self.canonical_decode,
                    canonical_step=self.canonical_step, pool=self.decode_graphs.pool,
                    cublaslt_min_rows=self.config.tuning.decode_cublaslt_min_rows)
                self.graphs_status += f"+long{self.max_model_len}"
            except (ValueError, RuntimeError) as exc:
                self.graphs_status += f"; rows past {GRAPH_MAX_LEN} eager (capture failed: {type(exc).__name__})"
        if self.config.mode != Mode.DVR:
            return
        try:
            # the whole served context: unlike the split-KV decode grid, the verify kernel's grid does not
            # grow with the block-table width (rows x query tiles x heads; each program's key loop ends at
            # its row's seq_len), so one graph serves short and long rows at the same cost (a graph capped at
            # GRAPH_MAX_LEN would leave the 4k/1k set's verify passes eager: 31.6 ms a pass, 15.0 with the
            # graph)
            packed = self.config.tuning.verify_packing == VerifyPacking.PACKED
            graph = VerifyGraph(self.model, self.kv, self.config.group, self.config.window, self.max_model_len,
                                self.config.tuning.verify_decode_rows,
                                max_windows=self.config.tuning.verify_max_windows if packed else None)
            graph.stage_dummy(SCRATCH_BLOCK * self.config.block_size)
            graph.capture()
        except (ValueError, RuntimeError) as exc:
            self.graphs_status += f"; verify eager (capture failed: {type(exc).__name__})"
            return
        if graph.bit_exact:
            self.verify_graph = graph
            self.graphs_status += "+verify"
        else:
            self.graphs_status += "; verify eager (graph not bit-exact)"

    def _agree_on_graphs(self, tp: TensorParallel) -> None:
        """Every rank replays a graph family only if every rank captured it (a graph and an eager pass issue
        the same collectives, but the verify graph is used only where it is bit-exact on every rank)."""
        for attr in ("decode_graphs", "long_decode_graphs", "verify_graph"):
            have = getattr(self, attr) is not None
            if not tp.agree_min(int(have)) and have:
                setattr(self, attr, None)
                self.graphs_status += f"; {attr} eager (not captured on every rank)"

    def _forward(self, kind: PassKind, rows: list[Row], pad_to: tuple[int, int] | None,
                 chain: Chain | None = None) -> tuple[torch.Tensor, AttentionMetadata]:
        lay = self._layout(rows, pad_to)
        canonical = None
        if kind == PassKind.DECODE and self.canonical_decode and any(r.canonical for r in rows):
            # no flagged row: the plain split path (an eager step then launches no canonical kernel)
            canonical = _int32([r.canonical for r in rows])
        input_ids, positions, meta = self._to_device(kind, lay, canonical)
        self._chain_ids(input_ids, chain)
        return self.model(input_ids, positions, meta, self.kv), meta

    def _to_device(self, kind: PassKind, lay: Layout, canonical: np.ndarray | None, carried_rows: int = 0,
                   verify_window: int = 0) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """One host buffer (pinned on CUDA), one copy to the device; every tensor is a view of it.

        Int32 buffer, each region starting on a 16-byte boundary:
            | ids | positions | slots (Int64[T] each) | query_start_loc | seq_lens | canonical? | block_tables |
        """
        t, r, nb = len(lay.ids), len(lay.seq_lens), lay.block_tables.shape[1]
        sizes = (6 * t, r + 1, r, 0 if canonical is None else r, r * nb)
        offs = [0]
        for size in sizes:
            offs.append(offs[-1] + -(-size // 4) * 4)
        host = torch.empty(offs[-1], dtype=torch.int32, pin_memory=self.device.type == "cuda")
        h = host.numpy()
        h64 = h[: 6 * t].view(np.int64)
        h64[:t], h64[t: 2 * t], h64[2 * t:] = lay.ids, lay.positions, lay.slots
        h[offs[1]: offs[1] + r + 1] = lay.query_start_loc
        h[offs[2]: offs[2] + r] = lay.seq_lens
        if canonical is not None:
            h[offs[3]: offs[3] + r] = canonical
        h[offs[4]: offs[4] + r * nb] = lay.block_tables.reshape(-1)
        dev = host.to(self.device, non_blocking=True) if self.device.type != "cpu" else host
        i64 = dev[: 6 * t].view(torch.int64)
        meta = AttentionMetadata(
            kind=kind,
            slot_mapping=i64[2 * t:],
            query_start_loc=dev[offs[1]: offs[1] + r + 1],
            seq_lens=dev[offs[2]: offs[2] + r],
            block_tables=dev[offs[4]: offs[4] + r * nb].view(r, nb),
            canonical_rows=None if canonical is None else dev[offs[3]: offs[3] + r],
            canonical_step=canonical is not None and self.canonical_step,
            carried_rows=carried_rows,
            verify_window=verify_window,
        )
        return i64[:t], i64[t: 2 * t], meta

    def _layout(self, rows: list[Row], pad_to: tuple[int, int] | None) -> Layout:
        """Flatten rows; with pad_to=(G, W) pad each row to W tokens and the pass to G rows.

        Row layout under padding:  | real tokens (slots in the row's blocks) | dummies (scratch slots) |
        A dummy token's slot is SCRATCH_BLOCK * bs + (its index in the pass) % bs; a dummy row has the
        table [ZERO_BLOCK]. Positions are clamped to the model's context (dummies may run past it).
        One Python pass over the rows; the per-token work is numpy.
        """
        bs = self.config.block_size
        if pad_to is not None:
            rows = [*rows, *[Row([], 0, [])] * (pad_to[0] - len(rows))]
        num = len(rows)
        tokens: list[int] = []
        blocks: list[int] = []
        for r in rows:
            tokens += r.tokens
            blocks += r.block_table
        real = _int64([len(r.tokens) for r in rows])                                # [R] real tokens
        start = _int64([r.start_pos for r in rows])                                 # [R]
        have = _int64([len(r.block_table) for r in rows])                           # [R] blocks held
        last_block = (start + real - 1) // bs
        short = (real > 0) & (last_block >= have)
        if short.any():
            i = int(np.argmax(short))
            raise ValueError(f"row {i}: tokens up to position {int(start[i] + real[i] - 1)} need "
                             f"{int(last_block[i]) + 1} blocks of {bs}, its table has {int(have[i])}")
        per_row = real if pad_to is None else np.full(num, pad_to[1], np.int64)      # [R] tokens in the pass
        qsl = np.zeros(num + 1, np.int64)
        np.cumsum(per_row, out=qsl[1:])
        total = int(qsl[-1])
        index = np.arange(total)                                                     # [T]
        row_of = np.repeat(np.arange(num), per_row)                                  # [T]
        offset = index - qsl[row_of]                                                 # [T] index in its row
        pos = start[row_of] + offset                                                 # [T] absolute position
        tables = np.full((num, max(1, int(have.max()))), ZERO_BLOCK, np.int32)       # [R, NB]
        tables[np.arange(tables.shape[1]) < have[:, None]] = _int32(blocks)
        if pad_to is None:  # every token is real
            ids = _int64(tokens)
            slots = tables[row_of, pos // bs].astype(np.int64) * bs + pos % bs
        else:
            is_real = offset < real[row_of]
            ids = np.full(total, DUMMY_TOKEN, np.int64)
            ids[is_real] = _int64(tokens)
            slots = SCRATCH_BLOCK * bs + index % bs
            p, rr = pos[is_real], row_of[is_real]
            slots[is_real] = tables[rr, p // bs].astype(np.int64) * bs + p % bs
        return Layout(ids=ids, positions=np.minimum(pos, self.shape.max_model_len - 1), slots=slots,
                      query_start_loc=qsl.astype(np.int32), seq_lens=(start + per_row).astype(np.int32),
                      block_tables=tables)


def _concat_layouts(a: Layout, b: Layout) -> Layout:
    """Layout a's rows, then b's (b's query starts shifted, block tables padded to the wider one)."""
    width = max(a.block_tables.shape[1], b.block_tables.shape[1])
    tables = np.full((a.block_tables.shape[0] + b.block_tables.shape[0], width), ZERO_BLOCK, np.int32)
    tables[: a.block_tables.shape[0], : a.block_tables.shape[1]] = a.block_tables
    tables[a.block_tables.shape[0]:, : b.block_tables.shape[1]] = b.block_tables
    return Layout(ids=np.concatenate([a.ids, b.ids]), positions=np.concatenate([a.positions, b.positions]),
                  slots=np.concatenate([a.slots, b.slots]),
                  query_start_loc=np.concatenate([a.query_start_loc, b.query_start_loc[1:] + a.query_start_loc[-1]]),
                  seq_lens=np.concatenate([a.seq_lens, b.seq_lens]), block_tables=tables)


def _pad_rows(lay: Layout, count: int, row_len: int, block_size: int, rows: int | None = None) -> Layout:
    """Append `count` dummy tokens as rows of at most `row_len` tokens (positions 0.., K/V written to the
    scratch block, keys read from the zero block), then empty rows (no token, seq_len 0) up to `rows` rows
    when given (a fixed row count for a graph); real rows keep their layout."""
    assert count >= 0, count
    lens = [row_len] * (count // row_len) + ([count % row_len] if count % row_len else [])
    if rows is not None:
        assert len(lay.seq_lens) + len(lens) <= rows, ("rows", len(lay.seq_lens), len(lens), rows)
        lens += [0] * (rows - len(lay.seq_lens) - len(lens))
    if not lens:
        return lay
    lens_np = np.asarray(lens, np.int64)
    real = len(lay.ids)
    index = real + np.arange(count)
    starts = np.zeros(len(lens), np.int64)
    np.cumsum(lens_np[:-1], out=starts[1:])
    pos = np.arange(count) - np.repeat(starts, lens_np)
    width = max(lay.block_tables.shape[1], -(-row_len // block_size))
    tables = np.full((lay.block_tables.shape[0] + len(lens), width), ZERO_BLOCK, np.int32)
    tables[: lay.block_tables.shape[0], : lay.block_tables.shape[1]] = lay.block_tables
    qsl = np.concatenate([lay.query_start_loc, (real + np.cumsum(lens_np)).astype(np.int32)])
    return Layout(ids=np.concatenate([lay.ids, np.full(count, DUMMY_TOKEN, np.int64)]),
                  positions=np.concatenate([lay.positions, pos]),
                  slots=np.concatenate([lay.slots, SCRATCH_BLOCK * block_size + index % block_size]),
                  query_start_loc=qsl, seq_lens=np.concatenate([lay.seq_lens, lens_np.astype(np.int32)]),
                  block_tables=tables)


DUMMY_PREFILL_ROW = 64  # dummy rows of a canonical prefill pass are this short: their attention costs ~nothing


def _int64(values: list[int]) -> np.ndarray:
    """A list of Python ints as Int64 numpy (through array.array: about twice as fast as np.array)."""
    return np.frombuffer(array.array("q", values), np.int64)


def _int32(values: list[int]) -> np.ndarray:
    return np.frombuffer(array.array("i", values), np.int32)


def free_kv_blocks(config: EngineConfig, shape: ModelShape, dtype: torch.dtype, device: torch.device) -> int | None:
    """The KV blocks `kv_memory_share` of the memory free now (after the weights) holds, where the config sizes
    the KV cache from it (CUDA, num_kv_blocks None); else None. The KV cache's size follows this budget, never
    the number of requests."""
    if config.num_kv_blocks is not None or Device.of(device) != Device.CUDA:
        return None
    from engine.gpu_memory import kv_blocks_for_free_memory, kv_bytes_per_block

    per_block = kv_bytes_per_block(shape.num_layers, shape.num_kv_heads, shape.head_dim, config.block_size, dtype)
    return kv_blocks_for_free_memory(per_block, config.kv_memory_share, device)


def batch_invariant(model: PagedModel, kernels: KernelSettings) -> PagedModel:
    """mode=batch_invariant: the model's weights through batch-invariant GEMM / norm / SwiGLU and attention
    (a weight-sharing view, its Triton kernels launched with `kernels`), its GEMM shapes probed once here at
    start-up."""
    from engine.models import LlamaForCausalLM, batch_invariant_view

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"EngineConfig.mode: batch_invariant needs an engine.models model, got {type(model).__name__}")
    return batch_invariant_view(model, kernels)


def chunked_gemms(model: PagedModel, rows: int) -> PagedModel:
    """An engine.models model whose GEMMs run on `rows`-row slices (ChunkedOps over its ops, a weight-sharing
    view); any other PagedModel (a test double) runs as it is."""
    from engine.kernels import ChunkedOps
    from engine.models import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):
        return model
    return model.with_numerics(ChunkedOps(model.ops, rows), model.attention)


def with_kernels(model: PagedModel, kernels: KernelSettings) -> PagedModel:
    """An engine.models model with its attention's Triton kernels launched under `kernels` (a weight-sharing
    view where they differ); any other PagedModel (a test double) runs as it is."""
    from engine.models import LlamaForCausalLM

    return model.with_kernels(kernels) if isinstance(model, LlamaForCausalLM) else model


@dataclass(frozen=True)
class LoadedModel:
    model: PagedModel
    shape: ModelShape
    tokenizer: object
    info: object            # engine.loader.ModelInfo (name, digests, dtype, max_model_len, eos ids)
    tp: TensorParallel | None = None  # tensor parallel: this rank's group (rank 0 holds the workers)


def load_shard(config: EngineConfig, tp: TensorParallel | None = None) -> LoadedModel:
    """Resolve config.model through the loader, build our own forward and load the weights: the whole model,
    or with `tp` this rank's shard of it (engine.loading.load_model starts the ranks)."""
    from pathlib import Path

    from engine.kernels import TORCH_OPS, BatchInvariantOps
    from engine.loader import load_model_source, tensor_count
    from engine.models import arch_from_hf, build_model
    from engine.models.synthetic import load_synthetic, parse_synthetic

    dtype, device = config.torch_dtype, config.torch_device
    backend = config.attention_backend_on(device).value
    ops = BatchInvariantOps() if config.mode == Mode.BATCH_INVARIANT else TORCH_OPS
    synthetic = parse_synthetic(config.model)
    if synthetic is not None:  # seeded random weights made on the device (no files)
        with progress.stage(f"model {config.model!r}: making seeded random weights on {device}"):
            model, hf_config, tokenizer, info = load_synthetic(synthetic, dtype, device, backend, ops,
                                                               tp, config.kernels)
    else:
        cache = Path(config.cache_dir) if config.cache_dir else None
        source = load_model_source(config.model, dtype, cache)
        hf_config, tokenizer, info = source.hf_config, source.tokenizer, source.info
        count, as_dtype = tensor_count(source.weight_files), str(dtype).removeprefix("torch.")
        with progress.stage(f"model {info.name!r}: loading {count} tensors on {device} as {as_dtype}"):
            model = build_model(hf_config, dtype, device, backend, ops, tp, config.kernels)
            model.load_weights(progress.track(source.weights(), "loading weights", count, "tensor"))
    arch = arch_from_hf(hf_config)
    shape = ModelShape(num_layers=arch.num_layers, num_kv_heads=model.num_kv_heads, head_dim=arch.head_dim,
                       vocab_size=arch.vocab_size, max_model_len=info.max_model_len)
    return LoadedModel(model, shape, tokenizer, info, tp)
