"""mode="batch_invariant" on CUDA (SmolLM2, bfloat16, Triton batch-invariant kernels): the issue-5 load test.

64 requests (greedy and sampled, half flagged deterministic; in this mode every request is bit-exact)
among 192 others, arriving at random steps, in three runs with different arrival orders, co-traffic
and max_num_seqs: token ids and logprobs bitwise equal, and no verify pass ever runs.
The model comes from $VERBATIM_GGUF (or $VERBATIM_GPU_GGUF), else the installed default GGUF.
"""
from __future__ import annotations

import os
import random
from typing import Any

import pytest
import torch

from engine.config import EngineConfig
from engine.fingerprint import runtime_fingerprint
from engine.llm import LLM
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import assert_same, one_at_a_time

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BI = "batch_invariant"


@pytest.fixture(scope="module")
def source() -> Any:
    from engine.loader import default_model_path, load_model_source

    path = os.environ.get("VERBATIM_GGUF") or os.environ.get("VERBATIM_GPU_GGUF")
    if not path:
        try:
            path = str(default_model_path())
        except ValueError as exc:
            pytest.skip(f"no model: set VERBATIM_GGUF ({exc})")
    return load_model_source(path, torch.bfloat16)


@pytest.fixture(scope="module")
def bi_model(source: Any) -> Any:
    from engine.kernels import BatchInvariantOps
    from engine.models import build_model

    model = build_model(source.hf_config, torch.bfloat16, "cuda", BI, BatchInvariantOps())
    model.load_weights(source.weights())
    return model


@pytest.fixture(scope="module")
def make_llm(source: Any, bi_model: Any) -> Any:
    from engine.model_runner import ModelShape
    from engine.models import arch_from_hf

    arch = arch_from_hf(source.hf_config)
    shape = ModelShape(arch.num_layers, arch.num_kv_heads, arch.head_dim, arch.vocab_size, source.info.max_model_len)

    def make(**cfg: Any) -> LLM:
        config = EngineConfig(device="cuda", dtype="bfloat16", mode=BI, **{"num_kv_blocks": 2000, **cfg})
        return LLM.from_parts(config, bi_model, shape, set(source.info.eos_token_ids), source.tokenizer)

    return make


def _load_run(llm: LLM, det: list[tuple[list[int], SamplingParams]], pool: list[list[int]], seed: int,
              n_other: int = 192) -> list[Any]:
    """The 64 `det` requests + `n_other` others, arriving at random steps (order and co-traffic by seed)."""
    rng = random.Random(seed)
    arrivals: list[tuple[int, str, list[int], SamplingParams]] = []
    for i, (prompt, params) in enumerate(det):
        arrivals.append((rng.randrange(0, 60), f"d{i}", prompt, params))
    for j in range(n_other):
        params = SamplingParams(max_tokens=rng.randint(4, 40), temperature=0.0 if j % 3 else 0.7,
                                seed=rng.randrange(2**63), ignore_eos=True)
        arrivals.append((rng.randrange(0, 60), f"n{j}", rng.choice(pool), params))
    rng.shuffle(arrivals)
    arrivals.sort(key=lambda a: a[0])  # stable: ties keep the shuffled order
    core, seqs, step = llm.core, {}, 0
    while arrivals or core.has_work():
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt, params = arrivals.pop(0)
            seqs[rid] = core.add_request(rid, prompt, params)
        core.step()
        step += 1
    assert core.totals.verify_passes == 0
    return [core.output(seqs[f"d{i}"]) for i in range(len(det))]


def _workload(tok: Any) -> tuple[list[tuple[list[int], SamplingParams]], list[list[int]]]:
    topics = ["the sea", "bread", "Mars", "jazz", "tax law", "bees", "chess", "rain", "Rome", "DNA", "glass"]
    pool = [list(tok.encode(f"Tell me about {t}. {'Be brief.' if k % 2 else 'Give details and examples.'}"))
            for k, t in enumerate(topics * 2)]
    det = []
    for i in range(64):
        sampled = i % 2 == 1
        det.append((pool[i % len(pool)] + [tok.encode(str(i))[0]], SamplingParams(
            max_tokens=24 + i % 17, temperature=0.8 if sampled else 0.0, top_p=0.95 if i % 4 == 1 else 1.0,
            seed=10_000 + i, deterministic=i % 4 < 2, ignore_eos=i % 5 != 0)))
    return det, pool


def test_load_64_among_192_three_arrival_orders(make_llm: Any, source: Any) -> None:
    det, pool = _workload(source.tokenizer)
    runs = [_load_run(make_llm(max_num_seqs=96 + 32 * k), det, pool, seed=k) for k in range(3)]
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])
    assert all(len(o.token_ids) > 0 and o.windows == [] and o.verify_passes == 0 for o in runs[0])


def test_alone_equals_batched_and_preempted(make_llm: Any, source: Any) -> None:
    det, _ = _workload(source.tokenizer)
    prompts, params = [p for p, _ in det[:8]], [sp for _, sp in det[:8]]
    together = make_llm(max_num_seqs=8).generate(prompts, params)
    assert_same(one_at_a_time(make_llm(), prompts, params), together)
    tight = make_llm(max_num_seqs=8, num_kv_blocks=12)
    assert_same(tight.generate(prompts, params), together)
    assert tight.core.scheduler.preemptions > 0


def test_chunked_prefill_and_decode_equal_whole_prefill_cuda(bi_model: Any) -> None:
    from tests.engine.test_batch_invariant_mode import prefill_variants

    rng = random.Random(3)
    variants = prefill_variants(bi_model, [rng.randrange(3, 1000) for _ in range(40)], [5] * 9)
    for name, logits in variants.items():
        assert torch.equal(logits, variants["whole"]), name


def test_runs_triton_kernels(make_llm: Any) -> None:
    llm = make_llm()
    model = llm.core.runner.model
    assert model.ops.name == BI and model.attention.name == BI and model.device.type == "cuda"
    fp = runtime_fingerprint(llm.config)
    assert fp["batch_invariant_kernels"] == "triton" and fp["attention_split_size"] == model.attention.split_size
