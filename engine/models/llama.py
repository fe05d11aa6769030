"""Own forward for the Llama family (Llama, SmolLM2, Qwen2 qkv bias, Qwen3 q/k norm) over a paged KV cache.

Module and parameter names mirror transformers', so an HF state dict loads by name.
Every GEMM (q/k/v/o, gate/up/down, lm_head), every RMSNorm and the SwiGLU go through the model's `ops`
(engine.kernels: TORCH_OPS by default, BatchInvariantOps for mode="batch_invariant"), handed down as a
forward argument; attention goes through the model's attention backend. `with_numerics` gives a view
that shares the weights but runs other ops / attention.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, KVCache
from engine.kernels import TORCH_OPS, Ops
from engine.models.arch import LlamaArch
from engine.models.rope import apply_rope, rope_table

_IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)


def _linear(ops: Ops, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return ops.linear(x, layer.weight, layer.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        # normalised in float32, scaled in the model dtype (as transformers does)
        return ops.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, d
        self.scale = d**-0.5
        self.q_proj = nn.Linear(h, arch.num_heads * d, bias=arch.qkv_bias, dtype=dtype)
        self.k_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias, dtype=dtype)
        self.v_proj = nn.Linear(h, arch.num_kv_heads * d, bias=arch.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(arch.num_heads * d, h, bias=arch.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        plan: Any,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        ops: Ops,
    ) -> torch.Tensor:  # [T, H]
        t = x.shape[0]
        q = _linear(ops, self.q_proj, x).view(t, self.num_heads, self.head_dim)
        k = _linear(ops, self.k_proj, x).view(t, self.num_kv_heads, self.head_dim)
        v = _linear(ops, self.v_proj, x).view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = backend.forward(q, k, v, k_cache, v_cache, plan, self.scale)  # [T, Hq, D]
        return _linear(ops, self.o_proj, out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype) -> None:
        super().__init__()
        h, i, b = arch.hidden_size, arch.intermediate_size, arch.mlp_bias
        self.gate_proj = nn.Linear(h, i, bias=b, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=b, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=b, dtype=dtype)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:  # x [T, H]
        gate = _linear(ops, self.gate_proj, x)  # [T, I]
        up = _linear(ops, self.up_proj, x)  # [T, I]
        return _linear(ops, self.down_proj, ops.silu_mul(gate, up))  # [T, H]


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(arch, dtype)
        self.mlp = MLP(arch, dtype)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        plan: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        ops: Ops,
    ) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x, ops), cos, sin, plan, k_cache, v_cache, backend, ops)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x, ops), ops)


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """model(input_ids[T], positions[T], meta, kv) -> hidden [T, H]; compute_logits -> float32 [N, vocab]."""

    def __init__(self, arch: LlamaArch, dtype: torch.dtype, backend: AttentionBackend, ops: Ops = TORCH_OPS
                 ) -> None:
        super().__init__()
        self.arch, self.dtype, self.attention, self.ops = arch, dtype, backend, ops
        self.model = LlamaModel(arch, dtype)
        self.lm_head = nn.Linear(arch.hidden_size, arch.vocab_size, bias=False, dtype=dtype)
        self.register_buffer("rope", torch.empty(0), persistent=False)

    def materialize(self, device: torch.device | str) -> None:
        """Allocate parameters on `device` (built on "meta"), tie lm_head, build the RoPE table."""
        self.to_empty(device=device)
        if self.arch.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = rope_table(self.arch.rope, self.arch.head_dim, self.arch.max_position_embeddings, device)
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def with_numerics(self, ops: Ops, attention: AttentionBackend) -> LlamaForCausalLM:
        """A view sharing every parameter and buffer with this model, running `ops` and `attention`.

        A shallow copy: the module tree (and so the weights) is shared, `ops` and `attention` are plain
        attributes set on the copy only, so this model keeps its own numerics.
        """
        view = copy.copy(self)
        view.ops, view.attention = ops, attention
        return view

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(N, K) of every weight that goes through ops.linear, sorted, without repeats."""
        shapes = {(m.out_features, m.in_features) for m in self.modules() if isinstance(m, nn.Linear)}
        return sorted(shapes)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # Long[T]
        positions: torch.Tensor,  # Long[T], absolute
        meta: AttentionMetadata,
        kv: KVCache,
    ) -> torch.Tensor:  # [T, H]
        plan = self.attention.plan(meta, kv.block_size)
        cos_sin = self.rope.index_select(0, positions).to(self.dtype)  # [T, 2, D]
        cos, sin = cos_sin[:, 0:1], cos_sin[:, 1:2]
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, plan, kv.k[i], kv.v[i], self.attention, self.ops)
        return self.model.norm(x, self.ops)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 [N, vocab]. For invariant logits keep N fixed (e.g. all G*W rows)."""
        return self.ops.linear(hidden, self.lm_head.weight).float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        a = self.arch
        return KVCache.allocate(
            a.num_layers, num_blocks, block_size, a.num_kv_heads, a.head_dim, self.dtype, self.device
        )

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (cast to the model dtype); ValueError on unknown, misshaped or missing."""
        params = dict(self.named_parameters(remove_duplicate=False))
        tied = self.arch.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_WEIGHTS) or (tied and name == "lm_head.weight"):
                continue
            if name not in params:
                raise ValueError(f"model: unexpected weight {name!r} for {self.arch.architecture}")
            if tuple(tensor.shape) != tuple(params[name].shape):
                expected = tuple(params[name].shape)
                raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tied else set()))
        if missing:
            raise ValueError(f"model: {len(missing)} weights missing, first: {missing[:5]}")
