"""Which slice of each weight a tensor-parallel rank holds (Megatron-style column / row parallel layers).

    attention  q/k/v rows (column parallel) by KV head: rank r holds KV heads [k0, k1) and the query heads
               of their groups; o_proj columns of those query heads (row parallel: partial sums, reduced)
    MLP        gate/up rows [i0, i1) of the intermediate size (column parallel); down_proj columns [i0, i1)
    vocabulary embed_tokens and lm_head rows [v0, v1): every rank holds `vocab_per_rank` rows, the last one
               padded with zero rows; the embedding sums the ranks' lookups, the logits are gathered
    replicated norms, q/k norms, the o_proj and down_proj biases (added once, after the reduction)

Heads and the intermediate size need not divide evenly (SmolLM2: 3 KV heads on 2 ranks gives 1 and 2); a
rank must hold at least one KV head.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.arch import LlamaArch


def _split(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's share of `total` items, as even as possible, lower ranks the smaller shares."""
    return total * rank // size, total * (rank + 1) // size


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    size: int
    kv_heads: tuple[int, int]       # [start, end) of the KV heads
    q_heads: tuple[int, int]        # [start, end) of the query heads (the KV heads' groups)
    intermediate: tuple[int, int]   # [start, end) of the MLP intermediate features
    vocab: tuple[int, int]          # [start, end) of the real vocabulary rows
    vocab_per_rank: int             # rows of the local embedding / lm_head (padded)
    head_dim: int

    @classmethod
    def build(cls, arch: LlamaArch, rank: int, size: int) -> ShardPlan:
        if arch.num_kv_heads < size:
            raise ValueError(f"EngineConfig.tensor_parallel_size: {size} ranks need at least {size} KV heads, "
                             f"the model has {arch.num_kv_heads}")
        group = arch.num_heads // arch.num_kv_heads
        kv = _split(arch.num_kv_heads, rank, size)
        per_rank = -(-arch.vocab_size // size)
        vocab = (min(rank * per_rank, arch.vocab_size), min((rank + 1) * per_rank, arch.vocab_size))
        return cls(rank, size, kv, (kv[0] * group, kv[1] * group), _split(arch.intermediate_size, rank, size),
                   vocab, per_rank, arch.head_dim)

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, end) of HF weight `name` that this rank holds; None: the whole tensor."""
        d = self.head_dim
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return 0, self.q_heads[0] * d, self.q_heads[1] * d
        if name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                          "self_attn.v_proj.bias")):
            return 0, self.kv_heads[0] * d, self.kv_heads[1] * d
        if name.endswith("self_attn.o_proj.weight"):
            return 1, self.q_heads[0] * d, self.q_heads[1] * d
        if name.endswith(("mlp.gate_proj.weight", "mlp.gate_proj.bias", "mlp.up_proj.weight", "mlp.up_proj.bias")):
            return 0, *self.intermediate
        if name.endswith("mlp.down_proj.weight"):
            return 1, *self.intermediate
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return 0, *self.vocab
        return None

    def shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of the full HF tensor `name` (vocabulary rows padded with zeros to
        vocab_per_rank)."""
        where = self.slice_of(name)
        if where is None:
            return full
        dim, start, end = where
        part = full.narrow(dim, start, end - start)
        if name in ("model.embed_tokens.weight", "lm_head.weight") and end - start < self.vocab_per_rank:
            padded = torch.zeros((self.vocab_per_rank, *full.shape[1:]), dtype=full.dtype, device=full.device)
            padded[: end - start] = part
            return padded
        return part
