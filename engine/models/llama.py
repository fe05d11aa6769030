"""Own forward for the Llama family (Llama, SmolLM2, Qwen2 qkv bias, Qwen3 q/k norm) over a paged KV cache.

Module and parameter names mirror transformers', except that projections reading the same input are
fused into one GEMM: `self_attn.qkv_proj` holds q_proj, k_proj, v_proj (weights, and biases for Qwen2)
stacked along the output dim, `mlp.gate_up_proj` holds gate_proj and up_proj. `hf_weights()` maps every
HF name to its tensor (a row view of a fused weight), so an HF state dict still loads by name.
Every GEMM (qkv/o, gate_up/down, lm_head), every RMSNorm (the residual add fused into it), RoPE and the
SwiGLU go through the model's `ops`
(engine.kernels: TORCH_OPS by default, BatchInvariantOps for mode="batch_invariant"), handed down as a
forward argument; attention goes through the model's attention backend. `with_numerics` gives a view
that shares the weights but runs other ops / attention.

Tensor parallel (`tp`, engine.parallel): each rank builds the layers at its shard's sizes
(engine.models.sharding: its KV heads and their query heads, its part of the MLP and of the vocabulary),
`load_weights` takes the full HF tensors and keeps the rank's slices, o_proj and down_proj reduce their
partial sums through `tp.all_reduce` (then add their bias), the embedding sums the ranks' lookups and
`compute_logits` gathers the vocabulary columns, so every rank sees full rows. Without `tp` none of this
runs.
"""
from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from engine.attention import AttentionBackend, AttentionMetadata, KVCache
from engine.config import KernelSettings
from engine.kernels import TORCH_OPS, Ops
from engine.models.arch import LlamaArch
from engine.models.rope import rope_table
from engine.models.sharding import ShardPlan

if TYPE_CHECKING:
    from engine.parallel import TensorParallel

_IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)


def _linear(ops: Ops, layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return ops.linear(x, layer.weight, layer.bias)


def _row_linear(ops: Ops, layer: nn.Linear, x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """A row-parallel projection: this rank's partial sums, reduced over the ranks, then the bias once.
    Under chunked ops (ChunkedOps, a chunked canonical prefill pass) the local GEMM runs in its C-row slices;
    NCCL past two ranks also reduces slice by slice, its summation order following the message size."""
    if tp is None:
        return ops.linear(x, layer.weight, layer.bias)
    partial = ops.linear(x, layer.weight, None)  # [T, H], this rank's partial sums
    chunk = getattr(ops, "chunk_rows", None)
    if chunk is None or tp.reduction != "nccl" or tp.size <= 2 or partial.shape[0] <= chunk:
        out = tp.all_reduce(partial)
    else:
        out = torch.cat([tp.all_reduce(partial[i: i + chunk]) for i in range(0, partial.shape[0], chunk)])
    return out if layer.bias is None else out + layer.bias


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        # normalised in float32, scaled in the model dtype (as transformers does)
        return ops.rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor, ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual): the residual add fused into the norm."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)


class FusedLinear(nn.Linear):
    """One GEMM for several HF projections of the same input: their weights (and biases) stacked along
    the output dim, in `parts` order. The output splits back into the parts with views."""

    def __init__(self, in_features: int, parts: dict[str, int], bias: bool, dtype: torch.dtype) -> None:
        super().__init__(in_features, sum(parts.values()), bias=bias, dtype=dtype)
        self.parts = dict(parts)  # HF projection name -> its output features

    def split(self, out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """[..., sum(parts)] -> one view [..., part] per part."""
        return out.split(list(self.parts.values()), dim=-1)

    def part_views(self, param: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF projection name, row view of `param`) for a weight [N, K] or bias [N] of this module."""
        return zip(self.parts, param.split(list(self.parts.values()), dim=0), strict=True)


class Attention(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype, shard: ShardPlan | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        heads, kv_heads = (arch.num_heads, arch.num_kv_heads) if shard is None else (shard.num_heads,
                                                                                      shard.num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim, self.tp = heads, kv_heads, d, tp
        self.scale = d**-0.5
        parts = {"q_proj": heads * d, "k_proj": kv_heads * d, "v_proj": kv_heads * d}
        self.qkv_proj = FusedLinear(h, parts, bias=arch.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(heads * d, h, bias=arch.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None
        self.k_norm = RMSNorm(d, arch.rms_norm_eps, dtype) if arch.qk_norm else None

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: torch.Tensor,  # [T, 2, D]: cos, sin of each token's position, in the model dtype
        plan: Any,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        ops: Ops,
    ) -> torch.Tensor:  # [T, H]
        t = x.shape[0]
        q, k, v = self.qkv_proj.split(_linear(ops, self.qkv_proj, x))  # views of one [T, (Hq + 2 Hkv) * D]
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q, ops), self.k_norm(k, ops)
        # RoPE inside the attention launch (a decode step of split-KV rows on the triton backend), when the
        # ops' RoPE is the Triton kernel whose arithmetic the backend repeats there
        forward_rope = getattr(backend, "forward_rope", None)
        in_attention = forward_rope is not None and getattr(ops, "triton_rope", None) is not None \
            and ops.triton_rope(q)
        out = forward_rope(q, k, v, cos_sin, k_cache, v_cache, plan, self.scale) if in_attention else None
        if out is None:
            out = self._rope_then_attend(q, k, v, cos_sin, plan, k_cache, v_cache, backend, ops)
        return _row_linear(ops, self.o_proj, out.reshape(t, self.num_heads * self.head_dim), self.tp)

    def _rope_then_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor, plan: Any,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, backend: AttentionBackend, ops: Ops
                          ) -> torch.Tensor:  # [T, Hq, D]
        # RoPE that also writes K/V into the cache (one launch instead of rope + two index_copy_), when the
        # ops offer it for these tensors and the backend accepts K/V already written
        rope_write_kv = getattr(ops, "rope_write_kv", None) if getattr(backend, "kv_prewritten", False) else None
        q_rot = None if rope_write_kv is None else rope_write_kv(q, k, v, cos_sin, k_cache, v_cache,
                                                                 plan.slot_mapping)
        if q_rot is not None:
            return backend.forward(q_rot, None, None, k_cache, v_cache, plan, self.scale)
        q, k = ops.rope(q, k, cos_sin)
        return backend.forward(q, k, v, k_cache, v_cache, plan, self.scale)


class MLP(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype, shard: ShardPlan | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        h, b = arch.hidden_size, arch.mlp_bias
        i = arch.intermediate_size if shard is None else shard.intermediate_size
        self.gate_up_proj = FusedLinear(h, {"gate_proj": i, "up_proj": i}, bias=b, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=b, dtype=dtype)
        self.tp = tp

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:  # x [T, H]
        gate, up = self.gate_up_proj.split(_linear(ops, self.gate_up_proj, x))  # [T, I] views of [T, 2I]
        return _row_linear(ops, self.down_proj, ops.silu_mul(gate, up), self.tp)  # [T, H]


class DecoderLayer(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype, shard: ShardPlan | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(arch, dtype, shard, tp)
        self.mlp = MLP(arch, dtype, shard, tp)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]: the previous layer's MLP output, or the embeddings (residual None)
        residual: torch.Tensor | None,  # [T, H]: the residual stream before x is added
        cos_sin: torch.Tensor,
        plan: Any,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        backend: AttentionBackend,
        ops: Ops,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (MLP output, residual stream before it), [T, H] each
        if residual is None:
            h, residual = self.input_layernorm(x, ops), x
        else:
            h, residual = self.input_layernorm.add(x, residual, ops)
        h = self.self_attn(h, cos_sin, plan, k_cache, v_cache, backend, ops)
        h, residual = self.post_attention_layernorm.add(h, residual, ops)
        return self.mlp(h, ops), residual


class LlamaModel(nn.Module):
    def __init__(self, arch: LlamaArch, dtype: torch.dtype, shard: ShardPlan | None = None,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        vocab = arch.vocab_size if shard is None else shard.vocab_per_rank
        self.embed_tokens = nn.Embedding(vocab, arch.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(arch, dtype, shard, tp) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """model(input_ids[T], positions[T], meta, kv) -> hidden [T, H]; compute_logits -> float32 [N, vocab]."""

    def __init__(self, arch: LlamaArch, dtype: torch.dtype, backend: AttentionBackend, ops: Ops = TORCH_OPS,
                 tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.arch, self.dtype, self.attention, self.ops = arch, dtype, backend, ops
        self.tp = tp
        self.shard = None if tp is None else ShardPlan.build(arch, tp.rank, tp.size)
        self.model = LlamaModel(arch, dtype, self.shard, tp)
        vocab = arch.vocab_size if self.shard is None else self.shard.vocab_per_rank
        self.lm_head = nn.Linear(arch.hidden_size, vocab, bias=False, dtype=dtype)
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

    def with_kernels(self, kernels: KernelSettings) -> LlamaForCausalLM:
        """This model with its attention's Triton kernels launched under `kernels`: itself where they already
        are, else a weight-sharing view (with_numerics)."""
        attention = self.attention.with_kernels(kernels)
        return self if attention is self.attention else self.with_numerics(self.ops, attention)

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
        x, residual = self._embed(input_ids), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos_sin, plan, kv.k[i], kv.v[i], self.attention, self.ops)
        return self.model.norm.add(x, residual, self.ops)[0]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T, H]
        if self.shard is None or self.tp is None:
            return self.model.embed_tokens(input_ids)
        # vocabulary parallel: each rank looks up the ids in its rows, zeros for the others; the sum over
        # the ranks adds one row to zeros, so it is exact whatever the reduction
        start, end = self.shard.vocab
        mine = (input_ids >= start) & (input_ids < end)
        rows = self.model.embed_tokens(torch.where(mine, input_ids - start, 0))
        return self.tp.all_reduce(torch.where(mine.unsqueeze(1), rows, 0.0))

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 [N, vocab]. For invariant logits keep N fixed (e.g. all G*W rows)."""
        logits = _linear(self.ops, self.lm_head, hidden)
        if self.tp is not None:  # [N, vocab_per_rank] per rank, gathered in the model dtype (the cast is exact)
            logits = self.tp.gather_columns(logits, self.arch.vocab_size)
        return logits.float()

    @property
    def num_kv_heads(self) -> int:
        """KV heads this model's cache holds (its shard's under tensor parallelism)."""
        return self.arch.num_kv_heads if self.shard is None else self.shard.num_kv_heads

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> KVCache:
        a = self.arch
        return KVCache.allocate(
            a.num_layers, num_blocks, block_size, self.num_kv_heads, a.head_dim, self.dtype, self.device
        )

    def hf_weights(self) -> dict[str, torch.Tensor]:
        """HF name -> the parameter, or the row view of a fused one, that holds it; parameter order
        (a fused weight expands into its parts in place), tied weights once (lm_head absent when tied)."""
        out: dict[str, torch.Tensor] = {}
        for name, param in self.named_parameters():  # torch drops the second name of a tied weight
            module_name, kind = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, FusedLinear):
                parent = module_name.rsplit(".", 1)[0]
                out.update((f"{parent}.{part}.{kind}", view) for part, view in module.part_views(param))
            else:
                out[name] = param
        return out

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (cast to the model dtype); ValueError on unknown, misshaped or missing.
        Under tensor parallelism the tensors are the full ones; the rank keeps its slice (ShardPlan)."""
        params = self.hf_weights()
        tied = self.arch.tie_word_embeddings
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_WEIGHTS) or (tied and name == "lm_head.weight"):
                continue
            if name not in params:
                raise ValueError(f"model: unexpected weight {name!r} for {self.arch.architecture}")
            if self.shard is not None:
                tensor = self._shard_of(name, tensor)
            if tuple(tensor.shape) != tuple(params[name].shape):
                expected = tuple(params[name].shape)
                raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
            params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded - ({"lm_head.weight"} if tied else set()))
        if missing:
            raise ValueError(f"model: {len(missing)} weights missing, first: {missing[:5]}")

    def _shard_of(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of the full HF tensor `name`; ValueError when the full tensor is misshaped."""
        assert self.shard is not None
        where = self.shard.slice_of(name)
        if where is not None:
            dim, _, _ = where
            full = self._full_sizes(name)
            if tensor.dim() <= dim or tensor.shape[dim] != full:
                raise ValueError(f"model: weight {name!r} has shape {tuple(tensor.shape)}, expected {full} "
                                 f"along dim {dim}")
        return self.shard.shard(name, tensor)

    def _full_sizes(self, name: str) -> int:
        """The unsharded size of HF tensor `name` along its sharded dim."""
        a = self.arch
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return a.vocab_size
        if ".q_proj." in name or name.endswith("o_proj.weight"):
            return a.num_heads * a.head_dim
        if ".k_proj." in name or ".v_proj." in name:
            return a.num_kv_heads * a.head_dim
        return a.intermediate_size
