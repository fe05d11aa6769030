"""Replay entry point (DESIGN §5): canonical prefill + one teacher-forced verify pass per recorded window.

No fast path, no rollbacks; windows of several replays share G x W verify passes (a replay's own
windows run in order, other replays fill the other rows). The verifier's predictions are compared with
the recorded tokens: the first divergent output index is the mismatch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.limits import RequestLimits, validate_request
from engine.sampling import SamplingParams
from engine.sequence import Sequence

if TYPE_CHECKING:
    from engine.core import EngineCore


@dataclass(frozen=True)
class ReplayRequest:
    replay_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]                     # recorded output
    params: SamplingParams                   # with the recorded seed
    windows: list[tuple[int, int]]
    window_shape: tuple[int, int]            # (G, W) of the recorded passes


@dataclass(frozen=True)
class ReplayResult:
    replay_id: str
    token_ids: list[int]                     # predicted by the canonical prefill + verifier
    token_logprobs: list[float]
    first_mismatch: int | None               # output index of the first predicted != recorded
    window_index: int | None                 # window holding it (None: token 0 or no mismatch)
    prompt_logprobs: list[float] | None = None  # params.prompt_logprobs: recomputed by the canonical prefill

    @property
    def match(self) -> bool:
        return self.first_mismatch is None


def check_replay(req: ReplayRequest, group: int, window: int) -> None:
    """ValueError naming the field when the record cannot be replayed on this engine."""
    if tuple(req.window_shape) != (group, window):
        raise ValueError(f"window_shape: recorded (G, W) = {tuple(req.window_shape)}, this engine runs "
                         f"({group}, {window})")
    if not req.token_ids:
        raise ValueError("token_ids: a replay needs at least one recorded output token")
    if req.params.seed is None:
        raise ValueError("params.seed: a replay needs the recorded seed")
    expect = 1
    for i, (s, e) in enumerate(req.windows):
        if s != expect or not 0 < e - s <= window:
            raise ValueError(f"windows[{i}]: {(s, e)} must start at {expect} and span 1..{window} tokens")
        expect = e
    if expect != len(req.token_ids):
        raise ValueError(f"windows: cover [1, {expect}) but the record has {len(req.token_ids)} tokens")


def validate_replays(limits: RequestLimits, tokenizer: Any, requests: list[ReplayRequest]) -> None:
    """ValueError for the first record an engine of these limits cannot replay (`check_replay` against its
    verify shape, then the request check, `validate_request`); call before queueing any."""
    for req in requests:
        check_replay(req, limits.group, limits.window)
        validate_request(limits, tokenizer, req.prompt_token_ids, req.params)


def add_replays(core: EngineCore, requests: list[ReplayRequest]) -> list[Sequence]:
    """Queue records that passed `validate_replays`."""
    return [core.add_replay(r.replay_id, r.prompt_token_ids, r.token_ids, r.params, r.windows)
            for r in requests]


def replay_result(req: ReplayRequest, seq: Sequence) -> ReplayResult:
    assert seq.replay is not None and seq.is_finished
    predicted = seq.replay.predicted
    assert len(predicted) == len(req.token_ids), (len(predicted), len(req.token_ids))
    first = next((i for i, (a, b) in enumerate(zip(predicted, req.token_ids)) if a != b), None)
    win = None
    if first is not None and first > 0:
        win = next(k for k, (s, e) in enumerate(req.windows) if s <= first < e)
    prompt = list(seq.prompt_logprobs.logprobs) if seq.prompt_logprobs else None
    return ReplayResult(req.replay_id, list(predicted), list(seq.replay.logprobs), first, win, prompt)


def replay_results(requests: list[ReplayRequest], seqs: list[Sequence]) -> list[ReplayResult]:
    return [replay_result(r, s) for r, s in zip(requests, seqs)]
