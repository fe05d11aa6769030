"""Logits processors and grammars without a model forward: the specification of engine/processors.py checked
bit for bit against a literal numpy reading of it, the grammar state as a pure function of the prefix, and the
errors that name their field."""
from __future__ import annotations

import dataclasses
import json
import random

import numpy as np
import pytest
import torch

from engine.grammar import (PARALLEL_MASKS, GrammarError, GrammarSpec, GrammarState, compile_grammar, fill_masks,
                            tokenizer_info, validate_grammar)
from engine.processors import Slot, apply_processors
from engine.sampling import SamplingParams, sample_row

VOCAB = 300


def reference(x: np.ndarray, p: SamplingParams, prompt: list[int], out: list[int]) -> np.ndarray:
    """The docstring of engine/processors.py, steps 1-3, one id at a time in float32."""
    x = x.astype(np.float32).copy()
    f32 = np.float32
    if p.repetition_penalty != 1.0:
        r = f32(p.repetition_penalty)
        for t in sorted(set(prompt) | set(out)):
            x[t] = x[t] / r if x[t] > 0 else x[t] * r
    if p.frequency_penalty or p.presence_penalty:
        for t in sorted(set(out)):
            x[t] = x[t] - f32(out.count(t)) * f32(p.frequency_penalty)
            x[t] = x[t] - f32(p.presence_penalty)
    for t, b in p.logit_bias:
        x[t] = x[t] + f32(b)
    return x


def random_params(rng: random.Random) -> SamplingParams:
    bias = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randint(0, 6))}
    return SamplingParams(logit_bias=bias, presence_penalty=rng.choice([0.0, 0.7, -1.3, 2.0]),
                          frequency_penalty=rng.choice([0.0, 0.4, -2.0, 1.1]),
                          repetition_penalty=rng.choice([1.0, 1.3, 0.6, 2.0]))


def test_processors_follow_the_specification_bit_for_bit() -> None:
    rng = random.Random(5)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(12, VOCAB, generator=gen) * 6
    slots, rows = [], []
    for r in range(12):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        out = [rng.randrange(40) for _ in range(rng.randint(0, 40))]  # repeats, so counts > 1
        slots.append(Slot(random_params(rng), prompt, out + [1, 2, 3], len(out)))
        rows.append(r)
    got = logits.clone()
    apply_processors(got, rows, slots)
    for r, s in zip(rows, slots):
        want = reference(logits[r].numpy(), s.params, list(s.prompt), list(s.outputs[: s.n]))
        assert got[r].numpy().tobytes() == want.tobytes(), r


def test_a_row_is_processed_the_same_alone_and_among_others() -> None:
    rng = random.Random(9)
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(1))
    slots = [Slot(random_params(rng), [3, 4, 5], [7, 7, 8, 9], 4) for _ in range(6)]
    batch = logits.clone()
    apply_processors(batch, list(range(6)), slots)
    for r in range(6):
        alone = logits[r: r + 1].clone()
        apply_processors(alone, [0], [slots[r]])
        assert alone[0].numpy().tobytes() == batch[r].numpy().tobytes()


def test_each_processor_moves_the_logits_it_should() -> None:
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5, 3.0]])
    rp = x.clone()
    apply_processors(rp, [0], [Slot(SamplingParams(repetition_penalty=2.0), [0], [1], 1)])
    assert rp.tolist() == [[1.0, -4.0, 1.0, 0.5, 3.0]]  # prompt id 0 and output id 1, by sign
    fp = x.clone()
    apply_processors(fp, [0], [Slot(SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0], [2, 2, 3], 3)])
    assert fp.tolist() == [[2.0, -2.0, 1.0 - 1.0 - 0.25, 0.5 - 0.5 - 0.25, 3.0]]  # generated ids only
    lb = x.clone()
    apply_processors(lb, [0], [Slot(SamplingParams(logit_bias={1: 100.0}), [0], [], 0)])
    res = sample_row(lb[0].numpy(), SamplingParams(temperature=0.0), 1, 1)
    assert res.token == 1


@pytest.fixture(scope="module")
def info(smollm2_source):
    return tokenizer_info(smollm2_source.tokenizer, 49152, smollm2_source.info.eos_token_ids)


PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _allowed(bitmask: torch.Tensor, row: int = 0) -> set[int]:
    bits = ((bitmask[row].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
    return set(bits.nonzero().flatten().tolist())


def test_grammar_mask_is_a_pure_function_of_the_prefix(info, smollm2_source) -> None:
    """Masks asked for prefixes in a random order (rollbacks, re-accepts, an unacceptable token in the
    middle) equal the masks of a fresh matcher fed each prefix once."""
    tok = smollm2_source.tokenizer
    compiled = compile_grammar(GrammarSpec("json_schema", json.dumps(PERSON)), info)
    good = list(tok.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)) + [2]
    bad = good[:7] + [tok.encode("zebra", add_special_tokens=False)[0]] + good[7:]  # after '",': rejected
    words = info.words
    for outputs in (good, bad):
        fresh = []
        for n in range(len(outputs) + 1):
            bm = torch.zeros((1, words), dtype=torch.int32)
            GrammarState(compiled, info).fill(outputs, n, bm, 0)
            fresh.append(bm.clone())
        state = GrammarState(compiled, info)
        order = list(range(len(outputs) + 1)) * 2
        random.Random(3).shuffle(order)
        for n in order:
            bm = torch.zeros((1, words), dtype=torch.int32)
            state.fill(outputs, n, bm, 0)
            assert torch.equal(bm, fresh[n]), n
        state.follow(outputs, len(outputs))  # a kept mask is served without moving the matcher: move it
        assert state.accepted.count(False) == (outputs is bad)
    # one state asked along two prefixes that part at position 7, in turn: the masks it keeps from one are
    # never served for the other (GrammarState.masks)
    fresh = {id(o): [] for o in (good, bad)}
    for outputs in (good, bad):
        for n in range(len(outputs) + 1):
            bm = torch.zeros((1, words), dtype=torch.int32)
            GrammarState(compiled, info).fill(outputs, n, bm, 0)
            fresh[id(outputs)].append(bm.clone())
    state = GrammarState(compiled, info)
    asks = [(o, n) for o in (good, bad) for n in range(len(o) + 1)] * 2
    random.Random(5).shuffle(asks)
    for outputs, n in asks:
        bm = torch.zeros((1, words), dtype=torch.int32)
        state.fill(outputs, n, bm, 0)
        assert torch.equal(bm, fresh[id(outputs)][n]), (outputs is bad, n)
    assert state.masks  # some were kept
    once = GrammarState(compiled, info, keep_masks=False)  # a row that is not verified keeps none
    for n in range(len(good) + 1):
        bm = torch.zeros((1, words), dtype=torch.int32)
        once.fill(good, n, bm, 0)
        assert torch.equal(bm, fresh[id(good)][n]), n
    assert not once.masks
    # a verify pass asks one state for every position of its window (and other states) in one call
    walk, other = GrammarState(compiled, info), GrammarState(compiled, info)
    n_all = len(bad) + 1
    bm = torch.zeros((n_all + 2, words), dtype=torch.int32)
    requests = [(walk, bad, n, 0, n) for n in reversed(range(n_all))] + [(other, good, 3, 0, n_all),
                                                                        (other, good, 9, 2, n_all + 1)]
    fill_masks(requests, bm)
    def fresh_mask(outputs: list[int], n: int) -> torch.Tensor:
        one = torch.zeros((1, words), dtype=torch.int32)
        GrammarState(compiled, info).fill(outputs, n, one, 0)
        return one[0]

    assert all(torch.equal(bm[n], fresh_mask(bad, n)) for n in range(n_all))
    assert torch.equal(bm[n_all], fresh_mask(good, 3)) and torch.equal(bm[n_all + 1], fresh_mask(good, 9))
    state = GrammarState(compiled, info)
    bm = torch.zeros((1, words), dtype=torch.int32)
    state.fill(good, len(good) - 1, bm, 0)
    assert _allowed(bm) == {2}  # the object is complete: only EOS
    state.fill(good, len(good), bm, 0)
    assert _allowed(bm) == {2}  # after EOS: still only the stop tokens


def test_decode_steps_feed_one_output_and_give_the_fresh_masks(info, smollm2_source) -> None:
    """A row asked the way decode steps ask (the slot after all its outputs, every output committed) is fed one
    output a step; each mask equals a fresh matcher's for that prefix, along an unacceptable token and past EOS,
    with masks kept or not, and the state ends where one walk over the whole prefix ends."""
    tok = smollm2_source.tokenizer
    compiled = compile_grammar(GrammarSpec("json_schema", json.dumps(PERSON)), info)
    good = list(tok.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)) + [2]
    bad = good[:7] + [tok.encode("zebra", add_special_tokens=False)[0]] + good[7:]
    for outputs, rejected in ((good, 0), (bad, 1), (good + [5, 2], 2)):  # after EOS every token is rejected
        walked = GrammarState(compiled, info)
        walked.follow(outputs, len(outputs))
        for keep in (False, True):
            state = GrammarState(compiled, info, keep_masks=keep)
            for n in range(len(outputs) + 1):
                bm = torch.zeros((2, info.words), dtype=torch.int32)
                fill_masks([(state, outputs, n, n, 1)], bm)
                assert torch.equal(bm[1], _fresh(compiled, info, outputs, n)), (keep, n)
            assert (state.ids, state.accepted, state.terminated, state.fixed) == \
                (walked.ids, walked.accepted, walked.terminated, len(outputs)), keep
            assert set(state.masks) <= {len(outputs)}  # the slots before the last are committed: none kept
        assert walked.accepted.count(False) == rejected


def _fresh(compiled, info, outputs: list[int], n: int) -> torch.Tensor:
    """The mask after outputs[:n] from a new state."""
    one = torch.zeros((1, info.words), dtype=torch.int32)
    GrammarState(compiled, info).fill(outputs, n, one, 0)
    return one[0]


def test_a_completed_row_asks_the_library_nothing(info, smollm2_source, capfd) -> None:
    """A row held past its stop token (ignore_eos): every later slot allows only the stop tokens, the tokens after
    the stop are skipped without the library being asked (it would log a warning for each), and a rollback to
    before the stop finds the grammar open again."""
    compiled = compile_grammar(GrammarSpec("json_schema", json.dumps(PERSON)), info)
    good = list(smollm2_source.tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)) + [2]
    held = good + [2, 2, 2]
    capfd.readouterr()
    state = GrammarState(compiled, info, keep_masks=False)
    bm = torch.zeros((1, info.words), dtype=torch.int32)
    for n in range(len(good), len(held) + 1):
        state.fill(held, n, bm, 0, committed=n)
        assert _allowed(bm) == {2}, n
    assert state.accepted == [True] * len(good) + [False] * 3
    assert "terminated" not in capfd.readouterr().err
    state.fill(held, 5, bm, 0)
    assert torch.equal(bm[0], _fresh(compiled, info, held, 5)) and 2 not in _allowed(bm)
    state.fill(held, len(held), bm, 0)
    assert _allowed(bm) == {2}


def test_a_window_reads_kept_masks_without_moving_the_matcher(info, smollm2_source) -> None:
    """A DVR row's verify window over the prefixes its fast path filled copies the kept masks and leaves the
    matcher where the fast path left it; a prefix that then parts from the window inside it (a rollback) still
    gets its own masks."""
    tok = smollm2_source.tokenizer
    compiled = compile_grammar(GrammarSpec("json_schema", json.dumps(PERSON)), info)
    good = list(tok.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)) + [2]
    bad = good[:7] + [tok.encode("zebra", add_special_tokens=False)[0]] + good[7:]  # parts from good at 7
    state = GrammarState(compiled, info)
    bm = torch.zeros((1, info.words), dtype=torch.int32)
    for n in range(3, 12):  # the fast path after a committed prefix of 3
        state.fill(good, n, bm, 0, committed=3)
    window = torch.zeros((8, info.words), dtype=torch.int32)
    fill_masks([(state, good, n, 3, n - 3) for n in range(3, 11)], window)
    assert all(torch.equal(window[n - 3], _fresh(compiled, info, good, n)) for n in range(3, 11))
    assert state.ids == good[:11]  # not walked back
    for n in range(8, len(bad) + 1):  # the window kept good[:7] and committed bad[7]
        state.fill(bad, n, bm, 0, committed=8)
        assert torch.equal(bm[0], _fresh(compiled, info, bad, n)), n


@pytest.mark.parametrize("count", [PARALLEL_MASKS - 1, PARALLEL_MASKS])
def test_masks_filled_in_one_batch_equal_single_fills(info, smollm2_source, count) -> None:
    """One round of `count` states, on one thread below PARALLEL_MASKS and on several from it, at rows out of
    order: every row equals the mask a single state fills."""
    compiled = compile_grammar(GrammarSpec("json_schema", json.dumps(PERSON)), info)
    good = list(smollm2_source.tokenizer.encode('{"name": "Ada", "age": 36}', add_special_tokens=False)) + [2]
    rows = list(range(count))
    random.Random(count).shuffle(rows)
    requests = [(GrammarState(compiled, info), good, i % len(good), 0, row) for i, row in enumerate(rows)]
    bm = torch.zeros((count, info.words), dtype=torch.int32)
    fill_masks(requests, bm)
    fresh = [_fresh(compiled, info, good, n) for n in range(len(good))]
    assert all(torch.equal(bm[row], fresh[i % len(good)]) for i, row in enumerate(rows))


@pytest.mark.parametrize("spec, words", [
    (GrammarSpec("json_schema", '{"type": "objectx"}'), "objectx"),
    (GrammarSpec("json_schema", "{not json"), "not JSON"),
    (GrammarSpec("json_schema", '{"$ref": "#/definitions/missing"}'), "missing"),
    (GrammarSpec("ebnf", 'root ::= "a" | '), "EBNF"),
    (GrammarSpec("tagged", '{"triggers": ["<t>"], "tags": []}'), "non-empty"),
    (GrammarSpec("tagged", '{"triggers": ["<a"], "tags": [{"begin": "<b>", "schema": {}, "end": "</b>"}]}'),
     "none of the triggers"),
    (GrammarSpec("regex", "a+"), "kind"),
    (GrammarSpec("json_object", "{}"), "no source"),
])
def test_bad_grammars_are_named(smollm2_source, spec, words) -> None:
    with pytest.raises(GrammarError, match=words) as err:
        validate_grammar(spec, smollm2_source.tokenizer)
    assert str(err.value).startswith("grammar: ")
    assert isinstance(err.value, ValueError)


def test_good_grammars_compile(smollm2_source) -> None:
    tagged = {"triggers": ["<tool_call>"], "tags": [{"begin": "<tool_call>", "schema": PERSON, "end": "</tool_call>"}]}
    for spec in (GrammarSpec("json_object"), GrammarSpec("json_schema", json.dumps(PERSON)),
                 GrammarSpec("ebnf", 'root ::= "yes" | "no"'), GrammarSpec("tagged", json.dumps(tagged))):
        validate_grammar(spec, smollm2_source.tokenizer)


@pytest.mark.parametrize("kw, field", [
    (dict(presence_penalty=2.5), "presence_penalty"), (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(repetition_penalty=2.5), "repetition_penalty"),
    (dict(logit_bias={5: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias=[(5, 1.0), (5, 2.0)]), "logit_bias"), (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
])
def test_params_out_of_range_are_named(kw, field) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}:"):
        SamplingParams(**kw).validate()


def test_params_round_trip_through_json() -> None:
    """A signed transcript stores the params as JSON: they come back as the same frozen value."""
    p = SamplingParams(logit_bias={9: -3.5, 2: 100.0}, presence_penalty=0.5, repetition_penalty=1.2,
                       grammar=GrammarSpec("json_schema", json.dumps(PERSON)), prompt_logprobs=2)
    back = SamplingParams(**json.loads(json.dumps(dataclasses.asdict(p))))
    assert back == p and back.logit_bias == ((2, 100.0), (9, -3.5)) and isinstance(back.grammar, GrammarSpec)


def test_host_sampler_never_picks_a_masked_id() -> None:
    x = np.random.default_rng(0).normal(size=1000).astype(np.float32) * 4
    allowed = [3, 500, 999]
    masked = np.full(1000, -np.inf, dtype=np.float32)
    masked[allowed] = x[allowed]
    for p in (SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=0.9, top_p=0.9, logprobs=5)):
        for seed in range(20):
            res = sample_row(masked, p, seed, 7)
            assert res.token in allowed and res.logprob > -np.inf
            assert res.top_logprobs is not None and sorted(res.top_logprobs) == allowed
