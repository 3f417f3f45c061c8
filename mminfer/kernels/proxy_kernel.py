"""Triton kernels of the estimation proxy: softmax(Q[last queries] · Kᵀ · scale) reduced to
column sums and diagonal sums, without the [heads, queries, keys] matrix ever existing.

The queries are one contiguous run of positions q0 .. q0 + nq - 1 (nq <= BLOCK_Q), the keys
0 .. q0 + nq - 1 under the causal mask. Two kernels, both over (batch x query head, key
block) tiles scored on the tensor cores:

* ``_proxy_lse_kernel``: per tile and query row, the max and the sum of exp(score - max);
  the launcher folds them into the row log-sum-exp (a small torch reduction);
* ``_proxy_mass_kernel``: p = exp(score - lse) per tile; its column sums are the tile's
  slice of ``col`` (one owner per key, no atomics). Its diagonal sums (key offset
  ``o = query - key``) need a per-row shift, which registers cannot do: the tile goes to a
  per-program scratch slot, is read back skewed (row r shifted by r) and summed over rows,
  then added into ``diag`` with one vector atomic per tile (neighbouring key blocks share
  BLOCK_Q - 1 offsets). The programs are persistent so the scratch is
  programs x BLOCK_Q x BLOCK_N, not one slot per tile. Extra diagonal targets count only
  the keys of one key group (2D-boundary heads: text->video, ...).
"""

import triton
import triton.language as tl


@triton.jit
def _scores(q_ptr, k_ptr, bh, kb, q0, nq, kend, scale,
            s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, HQ, G, D,
            BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Scaled scores of the query run against key block ``kb`` ([BLOCK_Q, BLOCK_N], fp32,
    -inf where masked), with the row and key indices."""
    b = bh // HQ
    h = bh % HQ
    r = tl.arange(0, BLOCK_Q)
    c = kb * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, BLOCK_D)
    qp = q_ptr + b.to(tl.int64) * s_qb + h.to(tl.int64) * s_qh \
        + (q0 + r)[:, None].to(tl.int64) * s_qn + d[None, :]
    qt = tl.load(qp, mask=(r[:, None] < nq) & (d[None, :] < D), other=0.0)
    kp = k_ptr + b.to(tl.int64) * s_kb + (h // G).to(tl.int64) * s_kh \
        + c[:, None].to(tl.int64) * s_kn + d[None, :]
    kt = tl.load(kp, mask=(c[:, None] < kend) & (d[None, :] < D), other=0.0)
    s = tl.dot(qt, tl.trans(kt)) * scale
    ok = (r[:, None] < nq) & (c[None, :] <= q0 + r[:, None])
    return tl.where(ok, s, float("-inf")), r, c


@triton.jit
def _proxy_lse_kernel(q_ptr, k_ptr, m_ptr, l_ptr, q0, nq, kend, n_kb, scale,
                      s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, HQ, G, D,
                      BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    kb = tl.program_id(1)
    s, r, c = _scores(q_ptr, k_ptr, bh, kb, q0, nq, kend, scale,
                      s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, HQ, G, D, BLOCK_Q, BLOCK_N, BLOCK_D)
    m = tl.max(s, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.sum(tl.exp(s - m_safe[:, None]), 1)
    out = (bh.to(tl.int64) * n_kb + kb) * BLOCK_Q + r
    tl.store(m_ptr + out, m)
    tl.store(l_ptr + out, l)


@triton.jit
def _proxy_mass_kernel(q_ptr, k_ptr, lse_ptr, col_ptr, diag_ptr, kgroup_ptr, targets_ptr,
                       scratch_ptr, q0, nq, kend, N, n_kb, n_tiles, scale,
                       s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, HQ, G, D,
                       BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                       SKEW_W: tl.constexpr, N_DIAG: tl.constexpr, PLAIN: tl.constexpr):
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    tq = tl.arange(0, BLOCK_Q)
    tn = tl.arange(0, BLOCK_N)
    # skewed read-back: row r, column j of [BLOCK_Q, SKEW_W >= BLOCK_Q + BLOCK_N - 1] holds
    # p[r, r + t] with t = j - (BLOCK_Q - 1), i.e. key offset o = q0 - a - t (key block at a)
    tw = tl.arange(0, SKEW_W)
    cc = tq[:, None] + tw[None, :] - (BLOCK_Q - 1)
    skew_ok = (cc >= 0) & (cc < BLOCK_N)
    slot = scratch_ptr + pid.to(tl.int64) * (BLOCK_Q * BLOCK_N)
    for tile in range(pid, n_tiles, n_prog):
        bh = tile // n_kb
        kb = tile % n_kb
        s, r, c = _scores(q_ptr, k_ptr, bh, kb, q0, nq, kend, scale,
                          s_qb, s_qh, s_qn, s_kb, s_kh, s_kn, HQ, G, D,
                          BLOCK_Q, BLOCK_N, BLOCK_D)
        lse = tl.load(lse_ptr + bh.to(tl.int64) * BLOCK_Q + r)
        p = tl.exp(s - lse[:, None])                 # exactly 0 where s is -inf
        row = bh.to(tl.int64) * N
        tl.store(col_ptr + row + c, tl.sum(p, 0), mask=c < kend)
        a = kb * BLOCK_N
        o = q0 - a - (tw - (BLOCK_Q - 1))
        for t in tl.static_range(N_DIAG):
            if t < PLAIN:                            # slot 0: the plain diagonal
                pt = p
            else:
                grp = tl.load(kgroup_ptr + c, mask=c < kend, other=-1)
                want = tl.load(targets_ptr + (t - PLAIN))
                pt = tl.where((grp == want)[None, :], p, 0.0)
            tl.debug_barrier()                       # the slot's previous reads are done
            tl.store(slot + tq[:, None] * BLOCK_N + tn[None, :], pt)
            tl.debug_barrier()                       # ... and this tile is written
            sk = tl.load(slot + tq[:, None] * BLOCK_N + cc, mask=skew_ok, other=0.0)
            dsum = tl.sum(sk, 0)
            tl.atomic_add(diag_ptr + t * (n_tiles // n_kb) * N + row + o, dsum,
                          mask=(o >= 0) & (o < N) & (dsum != 0.0))
