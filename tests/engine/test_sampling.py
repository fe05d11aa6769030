"""Counter-based sampler: purity, greedy tie-break, masks, and a statistical check of the distribution."""
from __future__ import annotations

import math

import numpy as np
import pytest

from engine.noise import uniform
from engine.sampling import SAMPLER_ID, SamplingParams, keep_mask, sample_row

# chi-square critical values at p = 1e-6, by degrees of freedom: a correct sampler fails a random seed
# with probability 1e-6 (the false-alarm rate); with the fixed seeds below the outcome is fixed.
# (2 dof: -2 ln 1e-6; 3 dof: the root of erfc(sqrt(x/2)) + sqrt(2x/pi) exp(-x/2) = 1e-6.)
CHI2_P1E6 = {2: 27.63, 3: 30.66}


def _logits(probs: list[float]) -> np.ndarray:
    return np.log(np.array(probs, dtype=np.float64)).astype(np.float32)


def test_sampler_id_is_named() -> None:
    assert SAMPLER_ID == "verbatim-gumbel-splitmix64-v1"


def test_same_seed_and_position_same_token() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(1000).astype(np.float32)
    p = SamplingParams(temperature=0.9, top_p=0.95, top_k=50)
    a = [sample_row(logits, p, seed=42, position=i).token for i in range(64)]
    b = [sample_row(logits.copy(), p, seed=42, position=i).token for i in range(64)]
    c = [sample_row(logits, p, seed=43, position=i).token for i in range(64)]
    assert a == b
    assert a != c  # a different seed draws different noise


def test_uniform_in_open_interval_and_pure() -> None:
    u = uniform(2**64 - 1, 7, 50000)
    assert u.min() > 0.0 and u.max() < 1.0
    assert np.array_equal(u, uniform(2**64 - 1, 7, 50000))
    assert not np.array_equal(u, uniform(2**64 - 1, 8, 50000))


def test_greedy_is_argmax_with_first_index_tie_break() -> None:
    logits = np.array([0.5, 2.0, 2.0, -1.0, 2.0], dtype=np.float32)
    res = sample_row(logits, SamplingParams(temperature=0.0), seed=1, position=3)
    assert res.token == 1
    assert res.logprob == float(np.float32(logits[1] - np.log(np.exp(logits.astype(np.float64)).sum())))


def test_top_k_and_top_p_masks() -> None:
    scaled = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    assert keep_mask(scaled, top_k=2, top_p=1.0).tolist() == [False, True, False, True]
    # mass strictly above: 0.4 -> 0, 0.3 -> 0.4, 0.2 -> 0.7: top_p = 0.6 keeps the first two
    assert keep_mask(scaled, top_k=0, top_p=0.6).tolist() == [False, True, False, True]
    assert keep_mask(scaled, top_k=0, top_p=0.01).tolist() == [False, True, False, False]
    tie = np.array([1.0, 3.0, 3.0, 0.0])
    assert keep_mask(tie, top_k=1, top_p=1.0).tolist() == [False, True, False, False]
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3])).astype(np.float32)
    drawn = {sample_row(logits, SamplingParams(top_k=2), 5, i).token for i in range(400)}
    assert drawn == {1, 3}


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature,top_k,seed", [(1.0, 0, 11), (0.5, 0, 12), (1.0, 3, 13)])
def test_sampled_frequencies_match_distribution(temperature: float, top_k: int, seed: int) -> None:
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = _logits(probs.tolist())
    target = np.exp(logits.astype(np.float64) / temperature)
    if top_k:
        target[np.argsort(-target, kind="stable")[top_k:]] = 0.0
    target /= target.sum()
    n = 20000
    params = SamplingParams(temperature=temperature, top_k=top_k)
    tokens = [sample_row(logits, params, seed, pos).token for pos in range(n)]
    counts = np.bincount(tokens, minlength=4).astype(np.float64)
    kept = target > 0
    assert counts[~kept].sum() == 0
    dof = int(kept.sum()) - 1
    stat = _chi2(counts[kept], target[kept])
    assert stat < CHI2_P1E6[dof], (stat, dof, counts, target)
    assert math.isfinite(stat)


def _full_sort_mask(scaled: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """Reference: the definition of keep_mask with one full stable sort."""
    v = len(scaled)
    order = np.argsort(-scaled, kind="stable")
    n = v if top_k == 0 else min(top_k, v)
    keep = np.zeros(v, dtype=bool)
    if top_p >= 1.0:
        keep[order[:n]] = True
        return keep
    w = np.exp(scaled - scaled.max())
    in_k = np.zeros(v, dtype=bool)
    in_k[order[:n]] = True
    probs = w[order[:n]] / (w[in_k].sum() if top_k else w.sum())
    keep[order[: max(int(np.count_nonzero(np.cumsum(probs) - probs < top_p)), 1)]] = True
    return keep


def test_partial_sort_masks_equal_full_sort() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        v = int(rng.integers(2, 3000))
        scaled = np.round(rng.standard_normal(v) * rng.choice([0.1, 1.0, 5.0]), 1)  # many ties
        k, p = int(rng.choice([0, 1, 5, 50, 5000])), float(rng.choice([1.0, 0.01, 0.5, 0.9, 0.999]))
        assert np.array_equal(keep_mask(scaled, k, p), _full_sort_mask(scaled, k, p)), (v, k, p)


def test_noise_keys_of_many_rows_equal_each_rows_key() -> None:
    """The device sampler hashes all rows' keys in one call: each must be that row's noise_key, seeds over
    the whole uint64 range included."""
    from engine.noise import noise_key, noise_keys

    rng = np.random.default_rng(3)
    seeds = [int(x) for x in rng.integers(0, 2**63, 50)] + [0, 2**63, 2**64 - 1]
    positions = [int(x) for x in rng.integers(0, 10**6, len(seeds))]
    keys = noise_keys(seeds, positions)
    assert keys.dtype == np.uint64 and keys.shape == (len(seeds),)
    assert [int(k) for k in keys] == [int(noise_key(s, p)[0]) for s, p in zip(seeds, positions)]
    assert len(set(keys.tolist())) == len(seeds)
