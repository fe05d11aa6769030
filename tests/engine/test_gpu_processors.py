"""Logits processors on CUDA (SmolLM2, bfloat16, the CUDA defaults: overlap, chained verify, early decode,
packed verify passes, the device sampler): the device steps equal the specification's float32 arithmetic bit
for bit, masked ids never come out of the device sampler, and the CPU suite's determinism, replay and
constrained-output tests run on the device path."""
from __future__ import annotations

import random

import pytest
import torch

from engine.processors import Slot, apply_processors
from engine.sampling import SamplingParams, sample_rows, sample_rows_deferred
from tests.engine import test_processors as unit
from tests.engine import test_processors_real as cpu
from tests.engine.test_gpu_dvr import make_real_llm, smollm2_model, smollm2_source  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

for _name in ("workload", "reference", "test_constrained_outputs_parse_and_validate", "test_alone_equals_batched",
              "test_among_processed_co_traffic_with_faults_and_overlap", "test_replay_matches",
              "test_logit_bias_forces_a_token", "test_tagged_call_when_forced", "test_engine_names_the_field"):
    globals()[_name] = getattr(cpu, _name)


def test_device_processing_equals_the_host_bit_for_bit() -> None:
    rng = random.Random(2)
    logits = torch.randn(16, unit.VOCAB, generator=torch.Generator().manual_seed(4)) * 5
    slots = [Slot(unit.random_params(rng), [rng.randrange(unit.VOCAB) for _ in range(20)],
                  [rng.randrange(30) for _ in range(25)], 25) for _ in range(16)]
    host, dev = logits.clone(), logits.cuda()
    apply_processors(host, list(range(16)), slots)
    apply_processors(dev, list(range(16)), slots)
    assert torch.equal(dev.cpu(), host)


def test_the_device_sampler_never_picks_a_masked_id() -> None:
    """-inf logits (a grammar mask) through the device sampler, every parameter: the token is an allowed id,
    the top logprobs list allowed ids only, and the deferred path agrees."""
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(8, 50_000, generator=g) * 4
    allowed = [sorted(random.Random(r).sample(range(50_000), 3 + r)) for r in range(8)]
    for r, ids in enumerate(allowed):
        keep = torch.full((50_000,), float("-inf"))
        keep[ids] = 0.0
        logits[r] += keep
    logits = logits.cuda()
    specs = [(SamplingParams(temperature=0.0 if r % 2 else 0.9, top_p=0.9 if r % 3 == 0 else 1.0,
                             top_k=5 if r % 4 == 1 else 0, logprobs=6), 10 + r, 3 + r) for r in range(8)]
    res = sample_rows(logits, specs)
    for r, out in enumerate(res):
        assert out.token in allowed[r] and out.logprob > float("-inf")
        assert out.top_logprobs is not None and set(out.top_logprobs) <= set(allowed[r])
        assert len(out.top_logprobs) == min(6, len(allowed[r]))
    assert sample_rows_deferred(logits, specs).results() == res
