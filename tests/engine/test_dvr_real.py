"""DVR on the real default model (SmolLM2-135M-Instruct, float32, CPU): bitwise determinism under load,
fault injection, window boundaries, preemption, replay. Small W/G keep the suite fast; the defaults W=32,
G=8 and multi-window passes run in test_dvr_real_long.py."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from engine.sampling import SamplingParams
from engine.scheduler import seq_key
from engine.sequence import SeqKind
from tests.engine.dvr_cases import (assert_same, assert_windows_cover, one_at_a_time, record_verify_kinds,
                                    replay_requests, staggered)

TEXTS = [
    "The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
    "Once upon a time, in a small village near the mountains, there lived", "2 + 2 =",
    "Translate to German: good morning", "The quick brown fox", "Explain photosynthesis in one sentence.",
    "def fibonacci(n):", "My favourite colour is", "Q: What is the boiling point of water? A:",
    "In 1969, the first humans", "Roses are red,", "The three laws of robotics are",
    "A recipe for pancakes needs", "import numpy as np\n",
]
SMALL = dict(window=8, group=4)


@pytest.fixture(scope="module")
def workload(smollm2_source):
    tok = smollm2_source.tokenizer
    prompts = [list(tok.encode(t)) for t in TEXTS]
    params = []
    for i in range(len(prompts)):
        sampled = i % 2 == 1
        params.append(SamplingParams(max_tokens=6 + (i * 5) % 11, temperature=0.9 if sampled else 0.0,
                                     top_p=0.9 if i % 4 == 1 else 1.0, top_k=40 if i % 4 == 3 else 0,
                                     seed=1000 + i, deterministic=True, ignore_eos=i % 3 != 0))
    return prompts, params


@pytest.fixture(scope="module")
def reference(make_real_llm, workload):
    """All 16 at once, fault-free (b)."""
    prompts, params = workload
    return make_real_llm(**SMALL).generate(prompts, params)


@pytest.mark.slow
def test_determinism_alone_vs_batched(make_real_llm, workload, reference) -> None:
    prompts, params = workload
    alone = one_at_a_time(make_real_llm(**SMALL), prompts, params)  # (a)
    assert_same(alone, reference)
    for o in reference:
        assert_windows_cover(o, 8)


@pytest.mark.parametrize("max_seqs", [4, 12])
@pytest.mark.slow
def test_determinism_staggered_among_nondeterministic(make_real_llm, workload, reference, max_seqs) -> None:
    prompts, params = workload
    llm = make_real_llm(max_num_seqs=max_seqs, **SMALL)
    kinds = record_verify_kinds(llm)
    out = staggered(llm, prompts, params, every=3, seed=max_seqs)  # (c)
    assert_same(out, reference)
    assert set(kinds) == {SeqKind.DVR}  # the non-deterministic companions never entered a verify pass


@pytest.mark.parametrize("rate", [0.05, 0.3, 1.0])
def test_fault_injection_bitwise_equal(make_real_llm, workload, reference, rate) -> None:
    """A subset suffices: each request's output is its own pure function, so it must equal its entry in
    the 16-request reference whatever else runs (at rate 1.0, where every window is one token, three
    requests: greedy, top-p and greedy without ignore_eos)."""
    n = 10 if rate < 1.0 else 3
    prompts, params = workload
    out = make_real_llm(fault_rate=rate, fault_seed=11, **SMALL).generate(prompts[:n], params[:n])
    assert_same(out, reference[:n])
    assert sum(o.rollbacks for o in out) > 0
    for o in out:
        assert_windows_cover(o, 8)
        if rate == 1.0:
            assert all(e - s == 1 for s, e in o.windows) and o.verify_passes == len(o.token_ids) - 1


@pytest.mark.slow
def test_window_starts_from_fault_seeds(make_real_llm, workload, reference) -> None:
    """Two fault seeds on five requests: other windows, the reference's bits."""
    prompts, params = workload
    prompts, params = prompts[:5], params[:5]
    a = make_real_llm(fault_rate=0.3, fault_seed=1, **SMALL).generate(prompts, params)
    b = make_real_llm(fault_rate=0.3, fault_seed=2, **SMALL).generate(prompts, params)
    assert [o.windows for o in a] != [o.windows for o in b]
    assert_same(a, reference[:5])
    assert_same(b, reference[:5])


def _kv_snapshot(llm, seq) -> list[torch.Tensor]:
    """K and V of every layer at the sequence's positions 0..kv_len-1 (gathered through its block table)."""
    bs = llm.config.block_size
    kv = llm.core.runner.kv
    device = kv.k[0].device  # gather on the cache's device (the CUDA suite reuses this test)
    table = torch.tensor(llm.core.scheduler.blocks.table(seq_key(seq)), device=device)
    pos = torch.arange(seq.kv_len, device=device)
    slots = table[pos // bs] * bs + pos % bs
    return [c.view(-1, *c.shape[2:]).index_select(0, slots).clone() for c in kv.k + kv.v]


def _replay_with_kv(llm, req):
    captured = {}
    remove = llm.core.scheduler.remove

    def snap(seq):
        if seq.kind == SeqKind.REPLAY:
            captured[seq.request_id] = _kv_snapshot(llm, seq)
        remove(seq)

    llm.core.scheduler.remove = snap
    return llm.replay([req])[0], captured[req.replay_id]


def test_window_boundary_invariance_kv_and_logprobs(make_real_llm, workload, reference) -> None:
    """The same committed tokens verified with windows starting at different offsets: bitwise equal KV
    and logprobs (DESIGN §2 window-boundary invariance)."""
    prompts, params = workload
    i = max(range(len(reference)), key=lambda k: len(reference[k].token_ids))
    req = replay_requests(prompts, params, reference)[i]
    n = len(req.token_ids)
    assert n >= 10
    cuts_a = [(1, 4), (4, 9), (9, n)] if n - 9 <= 8 else None
    layouts = [[(s, min(s + 3, n)) for s in range(1, n, 3)], [(1, 2)] + [(s, min(s + 5, n)) for s in range(2, n, 5)]]
    if cuts_a:
        layouts.append(cuts_a)
    runs = [_replay_with_kv(make_real_llm(**SMALL), replace(req, windows=w)) for w in layouts]
    for res, kv in runs:
        assert res.token_ids == reference[i].token_ids
        assert res.token_logprobs == reference[i].token_logprobs  # the generating run's, bitwise
        assert all(torch.equal(x, y) for x, y in zip(kv, runs[0][1]))


@pytest.mark.slow
def test_preemption_bitwise_equal(make_real_llm, workload) -> None:
    """Six requests in 6 KV blocks of 8 tokens, with faults: preempted at least once, the bits of a run with
    room for all; every block is free again at the end."""
    prompts, params = workload
    prompts, params = prompts[:6], params[:6]
    unconstrained = make_real_llm(block_size=8, **SMALL).generate(prompts, params)
    llm = make_real_llm(num_kv_blocks=2 + 6, block_size=8, max_num_seqs=16, fault_rate=0.1, **SMALL)
    out = llm.generate(prompts, params)
    assert llm.core.scheduler.preemptions > 0
    assert_same(out, unconstrained)
    assert llm.core.scheduler.blocks.num_free == llm.core.scheduler.blocks.num_usable


@pytest.mark.slow
def test_replay_of_outputs_made_under_load(make_real_llm, workload, reference) -> None:
    prompts, params = workload
    prompts, params = prompts[:10], params[:10]
    made = staggered(make_real_llm(fault_rate=0.3, fault_seed=3, max_num_seqs=6, **SMALL), prompts, params,
                     seed=7)
    assert_same(made, reference[:10])
    reqs = replay_requests(prompts, params, made)
    altered_at = 5
    tokens = list(reqs[0].token_ids)
    tokens[altered_at] = (tokens[altered_at] + 1) % 49152
    reqs.append(replace(reqs[0], replay_id="altered", token_ids=tokens))
    llm = make_real_llm(**SMALL)
    results = llm.replay(reqs)
    for o, r in zip(made, results[:-1]):
        assert r.first_mismatch is None
        assert r.token_ids == o.token_ids and r.token_logprobs == o.token_logprobs
    assert results[-1].first_mismatch == altered_at
    assert results[-1].token_ids[:altered_at] == made[0].token_ids[:altered_at]
    assert llm.core.stats().verify_passes < sum(len(r.windows) for r in reqs)  # replays shared passes


def test_stop_string_on_committed_text(make_real_llm) -> None:
    llm = make_real_llm(**SMALL)
    p = SamplingParams(max_tokens=12, temperature=0.0, deterministic=True)
    full = llm.generate(["The capital of France is"], p)[0]
    assert "." in full.text
    out = llm.generate(["The capital of France is"], replace(p, stop=["."]))[0]
    assert out.finish_reason == "stop" and out.text == full.text[: full.text.index(".")]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    assert_windows_cover(out, 8)
