"""Logits processors: penalties, logit bias and grammar masks, applied to a logits row before the sampler.

Specification (PROCESSORS_ID). A logits row is sampled for the output slot that follows outputs o_1 .. o_n of a
row with prompt p_1 .. p_L (n = 0 for the first output). Let x be its float32 logits. Every step is float32
arithmetic, elementwise, each operation rounded on its own (no fused multiply-add), in this order:

1. repetition penalty r (vLLM / Hugging Face), when r != 1: for every distinct id t of p_1 .. p_L, o_1 .. o_n:
   x_t = x_t / r if x_t > 0, else x_t * r.
2. frequency f and presence s penalties (OpenAI), for every distinct id t among o_1 .. o_n (the generated
   tokens only) with count c_t: x_t = x_t - float32(c_t) * f (the product rounded first), then x_t = x_t - s.
3. logit bias: x_t = x_t + b_t for every (t, b_t) of `logit_bias`.
4. grammar: x_t = -inf for every id the row's grammar state after o_1 .. o_n does not allow
   (engine.grammar.GrammarState: a pure function of o_1 .. o_n).

The sampler (engine.sampling, its own specification) then takes the processed row: temperature, top-k / top-p /
min-p, the counter-based noise. The logprobs it reports, of the sampled token and the top ones, are the
log-softmax of the processed row (after step 4, before temperature), as OpenAI reports logprobs after
`logit_bias`; a masked id has logprob -inf and is never among the top logprobs.

Every step reads only the row's prompt, its outputs before the slot and its parameters, so a slot's processed
row is the same wherever the row sits and whatever else is batched. The engine applies it to every sampled
slot the same way: a prefill's first output (n = 0), a fast-path step (the prefix of committed tokens and
candidates known when the step is sampled), each position of a verify window (the prefix up to that
position: committed tokens, then the window's candidates) and of a teacher-forced window (the recorded
tokens). Steps 1-3 run on the logits' device as a handful of gathers and scatters over the ids they touch;
step 4 fills the masks on the host (the grammar library), in pinned memory when the logits are on CUDA
(MaskStaging), copied without waiting, then applied by the library's kernel where the logits are.
"""
from __future__ import annotations

import threading
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np
import torch

from engine.grammar import GrammarState, fill_masks
from engine.sampling import SamplingParams

PROCESSORS_ID = "verbatim-processors-v1"


@dataclass(frozen=True)
class Slot:
    """One sampled logits row: the slot after outputs[:n] of a row with `prompt`."""

    params: SamplingParams
    prompt: Seq[int]
    outputs: Seq[int]
    n: int
    grammar: GrammarState | None = None
    committed: int = 0     # outputs[:committed] are committed: they never change (the grammar state's hint)


@torch.inference_mode()  # the runner's logits are inference tensors
def apply_processors(logits: torch.Tensor, rows: list[int], slots: list[Slot]) -> None:
    """Process rows `rows` of logits [N, vocab] (float32, any device) in place, row rows[i] as slots[i]."""
    assert logits.dtype == torch.float32 and len(rows) == len(slots), (logits.dtype, len(rows), len(slots))
    picked = [(r, s) for r, s in zip(rows, slots) if s.params.processed]
    if not picked:
        return
    _apply_sparse(logits, picked)
    masked = [(r, s) for r, s in picked if s.grammar is not None]
    if masked:
        _apply_masks(logits, masked)


def _apply_sparse(logits: torch.Tensor, picked: list[tuple[int, Slot]]) -> None:
    """Steps 1-3 over the ids each slot touches (its context, generated and biased ids), one gather and one
    scatter for all slots."""
    parts: list[tuple[np.ndarray, ...]] = []
    for row, slot in picked:
        p = slot.params
        if not (p.logit_bias or p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0):
            continue
        part = _slot_entries(row, slot)
        if part is not None:
            parts.append(part)
    if not parts:
        return
    cols = [np.concatenate(c) for c in zip(*parts)]
    index = _staged(np.stack(cols[:2]), logits.device)                          # [2, K] row, id
    rep, count, freq, pres, bias, in_ctx, biased = _staged(np.stack(cols[2:]), logits.device)  # [7, K]
    rows_t, ids_t = index[0], index[1]
    counted = count > 0
    x = logits[rows_t, ids_t]
    x = torch.where(in_ctx > 0, torch.where(x > 0, x / rep, x * rep), x)
    x = torch.where(counted, x - count * freq, x)
    x = torch.where(counted, x - pres, x)
    x = torch.where(biased > 0, x + bias, x)
    logits[rows_t, ids_t] = x


def _slot_entries(row: int, slot: Slot) -> tuple[np.ndarray, ...] | None:
    """Per touched id of one slot, ids ascending: row, id (int64); r, count, f, s, bias, in context, biased
    (float32; the flags 0 / 1)."""
    p = slot.params
    out = np.asarray(slot.outputs[: slot.n], dtype=np.int64)
    assert len(out) == slot.n, ("the processors need the slot's whole prefix", len(out), slot.n)
    pieces = [np.array([t for t, _ in p.logit_bias], dtype=np.int64)]
    ctx = np.zeros(0, np.int64)
    if p.repetition_penalty != 1.0:
        ctx = np.unique(np.concatenate([np.asarray(slot.prompt, dtype=np.int64), out]))
        pieces.append(ctx)
    gen, counts = np.zeros(0, np.int64), np.zeros(0, np.int64)
    if p.frequency_penalty or p.presence_penalty:
        gen, counts = np.unique(out, return_counts=True)
        pieces.append(gen)
    ids = np.unique(np.concatenate(pieces))
    if not len(ids):
        return None
    k = len(ids)
    count = np.zeros(k, np.float32)
    count[np.searchsorted(ids, gen)] = counts
    bias = np.zeros(k, np.float32)
    biased = np.zeros(k, np.float32)
    if p.logit_bias:
        at = np.searchsorted(ids, pieces[0])
        bias[at] = np.array([b for _, b in p.logit_bias], dtype=np.float32)
        biased[at] = 1.0
    full = np.full
    return (full(k, row, np.int64), ids, full(k, p.repetition_penalty, np.float32), count,
            full(k, p.frequency_penalty, np.float32), full(k, p.presence_penalty, np.float32), bias,
            np.isin(ids, ctx).astype(np.float32), biased)


def _staged(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """`a` on `device`: through pinned memory without waiting when it is CUDA (the copy queues behind the pass)."""
    t = torch.from_numpy(np.ascontiguousarray(a))
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def _apply_masks(logits: torch.Tensor, masked: list[tuple[int, Slot]]) -> None:
    """Step 4: the grammar masks, filled on the host, applied where the logits are (the library's kernel:
    x = -inf where the mask bit is 0, on the rows it is given). On CUDA the masks and the rows go to the device
    in one copy without waiting (MaskStaging)."""
    import xgrammar as xgr

    vocab = logits.shape[1]
    info = masked[0][1].grammar.info  # type: ignore[union-attr]
    assert info.words * 32 >= vocab, (info.words, vocab)
    rows = [r for r, _ in masked]
    if not logits.is_cuda:
        bitmask = torch.empty((logits.shape[0], info.words), dtype=torch.int32)
        fill_masks([(s.grammar, s.outputs, s.n, s.committed, r) for r, s in masked], bitmask)  # type: ignore[misc]
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
        return
    staging = info.staging.get(logits.device) or info.staging.setdefault(logits.device, MaskStaging(info.words))
    head = -(-len(rows) // info.words)  # index rows ahead of the masks
    with staging.lock:
        host = staging.take(head + max(rows) + 1)
        host.numpy().reshape(-1)[: len(rows)] = rows
        fill_masks([(s.grammar, s.outputs, s.n, s.committed, head + r) for r, s in masked], host)  # type: ignore[misc]
        staged = host.to(logits.device, non_blocking=True)
        staging.sent(logits.device)
    indices = staged[:head].view(-1)[: len(rows)]
    xgr.apply_token_bitmask_inplace(logits, staged[head:], vocab_size=vocab, indices=indices)


class MaskStaging:
    """Pinned host buffers through which one vocabulary's grammar masks go to a CUDA device, reused from step to
    step: a ring of SLOTS buffers, each written again only once the copy out of it is complete (its event).

    A staged buffer (int32 [head + rows, words]):   index rows | mask rows
        rows 0 .. head-1        the logits rows to mask, int32, back to back (then unused words)
        row head + r            the mask of logits row r (rows that are not masked: stale, never read)
    so one copy carries the masks and the row indices the kernel reads them by."""

    SLOTS = 4

    def __init__(self, words: int) -> None:
        self.words = words
        self.lock = threading.Lock()  # a slot is taken, filled and sent under it
        self._buffers: list[torch.Tensor | None] = [None] * self.SLOTS
        self._events: list[torch.cuda.Event | None] = [None] * self.SLOTS
        self._slot = self.SLOTS - 1

    def take(self, rows: int) -> torch.Tensor:
        """The next slot's buffer, `rows` tall, once the copy out of it is complete."""
        self._slot = (self._slot + 1) % self.SLOTS
        event = self._events[self._slot]
        if event is not None:
            event.synchronize()  # a step or more ago: normally complete already
        buf = self._buffers[self._slot]
        if buf is None or buf.shape[0] < rows:
            buf = self._buffers[self._slot] = torch.empty((-(-rows // 64) * 64, self.words), dtype=torch.int32,
                                                          pin_memory=True)
        return buf[:rows]

    def sent(self, device: torch.device) -> None:
        """The copy out of the slot last taken is queued on `device`'s current stream."""
        event = self._events[self._slot]
        if event is None:
            event = self._events[self._slot] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
