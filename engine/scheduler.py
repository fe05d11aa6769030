"""Continuous batching: admit, plan prefill / decode / verify steps under budgets, preempt.

Policy per step (first that applies):
1. PREFILL the head of the waiting queue: a canonical pass (fixed size) when the head is a DVR or replay
   prompt, or when a plain pass would reach one whose canonical pass is as large as a plain pass (or holds
   the prompts before it and it), or would leave prompts over while a full-size one waits further back
   (non-deterministic prompts ride along in all three); else a run of consecutive non-deterministic prompts
   batched under the token budget. With chunked canonical GEMMs (canonical_prefill_chunk_tokens = C > 0)
   every DVR / replay prompt counts as full size and a canonical pass takes the size of its content,
   rounded up to a multiple of C.
2. VERIFY when >= G windows are ready (a row that ran ahead holds several: they share one pass), or
   nothing can decode, or a ready row that can no longer decode waited W steps (W + dvr_lookahead for any
   ready row), or — verify cadence, while at most verify_cadence_max_rows sequences run — a DVR row took
   verify_cadence_steps candidates since its last commit. The pass carries the decode step of up to
   verify_decode_rows other rows (`Plan.decode`).
3. DECODE every running sequence that can take a fast-path token.
Preemption (KV exhausted) evicts the newest running sequence; it re-enters the waiting queue's head and
is rebuilt from its committed state (DVR: prompt alone, then its recorded windows teacher-forced).
"""
from __future__ import annotations

import enum
import itertools
import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.block_manager import BlockManager, OutOfBlocks
from engine.sequence import Sequence, SeqKind, SeqStatus
from engine.verifier import VerifyRow, dvr_row, teacher_row

if TYPE_CHECKING:
    from engine.config import EngineConfig


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"
    IDLE = "idle"


@dataclass(frozen=True)
class PrefillItem:
    seq: Sequence
    tokens: list[int]      # inputs at positions 0..len-1
    sample: bool           # False for a non-deterministic re-prefill whose next token is known


@dataclass
class Plan:
    kind: StepKind
    prefill: list[PrefillItem] = field(default_factory=list)
    decode: list[Sequence] = field(default_factory=list)  # DECODE's rows; VERIFY: the decode rows it carries
    verify: list[VerifyRow] = field(default_factory=list)
    pass_tokens: int | None = None  # PREFILL: a canonical pass padded to exactly this many tokens


class Scheduler:
    def __init__(self, config: EngineConfig, eos_ids: set[int]) -> None:
        self.config = config
        self.eos_ids = eos_ids
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.step_index = 0
        self.preemptions = 0

    # ---- queue -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and release its KV."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq_key(seq))

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ----------------------------------------------------------------------------
    def schedule(self) -> Plan:
        self.step_index += 1
        plan = self._plan_prefill()
        if plan is not None:
            return plan
        preemptions = self.preemptions
        ready, decodable = self._classify()
        plan = self._plan_verify(ready, decodable)
        if plan is not None:
            return plan
        if self.preemptions != preemptions:  # a verify attempt that granted nothing may have preempted
            ready, decodable = self._classify()
        plan = self._plan_decode(decodable)
        if plan is not None:
            return plan
        if self.running:  # nothing decodes and the verifier waits: force the ready rows through
            ready, decodable = self._classify()
            plan = self._plan_verify(ready, decodable, force=True)
            if plan is not None:
                return plan
        assert not self.running, "scheduler stalled with running sequences"
        return Plan(StepKind.IDLE)

    def _classify(self) -> tuple[list[Sequence], list[Sequence]]:
        """Running sequences that need a verify pass, and those that can take a fast-path token, in
        running order. Ready: teacher windows pending (rebuild / replay), or a DVR row whose candidates
        are done. Decodable: FAST, or a DVR row that may still take candidates (collecting its window,
        or running ahead of a ready one within dvr_lookahead: then it is in both lists). One pass, one
        `candidate_done` per DVR row."""
        window, eos, lookahead = self.config.window, self.eos_ids, self.config.tuning.dvr_lookahead
        ready: list[Sequence] = []
        decodable: list[Sequence] = []
        for s in self.running:
            if s.status != SeqStatus.RUNNING or s.stale_inflight:  # a void in-flight token: wait for its settle
                continue
            if s.pending_windows:
                ready.append(s)
            elif s.kind == SeqKind.FAST:
                if len(s.tokens) + s.inflight < s.params.max_tokens:  # else its last token is in flight
                    decodable.append(s)
            elif s.kind == SeqKind.DVR:
                if candidate_done(s, window, eos):
                    ready.append(s)
                if can_run_ahead(s, window, eos, lookahead):
                    decodable.append(s)
        return ready, decodable

    def chained_decode(self, exclude: frozenset[Sequence] = frozenset(),
                       not_ready: frozenset[Sequence] = frozenset()) -> Plan | None:
        """The decode step `schedule` would plan now, planned while the previous decode step's tokens are
        still on the device (engine overlap: counts include in-flight tokens, their values are unknown).
        None when the policy could plan anything else — a prefill, a verify pass, a preemption — which
        needs those values: the caller then reads them and calls `schedule`. Planning one step behind
        changes when rows become ready, never a committed token (rows that finished in the in-flight step
        may ride one wasted step).

        `exclude`: rows left out as if they were not running; `not_ready`: rows that may decode but are not
        counted ready. The engine launches the step after a verify pass before reading the pass's samples:
        the pass's rows are `not_ready`, and those whose next input depends on them are `exclude`d (they
        rejoin at the next step); a row with run-ahead candidates past its windows decodes on, speculatively."""
        if self.waiting and len(self.running) < self.config.max_num_seqs and self._head_fits():
            return None
        ready, decodable = self._classify()
        if exclude or not_ready:
            ready = [s for s in ready if s not in exclude and s not in not_ready]
            decodable = [s for s in decodable if s not in exclude]
        known_only = self.config.tuning.chained_verify and self.chained_known_only
        if not decodable or self._verify_due(ready, decodable, self.step_index + 1, known_only=known_only):
            return None
        if self._cadence_active() and self._cadence_due(decodable, known_only, skip=exclude | not_ready):
            return None
        need = sum(self.blocks.extra_blocks(seq_key(s), s.num_tokens) for s in decodable)
        if need > self.blocks.num_free:
            return None
        self.step_index += 1
        for s in decodable:
            self.blocks.ensure(seq_key(s), s.num_tokens)
        return Plan(StepKind.DECODE, decode=decodable)

    def chained_prefill(self) -> Plan | None:
        """The prefill pass `schedule` would plan now, planned while the previous prefill pass's first tokens
        are still on the device (engine overlap): a prefill plan depends on the queue, the running count and
        free KV, never on those tokens' values. None when `schedule` would plan no prefill now (the caller
        then reads the tokens and calls `schedule`). A row that finishes at its first token frees its KV only
        once read, so this pass may admit fewer prompts than one planned after the read."""
        plan = self._plan_prefill()
        if plan is not None:
            self.step_index += 1
        return plan

    def chained_verify(self) -> Plan | None:
        """The verify pass `schedule` would plan now, planned while the previous decode step's tokens are
        still on the device (DvrTuning.chained_verify). Its windows are those the pass planned after the
        read would take: a window may end at a row's token in flight (its input id is taken on the device,
        as the rows it carries take theirs), since where a full window ends does not depend on that token's
        value (one that ends early at a stop token is taken by a later pass). With fault injection
        (fault_rate > 0, which rewrites candidates on the host) the windows hold known candidates only. None
        where `schedule` could plan something else (a prefill), the verify trigger does not hold, with
        faults where the in-flight tokens would complete a window this pass could take (the pass planned
        after the read holds more), or KV is short (planning after the read may preempt; this never does)."""
        if self.waiting and len(self.running) < self.config.max_num_seqs and self._head_fits():
            return None
        ready, decodable = self._classify()
        step = self.step_index + 1
        known_only = self.chained_known_only
        due = bool(ready) and self._verify_due(ready, decodable, step, known_only=known_only)
        partial = self._cadence_active()
        if not due and not (partial and self._cadence_due(decodable, known_only)):
            return None
        rows = self._cadence_rows(ready, known_only) if partial else ready
        w = self.config.window
        picks, known = self._pick_windows(rows, known_only=known_only, partial=partial)
        if known_only and known < self._pick_windows(rows, partial=partial)[1]:
            return None
        taken = list(dict.fromkeys(s for s, _ in picks))
        if not taken:
            return None
        if sum(self.blocks.extra_blocks(seq_key(s), verify_slots(s)) for s in taken) > self.blocks.num_free:
            return None
        self.step_index = step
        for s in taken:
            self.blocks.ensure(seq_key(s), verify_slots(s))
        built = [teacher_row(s) if s.pending_windows
                 else dvr_row(s, w, index, inflight=not known_only and inflight_is_candidate(s, self.eos_ids))
                 for s, index in picks]
        return Plan(StepKind.VERIFY, verify=built, decode=self._carried(decodable, set(taken)))

    # ---- verify cadence (DvrTuning.verify_cadence_steps) ------------------------------------
    def _cadence_active(self) -> bool:
        """The running batch is small enough for the verify cadence (verify_cadence_max_rows)."""
        k = self.config.tuning.verify_cadence_steps
        return bool(k) and len(self.running) <= self.config.tuning.verify_cadence_max_rows  # type: ignore[operator]

    def _cadence_due(self, decodable: list[Sequence], known_only: bool = False,
                     skip: frozenset[Sequence] = frozenset()) -> bool:
        """A verify pass is due by the cadence: a DVR row (not in `skip`) took verify_cadence_steps candidates
        since its last commit (one per decode step it ran), or holds candidates and can take no more (a stop
        candidate, its run-ahead cap or max_tokens). Candidates count in-flight tokens unless `known_only`."""
        k = self.config.tuning.verify_cadence_steps
        moving = set(decodable)
        for s in self.running:
            if s in skip or not _cadence_candidate(s):
                continue
            n = cadence_candidates(s, self.eos_ids, known_only)
            if n >= k or (n and s not in moving):  # type: ignore[operator]
                return True
        return False

    def _cadence_rows(self, ready: list[Sequence], known_only: bool = False) -> list[Sequence]:
        """The rows of a pass while the cadence is active: the ready rows and every DVR row holding candidates,
        in running order (an unfinished window rides along: the pass has its fixed shape whatever fills it)."""
        chosen = set(ready)
        return [s for s in self.running
                if s in chosen or (_cadence_candidate(s) and cadence_candidates(s, self.eos_ids, known_only))]

    @property
    def chained_known_only(self) -> bool:
        """A chained verify pass (and the trigger for it) counts known candidates only: with fault injection,
        whose rewritten candidates differ from the tokens on the device."""
        return self.config.fault_rate > 0.0

    def _head_fits(self) -> bool:
        """The queue's head could be admitted now (its prompt's KV is free): a prefill pass could be planned.
        Every prefill plan starts with the head, so when it does not fit no prefill is planned."""
        head = self.waiting[0]
        return self.blocks.extra_blocks(seq_key(head), prefill_len(head) + 1) <= self.blocks.num_free

    def _verify_due(self, rows: list[Sequence], decodable: list[Sequence], step: int, known_only: bool = False
                    ) -> bool:
        """The verify trigger at step `step` (`_plan_verify` and `chained_decode`): a full pass ready (G windows
        padded; packed: G*W tokens of windows or verify_max_windows windows, or G windows with
        verify_trigger="windows"),
        nothing to decode, a ready row that cannot decode (stop candidate, run-ahead cap, teacher windows)
        waited W steps, or any ready row waited W + dvr_lookahead steps. A row that keeps running ahead
        while it waits gathers more windows, which a later pass takes together (fewer, fuller passes);
        its wait is bounded by its run-ahead cap. Rows first seen ready start waiting now, so none starves.
        `known_only`: windows count known candidates, not in-flight tokens (DvrTuning.chained_verify: the
        pass is then planned before they are read)."""
        if not rows:
            return False
        for s in rows:
            if s.ready_since is None:
                s.ready_since = step
        if not decodable:
            return True
        config = self.config
        w, cap, budget = config.window, config.tuning.verify_max_windows, config.group * config.window
        if config.tuning.verify_trigger == "windows":  # >= G windows, whatever their length (padded)
            cap, budget = config.group, math.inf
        windows = tokens = 0
        moving = set(decodable)
        for s in rows:
            waited = step - s.ready_since  # type: ignore[operator]  # set above
            if waited >= w + config.tuning.dvr_lookahead or (waited >= w and s not in moving):
                return True
            costs = self._window_costs(s, cap - windows, known_only)
            windows, tokens = windows + len(costs), tokens + sum(costs)
            if tokens >= budget or windows >= cap:
                return True
        return False

    def _window_costs(self, seq: Sequence, limit: int, known_only: bool = False, partial: bool = False
                      ) -> list[int]:
        """The token slots each window a ready row could give a verify pass now takes, in order (at most
        `limit` windows): W each when padded (DvrTuning.verify_packing), its own tokens when packed.
        A teacher row gives its next recorded window; `partial`: a DVR row's last window may be unfinished."""
        w = self.config.window
        if seq.pending_windows:
            start, end = seq.pending_windows[0]
            sizes = [end - start] if limit > 0 else []
        else:
            sizes = dvr_window_sizes(seq, w, self.eos_ids, limit, known_only, partial)
        return sizes if self.config.tuning.verify_packing == "packed" else [w] * len(sizes)

    def _pick_windows(self, rows: list[Sequence], known_only: bool = False, partial: bool = False
                      ) -> tuple[list[tuple[Sequence, int]], int]:
        """(picks, token slots they take): round robin over the ready rows in running order, every row's
        next window first, then the second windows of rows that ran ahead, and so on, within the pass's
        G*W token slots and verify_max_windows windows. A row whose window does not fit takes no later
        window (a row's windows stay in order, window j always after window j-1 in the pass). Padded: the
        first G windows of that order. `partial` (verify cadence): a row's last window may be unfinished."""
        config = self.config
        cap, budget = config.tuning.verify_max_windows, config.group * config.window
        costs = {s: self._window_costs(s, cap, known_only, partial) for s in rows}
        picks: list[tuple[Sequence, int]] = []
        blocked: set[Sequence] = set()
        used = 0
        for j in range(cap):
            for s in rows:
                if j >= len(costs[s]) or s in blocked:
                    continue
                if len(picks) >= cap:
                    return picks, used
                if used + costs[s][j] > budget:
                    blocked.add(s)
                    continue
                picks.append((s, j))
                used += costs[s][j]
        return picks, used

    def _plan_prefill(self) -> Plan | None:
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return None
        if self.waiting[0].kind != SeqKind.FAST:
            return self._plan_canonical_prefill(self.waiting[0])
        anchor, in_reach = self._full_size_canonical_anchor()
        if anchor is not None:
            return self._plan_canonical_prefill(anchor, in_reach)
        items: list[PrefillItem] = []
        budget = self.config.max_num_batched_tokens
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            item = prefill_item(seq)
            if seq.kind != SeqKind.FAST or (items and len(item.tokens) > budget):
                break  # a DVR / replay prompt waits for its own canonical pass (next step)
            if not self._admit(seq, item):
                break
            self.waiting.popleft()
            items.append(item)
            budget -= len(item.tokens)
        return Plan(StepKind.PREFILL, prefill=items) if items else None

    def _full_size_canonical_anchor(self) -> tuple[Sequence | None, bool]:
        """(anchor, in reach): the DVR / replay prompt around which this prefill pass is planned canonical,
        when its canonical pass is as large as a plain pass (P = max_num_batched_tokens, the CUDA default).

        In reach: the first such prompt a plain pass would reach (queue order, within the token budget and
        the row caps). The pass takes the non-deterministic prompts a plain pass would take before it, then
        it and the other deterministic prompts of its size, instead of stopping at the first of them and
        leaving it a mostly padded pass of its own.
        Beyond reach: a plain pass would stop (budget or rows) with prompts left over, so another pass
        follows anyway; the first full-size DVR prompt further back is pulled into this one (after the
        queue's head), so that the pass left for the end is not a padded canonical one (on the 8B, a
        mostly padded 8192-token pass costs what a full one does: 0.18 s, `prefill alone` in the core bench).
        A DVR / replay prompt with a smaller canonical pass (canonical_prefill_min_tokens below the budget)
        in reach anchors a canonical pass when the non-deterministic prompts before it and it fit in that
        pass; otherwise the plain pass stops before it (it already holds at least that pass's tokens).
        (None, False) when neither applies."""
        budget, rows = self.config.max_num_batched_tokens, 0
        room = min(self.config.max_num_seqs - len(self.running), CANONICAL_PREFILL_ROWS)

        def full_size(seq: Sequence) -> bool:
            return canonical_prefill_tokens(self.config, prefill_len(seq)) == self.config.max_num_batched_tokens

        for i, seq in enumerate(self.waiting):
            n = prefill_len(seq)
            if n > budget or rows >= room:
                if i == 0:
                    return None, False
                beyond = (s for s in itertools.islice(self.waiting, i, None) if s.kind != SeqKind.FAST)
                return next((s for s in beyond if full_size(s)), None), False
            if seq.kind != SeqKind.FAST:
                # a smaller canonical pass: taken when the prompts before it and it fit in it (a plain pass
                # stopping here would be smaller than the canonical pass that follows it anyway)
                used = self.config.max_num_batched_tokens - budget
                fits = used + n <= canonical_prefill_tokens(self.config, n)
                return (seq if full_size(seq) or fits else None), True
            budget, rows = budget - n, rows + 1
        return None, False

    def _plan_canonical_prefill(self, anchor: Sequence, in_reach: bool = True) -> Plan | None:
        """A canonical prefill pass: exactly P tokens (P = canonical_prefill_tokens of the anchor, a DVR /
        replay prompt: the queue's head, one a plain pass would reach, or — not in reach — one further back
        of the full pass size) and at most CANONICAL_PREFILL_ROWS prompts, taken in three phases, each in
        queue order:

            1. the prompts before the anchor (all non-deterministic: a plain pass would take them) and the
               anchor itself, so the queue's head is never overtaken; for an anchor not in reach, only the
               queue's head (the anchor joins in phase 2);
            2. every other waiting DVR / replay prompt with the same P that fits: deterministic prompts can
               only be prefilled in such a pass, so taking them now leaves fewer leftovers that need a padded
               pass of their own;
            3. non-deterministic prompts that fit in what is left (skipping those that do not);

        the rest of the pass is dummy tokens. A row's bits depend only on its own tokens and P (every GEMM
        has M = P, the logits GEMM M = the row cap), so a prompt prefilled here, alone or packed, later or
        in a replay, gives the same bits.
        Chunked (canonical_prefill_chunk_tokens = C > 0): every GEMM has M = C whatever the pass size, so every
        DVR / replay prompt has P = max_num_batched_tokens (all of them share phase 2) and the pass, filled
        the same way, shrinks to the tokens it holds rounded up to a multiple of C."""
        pass_tokens = canonical_prefill_tokens(self.config, prefill_len(anchor))
        waiting = list(self.waiting)
        head = waiting[: waiting.index(anchor) + 1] if in_reach else waiting[:1]
        rest = waiting[len(head):]
        same_size = [s for s in rest if s.kind != SeqKind.FAST
                     and canonical_prefill_tokens(self.config, prefill_len(s)) == pass_tokens]
        fast = [s for s in rest if s.kind == SeqKind.FAST]
        items: list[PrefillItem] = []
        budget = pass_tokens
        for i, seq in enumerate(head + same_size + fast):
            if len(self.running) >= self.config.max_num_seqs or len(items) >= CANONICAL_PREFILL_ROWS:
                break
            n = prefill_len(seq)
            if n > budget and i >= len(head):
                continue  # phases 2 and 3 skip what does not fit
            # a head prompt that does not fit (impossible for an anchor in reach) or KV that is short: the
            # pass ends here rather than overtake
            item = prefill_item(seq)
            if n > budget or not self._admit(seq, item):
                break
            self.waiting.remove(seq)
            items.append(item)
            budget -= n
        chunk = self.config.tuning.canonical_prefill_chunk_tokens
        if chunk:  # the pass follows its content: the tokens used, up to a whole number of GEMM chunks
            pass_tokens = -(-(pass_tokens - budget) // chunk) * chunk
        return Plan(StepKind.PREFILL, prefill=items, pass_tokens=pass_tokens) if items else None

    def _admit(self, seq: Sequence, item: PrefillItem) -> bool:
        """Reserve the prompt's KV (+1 slot) and move the sequence to running; False when KV is short."""
        if self.blocks.extra_blocks(seq_key(seq), len(item.tokens) + 1) > self.blocks.num_free:
            return False
        self.blocks.ensure(seq_key(seq), len(item.tokens) + 1)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def _plan_verify(self, rows: list[Sequence], decodable: list[Sequence], force: bool = False) -> Plan | None:
        """The windows `_pick_windows` takes (up to G, or as many as fit when packed), KV granted; with the
        verify cadence active, each DVR row's unfinished window too."""
        due = bool(rows) and (self._verify_due(rows, decodable, self.step_index) or force)
        partial = self._cadence_active()
        if not due and not (partial and self._cadence_due(decodable)):
            return None
        rows = self._cadence_rows(rows) if partial else rows
        w = self.config.window
        # running order (admission), not readiness: under KV pressure the oldest rows finish first
        picks, _ = self._pick_windows(rows, partial=partial)
        taken = list(dict.fromkeys(s for s, _ in picks))
        granted = set(self._allocate([(s, verify_slots(s)) for s in taken]))
        built = [teacher_row(s) if s.pending_windows else dvr_row(s, w, index)
                 for s, index in picks if s in granted]
        if not built:
            return None
        return Plan(StepKind.VERIFY, verify=built, decode=self._carried(decodable, set(granted)))

    def _carried(self, decodable: list[Sequence], verified: set[Sequence]) -> list[Sequence]:
        """The decode step a verify pass carries (DvrTuning.verify_decode_rows = D): up to D of the rows a
        decode step would take now (running order), leaving out the pass's own rows. Their KV slot is taken
        only where it is free: carrying never preempts (a row without one decodes in a later step)."""
        d = self.config.tuning.verify_decode_rows
        carried: list[Sequence] = []
        for s in decodable:
            if len(carried) >= d:
                break
            if s in verified or s.status != SeqStatus.RUNNING:  # the pass's own rows, or preempted for it
                continue
            if self.blocks.extra_blocks(seq_key(s), s.num_tokens) <= self.blocks.num_free:
                self.blocks.ensure(seq_key(s), s.num_tokens)
                carried.append(s)
        return carried

    def _plan_decode(self, seqs: list[Sequence]) -> Plan | None:
        if not seqs:
            return None
        granted = self._allocate([(s, s.num_tokens) for s in seqs])
        return Plan(StepKind.DECODE, decode=granted) if granted else None

    # ---- KV ----------------------------------------------------------------------------------
    def _allocate(self, wants: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Grow each sequence's table to its slot count, preempting the newest others when KV runs out."""
        granted: list[Sequence] = []
        for seq, slots in wants:
            while seq.status == SeqStatus.RUNNING:
                try:
                    self.blocks.ensure(seq_key(seq), slots)
                    granted.append(seq)
                    break
                except OutOfBlocks:
                    victim = max((s for s in self.running if s not in granted), key=lambda s: s.arrival)
                    self.preempt(victim)
        return granted

    def preempt(self, seq: Sequence) -> None:
        assert seq.inflight == 0, f"preempting {seq.request_id} with a decode token in flight"
        self.running.remove(seq)
        self.blocks.free(seq_key(seq))
        seq.reset_for_rebuild()
        self.waiting.appendleft(seq)
        self.preemptions += 1


CANONICAL_PREFILL_ROWS = 64  # prompts per canonical prefill pass; its logits GEMM always has this many rows


def canonical_prefill_tokens(config: EngineConfig, prompt_len: int) -> int:
    """The canonical prefill pass size of a DVR / replay prompt: a function of its length and the config
    only — max(canonical_prefill_min_tokens, next power of two >= prompt_len), at most
    max_num_batched_tokens (which bounds prompt lengths, so the prompt always fits). Chunked
    (canonical_prefill_chunk_tokens > 0): max_num_batched_tokens for every prompt, the largest pass a prompt
    can share (the planned pass is then cut to its content, `_plan_canonical_prefill`)."""
    if config.tuning.canonical_prefill_chunk_tokens:
        return config.max_num_batched_tokens
    pow2 = 1 << max(0, prompt_len - 1).bit_length()
    return min(max(config.tuning.canonical_prefill_min_tokens, pow2), config.max_num_batched_tokens)


def seq_key(seq: Sequence) -> str:
    return seq.key


def prefill_len(seq: Sequence) -> int:
    """len(prefill_item(seq).tokens), without copying the prompt (the planners size passes with it)."""
    return len(seq.prompt) + (len(seq.tokens) - 1 if seq.kind == SeqKind.FAST and seq.tokens else 0)


def prefill_item(seq: Sequence) -> PrefillItem:
    """DVR / replay: the prompt alone. FAST re-prefill after preemption: prompt + outputs but the last."""
    if seq.kind == SeqKind.FAST and seq.tokens:
        return PrefillItem(seq, seq.prompt + seq.tokens[:-1], sample=False)
    return PrefillItem(seq, list(seq.prompt), sample=True)


def candidate_done(seq: Sequence, window: int, eos_ids: set[int]) -> bool:
    """A DVR row is ready: W-1 candidates, or the fast path says it finished (EOS / stop id / max_tokens)."""
    if seq.num_candidates >= seq.max_candidates(window):
        return True
    return bool(seq.candidates) and seq.params.is_stop_token(seq.candidates[-1], eos_ids)


def can_run_ahead(seq: Sequence, window: int, eos_ids: set[int], lookahead: int) -> bool:
    """A DVR row may take another fast-path token: no stop candidate yet, and fewer than
    max_candidates(W) + lookahead candidates (never past max_tokens). Run-ahead candidates wait for the
    next window, so a row waiting for its verify pass keeps decoding instead of idling."""
    if seq.candidates and seq.params.is_stop_token(seq.candidates[-1], eos_ids):
        return False
    cap = min(window - 1 + lookahead, seq.params.max_tokens - len(seq.tokens))
    return seq.num_candidates < cap


def dvr_windows(seq: Sequence, window: int, eos_ids: set[int], limit: int, known_only: bool = False) -> int:
    """How many consecutive windows of a DVR row one verify pass can take now (at most `limit`): window 0
    once `candidate_done`, then window j >= 1 (input c_{jW}, the bonus slot of window j-1) while the
    candidates fill it — W-1 of them, or up to max_tokens, or up to a stop candidate. Counts in-flight
    tokens as candidates (the chained planner's view; a verify pass itself runs with none in flight).
    Window 0 is there exactly when `candidate_done` holds. `known_only`: in-flight tokens do not count (the
    windows a chained verify pass can take before they are read)."""
    return len(dvr_window_sizes(seq, window, eos_ids, limit, known_only))


def dvr_window_sizes(seq: Sequence, window: int, eos_ids: set[int], limit: int, known_only: bool = False,
                     partial: bool = False) -> list[int]:
    """The tokens of each window `dvr_windows` counts (dvr_row's row length: the input before the window's
    candidates, then them): W for a full window, fewer for one ending at a stop candidate or max_tokens, or
    with `partial` (verify cadence) at the row's last candidate."""
    stopped = bool(seq.candidates) and seq.params.is_stop_token(seq.candidates[-1], eos_ids)
    n = seq.num_candidates if not known_only and inflight_is_candidate(seq, eos_ids) else len(seq.candidates)
    left = seq.params.max_tokens - len(seq.tokens)  # outputs still to commit
    sizes: list[int] = []
    while len(sizes) < limit:
        first = len(sizes) * window                  # candidates before this window (incl. bonus slots)
        rest, cap = n - first, min(window - 1, left - first)
        if rest <= 0 or cap <= 0 or (rest < cap and not stopped and not partial):
            break
        sizes.append(1 + min(rest, cap))
        if rest <= cap:                              # this window holds the last candidate
            break
    return sizes


def cadence_candidates(seq: Sequence, eos_ids: set[int], known_only: bool = False) -> int:
    """The verify cadence's wait of a DVR row: its candidates (the decode steps it ran since its last commit,
    as the row took one per step), counting its token in flight unless `known_only`."""
    inflight = not known_only and seq.inflight and inflight_is_candidate(seq, eos_ids)
    return len(seq.candidates) + (seq.inflight if inflight else 0)


def _cadence_candidate(seq: Sequence) -> bool:
    """A running DVR row collecting candidates (not rebuilding recorded windows, no void token in flight)."""
    return (seq.kind == SeqKind.DVR and seq.status == SeqStatus.RUNNING and not seq.pending_windows
            and not seq.stale_inflight)


def inflight_is_candidate(seq: Sequence, eos_ids: set[int]) -> bool:
    """The row's token in flight will become its next candidate when read: it is not voided by a rollback
    (stale_inflight) and does not follow a stop candidate (a token decoded past a stop is dropped)."""
    stopped = bool(seq.candidates) and seq.params.is_stop_token(seq.candidates[-1], eos_ids)
    return not stopped and not seq.stale_inflight


def verify_slots(seq: Sequence) -> int:
    """Slots a verify row writes: DVR up to the last candidate's position; teacher up to L+e-2."""
    if seq.pending_windows:
        return seq.prompt_len + seq.pending_windows[0][1] - 1
    return seq.num_tokens
