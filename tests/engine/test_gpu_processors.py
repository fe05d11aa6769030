"""Logits processors on CUDA (SmolLM2, bfloat16, the CUDA defaults: overlap, chained verify, early decode,
packed verify passes, the device sampler): the device steps equal the specification's float32 arithmetic bit
for bit, masked ids never come out of the device sampler, and the CPU suite's determinism, replay and
constrained-output tests run on the device path."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine.grammar import GrammarSpec, GrammarState, compile_grammar, tokenizer_info
from engine.processors import MaskStaging, Slot, apply_processors
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


def test_staged_masks_equal_the_host_path_step_after_step(smollm2_source) -> None:
    """Grammar masks through the reused pinned buffers (MaskStaging) equal the CPU path's: steps queued behind a
    busy stream, so a buffer's copy is still waiting when its slot comes round again, rows out of order, and one
    call of more slots than a bitmask row holds row indices."""
    tok = smollm2_source.tokenizer
    info = tokenizer_info(tok, 49152, smollm2_source.info.eos_token_ids)
    spec = GrammarSpec("json_schema", json.dumps(unit.PERSON))
    compiled = compile_grammar(spec, info)
    eos = min(smollm2_source.info.eos_token_ids)
    texts = ['{"name": "Ada", "age": 36}', '{"name": "Grace Hopper", "age": 85}', '{"name": "x", "age": 7}']
    outs = [list(tok.encode(t, add_special_tokens=False)) + [eos] for t in texts]
    steps = max(map(len, outs)) + 2
    outs = [(o + [eos] * steps)[:steps] for o in outs]  # held past the stop, as under ignore_eos
    params = SamplingParams(grammar=spec)
    rows = [5, 0, 9]
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(12, 49152, generator=g) for _ in range(steps)]
    devs = [x.cuda() for x in xs]
    torch.cuda.synchronize()
    on_dev = [GrammarState(compiled, info) for _ in outs]
    on_host = [GrammarState(compiled, info) for _ in outs]
    assert steps > MaskStaging.SLOTS
    for n, (x, dev) in enumerate(zip(xs, devs)):
        torch.cuda._sleep(5_000_000)  # the copies below wait behind it
        apply_processors(dev, rows, [Slot(params, [1], o, n, s, n) for o, s in zip(outs, on_dev)])
        apply_processors(x, rows, [Slot(params, [1], o, n, s, n) for o, s in zip(outs, on_host)])
    for n, (x, dev) in enumerate(zip(xs, devs)):
        assert torch.equal(dev.cpu(), x), n
    k = info.words + 7  # a verify-like call: every prefix of each row, more slots than a row of indices
    order = list(range(k))
    random.Random(3).shuffle(order)
    slots = [(order[i], i % len(outs), i // len(outs) % steps) for i in range(k)]
    x = torch.randn(k, 49152, generator=g)
    dev = x.cuda()
    for logits in (dev, x):
        states = [GrammarState(compiled, info) for _ in outs]
        apply_processors(logits, [r for r, _, _ in slots],
                         [Slot(params, [1], outs[j], n, states[j]) for _, j, n in slots])
    assert torch.equal(dev.cpu(), x)
