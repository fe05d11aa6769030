"""Per-request state: prompt, committed tokens, candidates, KV counters, window records.

Token index regions of one sequence (absolute positions; L = len(prompt)):

    | prompt 0..L-1 | committed outputs L..L+n-1 | candidates (fast path, unverified) |

Output token i sits at position L + i; in-flight decode tokens (engine overlap) follow the candidates
(or, for a non-deterministic request, the committed outputs). `kv_len` counts positions whose K/V is in the cache. After a
prefill, verify pass or non-deterministic decode step the newest token has not been fed yet, so
kv_len == L + n - 1 (plus the candidates fed by the fast path for a DVR request).
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.grammar import GrammarState
    from engine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # needs a prefill (new, or preempted)
    RUNNING = "running"      # has KV, decodes / verifies / replays windows
    FINISHED = "finished"


class SeqKind(enum.Enum):
    FAST = "fast"            # non-deterministic: fast path only, never verified
    DVR = "dvr"              # deterministic: canonical prefill, fast-path candidates, verify passes
    REPLAY = "replay"        # re-executes recorded windows teacher-forced; never decodes


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class PromptLogprobs:
    """Of prompt tokens 1 .. L-1: logprobs[i-1] = log p(token i | tokens before it); top[i-1] its n best ids."""

    logprobs: list[float]
    top: list[dict[int, float]] | None


@dataclass
class ReplayState:
    """Predictions of a replay: what the canonical prefill and the verifier produced, per output."""

    predicted: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    kind: SeqKind
    arrival: int                                   # engine-wide admission counter (ordering)
    status: SeqStatus = SeqStatus.WAITING
    tokens: list[int] = field(default_factory=list)          # committed (replay: the recorded tokens)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    candidates: list[int] = field(default_factory=list)
    kv_len: int = 0
    inflight: int = 0                              # decode tokens launched whose values are not read yet
    stale_inflight: int = 0                        # of those, tokens a verify pass's rollback made void: the
                                                   # settle drops them (kv_len already excludes their slots)
    windows: list[tuple[int, int]] = field(default_factory=list)
    pending_windows: deque[tuple[int, int]] = field(default_factory=deque)  # teacher-forced, in order
    replay: ReplayState | None = None
    finish_reason: FinishReason | None = None
    verify_passes: int = 0
    rollbacks: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    ready_since: int | None = None                 # step at which it became ready for verify
    grammar: GrammarState | None = None            # params.grammar's matcher, following the outputs' prefix
    prompt_logprobs: PromptLogprobs | None = None  # params.prompt_logprobs: from the (first) prefill
    key: str = field(init=False, repr=False)       # KV owner in the block manager: "<kind>:<request_id>"

    def __post_init__(self) -> None:
        self.key = f"{self.kind.value}:{self.request_id}"  # kind and request_id never change

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        """Prompt + committed + candidates + in-flight decode tokens (engine overlap: sampled on the device,
        not read yet; each already holds its KV slot, so kv_len counts it)."""
        return len(self.prompt) + len(self.tokens) + len(self.candidates) + self.inflight

    @property
    def num_candidates(self) -> int:
        """Candidates, counting in-flight decode tokens (which become candidates of a DVR row)."""
        return len(self.candidates) + self.inflight

    @property
    def last_token(self) -> int:
        """The newest known token (an in-flight one, if any, is newer and lives on the device)."""
        return (self.candidates or self.tokens or self.prompt)[-1]

    @property
    def is_finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def max_candidates(self, window: int) -> int:
        """How many candidates the next verify row may hold (W-1, fewer near max_tokens)."""
        return min(window - 1, self.params.max_tokens - len(self.tokens))

    def reset_for_rebuild(self) -> None:
        """Preempted: drop candidates and KV; the committed state is rebuilt canonically (DESIGN §2)."""
        self.recomputed_tokens += len(self.candidates)
        self.candidates.clear()
        self.kv_len = 0
        self.status = SeqStatus.WAITING
        self.ready_since = None
        self.preemptions += 1
        if self.kind == SeqKind.DVR:
            self.pending_windows = deque(self.windows)
        elif self.kind == SeqKind.REPLAY:
            assert self.replay is not None
            self.replay = ReplayState()
            self.pending_windows = deque(self.windows)


@dataclass
class RequestOutput:
    """Cumulative view of one request's COMMITTED tokens (never candidates)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    seed: int
    deterministic: bool
    token_logprobs: list[float]
    top_logprobs: list[dict[int, float]] | None
    logprobs: list[float] | None
    windows: list[tuple[int, int]]
    window_shape: tuple[int, int]
    verify_passes: int
    rollbacks: int
    recomputed_tokens: int
    prompt_logprobs: list[float] | None = None     # params.prompt_logprobs: of prompt tokens 1 .. L-1
    prompt_top_logprobs: list[dict[int, float]] | None = None  # their top ids, when prompt_logprobs > 0
