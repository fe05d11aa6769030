"""Counter-based noise (DESIGN §2): a pure function of (seed, absolute position, vocab id), no generator state.

A splitmix64-style hash of the seed, mixed with the position, gives a per-(seed, position) key; the key mixed
with a vocab id gives 64 bits, whose top 53 become a uniform u in the open interval (0, 1), and
g = -log(-log(u)) a Gumbel draw in float64. The host sampler (engine.sampling) and the device sampler
(engine.kernels.triton_sampler) take their keys from here, so both draw the same noise for the same slot.
"""
from __future__ import annotations

import numpy as np

_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 output function on uint64 arrays (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        return _mix(x + _GAMMA)


def noise_keys(seeds: list[int], positions: list[int]) -> np.ndarray:
    """The per-(seed, position) keys every vocab id's noise is hashed from, for many rows at once: uint64[N]."""
    with np.errstate(over="ignore"):
        return splitmix64(splitmix64(np.array(seeds, dtype=np.uint64)) ^ np.array(positions, dtype=np.uint64))


def noise_key(seed: int, position: int) -> np.ndarray:
    """One row's key (noise_keys of one row): uint64 array of shape [1]."""
    return noise_keys([seed], [position])


def uniform(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """u(seed, position, v) for v in [0, vocab): float64 in the open interval (0, 1). Shape [vocab]."""
    with np.errstate(over="ignore"):
        bits = splitmix64(noise_key(seed, position) ^ np.arange(vocab_size, dtype=np.uint64))
    return ((bits >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0 ** -53)


def gumbel(seed: int, position: int, vocab_size: int) -> np.ndarray:
    return -np.log(-np.log(uniform(seed, position, vocab_size)))
