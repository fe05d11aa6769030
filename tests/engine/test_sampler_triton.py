"""The device sampler (engine.kernels.triton_sampler) against the host sampler, and its invariances.

CPU: the kernels run under the Triton interpreter in a subprocess (TRITON_INTERPRET must be set before
the kernels are defined, and must not leak into GPU tests of the same process).
CUDA (`gpu`): the compiled kernels on the real vocab size, bitwise batch invariance over batch sizes.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.sampling import SamplingParams, sample_row, sample_rows

ROOT = Path(__file__).resolve().parents[2]

VOCAB = 16500  # 3 splits: a partial last split and chunks wholly past the vocab

# (temperature, top_k, top_p, min_p, logprobs) per row; _logits shapes the adversarial rows
PARAMS = [
    (0.0, 0, 1.0, 0.0, None),      # 0 greedy
    (1.0, 0, 1.0, 0.0, None),      # 1 sampled
    (0.7, 0, 1.0, 0.0, 3),         # 2 tempered, logprobs
    (1.3, 0, 1.0, 0.0, None),      # 3
    (0.0, 0, 1.0, 0.0, 5),         # 4 greedy with a tie at the max: the first id wins
    (1.0, 40, 1.0, 0.0, 2),        # 5 top-k
    (0.9, 0, 0.8, 0.0, None),      # 6 top-p
    (1.0, 0, 1.0, 0.0, 0),         # 7 logprobs=0
    (1.0, 0, 0.5, 0.0, 4),         # 8 eight ids tied at the max, the rest without mass: top-p keeps exactly 4
    (1.0, 0, 0.9, 0.0, None),      # 9 one id holds all the mass
    (1.0, 0, 1e-6, 0.0, None),     # 10 top_p = 1e-6: the first id of the order only
    (1.0, 1, 1.0, 0.0, None),      # 11 top_k = 1
    (1.0, VOCAB, 1.0, 0.0, None),  # 12 top_k = vocab: off
    (1.0, 0, 1.0, 1.0, None),      # 13 min_p = 1 with two ids tied at the max
    (0.7, 0, 1.0, 0.1, 2),         # 14 min-p
    (1.0, 40, 0.8, 0.0, None),     # 15 top-k and top-p (top-p over the top-k set)
    (1.0, 50, 1.0, 0.0, None),     # 16 ties straddling the top-k cut
    (1.0, 50, 0.9, 0.05, 3),       # 17 every filter, ties straddling the top-k cut
    (0.0, 5, 0.1, 0.5, None),      # 18 greedy ignores the filters
    (1.0, 0, 0.95, 0.0, None),     # 19 the usual chat setting
    # 20-23: a language model's shape, a few high ids spread over the chunks and the rest far below, so the
    # filter skips most chunks (engine.kernels.triton_sampler_kernels.filter_kernel)
    (1.0, 0, 0.9, 0.0, None),      # 20 top-p
    (1.0, 5, 1.0, 0.0, None),      # 21 top-k
    (0.8, 0, 1.0, 0.2, None),      # 22 min-p
    (1.0, 8, 0.7, 0.0, None),      # 23 top-k and top-p
    # 24-26: two ids on top and 64 just below (four per chunk), so the unfiltered draw mostly falls below the
    # min-p cut and the next candidate is searched chunk by chunk
    (1.0, 0, 1.0, 0.5, None),      # 24 min-p
    (1.0, 0, 1.0, 0.5, None),      # 25 the same, another seed
    (1.0, 0, 0.5, 0.3, 1),         # 26 top-p and min-p
    # 27-28: a grammar mask (engine.processors) left most ids at -inf, whole chunks of them
    (1.0, 0, 0.9, 0.1, 3),         # 27 top-p and min-p
    (1.0, 3, 0.8, 0.0, None),      # 28 top-k and top-p
]
SEEDS = [0, (1 << 64) - 5, 123, 1 << 63, 7, 99, 2**40 + 3, 5, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22,
         23, 24, 25, 26, 27, 28, 29, 30, 31]


def _specs() -> list[tuple[SamplingParams, int, int]]:
    return [(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, logprobs=lp), SEEDS[i], 7 + 13 * i)
            for i, (t, k, p, m, lp) in enumerate(PARAMS)]


def _logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 3
    if n == len(PARAMS):
        x[4, 100:110] = x[4].max() + 1
        x[8] = -1e4
        x[8, 300:308] = 2.0
        x[9, 7] = 100.0
        x[13, 3] = x[13, 9] = x[13].max() + 0.5
        for r in (16, 17):  # the 45th..54th largest values made equal: the cut at 50 falls inside the tie
            order = torch.argsort(x[r], descending=True, stable=True)
            x[r, order[44:54]] = x[r, order[44]].item()
        for r in (20, 21, 22, 23):  # 12 high ids, one in every other 1024-id chunk, two of them tied
            x[r] = x[r] / 3 - 12.0
            high = torch.arange(12) * 1400 + 3 * r
            x[r, high] = torch.linspace(6.0, 0.0, 12)
            x[r, high[5]] = x[r, high[4]].item()
        for r in (24, 25, 26):
            x[r] = x[r] / 3 - 12.0
            x[r, torch.arange(64) * 256 + 5 * r] = 3.5
            x[r, [1030, 9000]] = 5.0
        for r in (27, 28):
            keep = x[r, [5, 6, 1500, 1501, 9000, 16400]].clone()
            x[r] = -float("inf")
            x[r, [5, 6, 1500, 1501, 9000, 16400]] = keep
    return x


def _as_json(results) -> list:
    return [[r.token, r.logprob, sorted((r.top_logprobs or {}).items()) if r.top_logprobs is not None else None]
            for r in results]


def _device(x: torch.Tensor, specs, rows) -> list:
    from engine.sampling import _launch_device

    return _launch_device(x, specs, rows).results()


def _interpreted_case() -> dict:
    """Runs inside the TRITON_INTERPRET=1 subprocess: the device path on CPU tensors."""
    from engine.kernels.triton_sampler import gumbel_sample, row_key

    x = _logits(len(PARAMS), VOCAB)
    specs = _specs()
    together = _device(x, specs, list(range(len(specs))))
    alone = [_device(x, [specs[i]], [i])[0] for i in range(len(specs))]
    # the same rows in reverse order, taken from a bigger logits tensor (other row ids, other neighbours)
    perm = list(reversed(range(len(specs))))
    big = torch.cat([_logits(3, VOCAB, seed=9), x])
    permuted = _device(big, [specs[i] for i in perm], [i + 3 for i in perm])
    keys = torch.tensor([row_key(s, p) for _, s, p in specs[:1]], dtype=torch.int64)
    _, _, lse = gumbel_sample(x, torch.tensor([0]), keys, torch.tensor([0.0], dtype=torch.float64))
    return {"together": _as_json(together), "alone": _as_json(alone), "permuted": _as_json(permuted[::-1]),
            "lse0": lse.item()}


@pytest.mark.slow
def test_interpreted_kernel_matches_host_and_is_batch_invariant() -> None:
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # bitwise: a row's result never depends on its batch, its index or its neighbours
    assert got["together"] == got["alone"] == got["permuted"]
    x = _logits(len(PARAMS), VOCAB)
    host = _as_json([sample_row(x[i].numpy(), p, s, pos) for i, (p, s, pos) in enumerate(_specs())])
    for i, (dev, ref) in enumerate(zip(got["together"], host)):
        assert dev[0] == ref[0], f"row {i} {PARAMS[i]}: token {dev[0]} != host {ref[0]}"
        assert abs(dev[1] - ref[1]) <= 4 * np.spacing(np.float32(abs(ref[1]))), (i, dev[1], ref[1])
        if ref[2] is None:
            assert dev[2] is None, i
        else:
            assert [k for k, _ in dev[2]] == [k for k, _ in ref[2]], i
            assert all(abs(a[1] - b[1]) <= 1e-5 for a, b in zip(dev[2], ref[2])), i
    assert host[4][0] == 100  # the greedy tie went to the first id
    assert 300 <= host[8][0] < 304  # top-p kept exactly the 4 lowest ids of the 8 tied
    assert host[9][0] == 7 and host[10][0] == int(x[10].argmax()) and host[11][0] == int(x[11].argmax())
    assert host[13][0] in (3, 9)
    assert host[18][0] == int(x[18].argmax())
    x64 = x[0].double()
    assert abs(got["lse0"] - torch.logsumexp(x64, 0).item()) < 1e-9


def test_host_filters_follow_the_specification() -> None:
    """The host masks on the adversarial rows, checked against a direct reading of the specification."""
    from engine.sampling import keep_mask

    x = _logits(len(PARAMS), VOCAB).double().numpy()
    for i, (t, k, p, m, _) in enumerate(PARAMS):
        if t == 0:
            continue
        s = x[i] / t
        order = sorted(range(VOCAB), key=lambda j: (-s[j], j))
        topk = order[: k if 0 < k < VOCAB else VOCAB]
        w = np.exp(s - s.max())
        total = sum(w[j] for j in topk)
        kept, before = [], 0.0
        for j in topk:
            if p < 1 and not before < p * total:
                break
            kept.append(j)
            before += w[j]
        if m > 0:
            kept = [j for j in kept if s[j] - s.max() >= np.log(m)]
        assert sorted(np.flatnonzero(keep_mask(s, k, p, m)).tolist()) == sorted(kept), f"row {i} {PARAMS[i]}"


def test_min_p_is_validated() -> None:
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match=r"min_p: must be in \[0, 1\]"):
            SamplingParams(min_p=bad).validate()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_bitwise_batch_invariant_and_agrees_with_host() -> None:
    vocab, n = 128256, 512
    x = (torch.randn(n, vocab, generator=torch.Generator().manual_seed(3)) * 4).cuda()
    base = _specs()
    specs = [(base[i % len(base)][0], (i * 2654435761) % (1 << 64), 5 + i) for i in range(n)]
    full = sample_rows(x, specs)
    for size in (1, 2, 7, 64, 256, 511):
        sub = sample_rows(x, specs[:size], list(range(size)))
        assert _as_json(sub) == _as_json(full[:size]), f"batch {size} differs from the batch of {n}"
    rev = sample_rows(x, specs[::-1], list(range(n))[::-1])
    assert _as_json(rev[::-1]) == _as_json(full)
    again = sample_rows(x, specs)
    assert _as_json(again) == _as_json(full)  # run to run
    host = x[:64].cpu()
    for i in range(64):
        p, s, pos = specs[i]
        ref = sample_row(host[i].numpy(), p, s, pos)
        assert full[i].token == ref.token, i
        assert abs(full[i].logprob - ref.logprob) <= 1e-5, i


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_bf16_logits_and_row_ids() -> None:
    x = (torch.randn(16, 50000, generator=torch.Generator().manual_seed(4)) * 2).cuda()
    specs = [(SamplingParams(temperature=1.0), 11 + i, 3) for i in range(4)]
    a = sample_rows(x.bfloat16(), specs, [1, 5, 9, 13])
    b = sample_rows(x.bfloat16().float()[[1, 5, 9, 13]], specs)
    assert _as_json(a) == _as_json(b)


if __name__ == "__main__":  # the interpreter subprocess of the CPU test
    from triton.runtime import interpreter

    from tests.engine.test_canonical_decode import patch_lang_once

    interpreter._patch_lang = patch_lang_once(interpreter._patch_lang)
    print(json.dumps(_interpreted_case()))
