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

# (temperature, top_k, top_p, logprobs): greedy, sampled, tempered, top-k / top-p (host fallback), logprobs
PARAMS = [(0.0, 0, 1.0, None), (1.0, 0, 1.0, None), (0.7, 0, 1.0, 3), (1.3, 0, 1.0, None), (0.0, 0, 1.0, 5),
          (1.0, 40, 1.0, 2), (0.9, 0, 0.8, None), (1.0, 0, 1.0, 0)]
SEEDS = [0, (1 << 64) - 5, 123, 1 << 63, 7, 99, 2**40 + 3, 5]


def _specs() -> list[tuple[SamplingParams, int, int]]:
    return [(SamplingParams(temperature=t, top_k=k, top_p=p, logprobs=lp), SEEDS[i], 7 + 13 * i)
            for i, (t, k, p, lp) in enumerate(PARAMS)]


def _logits(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, vocab, generator=g) * 3
    if n > 4:
        x[4, 100:110] = x[4].max() + 1  # a greedy row with a tie: the first id must win
    return x


def _as_json(results) -> list:
    return [[r.token, r.logprob, sorted((r.top_logprobs or {}).items()) if r.top_logprobs is not None else None]
            for r in results]


def _interpreted_case() -> dict:
    """Runs inside the TRITON_INTERPRET=1 subprocess: the device path on CPU tensors."""
    from engine.kernels.triton_sampler import gumbel_sample, row_key
    from engine.sampling import _sample_rows_device

    vocab = 20000  # 3 splits: a partial last split and chunks wholly past the vocab
    x = _logits(len(PARAMS), vocab)
    specs = _specs()
    together = _sample_rows_device(x, specs, list(range(len(specs))))
    alone = [_sample_rows_device(x, [specs[i]], [i])[0] for i in range(len(specs))]
    perm = list(reversed(range(len(specs))))
    permuted = _sample_rows_device(x, [specs[i] for i in perm], perm)
    # the same row sampled from a bigger, different batch (row ids into a larger logits tensor)
    big = torch.cat([_logits(3, vocab, seed=9), x])
    shifted = _sample_rows_device(big, specs, [i + 3 for i in range(len(specs))])
    keys = torch.tensor([row_key(s, p) for _, s, p in specs[:1]], dtype=torch.int64)
    _, _, lse = gumbel_sample(x, torch.tensor([0]), keys, torch.tensor([0.0], dtype=torch.float64))
    return {"together": _as_json(together), "alone": _as_json(alone), "permuted": _as_json(permuted[::-1]),
            "shifted": _as_json(shifted), "lse0": lse.item()}


def test_interpreted_kernel_matches_host_and_is_batch_invariant() -> None:
    pytest.importorskip("triton")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # bitwise: a row's result never depends on its batch, its index or its neighbours
    assert got["together"] == got["alone"] == got["permuted"] == got["shifted"]
    x = _logits(len(PARAMS), 20000)
    host = _as_json([sample_row(x[i].numpy(), p, s, pos) for i, (p, s, pos) in enumerate(_specs())])
    for i, (dev, ref) in enumerate(zip(got["together"], host)):
        assert dev[0] == ref[0], f"row {i}: token {dev[0]} != host {ref[0]}"
        assert abs(dev[1] - ref[1]) <= 4 * np.spacing(np.float32(abs(ref[1]))), (i, dev[1], ref[1])
        if ref[2] is None:
            assert dev[2] is None, i
        else:
            assert [k for k, _ in dev[2]] == [k for k, _ in ref[2]], i
            assert all(abs(a[1] - b[1]) <= 1e-5 for a, b in zip(dev[2], ref[2])), i
    assert host[4][0] == 100  # the greedy tie went to the first id
    x64 = x[0].double()
    assert abs(got["lse0"] - torch.logsumexp(x64, 0).item()) < 1e-9


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
    print(json.dumps(_interpreted_case()))
