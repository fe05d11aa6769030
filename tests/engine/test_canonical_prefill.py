"""Canonical prefill passes: DVR / replay prompts packed into fixed-size passes.

A pass has exactly P = canonical_prefill_tokens(prompt) tokens (dummy rows pad it) and its logits GEMM
exactly CANONICAL_PREFILL_ROWS rows, so a prompt's bits do not depend on what it was packed with.
"""
from __future__ import annotations

from typing import Any

import torch

from engine.config import DEFAULT_CUDA_CANONICAL_PREFILL_MIN_TOKENS, SCRATCH_BLOCK, ZERO_BLOCK, DvrTuning
from engine.model_runner import DUMMY_PREFILL_ROW, DUMMY_TOKEN, ModelRunner, ModelShape, Row
from engine.sampling import SamplingParams
from engine.scheduler import CANONICAL_PREFILL_ROWS, Scheduler, StepKind, canonical_prefill_tokens
from engine.sequence import Sequence, SeqKind
from tests.engine.configs import resolved
from tests.engine.dvr_cases import assert_same
from tests.engine.test_host_overhead import Recorder

BS = 16


def test_pass_size_is_a_function_of_the_prompt_and_config() -> None:
    cfg = resolved(device="cpu", max_num_batched_tokens=1000, tuning=DvrTuning(canonical_prefill_min_tokens=64))
    assert [canonical_prefill_tokens(cfg, n) for n in (1, 63, 64, 65, 200, 513, 1000)] == \
        [64, 64, 64, 128, 256, 1000, 1000]
    assert resolved(device="cpu").tuning.canonical_prefill_min_tokens == 64


def test_cuda_default_pass_is_2048_tokens_at_most_the_budget() -> None:
    """CUDA's default smallest canonical pass is 2048 tokens, at most the prefill budget (a config only:
    building it needs no GPU); another minimum is a setting, and the pass sizes follow it."""
    default = resolved(device="cuda").tuning.canonical_prefill_min_tokens
    assert default == DEFAULT_CUDA_CANONICAL_PREFILL_MIN_TOKENS == 2048
    assert resolved(device="cuda", max_num_batched_tokens=8192).tuning.canonical_prefill_min_tokens == 2048
    assert resolved(device="cuda", max_num_batched_tokens=1024).tuning.canonical_prefill_min_tokens == 1024
    assert resolved(device="cuda", max_num_batched_tokens=8192,
                    tuning=DvrTuning(canonical_prefill_min_tokens=8192)).tuning.canonical_prefill_min_tokens == 8192
    cfg = resolved(device="cuda", max_num_batched_tokens=8192,
                   tuning=DvrTuning(canonical_prefill_min_tokens=2048, canonical_prefill_chunk_tokens=0))
    assert [canonical_prefill_tokens(cfg, n) for n in (1, 2048, 2049, 4097, 8192)] == [2048, 2048, 4096, 8192, 8192]
    # with CUDA's default chunked GEMMs every prompt counts as full size (the pass is cut to its content later)
    chunked = resolved(device="cuda", max_num_batched_tokens=8192)
    assert [canonical_prefill_tokens(chunked, n) for n in (1, 2048, 8192)] == [8192, 8192, 8192]


def test_runner_pads_the_pass_and_the_logits_gemm() -> None:
    model = Recorder()
    seen: list[int] = []
    model.compute_logits = lambda h: (seen.append(h.shape[0]), torch.zeros(h.shape[0], 8))[1]  # type: ignore
    cfg = resolved(device="cpu", num_kv_blocks=64, block_size=BS)
    runner = ModelRunner(cfg, model, ModelShape(1, 1, 4, 8, 4096), torch.float32, torch.device("cpu"))
    rows = [Row([5] * 20, 0, [2, 3]), Row([6] * 7, 0, [4])]
    logits = runner.prefill(rows, pass_tokens=256)
    assert logits.shape == (2, 8) and seen == [CANONICAL_PREFILL_ROWS]
    ids, pos, meta = model.calls[-1]
    assert ids.shape[0] == 256 and meta.slot_mapping.shape[0] == 256
    qsl = meta.query_start_loc.tolist()
    assert qsl[:3] == [0, 20, 27] and qsl[-1] == 256
    dummy_lens = [b - a for a, b in zip(qsl[2:], qsl[3:])]
    assert sum(dummy_lens) == 229 and max(dummy_lens) <= DUMMY_PREFILL_ROW
    assert (ids[27:] == DUMMY_TOKEN).all()
    assert ((meta.slot_mapping[27:] // BS) == SCRATCH_BLOCK).all()      # dummies never touch live blocks
    assert (meta.block_tables[2:] == ZERO_BLOCK).all()                  # and read only the zero block
    assert meta.slot_mapping[:20].tolist() == [2 * BS + i for i in range(16)] + [3 * BS + i for i in range(4)]


def _seq(i: int, n: int, det: bool) -> Sequence:
    return Sequence(f"r{i}", [7] * n, SamplingParams(deterministic=det), 1, SeqKind.DVR if det else SeqKind.FAST, i)


def _full_size_scheduler(seqs: list[Sequence]) -> Scheduler:
    """A scheduler whose canonical pass is as large as a plain pass (256 tokens, as CUDA's default), with
    `seqs` queued in order."""
    cfg = resolved(device="cpu", num_kv_blocks=400, block_size=BS, max_num_batched_tokens=256,
                   tuning=DvrTuning(canonical_prefill_min_tokens=256))
    sched = Scheduler(cfg, set())
    for s in seqs:
        sched.add(s)
    return sched


def test_scheduler_packs_same_size_deterministic_prompts_and_fills_with_fast_ones() -> None:
    cfg = resolved(device="cpu", num_kv_blocks=400, block_size=BS, tuning=DvrTuning(canonical_prefill_min_tokens=64))
    sched = Scheduler(cfg, set())
    seqs = [_seq(0, 30, True), _seq(1, 100, True), _seq(2, 20, True), _seq(3, 10, False), _seq(4, 30, True)]
    for s in seqs:
        sched.add(s)
    plan = sched.schedule()
    assert plan.kind == StepKind.PREFILL and plan.pass_tokens == 64
    # r1 (128-token pass) is skipped, r0 + r2 + the fast r3 fit in 64, r4 would not
    assert [it.seq.request_id for it in plan.prefill] == ["r0", "r2", "r3"]
    plan = sched.schedule()
    assert plan.pass_tokens == 128 and [it.seq.request_id for it in plan.prefill] == ["r1"]
    plan = sched.schedule()
    assert plan.pass_tokens == 64 and [it.seq.request_id for it in plan.prefill] == ["r4"]


def test_fast_prompts_alone_are_batched_without_padding() -> None:
    cfg = resolved(device="cpu", num_kv_blocks=400, block_size=BS)
    sched = Scheduler(cfg, set())
    for s in [_seq(0, 30, False), _seq(1, 40, False), _seq(2, 20, True)]:
        sched.add(s)
    plan = sched.schedule()
    assert plan.pass_tokens is None and [it.seq.request_id for it in plan.prefill] == ["r0", "r1"]


def test_packed_prefill_gives_the_bits_of_a_lone_prefill(make_real_llm: Any, smollm2_source: Any) -> None:
    """The same DVR prompts, prefilled alone and packed (with non-deterministic prompts filling the pass):
    committed token ids and logprobs bitwise equal; the packed run really took fewer prefill passes."""
    tok = smollm2_source.tokenizer
    texts = ["The capital of France is", "Roses are red,", "def add(a, b):", "Once upon a time"]
    prompts = [list(tok.encode(t)) for t in texts]
    det = [SamplingParams(max_tokens=5, temperature=0.8 if i % 2 else 0.0, seed=50 + i, deterministic=True,
                          ignore_eos=True) for i in range(len(prompts))]
    alone = []
    for p, sp in zip(prompts, det):
        llm = make_real_llm(window=4, group=2)
        alone += llm.generate([p], [sp])
        assert llm.core.totals.prefill_passes == 1
    llm = make_real_llm(window=4, group=2)
    fast = SamplingParams(max_tokens=3, temperature=1.0, seed=3)
    mixed = llm.generate(prompts + prompts[:2], det + [fast, fast])
    assert llm.core.totals.prefill_passes == 1  # 4 DVR prompts + 2 fast ones in one 64-token pass
    assert_same(mixed[:4], alone)


def test_a_pulled_forward_prompt_gives_the_bits_of_a_lone_prefill(make_real_llm: Any, smollm2_source: Any
                                                                   ) -> None:
    """A DVR prompt behind a queue that overflows a plain pass is pulled into the first pass (after the
    head, ahead of fast prompts): its committed ids and logprobs equal those of the same prompt prefilled
    alone, bit for bit (P = 64 = the prefill budget, the CUDA default's shape)."""
    tok = smollm2_source.tokenizer
    cfg = dict(window=4, group=2, max_num_batched_tokens=64, canonical_prefill_min_tokens=64)
    fast_prompts = [list(tok.encode(t)) for t in ("word " * 30, "two " * 14, "three " * 20)]
    det_prompt = list(tok.encode("The capital of France is"))
    det = SamplingParams(max_tokens=6, temperature=0.8, seed=9, deterministic=True, ignore_eos=True)
    alone = make_real_llm(**cfg).generate([det_prompt], [det])
    llm = make_real_llm(**cfg)
    assert sum(map(len, fast_prompts[:2])) <= 64 < sum(map(len, fast_prompts))  # a plain pass leaves f2 over
    sched, plans = llm.core.scheduler, []
    schedule = sched.schedule
    sched.schedule = lambda: plans.append(schedule()) or plans[-1]  # type: ignore[method-assign]
    fast = [SamplingParams(max_tokens=2, temperature=1.0, seed=i) for i in range(len(fast_prompts))]
    mixed = llm.generate(fast_prompts + [det_prompt], fast + [det])
    first = plans[0]
    assert first.pass_tokens == 64 and [it.seq.kind for it in first.prefill][:2] == [SeqKind.FAST, SeqKind.DVR]
    assert_same(mixed[-1:], alone)


def test_fast_head_and_full_size_deterministic_prompt_share_one_canonical_pass() -> None:
    """When the canonical pass is as large as a plain pass (the CUDA default), a plain pass reaching a DVR
    prompt becomes canonical and takes it along, instead of stopping before it (one padded pass fewer)."""
    sched = _full_size_scheduler([_seq(0, 30, False), _seq(1, 40, True), _seq(2, 20, False),
                                  _seq(3, 200, False)])
    plan = sched.schedule()
    assert plan.pass_tokens == 256 and [it.seq.request_id for it in plan.prefill] == ["r0", "r1", "r2"]
    plan = sched.schedule()
    assert plan.pass_tokens is None and [it.seq.request_id for it in plan.prefill] == ["r3"]


def test_deterministic_prompt_beyond_the_budget_joins_a_pass_that_leaves_prompts_over() -> None:
    """A plain pass would stop before the DVR prompt (budget) with prompts left over: the pass becomes
    canonical, the head first, then the DVR prompt, then the fast prompts that still fit; the one left
    over takes a plain pass, where before the DVR prompt got a padded 256-token pass of its own."""
    sched = _full_size_scheduler([_seq(0, 200, False), _seq(1, 40, False), _seq(2, 20, True)])
    plan = sched.schedule()
    assert plan.pass_tokens == 256 and [it.seq.request_id for it in plan.prefill] == ["r0", "r2"]
    plan = sched.schedule()
    assert plan.pass_tokens is None and [it.seq.request_id for it in plan.prefill] == ["r1"]


def test_deterministic_prompt_beyond_the_row_cap_joins_the_pass() -> None:
    """The same when the plain pass stops at the row cap (max_num_seqs) rather than the budget."""
    cfg = resolved(device="cpu", num_kv_blocks=400, block_size=BS, max_num_batched_tokens=256, max_num_seqs=3,
                   tuning=DvrTuning(canonical_prefill_min_tokens=256))
    sched = Scheduler(cfg, set())
    for s in [_seq(0, 10, False), _seq(1, 10, False), _seq(2, 10, False), _seq(3, 10, True)]:
        sched.add(s)
    plan = sched.schedule()
    assert plan.pass_tokens == 256 and [it.seq.request_id for it in plan.prefill] == ["r0", "r3", "r1"]


def test_a_small_canonical_pass_is_not_pulled_forward() -> None:
    """A DVR prompt whose canonical pass is smaller than a plain pass (min tokens below the budget) is not
    pulled into a plain pass: it waits for its own small canonical pass."""
    cfg = resolved(device="cpu", num_kv_blocks=400, block_size=BS, max_num_batched_tokens=256,
                   tuning=DvrTuning(canonical_prefill_min_tokens=64))
    sched = Scheduler(cfg, set())
    for s in [_seq(0, 200, False), _seq(1, 40, False), _seq(2, 20, True)]:
        sched.add(s)
    plan = sched.schedule()
    assert plan.pass_tokens is None and [it.seq.request_id for it in plan.prefill] == ["r0", "r1"]
    plan = sched.schedule()
    assert plan.pass_tokens == 64 and [it.seq.request_id for it in plan.prefill] == ["r2"]


def test_a_small_canonical_pass_takes_the_fast_prompts_before_it_when_they_fit() -> None:
    """A plain pass reaching a DVR prompt whose canonical pass is smaller than a plain pass, with fewer tokens
    before it than fit in that pass with it: the pass becomes that canonical pass (the fast prompts before it,
    then it, then fast prompts that still fit), instead of a small plain pass and a padded canonical one.
    When they would not fit, the plain pass stops before it (the test above)."""
    cfg = resolved(device="cpu", num_kv_blocks=400, block_size=BS, max_num_batched_tokens=256,
                   tuning=DvrTuning(canonical_prefill_min_tokens=64))
    sched = Scheduler(cfg, set())
    for s in [_seq(0, 20, False), _seq(1, 30, True), _seq(2, 100, False), _seq(3, 10, False), _seq(4, 40, True)]:
        sched.add(s)
    plan = sched.schedule()
    assert plan.pass_tokens == 64 and [it.seq.request_id for it in plan.prefill] == ["r0", "r1", "r3"]
    plan = sched.schedule()  # r2 (100 tokens) is more than r4's 64-token pass holds: plain, stopping before r4
    assert plan.pass_tokens is None and [it.seq.request_id for it in plan.prefill] == ["r2"]
    plan = sched.schedule()
    assert plan.pass_tokens == 64 and [it.seq.request_id for it in plan.prefill] == ["r4"]


def test_an_oversized_head_is_prefilled_plain_before_a_deterministic_prompt_is_pulled() -> None:
    """A preempted fast sequence re-prefills prompt + outputs, which can exceed the budget: a plain pass
    takes it alone. It would not fit a canonical pass of the budget's size, so no DVR prompt is pulled
    forward behind it (that pass would end empty and nothing would be prefilled); the DVR prompt goes next."""
    head = _seq(0, 200, False)
    head.tokens = [5] * 100  # re-prefill: 200 + 99 tokens > 256
    sched = _full_size_scheduler([head, _seq(1, 20, True)])
    plan = sched.schedule()
    assert plan.pass_tokens is None and [it.seq.request_id for it in plan.prefill] == ["r0"]
    plan = sched.schedule()
    assert plan.pass_tokens == 256 and [it.seq.request_id for it in plan.prefill] == ["r1"]


def test_deterministic_prompts_go_first_so_the_rest_needs_no_padded_pass() -> None:
    """Every waiting deterministic prompt of the pass size joins the canonical pass before the fast ones
    fill it: the prompts left over are all non-deterministic and take a plain (unpadded) pass."""
    sched = _full_size_scheduler([_seq(0, 40, True), _seq(1, 100, False), _seq(2, 100, False),
                                  _seq(3, 50, False), _seq(4, 40, True), _seq(5, 30, False)])
    plan = sched.schedule()
    assert plan.pass_tokens == 256 and [it.seq.request_id for it in plan.prefill] == ["r0", "r4", "r1", "r3"]
    plan = sched.schedule()
    assert plan.pass_tokens is None and [it.seq.request_id for it in plan.prefill] == ["r2", "r5"]


def test_what_shapes_a_canonical_pass_is_in_the_fingerprint() -> None:
    """P is capped by max_num_batched_tokens and the logits GEMM has CANONICAL_PREFILL_ROWS rows: engines
    that differ in either can give a prompt different bits, so their fingerprints differ."""
    from engine.fingerprint import runtime_fingerprint
    from engine.scheduler import CANONICAL_PREFILL_ROWS

    a = runtime_fingerprint(resolved(device="cpu", max_num_batched_tokens=4096))
    b = runtime_fingerprint(resolved(device="cpu", max_num_batched_tokens=2048))
    assert a["canonical_prefill_rows"] == CANONICAL_PREFILL_ROWS
    assert (a["canonical_prefill_max_tokens"], b["canonical_prefill_max_tokens"]) == (4096, 2048)
    assert a != b


def test_a_fast_head_is_never_overtaken_by_deterministic_prompts() -> None:
    """Deterministic prompts of the pass size go first only after the prompts before the anchor: a fast
    prompt at the head that fills most of the pass is prefilled in the first pass, however many
    deterministic prompts keep arriving behind it."""
    sched = _full_size_scheduler([_seq(0, 150, False), _seq(1, 60, True), _seq(2, 60, True)])
    plan = sched.schedule()
    assert plan.pass_tokens == 256 and [it.seq.request_id for it in plan.prefill] == ["r0", "r1"]
