"""Rotary position embedding as a table indexed by absolute position.

A table makes cos/sin a pure function of the position: computed on the fly, the same position
could fall in a vectorised body or a scalar tail of an elementwise kernel and round differently.
Applying it is an op (`ops.rope`: torch on the CPU, one Triton launch for q and k on CUDA).
"""
from __future__ import annotations

import math

import torch

from engine.models.arch import RopeSpec


def inv_frequencies(spec: RopeSpec, head_dim: int) -> torch.Tensor:
    """float32 [head_dim // 2], as transformers computes them for the "default"/"linear"/"llama3" types."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (spec.theta**exponents)
    if spec.rope_type == "linear":
        return inv_freq / spec.factor
    if spec.rope_type == "llama3":
        return _llama3_scaling(inv_freq, spec)
    return inv_freq


def _llama3_scaling(inv_freq: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    old_len = spec.original_max_position_embeddings
    low_wavelen = old_len / spec.low_freq_factor
    high_wavelen = old_len / spec.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / spec.factor, inv_freq)
    smooth = (old_len / wavelen - spec.low_freq_factor) / (spec.high_freq_factor - spec.low_freq_factor)
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_table(spec: RopeSpec, head_dim: int, max_positions: int, device: torch.device | str) -> torch.Tensor:
    """float32 [max_positions, 2, head_dim]: cos and sin of position * inv_freq, halves repeated."""
    inv_freq = inv_frequencies(spec, head_dim).to(device)
    freqs = torch.arange(max_positions, device=device).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # [P, head_dim]
    return torch.stack((emb.cos(), emb.sin()), dim=1)

