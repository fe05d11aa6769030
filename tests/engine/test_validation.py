"""Every bad input raises ValueError naming the field and the limit, before any work is queued, and the
engine keeps serving."""
from __future__ import annotations

import json

import pytest

from engine.config import EngineConfig
from engine.llm import LLM
from engine.sampling import SamplingParams

BAD = [
    ([], SamplingParams(), "prompt"),
    ([5] * 500, SamplingParams(max_tokens=20), "max_tokens"),        # beyond the mock's 512 context
    ([5, 6], SamplingParams(max_tokens=0), "max_tokens"),
    ([5, 6], SamplingParams(temperature=-0.1), "temperature"),
    ([5, 6], SamplingParams(top_p=0.0), "top_p"),
    ([5, 6], SamplingParams(top_p=1.5), "top_p"),
    ([5, 6], SamplingParams(top_k=-1), "top_k"),
    ([5, 99999], SamplingParams(), "prompt_token_ids"),
    ([5, 6], SamplingParams(seed=2**64), "seed"),
]


@pytest.mark.parametrize("prompt,params,field", BAD)
def test_bad_request_raises_naming_field(make_mock_llm, prompt, params, field) -> None:
    llm = make_mock_llm()
    with pytest.raises(ValueError, match=field):
        llm.generate([[3, 4], prompt], [SamplingParams(max_tokens=3), params])
    assert not llm.core.has_work() and llm.core.seqs == {}  # nothing was queued
    assert len(llm.generate([[3, 4]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids) == 3


def test_context_limit_message_has_numbers(make_mock_llm) -> None:
    with pytest.raises(ValueError, match=r"max_tokens.*500.*20.*520.*512"):
        make_mock_llm().core.validate([5] * 500, SamplingParams(max_tokens=20))


def test_kv_budget_limit(make_mock_llm) -> None:
    with pytest.raises(ValueError, match="KV budget"):
        make_mock_llm(num_kv_blocks=4, block_size=4).core.validate([5] * 4, SamplingParams(max_tokens=10))


@pytest.mark.parametrize("cfg,field", [
    (dict(window=1), "window"), (dict(group=0), "group"), (dict(fault_rate=1.5), "fault_rate"),
    (dict(device="tpu"), "device"), (dict(dtype="int8"), "dtype"), (dict(mode="fast"), "mode"),
    (dict(num_kv_blocks=2), "num_kv_blocks"), (dict(attention_backend="flash"), "attention_backend"),
])
def test_bad_config(cfg, field) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig(**cfg)


def test_missing_model_path(tmp_path) -> None:
    with pytest.raises(ValueError, match="model.*does not exist"):
        LLM(model=str(tmp_path / "nope"))


def test_unsupported_architecture(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="model.*unsupported architecture"):
        LLM(model=str(tmp_path))
