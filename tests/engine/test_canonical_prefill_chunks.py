"""Chunked canonical prefill passes (DvrTuning.canonical_prefill_chunk_tokens = C > 0).

Every GEMM of a canonical pass's body runs on exactly C rows, so a DVR / replay prompt's bits depend on its
tokens and C only; the scheduler then sizes a canonical pass by its content, rounded up to a multiple of C.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from engine.config import DEFAULT_CUDA_CANONICAL_PREFILL_CHUNK_TOKENS, DvrTuning, EngineConfig
from engine.fingerprint import runtime_fingerprint
from engine.kernels import TORCH_OPS, ChunkedOps
from engine.model_runner import ModelRunner, Row
from engine.sampling import SamplingParams
from engine.scheduler import CANONICAL_PREFILL_ROWS, Scheduler, StepKind, canonical_prefill_tokens
from engine.sequence import Sequence, SeqKind
from tests.engine.configs import resolved
from tests.engine.dvr_cases import assert_same, one_at_a_time

BS = 16
C = 32


def _chunked(**fields: Any) -> EngineConfig:
    return resolved(device="cpu", tuning=DvrTuning(canonical_prefill_chunk_tokens=C), **fields)


# ---- config and fingerprint ------------------------------------------------------------------------
def test_chunk_defaults_to_512_on_cuda_and_off_on_the_cpu() -> None:
    assert DEFAULT_CUDA_CANONICAL_PREFILL_CHUNK_TOKENS == 512
    assert resolved(device="cpu").tuning.canonical_prefill_chunk_tokens == 0
    assert resolved(device="cuda").tuning.canonical_prefill_chunk_tokens == 512
    assert resolved(device="cuda", max_num_batched_tokens=4096).tuning.canonical_prefill_chunk_tokens == 512
    # a budget set by hand that is no whole number of 512-token chunks keeps unchunked passes, and no error
    assert resolved(device="cuda", max_num_batched_tokens=1000).tuning.canonical_prefill_chunk_tokens == 0
    assert resolved(device="cuda", max_num_batched_tokens=256).tuning.canonical_prefill_chunk_tokens == 0
    assert _chunked(max_num_batched_tokens=256).tuning.canonical_prefill_chunk_tokens == C
    assert EngineConfig.from_options({"tuning": {"canonical_prefill_chunk_tokens": 64}}) \
        .tuning.canonical_prefill_chunk_tokens == 64
    assert EngineConfig.from_options({"canonical_prefill_chunk_tokens": 64}).tuning.canonical_prefill_chunk_tokens == 64


@pytest.mark.parametrize("bad", [-1, -32, 1.5, True, "32"])
def test_a_bad_chunk_size_names_the_field(bad: Any) -> None:
    with pytest.raises(ValueError, match=r"tuning\.canonical_prefill_chunk_tokens"):
        DvrTuning(canonical_prefill_chunk_tokens=bad)


def test_the_budget_must_be_a_multiple_of_the_chunk() -> None:
    with pytest.raises(ValueError, match=r"tuning\.canonical_prefill_chunk_tokens.*1000"):
        _chunked(max_num_batched_tokens=1000)
    with pytest.raises(ValueError, match=r"tuning\.canonical_prefill_chunk_tokens"):  # C above the budget
        resolved(device="cpu", max_num_batched_tokens=256, tuning=DvrTuning(canonical_prefill_chunk_tokens=512))
    with pytest.raises(ValueError, match=r"tuning\.canonical_prefill_chunk_tokens"):  # the CUDA default budget
        resolved(device="cuda", tuning=DvrTuning(canonical_prefill_chunk_tokens=96))
    assert resolved(device="cuda", tuning=DvrTuning(canonical_prefill_chunk_tokens=256)).max_num_batched_tokens == 8192


def test_fingerprint_names_the_chunk_instead_of_the_pass_sizes() -> None:
    """C > 0: C shapes every GEMM of a canonical pass, the pass size (its minimum, the budget that caps it)
    shapes nothing. C = 0: the pass-size fields as they are, and no chunk field, so an engine with C = 0
    keeps the fingerprint its earlier transcripts recorded."""
    plain = runtime_fingerprint(resolved(device="cpu", max_num_batched_tokens=4096))
    assert "canonical_prefill_chunk_tokens" not in plain
    assert (plain["canonical_prefill_min_tokens"], plain["canonical_prefill_max_tokens"]) == (64, 4096)
    a = runtime_fingerprint(_chunked(max_num_batched_tokens=4096))
    b = runtime_fingerprint(_chunked(max_num_batched_tokens=2048))
    other = runtime_fingerprint(resolved(device="cpu", tuning=DvrTuning(canonical_prefill_chunk_tokens=64)))
    assert a["canonical_prefill_chunk_tokens"] == C and a["canonical_prefill_rows"] == CANONICAL_PREFILL_ROWS
    assert "canonical_prefill_min_tokens" not in a and "canonical_prefill_max_tokens" not in a
    assert a == b and a != other and a != plain


# ---- ChunkedOps ------------------------------------------------------------------------------------
def test_chunked_linear_is_one_gemm_per_chunk_and_the_bias_after() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w, bias = (torch.randn(s, generator=gen) for s in ((3 * C, 40), (24, 40), (24,)))
    ops = ChunkedOps(TORCH_OPS, C)
    products = torch.cat([torch.mm(x[i: i + C], w.t()) for i in range(0, 3 * C, C)])  # [3C, 24]
    assert torch.equal(ops.linear(x, w, bias), products + bias)
    assert torch.equal(ops.linear(x[:5], w), torch.mm(x[:5], w.t()))  # fewer rows than C: one GEMM
    assert torch.equal(ops.linear(x.reshape(3, C, 40), w), products.reshape(3, C, 24))
    with pytest.raises(ValueError):
        ChunkedOps(TORCH_OPS, 0)


def test_chunked_ops_delegate_every_other_op() -> None:
    ops = ChunkedOps(TORCH_OPS, C)
    x = torch.randn(4, 8)
    assert torch.equal(ops.rms_norm(x, torch.ones(8), 1e-5), TORCH_OPS.rms_norm(x, torch.ones(8), 1e-5))
    assert ops.triton_rope(x) is False  # the optional ops are the inner object's
    assert ops.rope_write_kv.__func__ is TORCH_OPS.rope_write_kv.__func__  # type: ignore[attr-defined]

    class Bare:  # an Ops without the optional methods: lookups fail as they do on it
        name = "bare"

    assert getattr(ChunkedOps(Bare(), C), "rope_write_kv", None) is None  # type: ignore[arg-type]


# ---- scheduler ---------------------------------------------------------------------------------------
def _seq(i: int, n: int, det: bool) -> Sequence:
    return Sequence(f"r{i}", [7] * n, SamplingParams(deterministic=det), 1, SeqKind.DVR if det else SeqKind.FAST, i)


def _scheduler(seqs: list[Sequence], **fields: Any) -> Scheduler:
    sched = Scheduler(_chunked(num_kv_blocks=400, block_size=BS, max_num_batched_tokens=256, **fields), set())
    for s in seqs:
        sched.add(s)
    return sched


def test_every_prompt_plans_with_the_full_pass() -> None:
    cfg = _chunked(max_num_batched_tokens=256)
    assert {canonical_prefill_tokens(cfg, n) for n in (1, 31, 33, 200, 256)} == {256}


def test_a_lone_short_deterministic_prompt_gets_one_chunk() -> None:
    sched = _scheduler([_seq(0, 20, True)])
    plan = sched.schedule()
    assert plan.kind == StepKind.PREFILL and plan.pass_tokens == C
    assert [it.seq.request_id for it in plan.prefill] == ["r0"]
    sched = _scheduler([_seq(0, 33, True)])
    assert sched.schedule().pass_tokens == 2 * C


def test_a_burst_of_deterministic_prompts_of_any_length_shares_one_pass() -> None:
    """Deterministic prompts of lengths that would take passes of 64, 128 and 64 tokens unchunked share one
    pass, the fast prompt filling it; 200 tokens used, so 7 chunks."""
    sched = _scheduler([_seq(0, 30, True), _seq(1, 100, True), _seq(2, 20, True), _seq(3, 10, False),
                        _seq(4, 40, True)])
    plan = sched.schedule()
    assert [it.seq.request_id for it in plan.prefill] == ["r0", "r1", "r2", "r4", "r3"]
    assert plan.pass_tokens == 224 == -(-200 // C) * C


def test_the_pass_never_exceeds_the_budget() -> None:
    sched = _scheduler([_seq(0, 200, True), _seq(1, 56, True), _seq(2, 10, True)])
    plan = sched.schedule()
    assert [it.seq.request_id for it in plan.prefill] == ["r0", "r1"] and plan.pass_tokens == 256
    plan = sched.schedule()
    assert [it.seq.request_id for it in plan.prefill] == ["r2"] and plan.pass_tokens == C


def test_a_plain_pass_reaching_a_deterministic_prompt_becomes_a_chunked_canonical_one() -> None:
    """Every deterministic prompt counts as full size: the fast prompts before it, it, then the fast ones
    that fit, in a pass cut to its content."""
    sched = _scheduler([_seq(0, 30, False), _seq(1, 40, True), _seq(2, 20, False), _seq(3, 200, False)])
    plan = sched.schedule()
    assert [it.seq.request_id for it in plan.prefill] == ["r0", "r1", "r2"] and plan.pass_tokens == 96
    plan = sched.schedule()
    assert plan.pass_tokens is None and [it.seq.request_id for it in plan.prefill] == ["r3"]


# ---- model runner: GEMM shapes and bits ---------------------------------------------------------------
class _GemmRows(TorchFunctionMode):
    """Records M of every GEMM against one of `weights` (N, K): torch.mm(x, w.t()) and F.linear(x, w)."""

    def __init__(self, weights: list[tuple[int, int]]) -> None:
        super().__init__()
        self.weights, self.rows = set(weights), []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.mm, F.linear) and len(args) >= 2:
            n_k = tuple(args[1].shape) if func is F.linear else tuple(args[1].shape[::-1])
            if n_k in self.weights:
                self.rows.append((n_k, args[0].shape[0]))
        return func(*args, **(kwargs or {}))


def _runner(model: Any, shape: Any, chunk: int) -> ModelRunner:
    cfg = resolved(device="cpu", num_kv_blocks=24, block_size=BS, max_num_batched_tokens=256,
                   tuning=DvrTuning(canonical_prefill_chunk_tokens=chunk))
    return ModelRunner(cfg, model, shape, torch.float32, torch.device("cpu"))


def test_every_gemm_of_a_chunked_canonical_pass_has_c_rows(smollm2_model: Any, smollm2_shape: Any) -> None:
    """The body's GEMMs of a 128-token canonical pass run on 32 rows each, the logits GEMM on
    CANONICAL_PREFILL_ROWS rows; unchunked, the body's GEMMs take the whole pass."""
    vocab_weight = (smollm2_model.lm_head.out_features, smollm2_model.lm_head.in_features)
    for chunk, body_rows in ((C, C), (0, 4 * C)):
        runner = _runner(smollm2_model, smollm2_shape, chunk)
        with _GemmRows(smollm2_model.linear_shapes()) as seen:
            runner.prefill([Row(list(range(10, 50)), 0, [2, 3, 4]), Row([9] * 7, 0, [5])], pass_tokens=4 * C)
        body = [m for w, m in seen.rows if w != vocab_weight]
        assert len(body) >= 4 * smollm2_model.arch.num_layers and set(body) == {body_rows}
        assert [m for w, m in seen.rows if w == vocab_weight] == [CANONICAL_PREFILL_ROWS]


def test_a_prompt_has_the_same_logits_and_kv_alone_and_packed(smollm2_model: Any, smollm2_shape: Any) -> None:
    """The same prompt alone at offset 0 of a 32-token pass, and behind a 40-token prompt with another one
    after it in a 128-token pass: its last token's logits and its K/V in every layer are bitwise equal."""
    prompt = [1, 504, 3575, 282, 4649, 314, 28, 411, 1789]
    alone = _runner(smollm2_model, smollm2_shape, C)
    packed = _runner(smollm2_model, smollm2_shape, C)
    lone = alone.prefill([Row(prompt, 0, [2])], pass_tokens=C)
    mixed = packed.prefill([Row(list(range(100, 140)), 0, [2, 3, 4]), Row(prompt, 0, [7]),
                            Row(list(range(300, 350)), 0, [8, 9, 10, 11])], pass_tokens=4 * C)
    assert torch.equal(lone[0], mixed[1])
    n = len(prompt)
    for layer in range(smollm2_model.arch.num_layers):
        assert torch.equal(alone.kv.k[layer][2, :n], packed.kv.k[layer][7, :n])
        assert torch.equal(alone.kv.v[layer][2, :n], packed.kv.v[layer][7, :n])


# ---- engine: committed bits alone and under batching ----------------------------------------------------
TEXTS = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:",
         "Once upon a time, in a small village near the mountains, there lived", "2 + 2 =",
         "def fibonacci(n):", "Roses are red,", "import numpy as np\n"]


def test_deterministic_outputs_alone_equal_those_packed_with_fast_prompts(make_real_llm: Any,
                                                                          smollm2_source: Any) -> None:
    """Every DVR prompt alone (a pass of C tokens each) and all of them together with non-deterministic
    prompts (one pass of several chunks, the DVR prompts behind a fast one): the committed ids and
    logprobs are bitwise equal."""
    tok = smollm2_source.tokenizer
    prompts = [list(tok.encode(t)) for t in TEXTS]
    det = [SamplingParams(max_tokens=6, temperature=0.8 if i % 2 else 0.0, seed=70 + i, deterministic=True,
                          ignore_eos=True) for i in range(len(prompts))]
    cfg = dict(window=4, group=2, canonical_prefill_chunk_tokens=C)
    alone_llm = make_real_llm(**cfg)
    alone = one_at_a_time(alone_llm, prompts, det)
    assert alone_llm.core.totals.prefill_passes == len(prompts)
    llm = make_real_llm(**cfg)
    passes: list[int] = []
    prefill = llm.core.runner.prefill_with_prompts
    llm.core.runner.prefill_with_prompts = lambda rows, p, lp: passes.append(p) or prefill(rows, p, lp)  # type: ignore
    fast = SamplingParams(max_tokens=3, temperature=1.0, seed=3)
    mixed = llm.generate([list(tok.encode("word " * 40))] + prompts, [fast] + det)
    assert len(passes) == 1 and passes[0] > C and passes[0] % C == 0
    assert_same(mixed[1:], alone)


# ---- tensor parallelism: the row-parallel projection ------------------------------------------------------
class _Ranks:
    """A stand-in TensorParallel: records the rows of every all-reduce, sums nothing (one rank's sums)."""

    def __init__(self, reduction: str, size: int) -> None:
        self.reduction, self.size, self.reduced = reduction, size, []

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduced.append(x.shape[0])
        return x


@pytest.mark.parametrize("reduction,size,reduced", [("gather_sum", 4, [3 * C]), ("nccl", 2, [3 * C]),
                                                     ("nccl", 4, [C, C, C])])
def test_row_parallel_projection_chunks_the_local_gemm(reduction: str, size: int, reduced: list[int]) -> None:
    """Under chunked ops the local GEMM runs in C-row slices; NCCL past two ranks, whose summation order
    follows the message size, reduces slice by slice too, the element-wise gather_sum the whole pass."""
    from engine.models.llama import _row_linear

    layer = torch.nn.Linear(40, 24).requires_grad_(False)  # a model's weights, as materialize leaves them
    x = torch.randn(3 * C, 40)
    ranks = _Ranks(reduction, size)
    out = _row_linear(ChunkedOps(TORCH_OPS, C), layer, x, ranks)  # type: ignore[arg-type]
    assert ranks.reduced == reduced
    expected = torch.cat([torch.mm(x[i: i + C], layer.weight.t()) for i in range(0, 3 * C, C)]) + layer.bias
    assert torch.equal(out, expected)
    ranks = _Ranks(reduction, size)
    _row_linear(TORCH_OPS, layer, x, ranks)  # type: ignore[arg-type]
    assert ranks.reduced == [3 * C]
