"""Tensor parallelism on the CPU: shard plans, sharded weights, and SmolLM2 (float32) at two ranks in two
processes over gloo: the verify bits (token ids and logprobs) are equal alone and among other requests, in
two engines (two runs), and replay; TP = 2 against TP = 1 (close, not bitwise: another fingerprint)."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.fingerprint import runtime_fingerprint, system_fingerprint
from engine.llm import LLM
from engine.models import arch_from_hf, build_model
from engine.models.sharding import ShardPlan
from engine.models.synthetic import build_synthetic_model, random_hf_weights, synthetic_hf_config
from engine.parallel import TensorParallel, reduction_id
from engine.sampling import SamplingParams
from tests.engine.configs import resolved
from tests.engine.dvr_cases import (REAL_TEXTS, assert_same, assert_windows_cover, fast_params, one_at_a_time,
                                    replay_requests, staggered)

SMALL = dict(window=8, group=4)
TP2 = dict(device="cpu", num_threads=1, num_kv_blocks=130, max_num_seqs=32, tensor_parallel_size=2, **SMALL)


# ---- shard plans and sharded weights (one process) --------------------------------------------------

def test_shard_plan_splits_heads_by_kv_group_and_pads_the_vocabulary(smollm2_source) -> None:
    arch = arch_from_hf(smollm2_source.hf_config)  # 9 heads, 3 KV heads, MLP 1536, vocab 49152
    plans = [ShardPlan.build(arch, r, 2) for r in range(2)]
    assert [p.kv_heads for p in plans] == [(0, 1), (1, 3)]
    assert [p.q_heads for p in plans] == [(0, 3), (3, 9)]
    assert [p.intermediate for p in plans] == [(0, 768), (768, 1536)]
    assert [p.vocab for p in plans] == [(0, 24576), (24576, 49152)] and plans[0].vocab_per_rank == 24576
    odd = arch_from_hf(synthetic_hf_config("tiny", vocab_size=515))
    assert [ShardPlan.build(odd, r, 2).vocab for r in range(2)] == [(0, 258), (258, 515)]
    with pytest.raises(ValueError, match="tensor_parallel_size: 4 ranks need at least 4 KV heads, the model has 3"):
        ShardPlan.build(arch, 0, 4)


@pytest.mark.parametrize("preset,peaked,size", [("tiny", False, 2), ("tiny", True, 2), ("qwen3-tiny", False, 2),
                                                 ("smollm2-135m", False, 3)])
def test_rank_weights_are_the_slices_of_the_whole_model(preset: str, peaked: bool, size: int) -> None:
    """Each rank's parameters are its ShardPlan slices of the one-rank synthetic model (random_hf_weights
    draws what fill_random_ writes), vocabulary padding rows zero."""
    config = synthetic_hf_config(preset, vocab_size=515, num_hidden_layers=1)
    whole = build_synthetic_model(config, torch.float32, "cpu", seed=0, peaked=peaked).hf_weights()
    for rank in range(size):
        model = build_model(config, torch.float32, "cpu", tp=TensorParallel(rank, size))
        model.load_weights(random_hf_weights(config, 0, torch.float32, "cpu", peaked=peaked))
        plan = model.shard
        assert plan is not None
        for name, param in model.hf_weights().items():
            assert torch.equal(param, plan.shard(name, whole[name])), (rank, name)
        rows = plan.vocab[1] - plan.vocab[0]
        assert not model.model.embed_tokens.weight[rows:].any()


def test_misshaped_full_weight_is_refused() -> None:
    config = synthetic_hf_config("tiny")
    model = build_model(config, torch.float32, "cpu", tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match="q_proj.weight' has shape \\(64, 128\\), expected 128 along dim 0"):
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 128))])


def test_config_and_fingerprint_name_the_layout() -> None:
    one = runtime_fingerprint(resolved(device="cpu"))
    two = runtime_fingerprint(resolved(device="cpu", tensor_parallel_size=2))
    assert "tensor_parallel_size" not in one and "tp_reduction" not in one
    assert (two["tensor_parallel_size"], two["tp_reduction"]) == (2, "gather_sum")
    assert system_fingerprint(one) != system_fingerprint(two)
    assert reduction_id("nccl").startswith("nccl:")
    with pytest.raises(ValueError, match="EngineConfig.tp_reduction: nccl runs on CUDA only"):
        EngineConfig(device="cpu", tensor_parallel_size=2, tp_reduction="nccl")
    with pytest.raises(ValueError, match="EngineConfig.tensor_parallel_size: must be an int >= 1, got 0"):
        EngineConfig(device="cpu", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="EngineConfig.tp_reduction: one of gather_sum/nccl"):
        EngineConfig(device="cpu", tp_reduction="ring")


def test_an_engine_over_one_model_refuses_a_tensor_parallel_config(make_mock_llm) -> None:
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 ranks need a group of as many .* got none"):
        make_mock_llm(tensor_parallel_size=2)


# ---- SmolLM2 at two ranks (two processes, gloo) -----------------------------------------------------

@pytest.fixture(scope="module")
def tp2_llm() -> Iterator[LLM]:
    with LLM(EngineConfig(**TP2)) as llm:
        yield llm


@pytest.fixture(scope="module")
def workload(smollm2_source) -> tuple[list[list[int]], list[SamplingParams]]:
    """The first four REAL_TEXTS as deterministic requests: greedy, sampled top-p, greedy, sampled top-k, 3 to
    5 tokens each (every generated token is a step on both ranks, so the workload is kept small)."""
    tok = smollm2_source.tokenizer
    prompts = [list(tok.encode(t)) for t in REAL_TEXTS[:4]]
    params = [SamplingParams(max_tokens=3 + i % 3, temperature=0.9 if i % 2 else 0.0,
                             top_p=0.9 if i % 4 == 1 else 1.0, top_k=40 if i % 4 == 3 else 0, seed=700 + i,
                             deterministic=True, ignore_eos=True) for i in range(len(prompts))]
    return prompts, params


@pytest.fixture(scope="module")
def tp2_reference(tp2_llm: LLM, workload: Any) -> list[Any]:
    """All requests at once."""
    return tp2_llm.generate(*workload)


def test_tp2_bits_equal_alone_and_among_other_requests(tp2_llm: LLM, workload: Any, tp2_reference: list[Any]
                                                       ) -> None:
    prompts, params = workload
    assert tp2_llm.core.runner.tp is not None and tp2_llm.core.runner.tp.size == 2
    alone = one_at_a_time(tp2_llm, prompts, params)
    assert_same(alone, tp2_reference)
    busy = staggered(tp2_llm, prompts, params, every=2, seed=6)  # companions of 3 to 13 tokens
    assert_same(busy, tp2_reference)
    for out in tp2_reference:
        assert_windows_cover(out, SMALL["window"])
    assert sum(o.verify_passes for o in tp2_reference) > 0


def test_tp2_replay_reproduces_the_bits(tp2_llm: LLM, workload: Any, tp2_reference: list[Any]) -> None:
    prompts, params = workload
    results = tp2_llm.replay(replay_requests(prompts, params, tp2_reference))
    for out, res in zip(tp2_reference, results):
        assert res.first_mismatch is None, res
        assert res.token_ids == out.token_ids and res.token_logprobs == out.token_logprobs


def test_tp2_against_one_rank(make_real_llm, tp2_llm: LLM, workload: Any, tp2_reference: list[Any]) -> None:
    """Two ranks sum each row-parallel GEMM in two halves, so the bits generally differ from one rank (and the
    fingerprints differ, so neither replays the other); the values agree to float32 rounding."""
    prompts, params = workload
    one = make_real_llm(**SMALL).generate(prompts, params)
    assert runtime_fingerprint(tp2_llm.config)["tensor_parallel_size"] == 2
    greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
    for i in greedy:  # the first token comes from the canonical prefill of the same prompt
        assert one[i].token_ids[0] == tp2_reference[i].token_ids[0]
        assert abs(one[i].token_logprobs[0] - tp2_reference[i].token_logprobs[0]) < 1e-4


def test_tp2_logits_close_to_one_rank(smollm2_model, tp2_llm: LLM, workload: Any) -> None:
    """The sharded forward is the model: a prefill pass's logits at two ranks match one rank's to 1e-4."""
    from engine.attention import PassKind, RowSpec, build_metadata
    from engine.model_runner import Row

    prompt = workload[0][0]
    blocks = list(range(2, 2 + -(-len(prompt) // 16)))
    tp_logits = tp2_llm.core.runner.prefill([Row(prompt, 0, blocks)])[0]
    kv = smollm2_model.allocate_kv_cache(8, 16)
    meta = build_metadata(PassKind.PREFILL, [RowSpec(blocks, 0, len(prompt))], 16)
    hidden = smollm2_model(torch.tensor(prompt), torch.arange(len(prompt)), meta, kv)
    one_logits = smollm2_model.compute_logits(hidden[-1:])[0]
    assert tp_logits.shape == one_logits.shape == (49152,)
    assert torch.allclose(tp_logits, one_logits, atol=1e-4, rtol=1e-4)
    assert int(tp_logits.argmax()) == int(one_logits.argmax())


def test_tp2_nondeterministic_requests_run_beside(tp2_llm: LLM, workload: Any) -> None:
    prompts, _ = workload
    outs = tp2_llm.generate(prompts[:3], [replace(fast_params(seed=i, max_tokens=4)) for i in range(3)])
    assert [len(o.token_ids) for o in outs] == [4, 4, 4] and not any(o.deterministic for o in outs)


def test_tp2_prompt_logprobs_close_to_one_rank(make_real_llm, tp2_llm: LLM, workload: Any) -> None:
    """A prefill that also scores the prompt runs on every rank (the workers run the same pass)."""
    prompt = workload[0][0]
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2, deterministic=True, ignore_eos=True)
    two = tp2_llm.generate([prompt], [params])[0]
    one = make_real_llm(**SMALL).generate([prompt], [params])[0]
    assert two.prompt_logprobs is not None and len(two.prompt_logprobs) == len(one.prompt_logprobs)
    for a, b in zip(two.prompt_logprobs, one.prompt_logprobs):
        assert abs(a - b) < 1e-3, (a, b)


@pytest.mark.slow
def test_tp2_second_engine_gives_the_same_bits(tp2_llm: LLM, workload: Any, tp2_reference: list[Any]) -> None:
    """Another engine (two new processes) on the same config, the requests staggered among others. A process
    holds one tensor-parallel engine at a time (torch.distributed's group is per process): this test closes
    the module's engine, so it comes last."""
    prompts, params = workload
    with pytest.raises(RuntimeError, match="one per process"):
        LLM(EngineConfig(**TP2))
    tp2_llm.close()
    with LLM(EngineConfig(**{**TP2, "max_num_seqs": 5})) as llm:
        assert_same(staggered(llm, prompts, params, every=1, seed=8), tp2_reference)


def test_tp2_chunked_canonical_prefill_bits_equal_alone_and_packed(tp2_llm: LLM, workload: Any) -> None:
    """Chunked canonical GEMMs (canonical_prefill_chunk_tokens = 32) at two ranks: each prompt alone in a
    32-token pass, and all of them in one pass behind a non-deterministic prompt, give the same bits. It needs
    a process without another tensor-parallel engine, so it closes the module's and comes last."""
    prompts, params = workload
    tp2_llm.close()
    with LLM(EngineConfig(**TP2, tuning={"canonical_prefill_chunk_tokens": 32})) as llm:
        assert runtime_fingerprint(llm.core.runner.config)["canonical_prefill_chunk_tokens"] == 32
        alone = one_at_a_time(llm, prompts, params)
        mixed = llm.generate([prompts[0] * 4] + prompts, [fast_params(seed=1, max_tokens=2)] + params)
        assert llm.core.totals.prefill_passes == len(prompts) + 1
        assert_same(mixed[1:], alone)
