"""Triton kernels of the estimation proxy: softmax(Q[last queries] · Kᵀ · scale) reduced to
column sums and diagonal sums, without the [heads, queries, keys] matrix ever existing.

One layer's query sets go in one launch per pass: a set is one or more contiguous runs of
at most ``BLOCK_Q`` positions (keys under the causal mask up to each run's last query),
read for the query heads whose patterns need it; the launcher lists the (run x head) pairs
grouped by KV head. The kernels work on (batch x KV head, key block) tiles: a key tile is
loaded once and scored on the tensor cores against every pair of its GQA group, so keys are
read once per pass, not once per query head.

* ``_sets_lse_kernel``: per pair and row, the running max and sum of exp(score - max) over
  a chunk of ``KB_PER`` key blocks; ``_fold_lse_kernel`` folds the chunks into the row
  log-sum-exp;
* ``_sets_mass_kernel`` (persistent) and ``_sets_mass_chunk_kernel`` (key blocks in order,
  half the diagonal gather; the launcher picks by length, ``proxy.TUNING``):
  p = exp(score - lse) per tile, summed into the columns and the diagonals (key offset
  ``o = query - key``, read skewed with ``tl.gather`` and added with one vector atomic per
  tile); extra diagonal outputs count only the keys of one key group (2D-boundary heads).

The counts a launch takes from its input (keys, key blocks, chunks, pairs, the piece's
offset) are not specialised (``do_not_specialize``): Triton compiles a variant per integer
that is 1 or a multiple of 16, and these change from one request, or one piece of a live
stream, to the next; they only bound loops and masks. (The pieces of a 1.05M-token stream
that took 0.7-1.0 s more on an H100, 6, 8, 13, 17 and 30 of 35, are exactly those at which
one of them first took a new class, or, at 17, the chunked layout first ran.)
"""

import triton
import triton.language as tl


@triton.jit
def _load_q(q_ptr, b, h, q0, nq, s_qb, s_qh, s_qn, D,
            BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.arange(0, BLOCK_Q)
    d = tl.arange(0, BLOCK_D)
    qp = q_ptr + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh \
        + (q0 + r)[:, None].to(tl.int64) * s_qn + d[None, :]
    return tl.load(qp, mask=(r[:, None] < nq) & (d[None, :] < D), other=0.0)


@triton.jit
def _load_k(k_ptr, b, kvh, c, kend, s_kb, s_kh, s_kn, D, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)
    kp = k_ptr + b.to(tl.int64) * s_kb + kvh.to(tl.int64) * s_kh \
        + c[:, None].to(tl.int64) * s_kn + d[None, :]
    return tl.load(kp, mask=(c[:, None] < kend) & (d[None, :] < D), other=0.0)


@triton.jit
def _masked_scores(qt, kt, r, c, q0, nq, scale):
    """Scaled scores ``[BLOCK_Q, BLOCK_N]`` (fp32), -inf outside the causal run."""
    s = tl.dot(qt, tl.trans(kt)) * scale
    ok = (r[:, None] < nq) & (c[None, :] <= q0 + r[:, None])
    return tl.where(ok, s, float("-inf"))


@triton.jit(do_not_specialize=["n_pairs", "n_chunks", "q_off"])
def _sets_lse_kernel(q_ptr, k_ptr, m_ptr, l_ptr, kv_ptr, p_q0, p_nq, p_head,
                     n_pairs, n_chunks, scale,
                     s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, HKV, D, q_off,
                     BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                     KB_PER: tl.constexpr):
    bkv = tl.program_id(0)
    chunk = tl.program_id(1)
    b = bkv // HKV
    kvh = bkv % HKV
    r = tl.arange(0, BLOCK_Q)
    first = tl.load(kv_ptr + kvh)
    last = tl.load(kv_ptr + kvh + 1)
    for i in range(first, last):
        q0 = tl.load(p_q0 + i)
        nq = tl.load(p_nq + i)
        h = tl.load(p_head + i)
        kend = q0 + nq
        qt = _load_q(q_ptr, b, h, q0 - q_off, nq, s_qb, s_qh, s_qn, D, BLOCK_Q, BLOCK_D)
        m = tl.full([BLOCK_Q], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_Q], tl.float32)
        # only the key blocks this pair's run reaches (a short run early in the sequence
        # costs one block, not the whole chunk range of the layer)
        n_blk = tl.minimum(tl.cdiv(kend, BLOCK_N) - chunk * KB_PER, KB_PER)
        for j in range(0, n_blk):
            c = (chunk * KB_PER + j) * BLOCK_N + tl.arange(0, BLOCK_N)
            kt = _load_k(k_ptr, b, kvh, c, kend, s_kb, s_kh, s_kn, D, BLOCK_D)
            s = _masked_scores(qt, kt, r, c, q0, nq, scale)
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l = l * tl.exp(m - m_safe) + tl.sum(tl.exp(s - m_safe[:, None]), 1)
            m = m_new
        out = ((b * n_pairs + i).to(tl.int64) * n_chunks + chunk) * BLOCK_Q + r
        tl.store(m_ptr + out, m)
        tl.store(l_ptr + out, l)


@triton.jit(do_not_specialize=["n_pairs", "n_slots", "N", "n_kb", "n_tiles", "q_off"])
def _sets_mass_kernel(q_ptr, k_ptr, lse_ptr, col_ptr, diag_ptr, kgroup_ptr, dgroup_ptr,
                      kv_ptr, p_q0, p_nq, p_head, p_slot, p_dbits,
                      n_pairs, n_slots, N, n_kb, n_tiles, B, scale,
                      s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, HKV, D, q_off,
                      BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                      SKEW_W: tl.constexpr, N_DIAG: tl.constexpr, BY_GROUP: tl.constexpr):
    """``p_dbits[i]`` bit t: pair i adds its diagonal sums to diagonal output t, which counts
    the keys of group ``dgroup[t]`` (-1: every key). Column sums are read-modify-write: the
    runs of one slot (a set in two spans) meet only in the program that owns the tile."""
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    r = tl.arange(0, BLOCK_Q)
    tw = tl.arange(0, SKEW_W)
    cc = r[:, None] + tw[None, :] - (BLOCK_Q - 1)
    skew_ok = (cc >= 0) & (cc < BLOCK_N)
    cc = tl.where(skew_ok, cc, 0)
    for tile in range(pid, n_tiles, n_prog):
        bkv = tile // n_kb
        kb = tile % n_kb
        b = bkv // HKV
        kvh = bkv % HKV
        a = kb * BLOCK_N
        c = a + tl.arange(0, BLOCK_N)
        kt = _load_k(k_ptr, b, kvh, c, N, s_kb, s_kh, s_kn, D, BLOCK_D)
        grp = tl.load(kgroup_ptr + c, mask=(c < N) & BY_GROUP, other=-1)
        # one diagonal output's plane, int64 (B * slots * N passes 2**31 at long N); b * 0
        # keeps it a tensor where Triton passes an argument equal to 1 as a constant
        plane = (b * 0 + B).to(tl.int64) * n_slots * N
        first = tl.load(kv_ptr + kvh)
        last = tl.load(kv_ptr + kvh + 1)
        for i in range(first, last):
            q0 = tl.load(p_q0 + i)
            nq = tl.load(p_nq + i)
            if a < q0 + nq:
                h = tl.load(p_head + i)
                slot = tl.load(p_slot + i)
                bits = tl.load(p_dbits + i)
                qt = _load_q(q_ptr, b, h, q0 - q_off, nq, s_qb, s_qh, s_qn, D, BLOCK_Q, BLOCK_D)
                s = _masked_scores(qt, kt, r, c, q0, nq, scale)
                lse = tl.load(lse_ptr + (b * n_pairs + i).to(tl.int64) * BLOCK_Q + r)
                p = tl.exp(s - lse[:, None])             # exactly 0 where s is -inf
                row = (b * n_slots + slot).to(tl.int64) * N
                cm = c < q0 + nq
                prev = tl.load(col_ptr + row + c, mask=cm, other=0.0)
                tl.store(col_ptr + row + c, prev + tl.sum(p, 0), mask=cm)
                o = q0 - a - (tw - (BLOCK_Q - 1))
                o_ok = (o >= 0) & (o < N)
                for t in tl.static_range(N_DIAG):
                    if ((bits >> t) & 1) != 0:
                        want = tl.load(dgroup_ptr + t)
                        if want < 0:
                            pt = p
                        else:
                            pt = tl.where((grp == want)[None, :], p, 0.0)
                        sk = tl.where(skew_ok, tl.gather(pt, cc, 1), 0.0)
                        dsum = tl.sum(sk, 0)
                        dst = t * plane + row + o
                        tl.atomic_add(diag_ptr + dst, dsum, mask=o_ok & (dsum != 0.0))


@triton.jit(do_not_specialize=["n_pairs", "n_slots", "N", "n_chunks", "q_off"])
def _sets_mass_chunk_kernel(q_ptr, k_ptr, lse_ptr, col_ptr, diag_ptr, kgroup_ptr, dgroup_ptr,
                            kv_ptr, p_q0, p_nq, p_head, p_slot, p_dbits,
                            n_pairs, n_slots, N, n_chunks, B, scale,
                            s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, HKV, D, q_off,
                            BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, KB_PER: tl.constexpr,
                            N_DIAG: tl.constexpr, ND_P2: tl.constexpr, BY_GROUP: tl.constexpr):
    """The mass pass laid out like the log-sum-exp pass: a program per (batch x KV head,
    chunk of ``KB_PER`` key blocks), pairs outer, the chunk's key blocks inner (key tiles
    re-read from L2 per pair), so one pair's consecutive key blocks meet in one program and
    their diagonal sums need half the work: key block = query block = BLOCK_Q, each row r of
    the tile is rotated by r (cyclic, a [BLOCK_Q, BLOCK_Q] gather instead of the linear
    skew's [BLOCK_Q, 2 BLOCK_Q]); column t of the rotated tile holds offset q0 - a - t
    (unwrapped rows) and q0 - a + BLOCK_Q - t (wrapped rows), and the wrapped part is the
    previous key block's unwrapped part at the same t: the blocks run in descending order,
    the wrapped part is carried in registers and added there, one vector atomic of BLOCK_Q
    per tile (plus one per chunk for the carry left at its first block)."""
    BN: tl.constexpr = BLOCK_Q
    bkv = tl.program_id(0)
    chunk = tl.program_id(1)
    b = bkv // HKV
    kvh = bkv % HKV
    r = tl.arange(0, BLOCK_Q)
    t = tl.arange(0, BN)
    rc = r[:, None] + t[None, :]
    wrapped = rc >= BN
    rot = tl.where(wrapped, rc - BN, rc)             # rotated[r, t] = p[r, (r + t) mod BN]
    dt = tl.arange(0, ND_P2)
    plane = (b * 0 + B).to(tl.int64) * n_slots * N     # see _sets_mass_kernel
    first = tl.load(kv_ptr + kvh)
    last = tl.load(kv_ptr + kvh + 1)
    for i in range(first, last):
        q0 = tl.load(p_q0 + i)
        nq = tl.load(p_nq + i)
        h = tl.load(p_head + i)
        slot = tl.load(p_slot + i)
        bits = tl.load(p_dbits + i)
        kend = q0 + nq
        n_blk = tl.minimum(tl.cdiv(kend, BN) - chunk * KB_PER, KB_PER)
        qt = _load_q(q_ptr, b, h, q0 - q_off, nq, s_qb, s_qh, s_qn, D, BLOCK_Q, BLOCK_D)
        lse = tl.load(lse_ptr + (b * n_pairs + i).to(tl.int64) * BLOCK_Q + r)
        row = (b * n_slots + slot).to(tl.int64) * N
        carry = tl.zeros([ND_P2, BN], tl.float32)
        a = chunk * KB_PER * BN
        for jj in range(0, n_blk):
            a = (chunk * KB_PER + n_blk - 1 - jj) * BN
            c = a + t
            kt = _load_k(k_ptr, b, kvh, c, kend, s_kb, s_kh, s_kn, D, BLOCK_D)
            s = _masked_scores(qt, kt, r, c, q0, nq, scale)
            p = tl.exp(s - lse[:, None])
            cm = c < kend
            prev = tl.load(col_ptr + row + c, mask=cm, other=0.0)
            tl.store(col_ptr + row + c, prev + tl.sum(p, 0), mask=cm)
            if bits != 0:
                grp = tl.load(kgroup_ptr + c, mask=cm & BY_GROUP, other=-1)
                o = q0 - a - t
                for d in tl.static_range(N_DIAG):
                    if ((bits >> d) & 1) != 0:
                        want = tl.load(dgroup_ptr + d)
                        if want < 0:
                            pt = p
                        else:
                            pt = tl.where((grp == want)[None, :], p, 0.0)
                        sk = tl.gather(pt, rot, 1)
                        low = tl.sum(tl.where(wrapped, 0.0, sk), 0)
                        high = tl.sum(tl.where(wrapped, sk, 0.0), 0)
                        mine = dt[:, None] == d
                        dsum = low + tl.sum(tl.where(mine, carry, 0.0), 0)
                        carry = tl.where(mine, high[None, :], carry)
                        dst = d * plane + row + o
                        tl.atomic_add(diag_ptr + dst, dsum, mask=(o >= 0) & (dsum != 0.0))
        if n_blk > 0:                                # the last block's wrapped rows
            o = q0 - a + BN - t
            for d in tl.static_range(N_DIAG):
                if ((bits >> d) & 1) != 0:
                    dsum = tl.sum(tl.where(dt[:, None] == d, carry, 0.0), 0)
                    dst = d * plane + row + o
                    tl.atomic_add(diag_ptr + dst, dsum, mask=(o >= 0) & (o < N) & (dsum != 0.0))


@triton.jit(do_not_specialize=["n_chunks"])
def _fold_lse_kernel(m_ptr, l_ptr, lse_ptr, n_chunks, BLOCK_Q: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """Row log-sum-exp of one pair from its chunks' running (max, sum): one launch for what
    took a dozen torch ops (the host enqueues every one of them). Rows with no key (padding
    rows of a short run) get 0: any finite value keeps their p at exactly 0."""
    pair = tl.program_id(0)
    r = tl.arange(0, BLOCK_Q)
    base = pair.to(tl.int64) * n_chunks * BLOCK_Q
    mx = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    for c0 in range(0, n_chunks, BLOCK_C):
        ch = c0 + tl.arange(0, BLOCK_C)
        off = base + ch[:, None].to(tl.int64) * BLOCK_Q + r[None, :]
        m = tl.load(m_ptr + off, mask=(ch < n_chunks)[:, None], other=float("-inf"))
        mx = tl.maximum(mx, tl.max(m, 0))
    safe = tl.where(mx == float("-inf"), 0.0, mx)
    tot = tl.zeros([BLOCK_Q], tl.float32)
    for c0 in range(0, n_chunks, BLOCK_C):
        ch = c0 + tl.arange(0, BLOCK_C)
        off = base + ch[:, None].to(tl.int64) * BLOCK_Q + r[None, :]
        ok = (ch < n_chunks)[:, None]
        m = tl.load(m_ptr + off, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + off, mask=ok, other=0.0)
        tot += tl.sum(l * tl.exp(m - safe[None, :]), 0)
    lse = tl.where(tot > 0, safe + tl.log(tl.where(tot > 0, tot, 1.0)), 0.0)
    tl.store(lse_ptr + pair.to(tl.int64) * BLOCK_Q + r, lse)
