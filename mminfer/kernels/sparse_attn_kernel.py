"""Triton kernel: causal attention over an exact, permuted block-sparse pair set.

One program owns one block of query rows for one *slot* (a query head, optionally restricted
to one query modality group and one key modality group). Its keys are split into

* the **near range** ``[lo, diagonal]`` with ``lo = block_start - window`` (causal mask on
  the last tiles only), and
* **far keys**, all ``< lo``: sinks, grid columns (strided addresses), vertical columns
  (gathered), slash ranges, chosen key blocks.

Far streams are disjoint from the near range and from each other by construction, so one
online softmax runs over all of them and every (query, key) pair is counted once. Grid
row lines (queries ``≡ phase (mod stride)``) are programs of their own whose rows are loaded
with strided addresses; ordinary blocks skip storing those rows.

Queries may start at an offset into the keys (``q_start``: a piece appended to a cached prompt,
a chunk of a prefill): every position here is absolute, the row table holds the query rows'
blocks, and only the addresses of Q, O and the LSE subtract ``q_start``. Q, K and V are never
copied into permuted order: every permutation is address arithmetic here (the launcher
gathers each vertical slot's K/V rows once, so that its columns read as contiguous tiles).

There is one code path per pattern family, the one measured fastest on the H200
(BENCHMARKS.md, "Kernels"); the CPU (Triton interpreter) runs the same path with smaller
tiles. The launcher (``launch.py``) and the tile shapes per device and family
(``runtime.tile_config``) go with it; the plan that feeds it is ``plan.py``, the slot row it
reads ``layout.py``.
"""

import triton
import triton.language as tl

from . import layout, online_softmax

# The slot row and family ids of layout.py, as constexprs: the names are the contract, the
# kernel never spells a field by its number.
F_HEAD = tl.constexpr(layout.F_HEAD)
F_QGROUP = tl.constexpr(layout.F_QGROUP)
F_KGROUP = tl.constexpr(layout.F_KGROUP)
F_DST = tl.constexpr(layout.F_DST)
F_DSTHEAD = tl.constexpr(layout.F_DSTHEAD)
F_SINK = tl.constexpr(layout.F_SINK)
F_WINDOW = tl.constexpr(layout.F_WINDOW)
F_START = tl.constexpr(layout.F_START)
F_END = tl.constexpr(layout.F_END)
F_STRIDE = tl.constexpr(layout.F_STRIDE)
F_PHASE = tl.constexpr(layout.F_PHASE)
F_LINES = tl.constexpr(layout.F_LINES)
F_ACTIVE = tl.constexpr(layout.F_ACTIVE)
NF = tl.constexpr(layout.NF)
LINES_COLS = tl.constexpr(layout.LINES_COLS)
LINES_ROWS = tl.constexpr(layout.LINES_ROWS)
A_SHAPE = tl.constexpr(layout.A_SHAPE)
GRID = tl.constexpr(layout.GRID)
VERTICAL_SLASH = tl.constexpr(layout.VERTICAL_SLASH)
BLOCK = tl.constexpr(layout.BLOCK)

@triton.jit
def _key_ok(kvalid, kpos, KGb, kgroup, KEY_GROUPED: tl.constexpr):
    # 2D-boundary slots see only keys of their key modality group.
    if KEY_GROUPED:
        kg = tl.load(KGb + kpos, mask=kvalid, other=-1)
        kvalid = kvalid & ((kg == kgroup) | (kgroup < 0))
    return kvalid


@triton.jit
def _attend(acc, m_i, l_i, q, qpos, kpos, kvalid, Kb, Vb, skn, svn, offs_d, dmask, qk_scale,
            CAUSAL: tl.constexpr, PRECISION: tl.constexpr, EVEN: tl.constexpr = False,
            DMASK: tl.constexpr = True):
    """One key tile at rows ``kpos`` of Kb/Vb. Invalid logits are -inf before the max.
    EVEN: every key of the tile is valid and no causal mask applies, so loads and logits go
    unmasked (the bulk of the work: full tiles of near ranges, segments and columns)."""
    valid = kvalid[None, :]
    if CAUSAL:
        valid = valid & (kpos[None, :] <= qpos[:, None])
    # 64-bit row offsets: N x (heads x d) strides pass 2^31 at a few million tokens.
    krow = kpos.to(tl.int64)[:, None]
    if EVEN and not DMASK:
        k = tl.load(Kb + krow * skn + offs_d[None, :])
    else:
        kv_mask = kvalid[:, None] & dmask[None, :]
        k = tl.load(Kb + krow * skn + offs_d[None, :], mask=kv_mask, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if EVEN:
        qk = qk * qk_scale
    else:
        qk = tl.where(valid, qk * qk_scale, float("-inf"))
    p, alpha, m_i, l_i = online_softmax.weights(qk, m_i, l_i)
    if EVEN and not DMASK:
        v = tl.load(Vb + krow * svn + offs_d[None, :])
    else:
        v = tl.load(Vb + krow * svn + offs_d[None, :], mask=kv_mask, other=0.0)
    return online_softmax.accumulate(acc, alpha, p, v, PRECISION), m_i, l_i


@triton.jit
def _attend_desc(acc, m_i, l_i, q, KD, VD, b, kvh, start, qk_scale, BLOCK_N: tl.constexpr,
                 BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """A full key tile (every key valid, no causal mask) read through tensor descriptors:
    keys [start, start + BLOCK_N) of (b, kvh) by the copy engine (TMA on sm_90; columns past
    the head dim and rows past N come back zero)."""
    k = KD.load([b, kvh, start, 0]).reshape(BLOCK_N, BLOCK_D)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    p, alpha, m_i, l_i = online_softmax.weights(qk, m_i, l_i)
    v = VD.load([b, kvh, start, 0]).reshape(BLOCK_N, BLOCK_D)
    return online_softmax.accumulate(acc, alpha, p, v, PRECISION), m_i, l_i


@triton.jit
def _keys(acc, m_i, l_i, q, qpos, lo, full_end, hi, Kb, Vb, skn, svn, KGb, kgroup, offs_n,
          offs_d, dmask, qk_scale, BLOCK_N: tl.constexpr, KEY_GROUPED: tl.constexpr,
          PRECISION: tl.constexpr, DMASK: tl.constexpr, KD, VD, b, kvh, TMA: tl.constexpr,
          BLOCK_D: tl.constexpr, CAUSAL: tl.constexpr):
    """Contiguous keys [lo, hi), ``lo <= full_end <= hi`` (the plan's sinks and windows are
    never negative): the whole tiles below ``full_end`` (below every row of the block)
    unmasked, the tiles after them masked to the range, and causally with CAUSAL."""
    n_full = (full_end - lo) // BLOCK_N
    for t in range(0, n_full):
        if TMA and not KEY_GROUPED:
            acc, m_i, l_i = _attend_desc(acc, m_i, l_i, q, KD, VD, b, kvh,
                                         lo + t * BLOCK_N, qk_scale, BLOCK_N, BLOCK_D,
                                         PRECISION)
        else:
            kpos = lo + t * BLOCK_N + offs_n
            kvalid = _key_ok(kpos >= 0, kpos, KGb, kgroup, KEY_GROUPED)
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, kpos, kvalid, Kb, Vb, skn, svn,
                                    offs_d, dmask, qk_scale, False, PRECISION,
                                    not KEY_GROUPED, DMASK)
    # The masked tails (1-2 tiles) are not software-pipelined: every pipelined loop holds
    # its own K/V ring in shared memory, and with the tails pipelined a 64-key, 3-stage
    # kernel took 224 of sm_90's 227 KB (128-key tiles did not fit at all).
    for start in tl.range(lo + n_full * BLOCK_N, hi, BLOCK_N, num_stages=1):
        kpos = start + offs_n
        kvalid = _key_ok(kpos < hi, kpos, KGb, kgroup, KEY_GROUPED)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, kpos, kvalid, Kb, Vb, skn, svn,
                                offs_d, dmask, qk_scale, CAUSAL, PRECISION)
    return acc, m_i, l_i


# The counts a launch takes from its plan (row blocks, programs, slots, the most verticals,
# slashes and key blocks of a slot, the queries' offset) are not specialised: Triton compiles
# a variant per integer that is 1 or a multiple of 16, and these change with every plan (each
# candidate config a calibration scores, each piece of a live stream); they bound loops and
# index rows. Compiled mid-serving, each variant took 2-8 s on an H100 while requests waited
# (benchmarks/results/2026-12-07-selfcal-h100-06c658a). The key count ``N`` stays specialised:
# Pipeline.warmup compiles both of its classes.
@triton.jit(do_not_specialize=["n_table", "n_programs", "n_slots", "nv_max", "ns_max",
                               "nb_max", "q_start"])
def _sparse_attn_fwd(
    Q, K, V, O, OS, L, LS,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    sos, sosb, sosh, sosn, slb, slh, sls, slsb, slsh,
    Table, n_table, n_programs, P, n_slots,
    VIdx, VCnt, VFlag, SIdx, SRange, BIdx, BCnt, KGid, KVert, VVert, KDesc, VDesc,
    nv_max, ns_max, nb_max,
    N, q_start, kv_group, qk_scale,
    HEAD_D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, FAMILY: tl.constexpr, KEY_GROUPED: tl.constexpr,
    WRITE_LSE: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
    DMASK: tl.constexpr,
    TMA: tl.constexpr,
):
    # One axis of programs, slots innermost: the query heads of one row block (the heads of
    # a KV group read the same keys, from L2) run side by side, row lines (the longest
    # rows) first, then row blocks longest first over all slots.
    # TMA (the block family's launches): full contiguous key tiles (near range, key blocks)
    # read through the tensor descriptors KDesc/VDesc over K/V [B, Hkv, N, D] (block
    # [1, 1, BLOCK_N, BLOCK_D]); off where the launcher found them unaddressable.
    # Verticals are read from K/V rows gathered per slot by the launcher (``KVert``/
    # ``VVert`` [B*S, nv_max, HEAD_D]): contiguous tiles, no index load per key.
    n_bs = tl.num_programs(0) // n_programs
    u_sched = tl.program_id(0) // n_bs
    pid_bs = tl.program_id(0) % n_bs
    pid_m = (u_sched + n_table) % n_programs
    b = pid_bs // n_slots
    prm = P + pid_bs * NF
    head = tl.load(prm + F_HEAD)
    qgroup = tl.load(prm + F_QGROUP)
    kgroup = tl.load(prm + F_KGROUP)
    dst = tl.load(prm + F_DST)
    dsthead = tl.load(prm + F_DSTHEAD)
    sink = tl.load(prm + F_SINK)
    window = tl.load(prm + F_WINDOW)
    g_start = tl.load(prm + F_START)
    g_end = tl.load(prm + F_END)
    g_stride = tl.load(prm + F_STRIDE)
    g_phase = tl.load(prm + F_PHASE)
    g_lines = tl.load(prm + F_LINES)
    slot_on = tl.load(prm + F_ACTIVE) != 0
    kvh = head // kv_group

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < HEAD_D

    Kb = K + b.to(tl.int64) * skb + kvh.to(tl.int64) * skh
    Vb = V + b.to(tl.int64) * svb + kvh.to(tl.int64) * svh
    KGb = KGid + b.to(tl.int64) * N
    slot_base = pid_bs.to(tl.int64)

    is_rowline = pid_m >= n_table
    r = n_table - 1 - pid_m  # latest (longest) row blocks first; negative for row lines
    if is_rowline:
        # Grid horizontal lines: rows start + phase + (t*BLOCK_M + i)*stride see every key.
        t_line = pid_m - n_table
        first = g_start + g_phase
        # the first line at or after q_start: lines keep their absolute phase
        first += tl.maximum(tl.cdiv(q_start - first, g_stride), 0) * g_stride
        qpos = first + (t_line * BLOCK_M + offs_m) * g_stride
        qvalid = (qpos < g_end) & ((g_lines & LINES_ROWS) != 0)
        r0 = first + t_line * BLOCK_M * g_stride
        active = slot_on & (FAMILY == GRID) & (r0 < g_end) & ((g_lines & LINES_ROWS) != 0)
        r1 = tl.minimum(tl.max(tl.where(qvalid, qpos, 0), 0) + 1, N)
        store_ok = qvalid
    else:
        r0 = tl.load(Table + r * 3 + 0)
        r1 = tl.load(Table + r * 3 + 1)
        rg = tl.load(Table + r * 3 + 2)
        active = slot_on & ((qgroup < 0) | (rg == qgroup))
        qpos = r0 + offs_m
        qvalid = qpos < r1
        store_ok = qvalid
        if FAMILY == GRID:
            on_line = (qpos >= g_start) & (qpos < g_end) & \
                ((qpos - g_start) % g_stride == g_phase) & ((g_lines & LINES_ROWS) != 0)
            store_ok = qvalid & (~on_line)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    if active:
        qrow = tl.where(qvalid, qpos - q_start, 0)
        q_ptrs = Q + b.to(tl.int64) * sqb + head.to(tl.int64) * sqh + \
            qrow.to(tl.int64)[:, None] * sqn + offs_d[None, :]
        q = tl.load(q_ptrs, mask=qvalid[:, None] & dmask[None, :], other=0.0)

        if is_rowline:
            acc, m_i, l_i = _keys(acc, m_i, l_i, q, qpos, 0, r0 + 1, r1, Kb, Vb, skn, svn,
                                  KGb, kgroup, offs_n, offs_d, dmask, qk_scale, BLOCK_N,
                                  KEY_GROUPED, PRECISION, DMASK, KDesc, VDesc, b, kvh, TMA,
                                  BLOCK_D, True)
        else:
            lo = tl.maximum(r0 - window, 0)
            if FAMILY == A_SHAPE or FAMILY == GRID:
                # Sink keys [0, min(sink, lo)): below every row, no causal mask.
                s_end = tl.minimum(sink, lo)
                acc, m_i, l_i = _keys(acc, m_i, l_i, q, qpos, 0, s_end, s_end, Kb, Vb, skn,
                                      svn, KGb, kgroup, offs_n, offs_d, dmask, qk_scale,
                                      BLOCK_N, KEY_GROUPED, PRECISION, DMASK, KDesc, VDesc, b,
                                      kvh, TMA, BLOCK_D, False)
            if FAMILY == GRID:
                if (g_lines & LINES_COLS) != 0:
                    # Grid columns in [max(sink, start), min(end, lo)): strided key tiles.
                    c_lo = tl.maximum(sink, g_start)
                    c_hi = tl.minimum(g_end, lo)
                    skip = tl.maximum(c_lo - g_start - g_phase, 0)
                    j0 = g_start + g_phase + ((skip + g_stride - 1) // g_stride) * g_stride
                    n_cols = tl.maximum((c_hi - j0 + g_stride - 1) // g_stride, 0)
                    n_cfull = n_cols // BLOCK_N
                    for t in range(0, n_cfull):
                        kpos = j0 + (t * BLOCK_N + offs_n) * g_stride
                        kvalid = _key_ok(kpos >= 0, kpos, KGb, kgroup, KEY_GROUPED)
                        acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, kpos, kvalid, Kb, Vb,
                                                skn, svn, offs_d, dmask, qk_scale, False,
                                                PRECISION, not KEY_GROUPED, DMASK)
                    for t in tl.range(n_cfull, tl.cdiv(n_cols, BLOCK_N), num_stages=1):
                        idx = t * BLOCK_N + offs_n
                        kpos = j0 + idx * g_stride
                        kvalid = _key_ok(idx < n_cols, kpos, KGb, kgroup, KEY_GROUPED)
                        acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, kpos, kvalid, Kb, Vb,
                                                skn, svn, offs_d, dmask, qk_scale, False,
                                                PRECISION)
            if FAMILY == VERTICAL_SLASH:
                # Vertical columns below lo (sorted; the count per row block is precomputed),
                # from this slot's gathered copy: tile t is its rows [t*BLOCK_N, ...).
                vbase = VIdx + slot_base * nv_max
                n_v = tl.load(VCnt + slot_base * n_table + r)
                Kv = KVert + slot_base * nv_max * HEAD_D
                Vv = VVert + slot_base * nv_max * HEAD_D
                n_vfull = n_v // BLOCK_N
                for t in range(0, n_vfull):
                    idx = t * BLOCK_N + offs_n
                    kpos = idx
                    if KEY_GROUPED:
                        kpos = tl.load(vbase + idx)
                    kvalid = _key_ok(idx >= 0, kpos, KGb, kgroup, KEY_GROUPED)
                    acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, idx, kvalid, Kv, Vv,
                                            HEAD_D, HEAD_D, offs_d, dmask, qk_scale, False,
                                            PRECISION, not KEY_GROUPED, DMASK)
                for t in range(n_vfull, tl.cdiv(n_v, BLOCK_N)):
                    idx = t * BLOCK_N + offs_n
                    vmask = idx < n_v
                    kpos = tl.load(vbase + idx, mask=vmask, other=0)
                    kvalid = _key_ok(vmask, kpos, KGb, kgroup, KEY_GROUPED)
                    acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, idx, kvalid, Kv, Vv,
                                            HEAD_D, HEAD_D, offs_d, dmask, qk_scale, False,
                                            PRECISION)
                # Slash ranges: offset o covers keys [r0 - o, r1 - o) for this row block,
                # clipped below the previous (smaller) offset's range and below lo, so the
                # ranges are disjoint; keys that are vertical columns are left to the
                # vertical stream above. One flat tile loop (a loop per offset has too few
                # iterations for the software pipeline to fill): every clipped range holds
                # <= r1 - r0 <= BLOCK_M keys, so SUB tiles per offset cover it (some empty
                # when clipped; they add nothing).
                sbase = SIdx + slot_base * ns_max
                fbase = VFlag + slot_base * N
                k_lo = tl.load(SRange + (slot_base * n_table + r) * 2 + 0)
                k_hi = tl.load(SRange + (slot_base * n_table + r) * 2 + 1)
                SUB: tl.constexpr = BLOCK_M // BLOCK_N
                for u in range(0, (k_hi - k_lo) * SUB):
                    kk = k_lo + u // SUB
                    o = tl.load(sbase + kk)
                    o_prev = tl.load(sbase + tl.maximum(kk - 1, 0), mask=kk > k_lo,
                                     other=-(1 << 30))
                    ks = tl.maximum(r0 - o, 0) + (u % SUB) * BLOCK_N
                    ke = tl.minimum(tl.minimum(r1 - o, r0 - o_prev), lo)
                    kpos = ks + offs_n
                    inr = kpos < ke
                    isv = tl.load(fbase + kpos, mask=inr, other=1)
                    kvalid = _key_ok(inr & (isv == 0), kpos, KGb, kgroup, KEY_GROUPED)
                    acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, kpos, kvalid, Kb, Vb,
                                            skn, svn, offs_d, dmask, qk_scale, False, PRECISION)
            if FAMILY == BLOCK:
                bbase = BIdx + (slot_base * n_table + r) * nb_max
                n_b = tl.load(BCnt + slot_base * n_table + r)
                # Key blocks of BLOCK_K keys, visited as BLOCK_K // BLOCK_N tiles, in one
                # flat loop (not a nested one) so loads stay pipelined. The blocks are
                # sorted: only the last can reach past lo, the others are full tiles.
                c_last = tl.load(bbase + tl.maximum(n_b - 1, 0), mask=n_b > 0, other=0)
                n_bfull = tl.where((n_b > 0) & ((c_last + 1) * BLOCK_K > lo), n_b - 1, n_b)
                for u in range(0, n_bfull * (BLOCK_K // BLOCK_N)):
                    c = tl.load(bbase + u // (BLOCK_K // BLOCK_N))
                    kstart = c * BLOCK_K + (u % (BLOCK_K // BLOCK_N)) * BLOCK_N
                    if TMA and not KEY_GROUPED:
                        acc, m_i, l_i = _attend_desc(acc, m_i, l_i, q, KDesc, VDesc, b,
                                                     kvh, kstart, qk_scale, BLOCK_N,
                                                     BLOCK_D, PRECISION)
                    else:
                        kpos = kstart + offs_n
                        kvalid = _key_ok(kpos >= 0, kpos, KGb, kgroup, KEY_GROUPED)
                        acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, kpos, kvalid, Kb,
                                                Vb, skn, svn, offs_d, dmask, qk_scale,
                                                False, PRECISION, not KEY_GROUPED, DMASK)
                for u in range(n_bfull * (BLOCK_K // BLOCK_N), n_b * (BLOCK_K // BLOCK_N)):
                    c = tl.load(bbase + u // (BLOCK_K // BLOCK_N))
                    kpos = c * BLOCK_K + (u % (BLOCK_K // BLOCK_N)) * BLOCK_N + offs_n
                    kvalid = _key_ok(kpos < lo, kpos, KGb, kgroup, KEY_GROUPED)
                    acc, m_i, l_i = _attend(acc, m_i, l_i, q, qpos, kpos, kvalid, Kb, Vb,
                                            skn, svn, offs_d, dmask, qk_scale, False, PRECISION)
            # The near range [lo, r1): tiles below r0 (<= every row) unmasked, the rest causal.
            acc, m_i, l_i = _keys(acc, m_i, l_i, q, qpos, lo, r0, r1, Kb, Vb, skn, svn,
                                  KGb, kgroup, offs_n, offs_d, dmask, qk_scale, BLOCK_N,
                                  KEY_GROUPED, PRECISION, DMASK, KDesc, VDesc, b, kvh, TMA,
                                  BLOCK_D, True)

        l_safe = tl.where(l_i > 0, l_i, 1.0)
        lse = tl.where(l_i > 0, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        acc = acc / l_safe[:, None]
        srow = tl.where(store_ok, qpos - q_start, 0).to(tl.int64)
        if dst == 0:
            o_ptrs = O + b.to(tl.int64) * sob + head.to(tl.int64) * soh + \
                srow[:, None] * son + offs_d[None, :]
            tl.store(o_ptrs, acc.to(O.dtype.element_ty), mask=store_ok[:, None] & dmask[None, :])
            if WRITE_LSE:
                tl.store(L + b.to(tl.int64) * slb + head.to(tl.int64) * slh + srow, lse,
                         mask=store_ok)
        else:
            part = (dst - 1).to(tl.int64)
            o_ptrs = OS + part * sos + b.to(tl.int64) * sosb + \
                dsthead.to(tl.int64) * sosh + srow[:, None] * sosn + offs_d[None, :]
            tl.store(o_ptrs, acc.to(OS.dtype.element_ty), mask=store_ok[:, None] & dmask[None, :])
            tl.store(LS + part * sls + b.to(tl.int64) * slsb + dsthead.to(tl.int64) * slsh +
                     srow, lse, mask=store_ok)
