"""Constrained decoding: grammar specs, their compilation, and per-row matchers.

A `GrammarSpec` names what a row's output must match:

    kind          source
    json_object   ""                        any JSON object
    json_schema   the JSON schema, as text  a JSON value valid under the schema (strict: no extra properties)
    ebnf          grammar text              the library's EBNF dialect (GBNF-like, start rule `root`)
    tagged        JSON text (below)         free text in which a trigger begins a tagged segment

tagged source: {"triggers": ["<tool_call>"], "tags": [{"begin": "<tool_call>", "schema": {...}, "end": "</tool_call>"}]}
Outside a segment any text is allowed; once the text reaches a trigger, one of the tags whose `begin` starts
with it must follow: `begin`, a JSON value valid under its schema, then `end`.

`compile_grammar(spec, tokenizer_info)` compiles a spec against a vocabulary (GrammarError, a ValueError whose
message names the problem, when it cannot); `compile_request_grammar(spec, tokenizer, vocab_size, stop_ids)`
compiles a request's grammar for the engine's model (request validation and the engine use it);
`validate_grammar(spec, tokenizer)` checks a spec for a Hugging Face tokenizer, for callers that want the error
before anything is queued.

The library is xgrammar (chosen by bench/grammar_bench.py: per-token masks 4-5x faster than llguidance's on
SmolLM2's vocabulary; docs/decisions.md). JSON is compiled strict (no properties outside the schema) with
free whitespace. A row's grammar state (`GrammarState`) is a pure function of its output prefix: a token the
matcher cannot accept (a fault-injected candidate) leaves the state unchanged, and once the stop token is
accepted only the stop tokens are allowed. The state follows the row's prefix by rolling the matcher back
to the common prefix and accepting the rest, so a verify pass walks a window position by position and a
rollback is a matcher rollback.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import numpy as np
import torch

GRAMMAR_KINDS = ("json_object", "json_schema", "ebnf", "tagged")


@dataclass(frozen=True)
class GrammarSpec:
    kind: str
    source: str = ""


class GrammarError(ValueError):
    """A grammar spec that cannot be compiled; the message names the problem."""


def check_spec(spec: GrammarSpec) -> Any:
    """Structural checks of a spec (kind, JSON text where JSON is expected); returns the parsed source
    (the schema, the tagged structure) or None. Raises GrammarError."""
    if not isinstance(spec, GrammarSpec):
        raise GrammarError(f"grammar: expected a GrammarSpec, got {type(spec).__name__}")
    if spec.kind not in GRAMMAR_KINDS:
        raise GrammarError(f"grammar: kind must be one of {list(GRAMMAR_KINDS)}, got {spec.kind!r}")
    if not isinstance(spec.source, str):
        raise GrammarError(f"grammar: source must be a string, got {type(spec.source).__name__}")
    if spec.kind == "json_object":
        if spec.source:
            raise GrammarError("grammar: a json_object grammar takes no source")
        return None
    if spec.kind == "ebnf":
        if not spec.source.strip():
            raise GrammarError("grammar: an ebnf grammar needs its grammar text")
        return None
    try:
        parsed = json.loads(spec.source)
    except json.JSONDecodeError as exc:
        raise GrammarError(f"grammar: the {spec.kind} source is not JSON: {exc}") from None
    if spec.kind == "json_schema":
        if not isinstance(parsed, (dict, bool)):
            raise GrammarError(f"grammar: a JSON schema must be an object or a boolean, got {type(parsed).__name__}")
        return parsed
    return _check_tagged(parsed)


def _check_tagged(parsed: Any) -> dict[str, Any]:
    if not isinstance(parsed, dict) or set(parsed) != {"triggers", "tags"}:
        raise GrammarError('grammar: a tagged source is {"triggers": [...], "tags": [...]}')
    triggers, tags = parsed["triggers"], parsed["tags"]
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError("grammar: tagged triggers must be a non-empty list of non-empty strings")
    if not isinstance(tags, list) or not tags:
        raise GrammarError("grammar: tagged tags must be a non-empty list")
    for i, tag in enumerate(tags):
        if not isinstance(tag, dict) or set(tag) != {"begin", "schema", "end"}:
            raise GrammarError(f'grammar: tag {i} must be {{"begin": str, "schema": object, "end": str}}')
        if not isinstance(tag["begin"], str) or not isinstance(tag["end"], str) or not tag["begin"]:
            raise GrammarError(f"grammar: tag {i}: begin (non-empty) and end must be strings")
        if not isinstance(tag["schema"], (dict, bool)):
            raise GrammarError(f"grammar: tag {i}: schema must be a JSON schema object")
        if not any(tag["begin"].startswith(t) for t in triggers):
            raise GrammarError(f"grammar: tag {i}: begin {tag['begin']!r} starts with none of the triggers")
    return parsed



GRAMMAR_LIBRARY = f"xgrammar-{metadata.version('xgrammar')}"

PARALLEL_MASKS = 128
"""The fewest masks one batch fill spreads over threads (TokenizerInfo.parallel); smaller batches take one."""
PARALLEL_THREADS = max(1, min(8, os.cpu_count() or 1))
"""The threads of a parallel batch fill."""


class TokenizerInfo:
    """A vocabulary for the grammar library: the tokenizer's tokens padded to the model's `vocab_size`, the
    stop tokens, and a compiler whose cache keeps every compiled grammar (a schema compiles once)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]) -> None:
        import xgrammar as xgr

        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(sorted(stop_token_ids))
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=list(self.stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self.words = (vocab_size + 31) // 32   # int32 words of one bitmask row
        # The library's batch fill starts its threads anew on every call with more than one thread, which costs
        # more than a few masks take to fill: a batch of fewer than PARALLEL_MASKS masks is filled on one.
        self.serial = xgr.BatchGrammarMatcher(max_threads=1)
        self.parallel = xgr.BatchGrammarMatcher(max_threads=PARALLEL_THREADS)
        self.stop_set = frozenset(self.stop_token_ids)
        stop = np.zeros(self.words, dtype=np.int64)
        for t in self.stop_token_ids:
            stop[t // 32] |= 1 << (t % 32)
        self.stop_mask = stop.astype(np.uint32).view(np.int32)  # [words]: only the stop tokens
        self.staging: dict[torch.device, Any] = {}  # by CUDA device: engine.processors.MaskStaging


_INFOS: dict[tuple[int, int, tuple[int, ...]], tuple[Any, TokenizerInfo]] = {}
_INFOS_LOCK = threading.Lock()


def tokenizer_info(tokenizer: Any, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None
                   ) -> TokenizerInfo:
    """The TokenizerInfo of a Hugging Face tokenizer (built once per tokenizer, vocab size and stop tokens:
    building one takes a few hundred ms). Defaults: vocab_size = len(tokenizer), the tokenizer's EOS id."""
    vocab = int(vocab_size if vocab_size is not None else len(tokenizer))
    stops = tuple(sorted(stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id]))
    key = (id(tokenizer), vocab, stops)
    with _INFOS_LOCK:
        hit = _INFOS.get(key)
        if hit is None or hit[0] is not tokenizer:
            hit = _INFOS[key] = (tokenizer, TokenizerInfo(tokenizer, vocab, stops))
        return hit[1]


def compile_grammar(spec: GrammarSpec, tokenizer_info: TokenizerInfo) -> Any:
    """The spec compiled against a vocabulary (an xgrammar CompiledGrammar); GrammarError when it cannot be."""
    parsed = check_spec(spec)
    compiler = tokenizer_info.compiler
    try:
        if spec.kind == "json_object":  # OpenAI's json_object: an object (any keys), not any JSON value
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=True, strict_mode=False)
        if spec.kind == "json_schema":
            return compiler.compile_json_schema(spec.source, any_whitespace=True, strict_mode=True)
        if spec.kind == "ebnf":
            return compiler.compile_grammar(spec.source)
        return _compile_tagged(compiler, parsed)
    except (RuntimeError, ValueError, TypeError) as exc:
        raise GrammarError(f"grammar: the {spec.kind} grammar does not compile: {_library_message(exc)}") from None


def _compile_tagged(compiler: Any, parsed: dict[str, Any]) -> Any:
    import xgrammar as xgr

    tags = [xgr.StructuralTagItem(begin=t["begin"], schema=json.dumps(t["schema"]), end=t["end"])
            for t in parsed["tags"]]
    return compiler.compile_structural_tag(tags, parsed["triggers"])


def _library_message(exc: BaseException) -> str:
    """The library's message without its source location prefix ('[time] path.cc:line: ')."""
    text = str(exc).strip()
    head, sep, rest = text.partition(".cc:")
    if sep and head.startswith("["):
        text = rest.split(": ", 1)[-1]
    return text.splitlines()[0] if text else type(exc).__name__


def compile_request_grammar(spec: GrammarSpec, tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int]
                            ) -> tuple[Any, TokenizerInfo]:
    """A request's grammar compiled for the engine's model (its Hugging Face `tokenizer`, padded to `vocab_size`,
    its stop ids), with the vocabulary it was compiled for; both cached (per vocabulary, per grammar). Raises
    ValueError naming `SamplingParams.grammar` when the engine has no tokenizer or stop ids, GrammarError when
    the grammar does not compile."""
    if tokenizer is None or not stop_token_ids:
        raise ValueError("SamplingParams.grammar: constrained decoding needs the model's tokenizer and EOS ids "
                         "(a completed grammar allows only EOS); this engine has none")
    info = tokenizer_info(tokenizer, vocab_size, sorted(stop_token_ids))
    try:
        return compile_grammar(spec, info), info
    except GrammarError as exc:
        raise GrammarError(f"SamplingParams.{exc}") from None


def validate_grammar(spec: GrammarSpec, tokenizer: Any) -> None:
    """Raise GrammarError (a ValueError naming the problem) when `spec` cannot be compiled for the Hugging Face
    `tokenizer` (the engine's). Compiled grammars are cached per vocabulary: an engine's (EngineCore builds one
    for its model's vocabulary size and EOS ids) is used when there is one, so the engine does not compile the
    grammar again."""
    with _INFOS_LOCK:
        known = next((info for (tid, _, _), (tok, info) in _INFOS.items() if tid == id(tokenizer) and tok is tokenizer),
                     None)
    compile_grammar(spec, known or tokenizer_info(tokenizer))


class GrammarState:
    """One row's matcher, kept at a prefix of the row's outputs (`ids`); masks for any prefix of them.

    The state after outputs o_1 .. o_n is the matcher fed o_1 .. o_n in order, where a token it cannot accept
    is skipped (the state stays); after the stop token is accepted, only the stop tokens are allowed."""

    def __init__(self, compiled: Any, info: TokenizerInfo, keep_masks: bool = True) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=-1)
        self.info = info
        self.ids: list[int] = []         # the outputs the matcher was fed, in order
        self.accepted: list[bool] = []   # whether it accepted each (a skipped one is not rolled back)
        self.fixed = 0                   # ids[:fixed] are committed outputs: they never change
        self.terminated = False          # the matcher has accepted a stop token (it accepts nothing more)
        # Masks already filled, by prefix length n: masks[n] is the mask after trail[:n] (int32 [words]).
        # `trail` is the longest sequence fed since it last diverged (ids is always a prefix of it), so a
        # rollback of the matcher keeps the masks past it: a verify window asks again for the prefixes the
        # fast path filled. keep_masks: a row whose prefixes are asked for once (not verified) keeps none, and no
        # trail.
        self.keep_masks = keep_masks
        self.trail: list[int] = []
        self.masks: dict[int, np.ndarray] = {}

    def fill(self, outputs: Sequence[int], n: int, bitmask: torch.Tensor, row: int, committed: int = 0) -> None:
        """bitmask[row] (int32 words, bit v of word v // 32 = token v allowed) for the output slot after
        outputs[:n]; outputs[:committed] are committed (they never change), so they are not compared again."""
        fill_masks([(self, outputs, n, committed, row)], bitmask)

    def follow(self, outputs: Sequence[int], n: int, committed: int = 0) -> bool:
        """Move the state to outputs[:n]; True when it has accepted the stop token (only stop tokens follow)."""
        fed = len(self.ids)
        if fed + 1 == n and self.fixed >= fed:  # a decode step past a committed prefix: one output to feed
            self._feed(int(outputs[fed]))
        else:
            self._follow(outputs, n)
        self._fix(min(committed, n))
        return self.terminated

    def kept(self, outputs: Sequence[int], n: int, committed: int = 0) -> np.ndarray | None:
        """The mask kept for the slot after outputs[:n] when outputs[:n] runs along the trail, else None; the
        matcher stays where it is (a verify window reads the fast path's masks without walking it back)."""
        mask = self.masks.get(n)
        if mask is None:
            return None
        start = min(self.fixed, n)
        if list(outputs[start:n]) != self.trail[start:n]:
            return None
        self._fix(min(committed, n))  # outputs[:n] is the trail's, and ids a prefix of the trail
        return mask

    def _fix(self, fixed: int) -> None:
        """ids[:fixed] are committed: no slot before them is sampled again, so their masks go."""
        if fixed > self.fixed:
            self.fixed = fixed
            if self.masks:
                for k in [k for k in self.masks if k < fixed]:
                    del self.masks[k]

    def _follow(self, outputs: Sequence[int], n: int) -> None:
        """Roll the matcher back to the longest common prefix of `ids` and outputs[:n], then feed the rest."""
        start, common = min(self.fixed, n), min(len(self.ids), n)
        if start < common and list(outputs[start:common]) != self.ids[start:common]:
            common = next(i for i in range(start, common) if outputs[i] != self.ids[i])
        if common < len(self.ids):
            drop = sum(self.accepted[common:])
            if drop:
                self.matcher.rollback(drop)
                self.terminated = bool(self.matcher.is_terminated())
            del self.ids[common:], self.accepted[common:]
        for t in outputs[common:n]:
            self._feed(int(t))

    def _feed(self, t: int) -> None:
        """Feed the matcher the next output `t` (ids grows by one)."""
        if self.keep_masks:  # the trail serves only the kept masks
            i, trail = len(self.ids), self.trail
            if i == len(trail):
                trail.append(t)
            elif trail[i] != t:  # the trail diverges at i: masks past i are stale
                del trail[i:]
                for k in [k for k in self.masks if k > i]:
                    del self.masks[k]
                trail.append(t)
        # a terminated matcher rejects every token (the library logs a warning for each): skip it here
        ok = not self.terminated and bool(self.matcher.accept_token(t))
        if ok and t in self.info.stop_set:  # only a stop token terminates the matcher
            self.terminated = bool(self.matcher.is_terminated())
        self.accepted.append(ok)
        self.ids.append(t)


MaskRequest = tuple[GrammarState, Sequence[int], int, int, int]
"""(state, outputs, n, committed, bitmask row): the mask of the slot after outputs[:n] into that row."""


def fill_masks(requests: list[MaskRequest], bitmask: torch.Tensor) -> None:
    """Fill the requested bitmask rows (int32 [rows, words], CPU). One state may be asked for several prefixes
    (the positions of a verify window): the requests go in rounds, each state once per round and its prefixes in
    ascending order, and each round's masks are filled by the library (in parallel threads for a batch of at
    least PARALLEL_MASKS), except those a state already filled along the same prefix (GrammarState.masks), which
    are copied without moving its matcher."""
    if not requests:
        return
    info = requests[0][0].info
    bits = bitmask.numpy()  # a view: rows written in place
    for batch in _rounds(requests):
        matchers, rows, filled = [], [], []
        for state, outputs, n, committed, row in batch:
            if (known := state.kept(outputs, n, committed)) is not None:  # none kept unless keep_masks
                bits[row] = known
            elif state.follow(outputs, n, committed):
                bits[row] = info.stop_mask
                if state.keep_masks:
                    state.masks[n] = info.stop_mask
            else:
                matchers.append(state.matcher)
                rows.append(row)
                if state.keep_masks:
                    filled.append((state, n, row))
        if matchers:
            batcher = info.parallel if len(matchers) >= PARALLEL_MASKS else info.serial
            batcher.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        for state, n, row in filled:
            state.masks[n] = bits[row].copy()  # its own array: a state's kept masks go with it


def _rounds(requests: list[MaskRequest]) -> list[list[MaskRequest]]:
    """The requests in rounds: each state at most once per round, its prefixes in ascending order (round k holds
    every state's k-th shortest prefix). A decode step asks each state once: one round, in the given order."""
    if len({id(req[0]) for req in requests}) == len(requests):
        return [requests]
    queues: dict[int, list[MaskRequest]] = {}
    for req in requests:
        queues.setdefault(id(req[0]), []).append(req)
    for q in queues.values():
        q.sort(key=lambda r: r[2])
    return [[q[depth] for q in queues.values() if depth < len(q)] for depth in range(max(map(len, queues.values())))]
