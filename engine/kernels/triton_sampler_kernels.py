"""Triton kernels of engine.kernels.triton_sampler (imported only when a kernel is first used)."""
import triton
import triton.language as tl


@triton.jit
def _mix(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def _gumbel(key, ids):
    """g(seed, position, id) of engine.noise in float64: the hash's top 53 bits as u in (0, 1), -log(-log(u)).
    Pass 1 and the filter both draw through here, so the filter's scores equal pass 1's bit for bit."""
    bits = _mix((key ^ ids.to(tl.uint64)) + 0x9E3779B97F4A7C15)
    u = ((bits >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
    return -tl.log(-tl.log(u))


@triton.jit
def split_kernel(logits_ptr, row_stride, row_ids_ptr, keys_ptr, temps_ptr, topk_ptr, topp_ptr,
                 best_ptr, arg_ptr, m_ptr, s_ptr, tm_ptr, ts_ptr, cmax_ptr, cbest_ptr, cid_ptr, vocab, n_chunks,
                 NUM_SPLITS: tl.constexpr, SPLIT_: tl.constexpr, BLOCK_: tl.constexpr):
    """Pass 1 for (row, split): the best Gumbel score and its id, the online log-sum-exp of x, every chunk's
    max x, best score and the first id reaching it (cmax, cbest, cid: for the filter) and, for rows whose
    top-p total is the whole vocab, the online sum of exp(x / T) (tm, ts)."""
    i = tl.program_id(0)
    sp = tl.program_id(1)
    row = tl.load(row_ids_ptr + i).to(tl.int64)
    key = tl.load(keys_ptr + i).to(tl.uint64, bitcast=True)
    temp = tl.load(temps_ptr + i)
    top_k = tl.load(topk_ptr + i)
    top_p = tl.load(topp_ptr + i)
    greedy = temp == 0.0
    need_total = (temp > 0.0) & (top_p < 1.0) & ((top_k <= 0) | (top_k >= vocab))
    inv = tl.where(greedy, 1.0, temp)
    best = tl.full((), -float("inf"), tl.float64)
    best_id = tl.full((), 0, tl.int64)
    m = tl.full((), -float("inf"), tl.float64)
    s = tl.full((), 0.0, tl.float64)
    tm = tl.full((), -float("inf"), tl.float64)
    ts = tl.full((), 0.0, tl.float64)
    base = logits_ptr + row * row_stride
    start = sp * SPLIT_
    for c in range(0, SPLIT_, BLOCK_):
        ids = start + c + tl.arange(0, BLOCK_)
        ok = ids < vocab
        x = tl.load(base + ids, mask=ok, other=-float("inf")).to(tl.float32).to(tl.float64)
        sv = x / inv
        score = tl.where(greedy, x, sv + _gumbel(key, ids))
        score = tl.where(ok, score, -float("inf"))
        cbest, carg = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = cbest > best
        best_id = tl.where(take, (start + c + carg).to(tl.int64), best_id)
        best = tl.where(take, cbest, best)
        cm = tl.max(x, axis=0)
        chunk = (start + c) // BLOCK_
        here = chunk < n_chunks
        tl.store(cmax_ptr + i * n_chunks + chunk, cm.to(tl.float32), mask=here)
        tl.store(cbest_ptr + i * n_chunks + chunk, cbest, mask=here)
        tl.store(cid_ptr + i * n_chunks + chunk, (start + c + carg).to(tl.int64), mask=here)
        m_new = tl.maximum(m, cm)
        alive = m_new > -float("inf")  # a chunk wholly past the vocab leaves (m, s) as they were
        m_safe = tl.where(alive, m_new, 0.0)
        e = tl.where(ok, tl.exp(x - m_safe), 0.0)
        s = tl.where(alive, s * tl.exp(m - m_safe) + tl.sum(e, axis=0), s)
        m = m_new
        if need_total:  # the same online sum over s = x / T (max s = max x / T: division keeps the order)
            tm_new = tl.maximum(tm, cm / inv)
            alive_t = tm_new > -float("inf")
            tm_safe = tl.where(alive_t, tm_new, 0.0)
            et = tl.where(ok, tl.exp(sv - tm_safe), 0.0)
            ts = tl.where(alive_t, ts * tl.exp(tm - tm_safe) + tl.sum(et, axis=0), ts)
            tm = tm_new
    out = i * NUM_SPLITS + sp
    tl.store(best_ptr + out, best)
    tl.store(arg_ptr + out, best_id)
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)
    tl.store(tm_ptr + out, tm)
    tl.store(ts_ptr + out, ts)

@triton.jit
def merge_kernel(logits_ptr, row_stride, row_ids_ptr, best_ptr, arg_ptr, m_ptr, s_ptr,
                 token_ptr, logprob_ptr, lse_ptr, xmax_ptr, NUM_SPLITS: tl.constexpr):
    i = tl.program_id(0)
    row = tl.load(row_ids_ptr + i).to(tl.int64)
    base = i * NUM_SPLITS
    best = tl.load(best_ptr + base)
    tok = tl.load(arg_ptr + base)
    big_m = tl.load(m_ptr + base)
    for sp in tl.static_range(1, NUM_SPLITS):
        b = tl.load(best_ptr + base + sp)
        a = tl.load(arg_ptr + base + sp)
        take = b > best
        tok = tl.where(take, a, tok)
        best = tl.where(take, b, best)
        big_m = tl.maximum(big_m, tl.load(m_ptr + base + sp))
    total = tl.load(s_ptr + base) * tl.exp(tl.load(m_ptr + base) - big_m)
    for sp in tl.static_range(1, NUM_SPLITS):
        ms = tl.load(m_ptr + base + sp)
        total += tl.load(s_ptr + base + sp) * tl.exp(ms - big_m)
    lse = big_m + tl.log(total)
    x = tl.load(logits_ptr + row * row_stride + tok).to(tl.float32).to(tl.float64)
    tl.store(token_ptr + i, tok)
    tl.store(logprob_ptr + i, (x - lse).to(tl.float32))
    tl.store(lse_ptr + i, lse)
    tl.store(xmax_ptr + i, big_m)


@triton.jit
def _order_key(x):
    """float32 -> int32 whose order is the float order (-0.0 counts as +0.0; no NaN in logits)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _next_chunk(qual, cidx, after, NCHUNK_PAD: tl.constexpr):
    """The first chunk index > after among those marked in qual (NCHUNK_PAD when none is left)."""
    return tl.min(tl.where(qual & (cidx > after), cidx, NCHUNK_PAD), axis=0)


@triton.jit
def _count_at_least(base, vocab, t, ckey, cidx, NCHUNK_PAD: tl.constexpr, BLOCK_: tl.constexpr):
    """The number of ids with key >= t, walking only the chunks whose max key reaches t."""
    qual = ckey >= t
    n = tl.full((), 0, tl.int64)
    j = _next_chunk(qual, cidx, -1, NCHUNK_PAD)
    while j < NCHUNK_PAD:
        ids = j * BLOCK_ + tl.arange(0, BLOCK_)
        x = tl.load(base + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
        n += tl.sum(((_order_key(x) >= t) & (ids < vocab)).to(tl.int64), axis=0)
        j = _next_chunk(qual, cidx, j, NCHUNK_PAD)
    return n


@triton.jit
def _count_tied_upto(base, vocab, kkey, jid, ckey, cidx, NCHUNK_PAD: tl.constexpr, BLOCK_: tl.constexpr):
    """The number of ids <= jid whose key is kkey, walking only the chunks that can hold one."""
    qual = (ckey >= kkey) & (cidx * BLOCK_ <= jid)
    n = tl.full((), 0, tl.int64)
    j = _next_chunk(qual, cidx, -1, NCHUNK_PAD)
    while j < NCHUNK_PAD:
        ids = j * BLOCK_ + tl.arange(0, BLOCK_)
        x = tl.load(base + ids, mask=ids < vocab, other=-float("inf")).to(tl.float32)
        n += tl.sum(((_order_key(x) == kkey) & (ids <= jid) & (ids < vocab)).to(tl.int64), axis=0)
        j = _next_chunk(qual, cidx, j, NCHUNK_PAD)
    return n


@triton.jit
def filter_kernel(logits_ptr, row_stride, params_ptr, n_rows, xmax_ptr, lse_ptr, token_ptr, logprob_ptr,
                  cmax_ptr, cbest_ptr, cid_ptr, tm_ptr, ts_ptr, vocab, n_chunks, NUM_SPLITS: tl.constexpr,
                  NCHUNK_PAD: tl.constexpr, BLOCK_: tl.constexpr):
    """Top-k / top-p / min-p for one row per program (engine.sampling's specification): the Gumbel argmax over
    the kept ids, found by rejection from the unfiltered argmax (token_ptr holds it on entry). The kept set
    is a prefix of the order (s desc, id asc), so when candidate c is not kept, no id at or after c is: the
    next candidate is the best score strictly before c. The first id of the order is always kept.

    Every scan walks only the chunks that can hold an id it counts: a chunk whose max s (its max x from pass
    1, divided by T; division keeps the order) is below the candidate's s holds no id before the candidate.
    The mass before a candidate is summed chunk by chunk in a fixed order (the chunks' max desc), so a scan
    that has rejected the candidate stops without changing the outcome."""
    i = tl.program_id(0)
    row = tl.load(params_ptr + 5 * n_rows + i)
    key = tl.load(params_ptr + i).to(tl.uint64, bitcast=True)
    temp = tl.load(params_ptr + n_rows + i).to(tl.float64, bitcast=True)
    top_k = tl.load(params_ptr + 2 * n_rows + i)
    top_p = tl.load(params_ptr + 3 * n_rows + i).to(tl.float64, bitcast=True)
    log_min_p = tl.load(params_ptr + 4 * n_rows + i).to(tl.float64, bitcast=True)
    use_k = (top_k > 0) & (top_k < vocab)
    use_p = top_p < 1.0
    use_m = log_min_p > -float("inf")
    if (temp > 0.0) & (use_k | use_p | use_m):
        base = logits_ptr + row * row_stride
        s_max = tl.load(xmax_ptr + i) / temp
        cidx = tl.arange(0, NCHUNK_PAD)
        valid = cidx < n_chunks
        cmx = tl.load(cmax_ptr + i * n_chunks + cidx, mask=valid, other=-float("inf"))
        cms = cmx.to(tl.float64) / temp
        ckey = tl.where(valid, _order_key(cmx).to(tl.int64), -2147483649)
        # the top-k set when top-p needs its total: ids with key > K, then the lowest ids with key == K
        kkey = tl.full((), -2147483648, tl.int64)
        jcut = tl.full((), 2147483647, tl.int64)
        if use_k & use_p:
            # lo: a key at least k ids reach, stepping down from the max x by 1, 2, 4, ... (x - d reaches -inf,
            # which every id reaches, so this ends); hi: the max key, which no id exceeds. The searches then only
            # walk the chunks near the top.
            hi = tl.max(ckey, axis=0)
            x_top = tl.max(cmx, axis=0)
            d = tl.full((), 1.0, tl.float32)
            lo = _order_key(x_top - d).to(tl.int64)
            while _count_at_least(base, vocab, lo, ckey, cidx, NCHUNK_PAD, BLOCK_) < top_k:
                d = d * 2.0
                lo = _order_key(x_top - d).to(tl.int64)
            lo = tl.minimum(lo, hi)
            while lo < hi:  # the largest t with count(key >= t) >= k
                mid = lo + (hi - lo + 1) // 2
                if _count_at_least(base, vocab, mid, ckey, cidx, NCHUNK_PAD, BLOCK_) >= top_k:
                    lo = mid
                else:
                    hi = mid - 1
            kkey = lo
            need = top_k - _count_at_least(base, vocab, kkey + 1, ckey, cidx, NCHUNK_PAD, BLOCK_)
            jlo = tl.full((), 0, tl.int64)
            jhi = tl.full((), 0, tl.int64) + n_chunks * BLOCK_ - 1
            while jlo < jhi:  # the smallest id j with need tied ids <= j
                jmid = (jlo + jhi) // 2
                if _count_tied_upto(base, vocab, kkey, jmid, ckey, cidx, NCHUNK_PAD, BLOCK_) >= need:
                    jhi = jmid
                else:
                    jlo = jmid + 1
            jcut = jlo
        # the top-p total: over the whole vocab from pass 1's online sums, merged in split order; over the top-k
        # set by one walk of the chunks that reach its smallest key, in order
        total = tl.full((), 0.0, tl.float64)
        if use_p & (use_k == 0):
            for sp in tl.static_range(NUM_SPLITS):
                total += tl.load(ts_ptr + i * NUM_SPLITS + sp) * tl.exp(tl.load(tm_ptr + i * NUM_SPLITS + sp) - s_max)
        if use_p & use_k:
            qual = valid & (ckey >= kkey)
            j = _next_chunk(qual, cidx, -1, NCHUNK_PAD)
            while j < NCHUNK_PAD:
                ids = j * BLOCK_ + tl.arange(0, BLOCK_)
                ok = ids < vocab
                x = tl.load(base + ids, mask=ok, other=-float("inf")).to(tl.float32)
                k32 = _order_key(x).to(tl.int64)
                in_set = ok & ((k32 > kkey) | ((k32 == kkey) & (ids <= jcut)))
                total += tl.sum(tl.where(in_set, tl.exp(x.to(tl.float64) / temp - s_max), 0.0), axis=0)
                j = _next_chunk(qual, cidx, j, NCHUNK_PAD)
        cbv = tl.load(cbest_ptr + i * n_chunks + cidx, mask=valid, other=-float("inf"))
        civ = tl.load(cid_ptr + i * n_chunks + cidx, mask=valid, other=0)
        # Check candidate c: its rank and the mass before it, summed over the chunks that can hold an id before
        # it, in the order of their max (desc, lower chunk first on ties); rank and mass only grow, so the
        # scan stops as soon as either rejects c. min-p alone needs no scan.
        c = tl.load(token_ptr + i)
        done = tl.full((), 0, tl.int32)
        while done == 0:
            sc = tl.load(base + c).to(tl.float32).to(tl.float64) / temp
            rejected = (sc - s_max < log_min_p).to(tl.int32)
            if (use_k | use_p) & (rejected == 0):
                mass = tl.full((), 0.0, tl.float64)
                rank = tl.full((), 0, tl.int64)
                todo = valid & (cms >= sc)
                while (tl.sum(todo.to(tl.int32), axis=0) > 0) & (rejected == 0):
                    _, j = tl.max(tl.where(todo, cms, -float("inf")), axis=0, return_indices=True,
                                  return_indices_tie_break_left=True)
                    todo = todo & (cidx != j)
                    ids = j * BLOCK_ + tl.arange(0, BLOCK_)
                    ok = ids < vocab
                    s = tl.load(base + ids, mask=ok, other=-float("inf")).to(tl.float32).to(tl.float64) / temp
                    before = ok & ((s > sc) | ((s == sc) & (ids < c)))
                    rank += tl.sum(before.to(tl.int64), axis=0)
                    if use_p:
                        mass += tl.sum(tl.where(before, tl.exp(s - s_max), 0.0), axis=0)
                    rejected = ((use_k & (rank >= top_k)) | (use_p & (mass >= top_p * total))).to(tl.int32)
            done = 1 - rejected
            if rejected != 0:
                # The next candidate: the best score among the ids before c that pass min-p. A chunk whose best
                # id (pass 1) is one of them gives its answer at once; the others are walked only while their
                # best score can still win (score desc, lower id first on ties).
                qual = valid & (cms >= sc) & (cms - s_max >= log_min_p)
                sb = tl.load(base + civ, mask=valid, other=-float("inf")).to(tl.float32).to(tl.float64) / temp
                elig = qual & ((sb > sc) | ((sb == sc) & (civ < c))) & (sb - s_max >= log_min_p)
                nb, nj = tl.max(tl.where(elig, cbv, -float("inf")), axis=0, return_indices=True,
                                return_indices_tie_break_left=True)
                nb_id = tl.sum(tl.where(cidx == nj, civ, 0), axis=0)
                rest = qual & (elig == 0)
                j = _next_chunk(rest, cidx, -1, NCHUNK_PAD)
                while j < NCHUNK_PAD:
                    if tl.load(cbest_ptr + i * n_chunks + j) >= nb:
                        ids = j * BLOCK_ + tl.arange(0, BLOCK_)
                        ok = ids < vocab
                        s = tl.load(base + ids, mask=ok, other=-float("inf")).to(tl.float32).to(tl.float64) / temp
                        before = ok & ((s > sc) | ((s == sc) & (ids < c)))
                        score = tl.where(before & (s - s_max >= log_min_p), s + _gumbel(key, ids), -float("inf"))
                        cb, ca = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
                        cid = (j * BLOCK_ + ca).to(tl.int64)
                        take = (cb > nb) | ((cb == nb) & (cb > -float("inf")) & (cid < nb_id))
                        nb_id = tl.where(take, cid, nb_id)
                        nb = tl.where(take, cb, nb)
                    j = _next_chunk(rest, cidx, j, NCHUNK_PAD)
                c = nb_id
        tl.store(token_ptr + i, c)
        x_tok = tl.load(base + c).to(tl.float32).to(tl.float64)
        tl.store(logprob_ptr + i, (x_tok - tl.load(lse_ptr + i)).to(tl.float32))


@triton.jit
def top_logprobs_kernel(logits_ptr, row_stride, params_ptr, n_rows, lse_ptr, ids_out_ptr, lp_out_ptr, vocab,
                        NMAX: tl.constexpr, VOCAB_PAD: tl.constexpr, BLOCK_: tl.constexpr):
    """The n most likely ids of a row in order (x desc, id asc), n = params row 6: one pass per id, each taking
    the best id strictly after the previous one in that order. logprob = float32(float64(x) - lse)."""
    i = tl.program_id(0)
    row = tl.load(params_ptr + 5 * n_rows + i)
    n = tl.load(params_ptr + 6 * n_rows + i)
    lse = tl.load(lse_ptr + i)
    base = logits_ptr + row * row_stride
    px = tl.full((), float("inf"), tl.float32)
    pid = tl.full((), -1, tl.int64)
    for t in tl.static_range(NMAX):
        if t < n:
            best = tl.full((), -float("inf"), tl.float32)
            best_id = tl.full((), -1, tl.int64)
            for c0 in range(0, VOCAB_PAD, BLOCK_):
                ids = c0 + tl.arange(0, BLOCK_)
                ok = ids < vocab
                x = tl.load(base + ids, mask=ok, other=-float("inf")).to(tl.float32)
                after = ok & ((x < px) | ((x == px) & (ids > pid)))
                cand = tl.where(after, x, -float("inf"))
                cb, ca = tl.max(cand, axis=0, return_indices=True, return_indices_tie_break_left=True)
                cid = tl.where(tl.sum(after.to(tl.int32), axis=0) > 0, (c0 + ca).to(tl.int64), -1)
                take = (cid >= 0) & ((best_id < 0) | (cb > best))
                best_id = tl.where(take, cid, best_id)
                best = tl.where(take, cb, best)
            tl.store(ids_out_ptr + i * NMAX + t, best_id)
            tl.store(lp_out_ptr + i * NMAX + t, (best.to(tl.float64) - lse).to(tl.float32))
            px = best
            pid = best_id
