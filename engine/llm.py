"""LLM: the offline engine. generate(prompts, params) -> one RequestOutput per prompt, in order."""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq
from typing import Any

import torch

from engine import progress
from engine.config import EngineConfig
from engine.core import EngineCore
from engine.loading import load_model
from engine.model_runner import ModelShape, PagedModel
from engine.replay import ReplayRequest, ReplayResult, add_replays, replay_results, validate_replays
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput

Prompt = str | list[int]


class LLM:
    """`LLM()` loads the default model; `LLM(EngineConfig(...))` or `LLM(model="path", window=16)` (flat
    options, DvrTuning fields included: EngineConfig.from_options)."""

    def __init__(self, config: EngineConfig | None = None, **overrides: Any) -> None:
        if config is not None and overrides:
            raise ValueError(f"LLM: pass an EngineConfig or keyword options, not both (got {sorted(overrides)})")
        config = config or EngineConfig.from_options(overrides)
        started = time.perf_counter()
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        loaded = load_model(config)
        eos = set(loaded.info.eos_token_ids)
        try:
            core = EngineCore(config, loaded.model, loaded.shape, eos, detokenizer(loaded.tokenizer), loaded.tokenizer,
                              tp=loaded.tp)
        except BaseException:
            if loaded.tp is not None:
                loaded.tp.close()
            raise
        self._attach(core, loaded.tokenizer, loaded.info)
        progress.ready(core.config, loaded.info.name, started)

    @classmethod
    def from_parts(cls, config: EngineConfig, model: PagedModel, shape: ModelShape, eos_ids: set[int],
                   tokenizer: Any = None) -> LLM:
        """An engine over an already built model (tests use a mock model, benches share weights)."""
        self = cls.__new__(cls)
        self._attach(EngineCore(config, model, shape, eos_ids, detokenizer(tokenizer), tokenizer), tokenizer, None)
        return self

    def _attach(self, core: EngineCore, tokenizer: Any, info: Any) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.model_info = info
        self._ids = itertools.count()

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    def close(self) -> None:
        """Stop the tensor-parallel worker processes (tensor_parallel_size > 1); nothing to do otherwise."""
        self.core.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        prompts = [prompts] if isinstance(prompts, str) or _is_ids(prompts) else list(prompts)
        plist = _per_prompt(params, len(prompts))
        token_lists = [self._encode(p) for p in prompts]
        for ids, p in zip(token_lists, plist):  # validate everything before queueing anything
            self.core.validate(ids, p)
        seqs = [self.core.add_request(f"gen-{next(self._ids)}", ids, p) for ids, p in zip(token_lists, plist)]
        while any(not s.is_finished for s in seqs):
            self.core.step()
        return [self.core.output(s) for s in seqs]

    def chat(self, conversations: list[dict[str, str]] | list[list[dict[str, str]]],
             params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        convs = [conversations] if conversations and isinstance(conversations[0], dict) else conversations
        ids = [list(self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=True,
                                                       return_dict=False)) for c in convs]
        return self.generate(ids, params)

    def replay(self, requests: list[ReplayRequest]) -> list[ReplayResult]:
        """Re-execute recorded windows teacher-forced, all replays sharing G x W verify passes."""
        validate_replays(self.core.limits(), self.core.tokenizer, requests)
        seqs = add_replays(self.core, requests)
        while any(not s.is_finished for s in seqs):
            self.core.step()
        return replay_results(requests, seqs)

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: text prompts need a tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]


def detokenizer(tokenizer: Any) -> Callable[[list[int]], str] | None:
    if tokenizer is None:
        return None
    from engine.detokenize import Detokenizer

    return Detokenizer(tokenizer)


def _is_ids(x: Any) -> bool:
    return isinstance(x, list) and (not x or isinstance(x[0], int))


def _per_prompt(params: SamplingParams | Seq[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"params: got {len(params)} SamplingParams for {n} prompts")
    return list(params)
