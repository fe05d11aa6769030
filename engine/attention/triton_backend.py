"""The Triton paged-attention backend (CUDA): the attention-backend seam (plan / forward) over the kernels of
engine.attention.triton_paged (prefill / verify and split-KV decode) and engine.attention.triton_canonical_decode
(the prefill kernel's bits for one-query rows, GQA-packed), launched with one engine's KernelSettings.

Canonical decode rows (`AttentionMetadata.canonical_rows`, the DVR rows of a DECODE pass; every row
with decode="canonical"): the split kernels skip the flagged rows, then the prefill kernel's numerics
run over the same rows with `only_rows`, where the programs of unflagged rows return before any work
— as its GQA-packed one-query twin (engine.attention.triton_canonical_decode: one program per row, KV
head and key chunk instead of per row and query head, checked bitwise equal on the device) or the
prefill kernel. A flagged row thus gets bitwise the verifier's output for its position (a 1-query
row is a window like any other), an unflagged row the split-KV output, and both launches have
static grids (CUDA-graph capturable).

"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import triton_canonical_decode as packed
from engine.attention.metadata import AttentionMetadata, PassKind
from engine.attention.torch_backend import write_kv
from engine.attention.triton_paged import (DecodeRope, DecodeWorkspace, decode_attention, decode_num_splits,
                                           decode_split_for_rows, prefill_attention, row_mask)
from engine.config import DEFAULT_KERNEL_SETTINGS, KernelSettings


def _canonical_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TritonPlan,
                      scale: float, out: torch.Tensor | None, only_rows: torch.Tensor | None,
                      settings: KernelSettings, rope: DecodeRope | None = None) -> torch.Tensor:
    """One-query rows with the prefill kernel's bits: its GQA-packed twin where that is checked to give
    them on this device (engine.attention.triton_canonical_decode), the prefill kernel itself otherwise.
    `rope` (q before RoPE; the caller has checked use_packed) goes to the packed kernel."""
    if rope is not None or packed.use_packed(q, k_cache, settings):
        return packed.canonical_decode_attention(q, k_cache, v_cache, plan.seq_lens, plan.block_tables, scale,
                                                 out=out, only_rows=only_rows, rope=rope, settings=settings)
    return prefill_attention(q, k_cache, v_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables,
                             scale, 1, out=out, only_rows=only_rows, settings=settings)


@dataclass(frozen=True)
class TritonPlan:
    """Per-forward launch parameters, shared by every layer; built without a host sync for DECODE/VERIFY."""

    kind: PassKind
    slot_mapping: torch.Tensor     # Long[T]
    query_start_loc: torch.Tensor  # Int[R+1]
    seq_lens: torch.Tensor         # Int[R]
    block_tables: torch.Tensor     # Int[R, max_blocks]
    max_query_len: int
    one_query_per_row: bool        # DECODE with T == R: the split-KV decode kernel
    canonical_rows: torch.Tensor | None = None  # Int32[R] with one_query_per_row: 1 = the prefill kernel
    canonical_decode: bool = False  # decode="canonical", DECODE with T == R: every row the prefill kernel's bits
    # VERIFY with carried decode rows (AttentionMetadata.carried_rows): the plan of those last rows, one query
    # each, as a canonical decode step (the G verify rows before them keep this plan's prefill kernel)
    carried: TritonPlan | None = None


class TritonPagedAttention:
    """The attention-backend seam (plan / forward, as TorchAttention) on the Triton kernels above.

    DECODE steps are CUDA-graph capturable: `plan` reads only tensor shapes, and the split buffers
    come from a workspace kept for the backend's lifetime (grown, never freed, so captured graphs
    keep valid pointers).
    """

    name = "triton"

    @property
    def kernel_id(self) -> str:
        # decode="canonical" (mode batch_invariant) runs every pass at the canonical tile
        return self.settings.canonical_kernel_id() if self.decode == "canonical" else self.settings.kernel_id()
    # forward accepts k = v = None: this pass's K/V already sit in the cache at plan.slot_mapping (written by
    # the ops' rope_write_kv, in the RoPE launch), so the write_kv launches are skipped
    kv_prewritten = True

    def __init__(self, split_size: int | None = None, decode: str = "split", merge: str = "fused",
                 settings: KernelSettings = DEFAULT_KERNEL_SETTINGS) -> None:
        """decode="split": the split-KV decode kernel (fast), except for the rows a DECODE pass flags in
        `canonical_rows`; "canonical": every decode query goes through the prefill/verify kernel, so the
        fast path's attention numerics equal the verifier's. merge: decode_attention's (same bits either way).
        split_size: keys per split of the split-KV kernel; None (the default) chooses it by the step's
        padded batch (decode_split_for_rows), an int fixes it for every batch (a row's split output then
        does not depend on its batch). settings: the kernels' launch settings (tiles, fusion, streams)."""
        if decode not in ("split", "canonical"):
            raise ValueError(f"decode must be 'split' or 'canonical', got {decode!r}")
        if merge not in ("fused", "kernel"):
            raise ValueError(f"merge must be 'fused' or 'kernel', got {merge!r}")
        self.split_size, self.decode, self.merge, self.settings = split_size, decode, merge, settings
        self.concurrent_canonical = True  # canonical decode rows on a side stream (see _side_stream)
        self._streams: dict[int | None, torch.cuda.Stream] = {}
        self._workspaces: dict[tuple, DecodeWorkspace] = {}
        self._retired: list[DecodeWorkspace] = []

    def with_kernels(self, kernels: KernelSettings) -> TritonPagedAttention:
        if kernels == self.settings:
            return self
        other = TritonPagedAttention(self.split_size, self.decode, self.merge, kernels)
        other.concurrent_canonical = self.concurrent_canonical
        return other

    def plan(self, meta: AttentionMetadata, block_size: int) -> TritonPlan:
        num_tokens, num_rows = meta.num_tokens, meta.num_rows
        decode_shape = meta.kind is PassKind.DECODE and num_tokens == num_rows
        # a step whose flagged rows ask for it (canonical_step) runs every row canonical, like decode="canonical"
        whole = decode_shape and (self.decode == "canonical"
                                  or (meta.canonical_step and meta.canonical_rows is not None))
        one_per_row = decode_shape and not whole
        if decode_shape:
            max_q = 1
        elif meta.kind is PassKind.VERIFY and meta.verify_window:
            # packed: rows of 0 .. W tokens; a query's tiles are absolute, so its bits are the padded pass's
            if not 0 <= meta.carried_rows < num_rows:
                raise ValueError(f"VERIFY: {meta.carried_rows} carried rows of {num_rows}")
            max_q = meta.verify_window
        elif meta.kind is PassKind.VERIFY:
            d = meta.carried_rows
            if not 0 <= d < num_rows or (num_tokens - d) % (num_rows - d):
                raise ValueError(f"VERIFY rows must all hold W tokens (then {d} carried one-token rows): "
                                 f"{num_tokens} tokens in {num_rows} rows")
            max_q = (num_tokens - d) // (num_rows - d)
        elif num_rows == 1:
            max_q = num_tokens
        else:
            max_q = int((meta.query_start_loc[1:] - meta.query_start_loc[:-1]).max().item())
        # decode="canonical" already sends every decode row through the prefill kernel
        canonical = row_mask(meta.canonical_rows, num_rows) if one_per_row else None
        slots = meta.slot_mapping.to(torch.long)
        carried = None
        if meta.kind is PassKind.VERIFY and meta.carried_rows:
            # the carried rows as a canonical decode step of their own (query starts rebased on the device)
            gv, tv = num_rows - meta.carried_rows, num_tokens - meta.carried_rows
            carried = TritonPlan(PassKind.DECODE, slots[tv:], meta.query_start_loc[gv:] - tv, meta.seq_lens[gv:],
                                 meta.block_tables[gv:], 1, False, None, canonical_decode=True)
        return TritonPlan(meta.kind, slots, meta.query_start_loc, meta.seq_lens,
                          meta.block_tables, max_q, one_per_row, canonical,
                          canonical_decode=whole, carried=carried)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        """The stream canonical decode rows run on, beside the split kernel on the current stream (both
        write disjoint rows of one output; a CUDA graph captures the fork and join as two branches). The
        kernels and their inputs are the same as on one stream, so are the bits. None off CUDA."""
        if device.type != "cuda" or not self.concurrent_canonical:
            return None
        stream = self._streams.get(device.index)
        if stream is None:
            stream = self._streams[device.index] = torch.cuda.Stream(device)
        return stream

    def workspace(self, num_rows: int, num_heads: int, head_dim: int, num_splits: int,
                  device: torch.device) -> DecodeWorkspace:
        key = (str(device), num_heads, head_dim, num_splits)
        ws = self._workspaces.get(key)
        if ws is None or ws.mid_o.shape[0] < num_rows:
            if ws is not None:
                self._retired.append(ws)  # a captured graph may still point at it
            # 64 rows at least (eager steps of other batch sizes reuse it), fewer for many short splits
            # (batch-1 graphs of a long-context family: 512 splits of 64 keys)
            floor = 64 if num_splits <= 64 else 8
            ws = DecodeWorkspace(max(num_rows, floor, 2 * ws.mid_o.shape[0] if ws is not None else 0),
                                 num_heads, head_dim, num_splits, device)
            self._workspaces[key] = ws
        return ws

    def forward_rope(
        self,
        q: torch.Tensor,        # [T, Hq, D], before RoPE (a strided view of the qkv output is fine)
        k: torch.Tensor,        # [T, Hkv, D], before RoPE
        v: torch.Tensor,
        cos_sin: torch.Tensor,  # [T, 2, D]: cos, sin of each token's position, in q's dtype
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        plan: TritonPlan,
        scale: float,
    ) -> torch.Tensor | None:   # [T, Hq, D], or None
        """`forward` of q and k before RoPE, for a pass where this backend can rotate them and write K/V
        inside its attention launch: a DECODE step whose rows all take the split-KV kernel (no canonical
        rows). The split kernel then applies triton_fused's RoPE arithmetic to q and K and stores K and V
        at plan.slot_mapping itself (decode_attention's `rope`), one launch a layer fewer than
        rope_write_kv + forward, with the same bits (output and caches). With settings.fuse_rope_canonical also a
        DECODE step with canonical rows, or of decode="canonical", where the packed canonical kernel serves
        them (use_packed): each kernel rotates and stores its own rows. Any other pass: None, having
        touched nothing (the caller ropes and writes as usual). The model calls it only where its ops'
        RoPE is triton_fused's (Ops.triton_rope), so the arithmetic is the ops' own."""
        if not (plan.one_query_per_row or plan.canonical_decode):
            return None
        if plan.canonical_decode or plan.canonical_rows is not None:  # rows for the canonical kernel
            # off, or the prefill kernel serves them (it reads K/V already written): the caller's path
            if not self.settings.fuse_rope_canonical or not packed.use_packed(q, k_cache, self.settings):
                return None
        rope = DecodeRope(k, v, cos_sin, plan.slot_mapping)
        if plan.canonical_decode:
            return _canonical_decode(q, k_cache, v_cache, plan, scale, None, None, self.settings, rope)
        return self._split_decode(q, k_cache, v_cache, plan, scale, rope)

    def _split_decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: TritonPlan,
                      scale: float, rope: DecodeRope | None) -> torch.Tensor:
        """A DECODE step of one query per row: the split-KV kernel, and the canonical kernel for the rows
        plan.canonical_rows flags (on a side stream where there is one). With `rope`, q is before RoPE and
        each kernel rotates and stores its own rows' K/V (the canonical rows through the packed kernel)."""
        split_size = self.split_size or decode_split_for_rows(q.shape[0])
        splits = decode_num_splits(plan.block_tables.shape[1] * k_cache.shape[1], split_size)
        ws = self.workspace(q.shape[0], q.shape[1], q.shape[2], splits, q.device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)

        def split() -> None:
            decode_attention(q, k_cache, v_cache, plan.seq_lens, plan.block_tables, scale,
                             workspace=ws, out=out, split_size=split_size, skip_rows=plan.canonical_rows,
                             merge=self.merge, rope=rope, settings=self.settings)

        if plan.canonical_rows is None:
            split()
        else:  # the canonical rows on a second stream, concurrent with the split rows
            self._beside(q.device, True, split,
                         lambda: _canonical_decode(q, k_cache, v_cache, plan, scale, out, plan.canonical_rows,
                                                   self.settings, rope))
        return out

    def _beside(self, device: torch.device, concurrent: bool, main: Callable[[], object],
                beside: Callable[[], object]) -> None:
        """`beside` on the side stream concurrently with `main` on the current one (fork before, join after)
        where `concurrent` and there is a side stream (_side_stream); else `main`, then `beside`. The two
        write disjoint outputs; the kernels and their inputs are the same either way, so are the bits."""
        side = self._side_stream(device) if concurrent else None
        if side is None:
            main()
            beside()
            return
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            beside()
        main()
        current.wait_stream(side)

    def forward(
        self,
        q: torch.Tensor,        # [T, Hq, D]
        k: torch.Tensor | None,  # [T, Hkv, D]; None with v: already written to plan.slot_mapping (kv_prewritten)
        v: torch.Tensor | None,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        plan: TritonPlan,
        scale: float,
    ) -> torch.Tensor:          # [T, Hq, D]
        if k is not None or v is not None:
            if k is None or v is None:
                raise ValueError("k and v are written together: pass both, or neither (kv_prewritten)")
            write_kv(k, v, k_cache, v_cache, plan.slot_mapping)
        q = q.contiguous()
        if plan.one_query_per_row:
            return self._split_decode(q, k_cache, v_cache, plan, scale, None)
        if plan.canonical_decode:
            return _canonical_decode(q, k_cache, v_cache, plan, scale, None, None, self.settings)
        if plan.carried is not None:
            # a verify pass carrying decode rows: the G rows of W tokens through the prefill kernel as in any
            # verify pass (its grid and each row's arithmetic do not see the carried rows), then the carried
            # rows through the canonical decode kernel; disjoint slices of one output
            d = plan.carried.seq_lens.shape[0]
            tv, gv = q.shape[0] - d, plan.seq_lens.shape[0] - d
            out = torch.empty_like(q)
            self._beside(q.device, self.settings.concurrent_carried,
                         lambda: prefill_attention(q[:tv], k_cache, v_cache, plan.query_start_loc[: gv + 1],
                                                   plan.seq_lens[:gv], plan.block_tables[:gv], scale,
                                                   plan.max_query_len, out=out[:tv], settings=self.settings),
                         lambda: _canonical_decode(q[tv:], k_cache, v_cache, plan.carried, scale, out[tv:], None,
                                                   self.settings))
            return out
        # plain prefill passes may take their own tile (settings.prefill_pass_tile); verify passes and every pass
        # of decode="canonical" keep the verifier's
        plain = plan.kind is PassKind.PREFILL and self.decode == "split"
        block_m = self.settings.prefill_tile if plain else self.settings.query_tile
        return prefill_attention(q, k_cache, v_cache, plan.query_start_loc, plan.seq_lens, plan.block_tables,
                                 scale, plan.max_query_len, block_m=block_m, settings=self.settings)
