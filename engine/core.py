"""EngineCore: the step loop (plan -> run -> commit) shared by LLM and AsyncEngine.

    step():  plan = scheduler.schedule()
             run the plan's pass (prefill | decode | verify) on the model runner
             sample with the counter-based sampler, commit / roll back, finish, free KV

Overlap (`DvrTuning.overlap`, on for CUDA): a decode step's tokens stay on the device while the host
plans and launches the next decode step (`Scheduler.chained_decode`), whose input ids are copied from
them device to device; only then are they read and committed. The GPU never waits for the host between
consecutive decode steps. Any other step (prefill, verify, preemption) first reads the in-flight tokens.

    step N:    launch decode N ......................................... (GPU runs N)
    step N+1:  plan N+1 | launch N+1 (ids <- tokens of N) | read N, commit  (GPU runs N+1)

A verify pass: launch (with the decode step it carries), settle (read the step in flight), sample, apply
(`_verify`). The in-flight steps and their chained inputs are engine/inflight.py; applying a pass's windows,
rollbacks and KV truncation, engine/apply.py; a request's check before it is queued, engine/limits.py.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.apply import apply_pass, release_kv
from engine.config import EngineConfig, Mode
from engine.grammar import GrammarState, compile_request_grammar
from engine.inflight import (InflightDecode, InflightPrefill, VerifyChain, decode_chain, needs_prefix, settle_decode,
                             settle_prefill)
from engine.limits import RequestLimits, validate_request
from engine.model_runner import DUMMY_TOKEN, ModelRunner, ModelShape, PagedModel, Row
from engine.noise import splitmix64
from engine.processors import Slot, apply_processors
from engine.sampling import PendingSamples, SampleResult, SamplingParams, sample_rows, sample_rows_deferred
from engine.scheduler import Plan, Scheduler, StepKind, candidate_done, seq_key
from engine.sequence import FinishReason, ReplayState, RequestOutput, Sequence, SeqKind, SeqStatus

if TYPE_CHECKING:
    import torch

    from engine.parallel import TensorParallel

Detokenize = Callable[[list[int]], str]
LaunchedDecode = tuple[list[Sequence], PendingSamples, bool]
"""A decode step's rows, their samples (launched) and whether they may stay in flight: what `_hold` takes."""


@dataclass
class EngineStats:
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0        # committed output tokens
    steps: int = 0
    prefill_passes: int = 0
    decode_passes: int = 0
    verify_passes: int = 0
    rollbacks: int = 0
    recomputed_tokens: int = 0
    preemptions: int = 0
    verify_seconds: float = 0.0
    carried_decode_rows: int = 0     # decode rows run inside verify passes (DvrTuning.verify_decode_rows)
    early_decode_steps: int = 0      # decode steps launched before the verify pass before them was applied
    chained_verify_passes: int = 0   # verify passes launched before the decode step before them was read
    step_seconds: float = 0.0        # wall time inside step(): the engine loop's busy time (host work, and waits
                                     # for the device where a step reads its results); its rate is the utilization
    command_seconds: float = 0.0     # wall time the engine loop spent on its commands (requests added, aborts;
                                     # not its waits for them); its driver (EngineProcess, AsyncEngine) adds it
    publish_seconds: float = 0.0     # wall time the engine loop spent handing its steps' outputs to their waiters


class EngineCore:
    def __init__(self, config: EngineConfig, model: PagedModel, shape: ModelShape, eos_ids: set[int],
                 detokenize: Detokenize | None = None, tokenizer: Any = None,
                 tp: TensorParallel | None = None) -> None:
        """`tokenizer` (Hugging Face): needed by grammar-constrained requests (engine.grammar). `tp`: rank 0 of a
        tensor-parallel group (`model` is its shard): the runner sends every pass to the worker ranks
        (engine.tp_workers)."""
        if (tp.size if tp is not None else 1) != config.tensor_parallel_size:
            raise ValueError(f"EngineConfig.tensor_parallel_size: {config.tensor_parallel_size} ranks need a group "
                             f"of as many (LLM(config) / AsyncEngine(config) start it), got "
                             f"{'none' if tp is None else tp.size}")
        self.shape = shape
        self.eos_ids = set(eos_ids)
        self.detokenize = detokenize
        self.tokenizer = tokenizer
        if tp is None:
            self.runner = ModelRunner(config, model, shape, config.torch_dtype, config.torch_device)
        else:
            from engine.tp_workers import DriverRunner

            self.runner = DriverRunner(config, model, shape, config.torch_dtype, config.torch_device, tp)
        self.max_model_len = self.runner.max_model_len
        # the KV budget and the running-sequence limit, resolved once by the runner (explicit, CPU default, or
        # sized from the device)
        self.config = config = self.runner.config
        self.scheduler = Scheduler(config, self.eos_ids)
        self.seqs: dict[str, Sequence] = {}
        self.totals = EngineStats()
        self._arrivals = 0
        self._inflight: InflightDecode | None = None
        self._inflight_prefill: InflightPrefill | None = None
        self._limits = RequestLimits(shape.vocab_size, self.max_model_len, config.max_num_batched_tokens,
                                     self.scheduler.blocks.num_usable * config.block_size, config.window,
                                     config.group, tuple(sorted(self.eos_ids)))

    # ---- requests ----------------------------------------------------------------------------
    def limits(self) -> RequestLimits:
        """What a request must fit; constant once the engine is built."""
        return self._limits

    def validate(self, prompt: list[int], params: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; nothing is queued (engine.limits.validate_request)."""
        validate_request(self._limits, self.tokenizer, prompt, params)

    def _grammar_state(self, params: SamplingParams, verified: bool) -> GrammarState | None:
        """The row's grammar state; a verified (DVR) row keeps its fast path's masks for its verify windows."""
        if params.grammar is None:
            return None
        compiled, info = compile_request_grammar(params.grammar, self.tokenizer, self._limits.vocab_size,
                                                 self._limits.eos_ids)
        return GrammarState(compiled, info, keep_masks=verified)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Sequence:
        """Queue a request that passed `validate` (its caller's way in: LLM, AsyncEngine, EngineProcess)."""
        if request_id in self.seqs:
            raise ValueError(f"request_id: {request_id!r} is already running")
        dvr = params.deterministic and self.config.mode == Mode.DVR
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        seq = Sequence(request_id, list(prompt), params, seed, SeqKind.DVR if dvr else SeqKind.FAST,
                       self._next_arrival(), grammar=self._grammar_state(params, dvr))
        return self._admit(seq)

    def add_replay(self, replay_id: str, prompt: list[int], tokens: list[int], params: SamplingParams,
                   windows: list[tuple[int, int]]) -> Sequence:
        """Teacher-forced re-execution of recorded windows (checked by the caller: engine.replay.validate_replays)."""
        assert params.seed is not None, "a replay needs the recorded seed"
        seq = Sequence(replay_id, list(prompt), params, params.seed, SeqKind.REPLAY, self._next_arrival(),
                       tokens=list(tokens), windows=list(windows), replay=ReplayState(),
                       grammar=self._grammar_state(params, False))
        seq.pending_windows.extend(windows)
        return self._admit(seq)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.candidates.clear()
        if not seq.is_finished:
            seq.status = SeqStatus.FINISHED
            seq.finish_reason = FinishReason.ABORT
        return seq

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (the engine takes no step after this)."""
        if self.runner.tp is not None:
            self.runner.tp.close()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None or self._inflight_prefill is not None

    def _next_arrival(self) -> int:
        self._arrivals += 1
        return self._arrivals

    def _admit(self, seq: Sequence) -> Sequence:
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)
        self.totals.prompt_tokens += len(seq.prompt)
        return seq

    # ---- stepping ----------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """One pass. Returns the sequences whose committed state changed (or finished)."""
        t0 = time.perf_counter()
        touched: list[Sequence] = []
        plan = None
        if self._inflight_prefill is not None:
            # the next prefill pass does not depend on the first tokens in flight: launch it before reading them
            plan = self.scheduler.chained_prefill()
            if plan is None:
                touched += self._retire(self._settle_prefill())
        if plan is None and self._inflight is not None:
            plan = self.scheduler.chained_decode()
        if plan is None and self._inflight is not None and self.config.tuning.chained_verify:
            plan = self.scheduler.chained_verify()  # launched behind the in-flight step, which it then reads
        if plan is None:
            touched += self._retire(self._settle())
            plan = self.scheduler.schedule()
        run = {StepKind.PREFILL: self._prefill, StepKind.DECODE: self._decode,
               StepKind.VERIFY: self._verify, StepKind.IDLE: lambda p: []}[plan.kind]
        touched += self._retire(run(plan))
        self.totals.steps += 1
        self.totals.step_seconds += time.perf_counter() - t0
        return touched

    def _retire(self, touched: list[Sequence]) -> list[Sequence]:
        """Release the finished ones among `touched` (their KV, their scheduler slot)."""
        for seq in touched:
            if seq.is_finished:
                self.scheduler.remove(seq)
                self.seqs.pop(seq.request_id, None)
        return touched

    def _prefill(self, plan: Plan) -> list[Sequence]:
        """Launch the pass and sample each row's first token. With overlap (and the device sampler) the samples
        stay in flight: the next step launches the next prefill pass, if it is one, before they are read
        (`_settle_prefill`); the previous pass's samples, if any, are applied once this one is launched."""
        rows = [Row(it.tokens, 0, self._table(it.seq)) for it in plan.prefill]
        wanted = {i: it.seq.params.prompt_logprobs for i, it in enumerate(plan.prefill)
                  if it.sample and it.seq.params.prompt_logprobs is not None and it.seq.prompt_logprobs is None}
        logits, prompts = self.runner.prefill_with_prompts(rows, plan.pass_tokens, wanted)  # [R, vocab]
        for i, got in prompts.items():
            plan.prefill[i].seq.prompt_logprobs = got
        self.totals.prefill_passes += 1
        idx = [i for i, it in enumerate(plan.prefill) if it.sample]
        specs = [(plan.prefill[i].seq.params, plan.prefill[i].seq.seed, len(plan.prefill[i].tokens)) for i in idx]
        for it in plan.prefill:
            it.seq.kv_len = len(it.tokens)
        first = logits[idx]  # [len(idx), vocab]: the first output of each sampled row (a copy)
        self._process(first, [(plan.prefill[i].seq, 0) for i in idx])
        pending = sample_rows_deferred(first, specs) if idx and self.config.tuning.overlap else None
        touched = self._settle_prefill()  # the pass before this one (launched behind it)
        if pending is not None:
            self._inflight_prefill = InflightPrefill([plan.prefill[i] for i in idx], pending)
            return touched + [it.seq for it in plan.prefill if not it.sample]
        for i, res in zip(idx, sample_rows(first, specs) if idx else []):
            self._after_prefill(plan.prefill[i].seq, res)
        return touched + [it.seq for it in plan.prefill]

    def _settle_prefill(self) -> list[Sequence]:
        """Apply the in-flight prefill pass's first tokens (waits for them); rows aborted meanwhile drop theirs."""
        held, self._inflight_prefill = self._inflight_prefill, None
        return settle_prefill(held, self._after_prefill)

    def _after_prefill(self, seq: Sequence, res: SampleResult) -> None:
        if seq.kind == SeqKind.REPLAY:
            assert seq.replay is not None
            seq.replay.predicted.append(res.token)
            seq.replay.logprobs.append(res.logprob)
            if not seq.pending_windows:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.STOP
        elif seq.tokens:  # DVR rebuild after preemption: the canonical prefill must agree bit for bit
            assert (res.token, res.logprob) == (seq.tokens[0], seq.logprobs[0]), f"rebuild of {seq.request_id}"
        else:
            self._commit(seq, res.token, res)

    def _decode(self, plan: Plan) -> list[Sequence]:
        """Launch the step (input ids of rows whose last token is in flight come from the device), then
        apply the in-flight step before it, then this one unless it can stay in flight."""
        for seq in plan.decode:
            assert seq.kv_len == seq.num_tokens - 1, (seq.request_id, seq.kv_len, seq.num_tokens)
        prev = self._inflight
        canonical = self.runner.canonical_decode  # False unless DVR mode with canonical decode
        rows = [Row([DUMMY_TOKEN if s.inflight else s.last_token], s.kv_len, self._table(s),
                    canonical and s.kind != SeqKind.FAST) for s in plan.decode]
        chain = decode_chain(prev, plan.decode)
        assert chain is not None or all(s.inflight == 0 for s in plan.decode), "an in-flight token with no step"
        logits = self.runner.decode(rows, chain=chain)  # [R, vocab]
        self.totals.decode_passes += 1
        # a processed row needs its whole prefix: read the step in flight first (the device runs this one)
        touched = self._settle() if needs_prefix(plan.decode) else []
        pending, stays = self._launch_samples(plan.decode, logits)
        touched += self._settle()
        return touched + self._hold(plan.decode, pending, stays)

    def _launch_samples(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[PendingSamples, bool]:
        """Sample a decode step of `seqs` (their K/V for it written: kv_len and inflight grow by one) from
        logits [R, vocab]: on the device without waiting (overlap), else, or where a row needs the host
        sampler (top-k / top-p, top logprobs), now. Returns the samples and whether they may stay in flight."""
        specs = [(s.params, s.seed, s.num_tokens) for s in seqs]
        self._process(logits, [(s, s.num_tokens - s.prompt_len) for s in seqs])
        for seq in seqs:
            seq.kv_len += 1
            seq.inflight += 1
        deferred = sample_rows_deferred(logits, specs) if self.config.tuning.overlap else None
        if deferred is not None:
            return deferred, True
        return PendingSamples(None, ready=sample_rows(logits, specs)), False

    def _hold(self, seqs: list[Sequence], samples: PendingSamples, stays: bool) -> list[Sequence]:
        """Make this step of `seqs` the in-flight one; it is applied at once unless it may stay in flight."""
        assert self._inflight is None, "a decode step launched with another in flight"
        self._inflight = InflightDecode(list(seqs), samples, {s.key: j for j, s in enumerate(seqs)})
        return [] if stays else self._settle()

    def _settle(self) -> list[Sequence]:
        """Apply the in-flight decode step's samples (waits for them): commit (non-deterministic rows) or
        append candidates (DVR rows). Rows that finished or were aborted meanwhile drop theirs, and so
        does a DVR row whose previous candidate is a stop token (it decoded one step past it)."""
        step, self._inflight = self._inflight, None
        return settle_decode(step, self._commit, self._add_candidate, self.eos_ids)

    def _add_candidate(self, seq: Sequence, token: int) -> None:
        """A DVR row's fast-path token (settled): its next candidate; the row is ready once its window is."""
        seq.candidates.append(self._maybe_fault(seq, token))
        if seq.ready_since is None and candidate_done(seq, self.config.window, self.eos_ids):
            seq.ready_since = self.scheduler.step_index

    def _verify(self, plan: Plan) -> list[Sequence]:
        """The verify pass, and the decode step it carries (`plan.decode`): launch, settle, sample, apply.

        The carried rows' samples are launched first and stay in flight like a decode step's; the verify rows
        are sampled and applied. With overlap and `verify_early_decode` (off by default), where the verify rows'
        samples can be launched on the device (no top-k / top-p / top logprobs), the next decode step
        (`_early_decode`) is launched before they are read, so the host applies them while the GPU runs that step.
        A chained pass (`Scheduler.chained_verify`) is planned with the decode step before it in flight: it is
        launched behind that step (carried rows whose last token is in flight, and windows that end at a token
        in flight, take it on the device), and that step is read only then, before the pass's samples are
        applied (the windows' inputs then get the values read)."""
        t0 = time.perf_counter()
        assert all(r.seq.kind != SeqKind.FAST for r in plan.verify), "a non-deterministic request in a verify pass"
        prev = self._inflight
        for seq in plan.decode:
            assert seq.inflight <= (prev is not None) and seq.kv_len == seq.num_tokens - 1, (seq.request_id, seq.kv_len)
        chain = VerifyChain.of(prev, plan.decode, plan.verify)
        logits, starts, carried_logits = self.runner.verify(
            [Row(r.tokens, r.start_pos, self._table(r.seq)) for r in plan.verify],
            [Row([DUMMY_TOKEN if s.inflight else s.last_token], s.kv_len, self._table(s)) for s in plan.decode],
            chain=chain.decode, row_chain=chain.rows)
        touched, carried = self._settle_behind_verify(prev, chain, plan.decode, carried_logits)
        samples, early = self._sample_verify(plan, logits, starts, carried)
        if early is not None:
            touched += early
            carried = None
        rollbacks, recomputed = apply_pass(plan.verify, samples, self._commit)
        release_kv(plan.verify, self.scheduler.blocks)
        self.totals.rollbacks += rollbacks
        self.totals.recomputed_tokens += recomputed
        self.totals.verify_passes += 1
        self.totals.verify_seconds += time.perf_counter() - t0
        touched += [r.seq for r in plan.verify]
        return touched + (self._hold(*carried) if carried is not None else [])

    def _settle_behind_verify(self, prev: InflightDecode | None, chain: VerifyChain, carried: list[Sequence],
                              carried_logits: torch.Tensor | None
                              ) -> tuple[list[Sequence], LaunchedDecode | None]:
        """With the verify pass launched: launch the carried rows' samples and read the step in flight, if any
        (first where a processed carried row needs its prefix, else after the launch), then write its tokens
        into the windows that took them on the device. Returns the rows the read touched and the carried
        step's samples, to be held in flight (`_hold`) once the pass is sampled."""
        touched: list[Sequence] = []
        read_first = prev is not None and needs_prefix(carried)  # a processed carried row needs its prefix
        if read_first:
            touched += self._settle()
        launched = None
        if carried:
            assert carried_logits is not None
            launched = (carried, *self._launch_samples(carried, carried_logits))
            self.totals.carried_decode_rows += len(carried)
        if prev is not None:
            self.totals.chained_verify_passes += 1
            if not read_first:
                touched += self._settle()  # the step before the pass: its tokens are read now, applied first
            chain.fill_inputs()
        return touched, launched

    def _sample_verify(self, plan: Plan, logits: torch.Tensor, starts: list[int],
                       carried: LaunchedDecode | None
                       ) -> tuple[list[SampleResult], list[Sequence] | None]:
        """Sample every window position of the pass (logits [G * W, vocab], sampled where they lie, device or
        host; row r's outputs from starts[r]). Early decode: where they can be launched on the device, the
        carried step is held and the next decode step (chained from its in-flight samples) queued before
        they are read, so the GPU does not idle while the host applies them, and the rows those steps touched
        come back with the samples (else None: the carried step is still to be held)."""
        ids: list[int] = []
        specs: list[tuple[SamplingParams, int, int]] = []
        slots: list[tuple[Sequence, int]] = []
        for row, first in zip(plan.verify, starts, strict=True):
            ids += range(first, first + row.num_outputs)
            specs += [(row.seq.params, row.seq.seed, row.start_pos + 1 + i) for i in range(row.num_outputs)]
            slots += [(row.seq, row.start_pos + 1 + i - row.seq.prompt_len) for i in range(row.num_outputs)]
        self._process(logits, slots, ids)  # each window position from its prefix: committed, then candidates
        early = self.config.tuning.overlap and self.config.tuning.verify_early_decode
        launched = sample_rows_deferred(logits, specs, ids) if early else None
        if launched is None:
            return sample_rows(logits, specs, ids), None
        touched = self._hold(*carried) if carried is not None else []
        touched += self._early_decode(plan)
        return launched.results(), touched

    def _early_decode(self, verify: Plan) -> list[Sequence]:
        """The decode step after a verify pass, planned and launched before the pass's samples are read:
        every row a chained decode step would take. The pass's own rows are not counted ready; a row of
        it whose candidates run past its windows in the pass decodes on from its last candidate
        (speculatively: if the pass rolls those candidates back, the token is void and dropped at the
        settle, `stale_inflight`), the others sit this step out (their next input is the pass's bonus
        token). A row's bits are those of any decode step at that position; nothing is launched where
        the scheduler would plan anything else (a prefill, a verify pass, a preemption) or nothing can
        decode."""
        verifying = frozenset(r.seq for r in verify.verify)
        covered: dict[Sequence, int] = {}  # each row's last position that this pass verifies
        for r in verify.verify:
            covered[r.seq] = max(covered.get(r.seq, -1), r.start_pos + len(r.tokens) - 1)
        runs_ahead = frozenset(s for s, end in covered.items()
                               if s.kind == SeqKind.DVR and not s.pending_windows and s.kv_len > end)
        plan = self.scheduler.chained_decode(exclude=verifying - runs_ahead, not_ready=verifying)
        if plan is None:
            return []
        self.totals.early_decode_steps += 1
        return self._decode(plan)

    def _commit(self, seq: Sequence, token: int, res: SampleResult) -> bool:
        """Append one committed token; judge finish conditions on committed tokens only."""
        seq.tokens.append(token)
        seq.logprobs.append(res.logprob)
        if res.top_logprobs is not None:
            seq.top_logprobs.append(res.top_logprobs)
        self.totals.generated_tokens += 1
        reason = self._finish_reason(seq, token)
        if reason is not None:
            seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
            seq.candidates.clear()
        return reason is not None

    def _finish_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        if p.is_stop_token(token, self.eos_ids):
            return FinishReason.STOP
        if p.stop and self.detokenize is not None and _stop_at(self.detokenize(seq.tokens), p.stop) is not None:
            return FinishReason.STOP
        if len(seq.tokens) >= p.max_tokens:
            return FinishReason.LENGTH
        return None

    def _maybe_fault(self, seq: Sequence, token: int) -> int:
        """Fault injection: replace a fast-path candidate by a different token at `fault_rate`."""
        rate = self.config.fault_rate
        if rate == 0.0:
            return token
        position = seq.prompt_len + len(seq.tokens) + len(seq.candidates)  # this candidate's position
        key = np.array([self.config.fault_seed, seq.seed, position, seq.verify_passes], dtype=np.uint64)
        h = int(splitmix64(np.array([int(np.bitwise_xor.reduce(splitmix64(key)))], dtype=np.uint64))[0])
        if (h >> 11) * 2.0 ** -53 >= rate:
            return token
        return (token + 1 + h % (self.shape.vocab_size - 1)) % self.shape.vocab_size

    def _process(self, logits: torch.Tensor, slots: list[tuple[Sequence, int]], rows: list[int] | None = None
                 ) -> None:
        """Apply the logits processors (engine.processors) in place: row rows[i] (default i) of logits is
        sampled for the slot after slots[i] = (seq, n): its first n outputs (committed, then candidates; a
        replay's recorded tokens). A slot whose prefix is no longer known (its step's previous token was
        dropped: the row finished, or decoded past a stop candidate) is left as is: its sample is dropped too."""
        if not any(seq.params.processed for seq, _ in slots):
            return
        rows = list(range(len(slots))) if rows is None else rows
        outputs: dict[str, list[int]] = {}
        picked_rows, picked = [], []
        for r, (seq, n) in zip(rows, slots, strict=True):
            if not seq.params.processed:
                continue
            out = outputs.get(seq.key)
            if out is None:
                out = outputs[seq.key] = seq.tokens + seq.candidates
            if n > len(out):
                stopped = bool(seq.candidates) and seq.params.is_stop_token(seq.candidates[-1], self.eos_ids)
                assert seq.status != SeqStatus.RUNNING or stopped, ("a processed slot without its prefix", seq.request_id)
                continue
            picked_rows.append(r)
            picked.append(Slot(seq.params, seq.prompt, out, n, seq.grammar, len(seq.tokens)))
        apply_processors(logits, picked_rows, picked)

    def _table(self, seq: Sequence) -> list[int]:
        return self.scheduler.blocks.table(seq_key(seq))

    # ---- outputs -----------------------------------------------------------------------------
    def output(self, seq: Sequence) -> RequestOutput:
        text = self.text_of(seq)
        return RequestOutput(
            request_id=seq.request_id, prompt_token_ids=list(seq.prompt), token_ids=list(seq.tokens),
            text=text, finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None, seed=seq.seed,
            deterministic=seq.kind == SeqKind.DVR, token_logprobs=list(seq.logprobs),
            top_logprobs=[dict(d) for d in seq.top_logprobs] if seq.params.logprobs else None,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            windows=list(seq.windows), window_shape=(self.config.group, self.config.window),
            prompt_logprobs=list(seq.prompt_logprobs.logprobs) if seq.prompt_logprobs else None,
            prompt_top_logprobs=([dict(d) for d in seq.prompt_logprobs.top]
                                 if seq.prompt_logprobs and seq.prompt_logprobs.top is not None else None),
            verify_passes=seq.verify_passes, rollbacks=seq.rollbacks, recomputed_tokens=seq.recomputed_tokens,
        )

    def text_of(self, seq: Sequence) -> str:
        if self.detokenize is None:
            return ""
        return stop_cut(self.detokenize(seq.tokens), seq.params.stop or [])

    def stats(self) -> EngineStats:
        s = EngineStats(**vars(self.totals))
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        s.preemptions = self.scheduler.preemptions
        return s


def stop_cut(text: str, stops: list[str]) -> str:
    """The text up to the first stop string (the engine finishes a request there; its text ends before it)."""
    cut = _stop_at(text, stops)
    return text if cut is None else text[:cut]


def _stop_at(text: str, stops: list[str]) -> int | None:
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None
