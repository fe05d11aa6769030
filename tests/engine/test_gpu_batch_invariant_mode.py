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
from tests.engine.dvr_cases import assert_same, load_run, load_workload, one_at_a_time

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
        config = EngineConfig(device="cuda", dtype="bfloat16", mode=BI,
                              **{"num_kv_blocks": 2000, "cuda_graphs": False, "max_num_seqs": 32, **cfg})
        return LLM.from_parts(config, bi_model, shape, set(source.info.eos_token_ids), source.tokenizer)

    return make


def test_load_64_among_192_three_arrival_orders(make_llm: Any, source: Any) -> None:
    det, pool = load_workload(source.tokenizer, deterministic=lambda i: i % 4 < 2)
    llms = [make_llm(max_num_seqs=96 + 32 * k) for k in range(3)]
    runs = [load_run(llm, det, pool, seed=k) for k, llm in enumerate(llms)]
    assert all(llm.core.totals.verify_passes == 0 for llm in llms)
    assert_same(runs[0], runs[1])
    assert_same(runs[0], runs[2])
    assert all(len(o.token_ids) > 0 and o.windows == [] and o.verify_passes == 0 for o in runs[0])


def test_alone_equals_batched_and_preempted(make_llm: Any, source: Any) -> None:
    det, _ = load_workload(source.tokenizer, deterministic=lambda i: i % 4 < 2)
    prompts, params = [p for p, _ in det[:8]], [sp for _, sp in det[:8]]
    together = make_llm(max_num_seqs=8).generate(prompts, params)
    assert_same(one_at_a_time(make_llm(), prompts, params), together)
    tight = make_llm(max_num_seqs=8, num_kv_blocks=12)
    assert_same(tight.generate(prompts, params), together)
    assert tight.core.scheduler.preemptions > 0


@pytest.mark.parametrize("fuse_rope", [False, True])
def test_chunked_prefill_and_decode_equal_whole_prefill_cuda(bi_model: Any, fuse_rope: bool) -> None:
    """fuse_rope: KernelSettings.fuse_rope_canonical, RoPE and the K/V store inside the canonical decode kernel."""
    from engine.config import KernelSettings
    from tests.engine.test_batch_invariant_mode import prefill_variants

    model = bi_model.with_kernels(KernelSettings(fuse_rope_canonical=fuse_rope))
    rng = random.Random(3)
    variants = prefill_variants(model, [rng.randrange(3, 1000) for _ in range(40)], [5] * 9)
    for name, logits in variants.items():
        assert torch.equal(logits, variants["whole"]), name


def test_rope_in_canonical_kernel_gives_the_same_bits(make_llm: Any, source: Any) -> None:
    """KernelSettings.fuse_rope_canonical on and off (graphs captured under each): the load test's first run
    gives the same token ids and logprobs."""
    from engine.config import KernelSettings

    det, pool = load_workload(source.tokenizer, deterministic=lambda i: i % 4 < 2)
    runs = []
    for on in (False, True):
        runs.append(load_run(make_llm(max_num_seqs=96, kernels=KernelSettings(fuse_rope_canonical=on)), det, pool,
                             seed=0))
    assert_same(runs[0], runs[1])


def test_runs_triton_kernels(make_llm: Any) -> None:
    llm = make_llm()
    model = llm.core.runner.model
    assert model.ops.name == BI and model.attention.name == BI and model.device.type == "cuda"
    fp = runtime_fingerprint(llm.config)
    assert fp["batch_invariant_kernels"] == "triton-paged-canonical" and "attention_split_size" not in fp
    assert fp["attention_kernel"].startswith("triton-paged") and fp["bi_matmul"].startswith("verbatim-bi-matmul")
    assert fp["row_kernels"].startswith("verbatim-fused-rows")  # BatchInvariantOps runs triton_fused on CUDA
    from engine.attention.metadata import AttentionMetadata, PassKind
    from engine.attention.triton_backend import TritonPlan

    one = torch.ones(1, dtype=torch.int32, device="cuda")
    meta = AttentionMetadata(PassKind.DECODE, one.long(), torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                             one, one[:, None])
    assert isinstance(model.attention.plan(meta, 16), TritonPlan)  # the paged kernels, canonical decode
