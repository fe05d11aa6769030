"""Penalties, logit bias, grammars and prompt logprobs on the real default model (SmolLM2, float32, CPU):
each processor's effect, constrained outputs that parse and validate, and deterministic rows under them
bit-exact alone, among co-traffic, under injected faults (rollbacks) with the overlap paths on, and in replay."""
from __future__ import annotations

import json
from collections import Counter
from typing import Any

import jsonschema
import pytest

from engine.grammar import GrammarSpec
from engine.sampling import SamplingParams
from tests.engine.dvr_cases import assert_same, assert_windows_cover, one_at_a_time, replay_requests, staggered

SMALL = dict(window=8, group=4)
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CALL = {"type": "object", "properties": {
    "name": {"const": "get_weather"},
    "arguments": {"type": "object", "properties": {"city": {"enum": ["Paris", "London"]}}, "required": ["city"],
                  "additionalProperties": False}}, "required": ["name", "arguments"], "additionalProperties": False}


def chat(tok: Any, text: str) -> list[int]:
    return list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False))


@pytest.fixture(scope="module")
def workload(smollm2_source):
    """Deterministic rows under grammars and penalties (greedy and sampled)."""
    tok = smollm2_source.tokenizer
    schema = GrammarSpec("json_schema", json.dumps(PERSON))
    prompts = [chat(tok, "Give me a person as JSON."), chat(tok, "Describe a made-up person in JSON."),
               chat(tok, "Write a short poem about rain."), chat(tok, "Return a JSON object about Mars.")]
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, seed=1, deterministic=True, grammar=schema,
                       repetition_penalty=1.1),
        SamplingParams(max_tokens=24, temperature=0.8, seed=2, deterministic=True, grammar=schema,
                       presence_penalty=0.5, logit_bias={tok.encode(" Smith", add_special_tokens=False)[0]: 5.0}),
        SamplingParams(max_tokens=16, temperature=0.7, seed=3, deterministic=True, frequency_penalty=0.8,
                       presence_penalty=0.3, repetition_penalty=1.2, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, seed=4, deterministic=True, grammar=GrammarSpec("json_object"),
                       frequency_penalty=0.3, prompt_logprobs=2),
    ]
    return prompts, params


@pytest.fixture(scope="module")
def reference(make_real_llm, workload):
    prompts, params = workload
    return make_real_llm(**SMALL).generate(prompts, params)


def test_constrained_outputs_parse_and_validate(reference) -> None:
    for o in reference[:2]:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), PERSON)
        else:  # cut by max_tokens: still a prefix the schema allows
            assert o.text.lstrip().startswith("{")
    assert reference[0].finish_reason == "stop"
    if reference[3].finish_reason == "stop":
        assert isinstance(json.loads(reference[3].text), dict)


def test_alone_equals_batched(make_real_llm, workload, reference) -> None:
    prompts, params = workload
    alone = one_at_a_time(make_real_llm(**SMALL), prompts, params)
    assert_same(alone, reference)
    assert [o.prompt_logprobs for o in alone] == [o.prompt_logprobs for o in reference]
    assert [o.prompt_top_logprobs for o in alone] == [o.prompt_top_logprobs for o in reference]
    for o in reference:
        assert_windows_cover(o, 8)


def test_among_processed_co_traffic_with_faults_and_overlap(make_real_llm, workload, reference, smollm2_source
                                                            ) -> None:
    """Non-deterministic companions (themselves under a grammar and penalties) arrive between the rows;
    faults roll candidates back; overlap, chained verify and early decode run the in-flight paths."""
    prompts, params = workload
    llm = make_real_llm(fault_rate=0.3, fault_seed=5, overlap=True, chained_verify=True, verify_early_decode=True,
                        max_num_seqs=6, **SMALL)
    core, companion = llm.core, SamplingParams(max_tokens=10, temperature=0.9, seed=7, presence_penalty=1.0,
                                               grammar=GrammarSpec("json_object"))
    original = core.add_request

    def add(rid: str, prompt: list[int], p: SamplingParams) -> Any:
        return original(rid, prompt, companion if rid.startswith("n") else p)

    core.add_request = add  # type: ignore[method-assign]
    out = staggered(llm, prompts, params, every=2, seed=3)
    assert_same(out, reference)
    assert out[3].prompt_logprobs == reference[3].prompt_logprobs
    assert sum(o.rollbacks for o in out) > 0


def test_replay_matches(make_real_llm, workload, reference) -> None:
    prompts, params = workload
    results = make_real_llm(**SMALL).replay(replay_requests(prompts, params, reference))
    assert all(r.match for r in results), [r.first_mismatch for r in results]
    assert [r.token_logprobs for r in results] == [o.token_logprobs for o in reference]
    assert results[3].prompt_logprobs == reference[3].prompt_logprobs


def test_logit_bias_forces_a_token(make_real_llm, smollm2_source) -> None:
    tok = smollm2_source.tokenizer
    banana = tok.encode(" banana", add_special_tokens=False)[0]
    llm = make_real_llm(**SMALL)
    for det in (False, True):
        out = llm.generate([chat(tok, "Say hello.")], SamplingParams(
            max_tokens=4, temperature=0.8, seed=1, deterministic=det, logit_bias={banana: 100.0}))[0]
        assert out.token_ids == [banana] * 4
    banned = llm.generate([list(tok.encode("1, 2, 3, 4,"))], SamplingParams(max_tokens=6, temperature=0.0))[0]
    first = banned.token_ids[0]
    again = llm.generate([list(tok.encode("1, 2, 3, 4,"))], SamplingParams(
        max_tokens=6, temperature=0.0, logit_bias={first: -100.0}))[0]
    assert first not in again.token_ids


def test_penalties_change_repetition(make_real_llm, smollm2_source) -> None:
    """Greedy SmolLM2 repeats a pattern; each penalty lowers the count of its most repeated token."""
    tok = smollm2_source.tokenizer
    prompts = [list(tok.encode("1, 2, 1, 2, 1, 2, 1, 2,")), list(tok.encode("the the the the the the"))]
    llm = make_real_llm(**SMALL)

    def top_counts(**kw: Any) -> list[int]:
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **kw))
        return [Counter(o.token_ids).most_common(1)[0][1] for o in outs]

    plain = top_counts()
    assert plain[0] >= 5 and plain[1] >= 4  # the model repeats itself
    assert top_counts(frequency_penalty=2.0)[0] < plain[0]
    assert top_counts(repetition_penalty=2.0)[0] < plain[0]
    assert top_counts(presence_penalty=2.0)[1] < plain[1]


def test_tagged_call_when_forced(make_real_llm, smollm2_source) -> None:
    """A trigger "<" (forced by a logit bias) opens the tag: the call inside is valid JSON under its schema."""
    tok = smollm2_source.tokenizer
    tagged = {"triggers": ["<"], "tags": [{"begin": "<tool_call>", "schema": CALL, "end": "</tool_call>"}]}
    lt = tok.encode("<", add_special_tokens=False)[0]
    llm = make_real_llm(**SMALL)
    outs = [llm.generate([chat(tok, "What is the weather in Paris?")], SamplingParams(
        max_tokens=48, temperature=0.0, seed=1, deterministic=det, logit_bias={lt: 100.0},
        grammar=GrammarSpec("tagged", json.dumps(tagged))))[0] for det in (True, False)]
    for out in outs:
        assert out.text.startswith("<tool_call>") and "</tool_call>" in out.text, out.text
        body = out.text[len("<tool_call>"): out.text.index("</tool_call>")]
        jsonschema.validate(json.loads(body), CALL)


def test_prompt_logprobs(make_real_llm, smollm2_source) -> None:
    tok = smollm2_source.tokenizer
    prompt = list(tok.encode("The capital of France is Paris."))
    llm = make_real_llm(**SMALL)
    det, fast = (llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3, deterministic=d, seed=1))[0]
                 for d in (True, False))
    for o in (det, fast):
        assert len(o.prompt_logprobs) == len(prompt) - 1 and all(lp <= 0 for lp in o.prompt_logprobs)
        assert all(len(t) == 3 and max(t.values()) >= o.prompt_logprobs[i] for i, t in enumerate(o.prompt_top_logprobs))
    paris = tok.encode(" Paris", add_special_tokens=False)[0]
    assert prompt[-2] == paris and paris in det.prompt_top_logprobs[-2]  # the model expects " Paris"


def test_engine_names_the_field(make_real_llm) -> None:
    llm = make_real_llm(**SMALL)
    with pytest.raises(ValueError, match=r"^SamplingParams\.logit_bias: .*49152"):
        llm.core.validate([1, 2], SamplingParams(logit_bias={49152: 1.0}))
    with pytest.raises(ValueError, match=r"^SamplingParams\.grammar: .*objectx"):
        llm.core.validate([1, 2], SamplingParams(grammar=GrammarSpec("json_schema", '{"type": "objectx"}')))
