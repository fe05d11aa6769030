"""Triton kernels of engine.kernels.triton_sampler (imported only when a kernel is first used)."""
import triton
import triton.language as tl


@triton.jit
def _mix(z):
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


@triton.jit
def split_kernel(logits_ptr, row_stride, row_ids_ptr, keys_ptr, temps_ptr,
                 best_ptr, arg_ptr, m_ptr, s_ptr, vocab, NUM_SPLITS: tl.constexpr,
                 SPLIT_: tl.constexpr, BLOCK_: tl.constexpr):
    i = tl.program_id(0)
    sp = tl.program_id(1)
    row = tl.load(row_ids_ptr + i).to(tl.int64)
    key = tl.load(keys_ptr + i).to(tl.uint64, bitcast=True)
    temp = tl.load(temps_ptr + i)
    greedy = temp == 0.0
    inv = tl.where(greedy, 1.0, temp)
    best = tl.full((), -float("inf"), tl.float64)
    best_id = tl.full((), 0, tl.int64)
    m = tl.full((), -float("inf"), tl.float64)
    s = tl.full((), 0.0, tl.float64)
    base = logits_ptr + row * row_stride
    start = sp * SPLIT_
    for c in range(0, SPLIT_, BLOCK_):
        ids = start + c + tl.arange(0, BLOCK_)
        ok = ids < vocab
        x = tl.load(base + ids, mask=ok, other=-float("inf")).to(tl.float32).to(tl.float64)
        bits = _mix((key ^ ids.to(tl.uint64)) + 0x9E3779B97F4A7C15)
        u = ((bits >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2**-53
        g = -tl.log(-tl.log(u))
        score = tl.where(greedy, x, x / inv + g)
        score = tl.where(ok, score, -float("inf"))
        cbest, carg = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = cbest > best
        best_id = tl.where(take, (start + c + carg).to(tl.int64), best_id)
        best = tl.where(take, cbest, best)
        cm = tl.max(x, axis=0)
        m_new = tl.maximum(m, cm)
        alive = m_new > -float("inf")  # a chunk wholly past the vocab leaves (m, s) as they were
        m_safe = tl.where(alive, m_new, 0.0)
        e = tl.where(ok, tl.exp(x - m_safe), 0.0)
        s = tl.where(alive, s * tl.exp(m - m_safe) + tl.sum(e, axis=0), s)
        m = m_new
    out = i * NUM_SPLITS + sp
    tl.store(best_ptr + out, best)
    tl.store(arg_ptr + out, best_id)
    tl.store(m_ptr + out, m)
    tl.store(s_ptr + out, s)

@triton.jit
def merge_kernel(logits_ptr, row_stride, row_ids_ptr, best_ptr, arg_ptr, m_ptr, s_ptr,
                 token_ptr, logprob_ptr, lse_ptr, NUM_SPLITS: tl.constexpr):
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
