"""Workloads and checks shared by the mock-model and real-model DVR tests."""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from engine.llm import LLM
from engine.replay import ReplayRequest
from engine.sampling import SamplingParams
from engine.scheduler import StepKind
from engine.sequence import RequestOutput, SeqKind


def det_workload(n: int, vocab: int, max_tokens: tuple[int, int], seed: int = 0,
                 prompt_len: tuple[int, int] = (3, 20)) -> tuple[list[list[int]], list[SamplingParams]]:
    """n deterministic requests: mixed prompt lengths and max_tokens, half greedy, half sampled."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append([rng.randrange(2, vocab) for _ in range(rng.randint(*prompt_len))])
        sampled = i % 2 == 1
        params.append(SamplingParams(
            max_tokens=rng.randint(*max_tokens), temperature=0.8 if sampled else 0.0,
            top_p=0.9 if i % 4 == 1 else 1.0, top_k=20 if i % 4 == 3 else 0,
            seed=rng.randrange(2**64) if sampled else 7, deterministic=True, ignore_eos=i % 3 != 0))
    return prompts, params


REAL_TEXTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):", "Roses are red,",
              "2 + 2 =", "The quick brown fox"]


def real_workload(tokenizer: Any, max_tokens: Callable[[int], int]) -> tuple[list[list[int]], list[SamplingParams]]:
    """REAL_TEXTS as deterministic requests for a real model: request i has max_tokens(i) outputs, even ones
    greedy, odd ones sampled (temperature 0.9, seed 300 + i), EOS ignored."""
    prompts = [list(tokenizer.encode(t)) for t in REAL_TEXTS]
    params = [SamplingParams(max_tokens=max_tokens(i), temperature=0.9 if i % 2 else 0.0, seed=300 + i,
                             deterministic=True, ignore_eos=True) for i in range(len(REAL_TEXTS))]
    return prompts, params


def fast_params(seed: int = 99, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def one_at_a_time(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[RequestOutput]:
    return [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]


def staggered(llm: LLM, prompts: list[list[int]], params: list[SamplingParams], every: int = 2,
              noise_prompt: list[int] | None = None, seed: int = 0) -> list[RequestOutput]:
    """Arrivals spread over steps, each with a non-deterministic companion request."""
    core = llm.core
    rng = random.Random(seed)
    order = list(range(len(prompts)))
    rng.shuffle(order)
    seqs: dict[int, Any] = {}
    step = 0
    while order or core.has_work():
        if order and step % every == 0:
            i = order.pop()
            seqs[i] = core.add_request(f"d{i}-{seed}", prompts[i], params[i])
            noise = noise_prompt or prompts[i][::-1]
            core.add_request(f"n{i}-{seed}", noise, fast_params(seed=i, max_tokens=rng.randint(3, 15)))
        core.step()
        step += 1
    return [core.output(seqs[i]) for i in range(len(prompts))]


def assert_same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    """Bitwise: token ids and float logprob lists compared with ==."""
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_logprobs for o in a] == [o.token_logprobs for o in b]
    assert [o.finish_reason for o in a] == [o.finish_reason for o in b]


def assert_windows_cover(out: RequestOutput, window: int) -> None:
    """Windows are contiguous, each 1..W tokens, and cover [1, len(token_ids))."""
    expect = 1
    for s, e in out.windows:
        assert s == expect and 1 <= e - s <= window, (out.request_id, out.windows)
        expect = e
    assert expect == max(1, len(out.token_ids)), (out.request_id, out.windows, len(out.token_ids))


def record_verify_kinds(llm: LLM) -> list[SeqKind]:
    """Wrap the scheduler so every sequence that enters a verify pass is recorded (by kind)."""
    kinds: list[SeqKind] = []
    sched = llm.core.scheduler
    original = sched.schedule

    def schedule() -> Any:
        plan = original()
        if plan.kind == StepKind.VERIFY:
            kinds.extend(row.seq.kind for row in plan.verify)
        return plan

    sched.schedule = schedule  # type: ignore[method-assign]
    return kinds


def replay_requests(prompts: list[list[int]], params: list[SamplingParams],
                    outs: list[RequestOutput]) -> list[ReplayRequest]:
    return [ReplayRequest(f"rp{i}", p, o.token_ids, replace(sp, seed=o.seed), o.windows, o.window_shape)
            for i, (p, sp, o) in enumerate(zip(prompts, params, outs))]


def load_workload(tokenizer: Any, deterministic: Callable[[int], bool] = lambda i: True,
                  ) -> tuple[list[tuple[list[int], SamplingParams]], list[list[int]]]:
    """The issue-5 load test's 64 requests (greedy and sampled) and the prompt pool of their co-traffic;
    `deterministic(i)` sets request i's flag."""
    topics = ["the sea", "bread", "Mars", "jazz", "tax law", "bees", "chess", "rain", "Rome", "DNA", "glass"]
    pool = [list(tokenizer.encode(f"Tell me about {t}. {'Be brief.' if k % 2 else 'Give details and examples.'}"))
            for k, t in enumerate(topics * 2)]
    det = []
    for i in range(64):
        sampled = i % 2 == 1
        det.append((pool[i % len(pool)] + [tokenizer.encode(str(i))[0]], SamplingParams(
            max_tokens=24 + i % 17, temperature=0.8 if sampled else 0.0, top_p=0.95 if i % 4 == 1 else 1.0,
            seed=10_000 + i, deterministic=deterministic(i),
            ignore_eos=i % 5 != 0)))
    return det, pool


def load_run(llm: LLM, det: list[tuple[list[int], SamplingParams]], pool: list[list[int]], seed: int,
             n_other: int = 192) -> list[RequestOutput]:
    """The `det` requests + `n_other` non-deterministic ones from `pool`, arriving at random steps
    (arrival order and co-traffic by seed); returns the outputs of `det`, in order."""
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
    return [core.output(seqs[f"d{i}"]) for i in range(len(det))]
