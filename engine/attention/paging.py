"""Build AttentionMetadata from per-row block tables (the model runner's job, shared for tests and tools)."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, PassKind

SCRATCH_BLOCK = 0


@dataclass(frozen=True)
class RowSpec:
    """One row of a pass: its block table, how many keys precede it, how many tokens it feeds."""

    block_table: Sequence[int]
    context_len: int  # tokens already in the cache before this pass
    num_tokens: int  # tokens this pass writes, at positions context_len ... context_len + num_tokens - 1


def build_metadata(
    kind: PassKind, rows: Sequence[RowSpec], block_size: int, device: torch.device | str = "cpu"
) -> AttentionMetadata:
    """Slots, cumulative query starts, seq lens and zero-padded block tables for `rows`."""
    slots: list[int] = []
    starts = [0]
    for row in rows:
        for pos in range(row.context_len, row.context_len + row.num_tokens):
            slots.append(row.block_table[pos // block_size] * block_size + pos % block_size)
        starts.append(starts[-1] + row.num_tokens)
    width = max(len(row.block_table) for row in rows)
    tables = [list(row.block_table) + [SCRATCH_BLOCK] * (width - len(row.block_table)) for row in rows]
    return AttentionMetadata(
        kind=kind,
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor([r.context_len + r.num_tokens for r in rows], dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
    )


def positions_of(rows: Sequence[RowSpec], device: torch.device | str = "cpu") -> torch.Tensor:
    """Long[T]: absolute positions of every token of the pass, row after row."""
    pos = [p for r in rows for p in range(r.context_len, r.context_len + r.num_tokens)]
    return torch.tensor(pos, dtype=torch.long, device=device)
