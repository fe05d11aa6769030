"""A tiny paged-attention model behind the engine's model seam, for CPU tests of engine logic.

PREFILL / VERIFY queries are computed one at a time over exactly their visible keys (float64), so a
query's result depends only on its position and the cache, never on its window or row (the property
the real attention backend guarantees). DECODE adds a perturbation that depends on the batch size,
standing in for shape-dependent fast-path numerics, so fast-path tokens really do differ with load; so
does a VERIFY pass to the decode rows it carries (AttentionMetadata.carried_rows), never to its verify rows.
"""
from __future__ import annotations

import torch

from engine.attention.kv_cache import KVCache
from engine.attention.metadata import AttentionMetadata, PassKind
from engine.model_runner import ModelShape


class MockModel:
    def __init__(self, vocab: int = 64, hidden: int = 32, head_dim: int = 16, layers: int = 2,
                 seed: int = 0, decode_noise: float = 0.3, max_len: int = 512) -> None:
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
        self.vocab, self.hidden, self.head_dim, self.layers = vocab, hidden, head_dim, layers
        self.emb = r(vocab, hidden)
        self.pos = r(max_len, hidden) * 0.3
        self.wq = [r(hidden, head_dim) / hidden**0.5 for _ in range(layers)]
        self.wk = [r(hidden, head_dim) / hidden**0.5 for _ in range(layers)]
        self.wv = [r(hidden, head_dim) / hidden**0.5 for _ in range(layers)]
        self.wo = [r(head_dim, hidden) / head_dim**0.5 for _ in range(layers)]
        self.head = r(vocab, hidden) * 2.0
        self.decode_noise = decode_noise
        self.shape = ModelShape(num_layers=layers, num_kv_heads=1, head_dim=head_dim, vocab_size=vocab,
                                max_model_len=max_len)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 kv: KVCache) -> torch.Tensor:
        x = self.emb[input_ids] + self.pos[positions]  # [T, H]
        for layer in range(self.layers):
            k_cache = kv.k[layer].view(-1, self.head_dim)  # [slots, D] (one KV head)
            v_cache = kv.v[layer].view(-1, self.head_dim)
            q = x @ self.wq[layer]
            k_cache[meta.slot_mapping] = x @ self.wk[layer]
            v_cache[meta.slot_mapping] = x @ self.wv[layer]
            attn = self._attend(q, k_cache, v_cache, meta, kv.block_size)
            x = x + torch.tanh(attn @ self.wo[layer])
        if meta.kind == PassKind.DECODE:
            rows = meta.num_rows
            x = x + self.decode_noise * (rows % 3) * torch.sin(torch.arange(self.hidden) * 0.7 + rows)
        elif meta.kind == PassKind.VERIFY and meta.carried_rows:  # carried decode rows: fast-path numerics too
            d = meta.carried_rows
            x = x.clone()
            x[-d:] += self.decode_noise * torch.sin(torch.arange(self.hidden) * 0.7 + d)
        return x

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, block_size: int) -> torch.Tensor:
        out = torch.empty_like(q)
        starts = meta.query_start_loc.tolist()
        for r in range(meta.num_rows):
            n = starts[r + 1] - starts[r]
            first = int(meta.seq_lens[r]) - n
            table = meta.block_tables[r].long()
            need = -(-(first + n) // block_size)  # keys past the table read the zero block (padding)
            table = torch.cat([table, table.new_zeros(max(0, need - table.numel()))])
            for i in range(n):
                p = first + i
                keys = torch.arange(p + 1)
                slots = table[keys // block_size] * block_size + keys % block_size
                qi = q[starts[r] + i].double()
                s = (k_cache[slots].double() @ qi) / self.head_dim**0.5
                out[starts[r] + i] = (torch.softmax(s, 0) @ v_cache[slots].double()).float()
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.head.T).float()
