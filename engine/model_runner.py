"""Turns a step plan into tensors, runs the model, returns float32 logits.

Three pass shapes (T tokens in R rows; AttentionMetadata from engine.attention):
  PREFILL  R rows of whole prompts; logits of each row's last token        -> [R, vocab]
  DECODE   R rows of one token;   logits of every row                      -> [R, vocab]
  VERIFY   exactly G rows x W tokens; logits of all G*W tokens (fixed GEMM shape) -> [G, W, vocab]
Verify padding: a real row's dummy tokens and whole dummy rows write their K/V to the scratch block,
so they never touch a live sequence; dummy rows read only the zero block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata, PassKind
from engine.config import SCRATCH_BLOCK, ZERO_BLOCK, EngineConfig, Mode


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


class ModelRunner:
    def __init__(self, config: EngineConfig, model: PagedModel, shape: ModelShape, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config = config
        self.model = batch_invariant(model) if config.mode == Mode.BATCH_INVARIANT else model
        self.shape = shape
        self.device = device
        self.num_kv_blocks = kv_block_budget(config, shape, dtype, device)
        self.kv = KVCache.allocate(shape.num_layers, self.num_kv_blocks, config.block_size,
                                   shape.num_kv_heads, shape.head_dim, dtype, device)
        self.decode_graphs: object | None = None   # engine.cuda_graphs.DecodeGraphs when captured
        self.verify_graph: object | None = None    # engine.cuda_graphs.VerifyGraph when bit-exact
        self.graphs_status = "eager"
        if config.cuda_graphs and device.type == "cuda":
            self._capture_graphs()

    @torch.inference_mode()
    def prefill(self, rows: list[Row]) -> torch.Tensor:
        hidden, meta = self._forward(PassKind.PREFILL, rows, pad_to=None)
        last = meta.query_start_loc[1:].long() - 1
        return self.model.compute_logits(hidden[last]).float()

    @torch.inference_mode()
    def decode(self, rows: list[Row]) -> torch.Tensor:
        assert all(len(r.tokens) == 1 for r in rows)
        if self.decode_graphs is not None:
            logits = self.decode_graphs.run_rows(rows)  # None: batch or block table past the captured sizes
            if logits is not None:
                return logits.float().clone()
        hidden, _ = self._forward(PassKind.DECODE, rows, pad_to=None)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def verify(self, rows: list[Row]) -> torch.Tensor:
        """Exactly G x W tokens; returns [len(rows), W, vocab] (the dummy rows' logits are dropped)."""
        g, w = self.config.group, self.config.window
        assert 1 <= len(rows) <= g and all(1 <= len(r.tokens) <= w for r in rows), "verify shape"
        if self.verify_graph is not None:
            ids, pos, slots, _starts, lens, tables = self._layout(rows, pad_to=(g, w))
            if self.verify_graph.stage(ids, pos, slots, lens, tables):
                return self.verify_graph.replay().float().view(g, w, -1)[: len(rows)].clone()
        hidden, _ = self._forward(PassKind.VERIFY, rows, pad_to=(g, w))
        assert hidden.shape[0] == g * w, hidden.shape
        logits = self.model.compute_logits(hidden).float()  # [G*W, vocab], one fixed GEMM shape
        return logits.view(g, w, -1)[: len(rows)]

    def _capture_graphs(self) -> None:
        """Decode graphs per padded batch size; the G x W verify graph only if it is bit-exact with the
        eager pass (a graph that changed committed bits would break the DVR invariants). A capture that
        fails leaves that pass eager and says why in `graphs_status` (named in the fingerprint)."""
        from engine.cuda_graphs import DecodeGraphs, VerifyGraph

        max_len = min(self.config.max_model_len or self.shape.max_model_len, self.shape.max_model_len)
        try:
            self.decode_graphs = DecodeGraphs.for_engine(self.model, self.kv, self.config.max_num_seqs, max_len,
                                                         SCRATCH_BLOCK)
            self.graphs_status = "decode"
        except (ValueError, RuntimeError) as exc:
            self.graphs_status = f"eager (decode graphs failed: {type(exc).__name__})"
            return
        if self.config.mode != Mode.DVR:
            return
        try:
            graph = VerifyGraph(self.model, self.kv, self.config.group, self.config.window, min(max_len, 4096))
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

    def _forward(self, kind: PassKind, rows: list[Row], pad_to: tuple[int, int] | None
                 ) -> tuple[torch.Tensor, AttentionMetadata]:
        ids, pos, slots, starts, lens, tables = self._layout(rows, pad_to)
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            kind=kind,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [ZERO_BLOCK] * (width - len(t)) for t in tables], dtype=torch.int32,
                                      device=dev),
        )
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        return self.model(input_ids, positions, meta, self.kv), meta

    def _layout(self, rows: list[Row], pad_to: tuple[int, int] | None
                ) -> tuple[list[int], list[int], list[int], list[int], list[int], list[list[int]]]:
        """Flatten rows; with pad_to=(G, W) pad each row to W tokens and the pass to G rows.

        Row layout under padding:  | real tokens (slots in the row's blocks) | dummies (scratch slots) |
        """
        bs = self.config.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        starts, lens, tables = [0], [], []
        all_rows = list(rows)
        if pad_to is not None:
            all_rows += [Row([], 0, [])] * (pad_to[0] - len(rows))
        for row in all_rows:
            n = len(row.tokens) if pad_to is None else pad_to[1]
            for i in range(n):
                p = row.start_pos + i
                real = i < len(row.tokens)
                ids.append(row.tokens[i] if real else DUMMY_TOKEN)
                pos.append(min(p, self.shape.max_model_len - 1))
                slots.append(row.block_table[p // bs] * bs + p % bs if real
                             else SCRATCH_BLOCK * bs + len(slots) % bs)
            starts.append(starts[-1] + n)
            lens.append(row.start_pos + n)
            tables.append(row.block_table or [ZERO_BLOCK])
        return ids, pos, slots, starts, lens, tables


CPU_KV_BLOCKS = 514


def kv_block_budget(config: EngineConfig, shape: ModelShape, dtype: torch.dtype, device: torch.device) -> int:
    """config.num_kv_blocks, else on CUDA `kv_memory_share` of the memory free now (after the weights),
    else CPU_KV_BLOCKS. The KV cache's size follows this budget, never the number of requests."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    if device.type != "cuda":
        return CPU_KV_BLOCKS
    from engine.gpu_memory import kv_blocks_for_free_memory, kv_bytes_per_block

    per_block = kv_bytes_per_block(shape.num_layers, shape.num_kv_heads, shape.head_dim, config.block_size, dtype)
    return kv_blocks_for_free_memory(per_block, config.kv_memory_share, device)


def batch_invariant(model: PagedModel) -> PagedModel:
    """mode=batch_invariant: the model's weights through batch-invariant GEMM / norm / SwiGLU and attention
    (a weight-sharing view), its GEMM shapes probed once here at start-up."""
    from engine.models import LlamaForCausalLM, batch_invariant_view

    if not isinstance(model, LlamaForCausalLM):
        raise ValueError(f"EngineConfig.mode: batch_invariant needs an engine.models model, got {type(model).__name__}")
    return batch_invariant_view(model)


@dataclass(frozen=True)
class LoadedModel:
    model: PagedModel
    shape: ModelShape
    tokenizer: object
    info: object            # engine.loader.ModelInfo (name, digests, dtype, max_model_len, eos ids)


def load_model(config: EngineConfig) -> LoadedModel:
    """Resolve config.model through the loader, build our own forward and load the weights."""
    from pathlib import Path

    from engine.kernels import TORCH_OPS, BatchInvariantOps
    from engine.loader import load_model_source
    from engine.models import arch_from_hf, build_model

    dtype, device = config.resolved_dtype, config.resolved_device
    cache = Path(config.cache_dir) if config.cache_dir else None
    source = load_model_source(config.model, dtype, cache)
    arch = arch_from_hf(source.hf_config)
    ops = BatchInvariantOps() if config.mode == Mode.BATCH_INVARIANT else TORCH_OPS
    model = build_model(source.hf_config, dtype, device, config.attention_backend, ops)
    model.load_weights(source.weights())
    shape = ModelShape(num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads, head_dim=arch.head_dim,
                       vocab_size=arch.vocab_size, max_model_len=source.info.max_model_len)
    return LoadedModel(model, shape, source.tokenizer, source.info)
