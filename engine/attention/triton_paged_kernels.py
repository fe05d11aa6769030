"""Triton kernels of engine.attention.triton_paged (imported lazily: only on the CUDA path).

Layouts, invariance argument and launch parameters: see triton_paged.py.
"""
import triton
import triton.language as tl


@triton.jit
def load_kv_tile(k_ptr, v_ptr, bt_ptr, r, stride_bt, table_cols, kpos, k_valid, kvh, offs_d, d_mask,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE: tl.constexpr):
    """The K and V tiles [BN, BD] of keys `kpos` of row r (paged through its block table); keys not
    `k_valid` (and head-dim lanes past D) load as 0."""
    col = kpos // BLOCK_SIZE
    blk = tl.load(bt_ptr + r * stride_bt + col, mask=k_valid & (col < table_cols), other=0)
    blk = blk.to(tl.int64)  # block * stride can pass 2**31 elements on large caches
    off = kpos % BLOCK_SIZE
    kv_mask = k_valid[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + blk[:, None] * stride_kb + off[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + blk[:, None] * stride_vb + off[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                mask=kv_mask, other=0.0)
    return k, v


@triton.jit
def rope_lanes(cs_ptr, t, stride_cst, stride_csw, offs_d, d_mask, HEAD_DIM: tl.constexpr):
    """What RoPE needs per lane of token t: (lane < D/2, its partner lane, cos, sin in fp32)."""
    lo = offs_d < HEAD_DIM // 2
    partner = tl.where(lo, offs_d + HEAD_DIM // 2, offs_d - HEAD_DIM // 2)
    cos = tl.load(cs_ptr + t * stride_cst + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + t * stride_cst + stride_csw + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    return lo, partner, cos, sin


@triton.jit
def rope_q(q_rows, q_mask, lo, partner, cos, sin, offs_d):
    """One token's query heads [rows, BD] (pointers `q_rows + lane`, before RoPE) rotated with
    triton_fused._rope_kernel's arithmetic lane by lane (lane i < D/2: x_i c_i - x_{i+D/2} s_i; lane
    i >= D/2: x_i c_i + x_{i-D/2} s_i, in fp32), rounded to q's dtype: the bits of the rope launch."""
    qx = tl.load(q_rows + offs_d[None, :], mask=q_mask, other=0.0).to(tl.float32)
    qp = tl.load(q_rows + partner[None, :], mask=q_mask, other=0.0).to(tl.float32)
    q = tl.where(lo[None, :], qx * cos[None, :] - qp * sin[None, :], qx * cos[None, :] + qp * sin[None, :])
    return q.to(q_rows.dtype.element_ty)


@triton.jit
def rope_store_kv(kraw_ptr, vraw_ptr, t, stride_krt, stride_krh, stride_vrt, stride_vrh, lo, partner, cos, sin,
                  slot_ptr, k_ptr, v_ptr, kvh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                  offs_d, d_mask, BLOCK_SIZE: tl.constexpr):
    """Token t's KV head kvh: K (before RoPE) rotated as rope_q, and V, stored in the paged caches at the
    token's slot (slot_ptr[t] = block * BLOCK_SIZE + offset): the bits triton_fused.rope_write_kv stores.
    The caller passes a CTA barrier before any thread loads a tile that may hold the slot, which makes
    these stores visible to every thread of the program."""
    slot = tl.load(slot_ptr + t).to(tl.int64)
    k_row = kraw_ptr + t * stride_krt + kvh * stride_krh
    kx = tl.load(k_row + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    kp = tl.load(k_row + partner, mask=d_mask, other=0.0).to(tl.float32)
    ky = tl.where(lo, kx * cos - kp * sin, kx * cos + kp * sin).to(kraw_ptr.dtype.element_ty)
    dst = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks + kvh * stride_kh
    tl.store(k_ptr + dst + offs_d, ky.to(k_ptr.dtype.element_ty), mask=d_mask)
    vv = tl.load(vraw_ptr + t * stride_vrt + kvh * stride_vrh + offs_d, mask=d_mask, other=0.0)
    vdst = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs + kvh * stride_vh
    tl.store(v_ptr + vdst + offs_d, vv.to(v_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    qsl_ptr, seq_lens_ptr, bt_ptr, row_mask_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_bt, table_cols,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr, CHUNK: tl.constexpr,
):
    r = tl.program_id(0)
    # canonical decode rows: only rows whose mask is nonzero run; the rest keep their split-KV output.
    # The exit comes before any arithmetic, so a running program computes the unmasked kernel's bits.
    if HAS_ROW_MASK:
        if tl.load(row_mask_ptr + r) == 0:
            return
    qt_rel = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // GROUP
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    ctx_len = seq_len - q_len
    # absolute query tile of this program
    qt = ctx_len // BLOCK_M + qt_rel
    pos = qt * BLOCK_M + tl.arange(0, BLOCK_M)            # [BM] absolute query positions
    q_valid = (pos >= ctx_len) & (pos < seq_len)
    tok = q_start + (pos - ctx_len)                        # row of q / o for each position
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=q_valid[:, None] & d_mask[None, :], other=0.0).to(k_ptr.dtype.element_ty)  # [BM, BD]

    last_key = tl.minimum(qt * BLOCK_M + BLOCK_M, seq_len)  # exclusive bound of keys any row sees
    # no key tile for a query tile past the row's end (its program writes nothing)
    num_tiles = tl.cdiv(last_key, BLOCK_N) * (qt * BLOCK_M < seq_len).to(tl.int32)
    # Keys in absolute chunks of CHUNK (CHUNK // BLOCK_N tiles): each chunk reduced on its own, then merged
    # into the running total in increasing chunk order (`merge_chunk`), so a decode query's chunks can
    # also be reduced in parallel and merged in that order with the same bits (_canonical_decode_kernel)
    tiles_per_chunk: tl.constexpr = CHUNK // BLOCK_N
    m_run = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_run = tl.zeros([BLOCK_M], tl.float32)
    acc_run = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for c in range(0, tl.cdiv(num_tiles, tiles_per_chunk)):
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for kt in range(c * tiles_per_chunk, tl.minimum(c * tiles_per_chunk + tiles_per_chunk, num_tiles)):
            kpos = kt * BLOCK_N + tl.arange(0, BLOCK_N)        # [BN] absolute key positions
            k_valid = kpos < seq_len
            k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr, r, stride_bt, table_cols, kpos, k_valid, kvh, offs_d, d_mask,
                                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale      # [BM, BN], log2 domain
            causal = (kpos[None, :] <= pos[:, None]) & k_valid[None, :]
            s = tl.where(causal, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet (invalid rows)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        m_run, l_run, acc_run = merge_chunk(m_run, l_run, acc_run, m_i, l_i, acc)
    out = acc_run / tl.where(l_run == 0.0, 1.0, l_run)[:, None]
    tl.store(o_ptr + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=q_valid[:, None] & d_mask[None, :])


@triton.jit
def merge_chunk(m_run, l_run, acc_run, m_c, l_c, acc_c):
    """Running (max, sum, unnormalised acc) [M], [M], [M, D] + one chunk's -> the new running triple.
    Elementwise only (no reduction, so no layout dependence); a chunk with no key (m_c = -inf) is exactly
    neutral (factors 1 and 0), as is merging into the empty start (factors 0 and 1)."""
    m_new = tl.maximum(m_run, m_c)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    a_run = tl.exp2(m_run - m_safe)
    a_c = tl.exp2(m_c - m_safe)
    acc_new = acc_run * a_run[:, None] + acc_c * a_c[:, None]
    l_new = l_run * a_run + l_c * a_c
    return m_new, l_new, acc_new


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, mid_o_ptr, mid_lse_ptr,
    seq_lens_ptr, bt_ptr, row_mask_ptr,
    qk_scale,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt, table_cols,
    stride_mo_t, stride_mo_h, stride_mo_s,
    stride_ml_t, stride_ml_h,
    o_ptr, cnt_ptr, stride_ot, stride_oh, stride_cnt,
    kraw_ptr, vraw_ptr, cs_ptr, slot_ptr, stride_krt, stride_krh, stride_vrt, stride_vrh, stride_cst, stride_csw,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr, NUM_SPLITS: tl.constexpr, FUSED_MERGE: tl.constexpr, MERGE_PAD: tl.constexpr,
    FUSE_ROPE: tl.constexpr,
):
    r = tl.program_id(0)
    if HAS_ROW_MASK:  # a canonical row: the prefill kernel computes it instead
        if tl.load(row_mask_ptr + r) != 0:
            return
    kvh = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + r)
    start = sp * SPLIT
    n_active = tl.maximum((seq_len + SPLIT - 1) // SPLIT, 1)  # splits holding keys (split 0 always runs)
    if FUSED_MERGE:
        # a split past the row's keys does nothing and is not counted: the merge reads the active splits
        # only, which gives the bits of reading them all (an empty split's lse is -inf, kept out by selects)
        if sp >= n_active:
            return
    heads = kvh * GROUP + tl.arange(0, GROUP_PAD)          # [GP] query heads of this KV head
    h_valid = tl.arange(0, GROUP_PAD) < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    q_mask = h_valid[:, None] & d_mask[None, :]
    if FUSE_ROPE:
        lo, partner, cos, sin = rope_lanes(cs_ptr, r, stride_cst, stride_csw, offs_d, d_mask, HEAD_DIM)
        q = rope_q(q_ptr + r * stride_qt + heads[:, None] * stride_qh, q_mask, lo, partner, cos, sin, offs_d)
        q = q.to(k_ptr.dtype.element_ty)  # [GP, BD]
        if sp == tl.maximum(seq_len - 1, 0) // SPLIT:  # the program whose split holds this step's key
            rope_store_kv(kraw_ptr, vraw_ptr, r, stride_krt, stride_krh, stride_vrt, stride_vrh, lo, partner, cos, sin,
                          slot_ptr, k_ptr, v_ptr, kvh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          offs_d, d_mask, BLOCK_SIZE)
        tl.debug_barrier()  # the stores before any thread's tile loads (see rope_store_kv)
    else:
        q = tl.load(q_ptr + r * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=q_mask, other=0.0).to(k_ptr.dtype.element_ty)  # [GP, BD]
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    end = tl.minimum(start + SPLIT, seq_len)
    for k0 in range(start, end, BLOCK_N):
        kpos = k0 + tl.arange(0, BLOCK_N)
        k_valid = kpos < end
        k, v = load_kv_tile(k_ptr, v_ptr, bt_ptr, r, stride_bt, table_cols, kpos, k_valid, kvh, offs_d, d_mask,
                            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, BLOCK_SIZE)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale                # [GP, BN]
        s = tl.where(k_valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    # an empty split (start >= seq_len) runs no tile: lse = -inf marks it and the merge skips it
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(l_i))
    tl.store(mid_o_ptr + r * stride_mo_t + heads[:, None] * stride_mo_h + sp * stride_mo_s
             + offs_d[None, :], out, mask=h_valid[:, None] & d_mask[None, :])
    tl.store(mid_lse_ptr + r * stride_ml_t + heads * stride_ml_h + sp, lse, mask=h_valid)
    if FUSED_MERGE:
        # The last of the row's n_active split programs of this KV head to finish merges the GROUP heads.
        # Ordering on the GPU (CUTLASS's semaphore pattern): the CTA barrier puts every thread's mid stores
        # before the atomic, a cumulative release at gpu scope; the merging program's atomic acquires every
        # other program's increment (a release sequence on the counter), and the barrier after it puts that
        # acquire before its threads' loads, which also bypass L1 (.cg). No program ever waits on another.
        tl.debug_barrier()
        cnt = cnt_ptr + r * stride_cnt + kvh
        done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")  # programs of this (row, KV head) done before
        if done == n_active - 1:
            tl.debug_barrier()
            # _decode_merge_kernel's arithmetic on all GROUP heads at once ([MP, BD]; mg, ml per head broadcast
            # over D as there): a skipped split (lse = -inf) keeps mg, ml, macc by a select instead of a branch,
            # so every head gets the merge kernel's bits
            mheads = kvh * GROUP + tl.arange(0, MERGE_PAD)
            mh_valid = tl.arange(0, MERGE_PAD) < GROUP
            mg = tl.full([MERGE_PAD, BLOCK_D], float("-inf"), tl.float32)
            ml = tl.zeros([MERGE_PAD, BLOCK_D], tl.float32)
            macc = tl.zeros([MERGE_PAD, BLOCK_D], tl.float32)
            for j in range(0, n_active):  # fixed increasing order
                lse_s = tl.load(mid_lse_ptr + r * stride_ml_t + mheads * stride_ml_h + j, mask=mh_valid,
                                other=float("-inf"), cache_modifier=".cg")
                ok = (lse_s > float("-inf"))[:, None]
                lse_b = lse_s[:, None]
                mo = tl.load(mid_o_ptr + r * stride_mo_t + mheads[:, None] * stride_mo_h + j * stride_mo_s
                             + offs_d[None, :], mask=ok & d_mask[None, :], other=0.0, cache_modifier=".cg")
                mg_new = tl.maximum(mg, lse_b)
                malpha = tl.exp2(mg - mg_new)
                mw = tl.exp2(lse_b - mg_new)
                macc = tl.where(ok, macc * malpha + mo * mw, macc)
                ml = tl.where(ok, ml * malpha + mw, ml)
                mg = tl.where(ok, mg_new, mg)
            tl.store(o_ptr + r * stride_ot + mheads[:, None] * stride_oh + offs_d[None, :],
                     (macc / ml).to(o_ptr.dtype.element_ty), mask=mh_valid[:, None] & d_mask[None, :])
            tl.store(cnt, 0)  # every program of this launch has counted: ready for the next launch

@triton.jit
def _decode_merge_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, row_mask_ptr,
    stride_mo_t, stride_mo_h, stride_mo_s,
    stride_ml_t, stride_ml_h,
    stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    HAS_ROW_MASK: tl.constexpr,
):
    r = tl.program_id(0)
    if HAS_ROW_MASK:  # a canonical row: its split buffers were never written
        if tl.load(row_mask_ptr + r) != 0:
            return
    h = tl.program_id(1)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    m = tl.full([BLOCK_D], float("-inf"), tl.float32)  # vectors, so loop-carried types never change
    l = tl.zeros([BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for sp in range(0, NUM_SPLITS):  # fixed increasing order
        lse = tl.load(mid_lse_ptr + r * stride_ml_t + h * stride_ml_h + sp)
        if lse > float("-inf"):
            o = tl.load(mid_o_ptr + r * stride_mo_t + h * stride_mo_h + sp * stride_mo_s + offs_d,
                        mask=d_mask, other=0.0)
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            acc = acc * alpha + o * w
            l = l * alpha + w
            m = m_new
    tl.store(o_ptr + r * stride_ot + h * stride_oh + offs_d, (acc / l).to(o_ptr.dtype.element_ty),
             mask=d_mask)
