"""Attention of a few query rows over an FP8 (e4m3) KV cache: flash-decoding.

The cache holds K and V in ``float8_e4m3fn`` with one fp32 scale per KV head (the value is
``fp8 * scale``; mminfer.models.kv). The rows that read it are the last ``q_len`` positions
of ``kv_len`` (a decode step: 1; a question's suffix over a cached video prefix: tens to a
few hundred), each seeing every key up to its own position (causal, aligned to the bottom
right).

One launch splits the keys into ``n_splits`` contiguous ranges; each program takes one KV
head, one key range and one block of rows, where a row is a (query position, query head of
that KV head's group) pair: GQA by index, so every K/V tile is read once for the whole group
(7 query heads per KV head at 28/4). K and V tiles are loaded as FP8 and converted to the
query's dtype in registers (e4m3 is exact in fp16, bf16 and fp32); their per-head scales are
constants of the program and are applied to the logits (K: folded into the softmax scale) and
to the output (V), so no dequantised copy of the cache exists anywhere. Each program writes
its range's normalised partial output and log-sum-exp; a second launch merges the ranges
through their log-sum-exp. Splitting across the length keeps the GPU busy when one query
and 4 KV heads alone would give 4 programs.

The keys may lie in two segments (:func:`split_attention`): a kept video prefix, shared by
every question about it and never written, and one question's own rows after it
(mminfer.models.kv.ForkKV). The ranges are planned over the two together, none straddling
them, and each program reads its range from its segment's buffer: the concatenation is read
without being made, and the merge is the same. A prefix in the query's dtype (how a question
reads a bf16 prefix it shares) goes to PyTorch's flash attention instead (:func:`_flash_prefix`:
its split-KV path reads at the GPU's bandwidth where our pass over a question's hundreds of
rows is compute bound), the own rows alone to the kernel (no scales: the conversion is the
identity), into the same scratch and merge.

Several readers of one prefix decoding together (:func:`shared_prefix_attention`, cascade
attention) read it once for all of them: one launch takes every reader's query heads of a KV
head as rows of one block (the M readers' G heads as M x G rows, like a question's rows), none
causal there since each reader comes after the whole prefix; one more launch takes every
reader's own rows (each reader's buffers found through a small table of their addresses) and
writes their key ranges into later slots of the same scratch; one merge writes every reader's
output: three launches a layer, whatever M (the host's launches are much of a batched step). A
decode step is memory bound, so M readers of a 115K prefix read 6.6 GB (bf16) once a step
instead of M times. A prefix in the queries' dtype takes PyTorch's flash attention for that
first pass instead (its split-KV path reads at the GPU's bandwidth with M x G rows; ours is
compute bound there); an FP8 prefix, which it cannot read, keeps ours.

The tests hold it to a pure-PyTorch fp32 oracle (tests/kernels/test_fp8_attention.py).
``chunked`` is the same attention in PyTorch a chunk of keys at a time with an online softmax
(no full dequantised copy of a layer): where Triton cannot run (the CPU without its
interpreter).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from . import online_softmax
from .runtime import compiled_gpu, dot_precision, interpreted

FP8 = torch.float8_e4m3fn
LOG2E = 1.4426950408889634
# keys a program takes at least (a shorter range costs more in the merge than it saves)
MIN_SPLIT_GPU = 256
MAX_SPLITS = 128


def is_fp8(t) -> bool:
    return getattr(t, "dtype", None) == FP8


# lengths and the scratch strides that follow them change every step or question: one compiled
# variant each, not one per divisibility class met mid-answer
@triton.jit(do_not_specialize=["sk2_h", "sk2_n", "sv2_h", "sv2_n", "spo_s", "spo_h", "spl_s",
                               "spl_h", "q_len", "kv_len", "split_len", "seg_len",
                               "seg_splits"])
def _fp8_split_fwd(Q, K, V, K2, V2, KS, VS, PO, PL,
                   sq_h, sq_m, sk_h, sk_n, sv_h, sv_n, sk2_h, sk2_n, sv2_h, sv2_n,
                   spo_s, spo_h, spl_s, spl_h,
                   q_len, kv_len, split_len, seg_len, seg_splits, G: tl.constexpr, qk_scale,
                   D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_D: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr):
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    mb = tl.program_id(2)
    # keys [0, seg_len) are K/V's rows, keys [seg_len, kv_len) K2/V2's from their row 0 (a
    # reader's own rows after a shared prefix); the first seg_splits ranges cover the first
    # segment, the others the second, so no range straddles the two
    if split < seg_splits:
        Kb = K + kvh.to(tl.int64) * sk_h
        Vb = V + kvh.to(tl.int64) * sv_h
        ks_n = sk_n
        vs_n = sv_n
        seg0 = 0
        lo = split * split_len
        seg_end = seg_len
    else:
        Kb = K2 + kvh.to(tl.int64) * sk2_h
        Vb = V2 + kvh.to(tl.int64) * sv2_h
        ks_n = sk2_n
        vs_n = sv2_n
        seg0 = seg_len
        lo = seg_len + (split - seg_splits) * split_len
        seg_end = kv_len
    _partial(Q, Kb, Vb, KS, VS, PO, PL, kvh, split, mb, sq_h, sq_m, ks_n, vs_n,
             spo_s, spo_h, spl_s, spl_h, q_len, kv_len, split_len, lo, seg0, seg_end, G,
             qk_scale, D, BLOCK_M, BLOCK_N, BLOCK_D, PRECISION, CAUSAL)


@triton.jit(do_not_specialize=["sq_r", "spo_s", "spo_h", "spl_s", "spl_h"])
def _fp8_own_fwd(Q, K, TAB, KS, VS, PO, PL, sq_r, sq_h, spo_s, spo_h, spl_s, spl_h,
                 G: tl.constexpr, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                 M_BLOCKS: tl.constexpr):
    """Each reader's own rows after a shared prefix, every reader in one launch (the third
    grid axis: reader x row block): reader r's query (row r of Q), its K/V wherever they
    are, from its row of ``TAB`` (int64: K's and V's addresses, their head and row strides,
    its length, its key ranges' length), into its G rows of the scratch. Each program
    computes what :func:`_fp8_split_fwd` computes for that reader alone (one segment, one
    query, causal)."""
    kvh = tl.program_id(0)
    split = tl.program_id(1)
    r = tl.program_id(2) // M_BLOCKS
    mb = tl.program_id(2) % M_BLOCKS
    t = TAB + r * 8
    sk_h = tl.load(t + 2)
    sk_n = tl.load(t + 3)
    sv_h = tl.load(t + 4)
    sv_n = tl.load(t + 5)
    kv_len = tl.load(t + 6).to(tl.int32)
    split_len = tl.load(t + 7).to(tl.int32)
    Kb = tl.load(t).to(tl.pointer_type(K.dtype.element_ty)) + kvh.to(tl.int64) * sk_h
    Vb = tl.load(t + 1).to(tl.pointer_type(K.dtype.element_ty)) + kvh.to(tl.int64) * sv_h
    _partial(Q + r * sq_r, Kb, Vb, KS, VS, PO + r * G * D, PL + r * G, kvh, split, mb,
             sq_h, 0, sk_n, sv_n, spo_s, spo_h, spl_s, spl_h, 1, kv_len, split_len,
             split * split_len, 0, kv_len, G, qk_scale, D, BLOCK_M, BLOCK_N, BLOCK_D,
             PRECISION, True)


@triton.jit
def _partial(Q, Kb, Vb, KS, VS, PO, PL, kvh, split, mb, sq_h, sq_m, ks_n, vs_n,
             spo_s, spo_h, spl_s, spl_h, q_len, kv_len, split_len, lo, seg0, seg_end,
             G: tl.constexpr, qk_scale, D: tl.constexpr, BLOCK_M: tl.constexpr,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
             CAUSAL: tl.constexpr):
    """One program's key range ``[lo, lo + split_len)`` (within ``[seg0, seg_end)``, read
    from ``Kb``/``Vb``: KV head ``kvh``'s rows of that segment) for one block of rows: its
    normalised partial output and log-sum-exp into slot ``split`` of the scratch."""
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)          # row r: query r // G, head r % G
    rvalid = rows < q_len * G
    qi = rows // G
    head = kvh * G + rows % G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    q = tl.load(Q + head[:, None].to(tl.int64) * sq_h + qi[:, None].to(tl.int64) * sq_m
                + offs_d[None, :], mask=rvalid[:, None] & dmask[None, :], other=0.0)
    if CAUSAL:
        qpos = kv_len - q_len + qi                       # each row's own position
        # keys past the block's last query are masked for every row: not read at all
        last = kv_len - q_len + tl.minimum((mb * BLOCK_M + BLOCK_M - 1) // G, q_len - 1)
    else:      # the rows are queries of several readers, each after every one of these keys
        qpos = qi * 0 + kv_len - 1
        last = kv_len - 1
    hi = tl.minimum(tl.minimum(lo + split_len, seg_end), last + 1)
    k_scale = tl.load(KS + kvh)
    v_scale = tl.load(VS + kvh)
    scale = qk_scale * k_scale                           # base 2, K's scale folded in
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kvalid = kpos < hi
        krow = (kpos - seg0).to(tl.int64)[:, None]
        kv_mask = kvalid[:, None] & dmask[None, :]
        k = tl.load(Kb + krow * ks_n + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        valid = kvalid[None, :] & (kpos[None, :] <= qpos[:, None])
        qk = tl.where(valid, qk * scale, float("-inf"))
        p, alpha, m_i, l_i = online_softmax.weights(qk, m_i, l_i)
        v = tl.load(Vb + krow * vs_n + offs_d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        acc = online_softmax.accumulate(acc, alpha, p, v, PRECISION)
    has = l_i > 0
    out = acc * (v_scale / tl.where(has, l_i, 1.0))[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    tl.store(PO + split * spo_s + kvh * spo_h + rows[:, None] * D + offs_d[None, :], out,
             mask=rvalid[:, None] & dmask[None, :])
    tl.store(PL + split * spl_s + kvh * spl_h + rows, lse, mask=rvalid)


@triton.jit(do_not_specialize=["spo_s", "spo_h", "spl_s", "spl_h", "q_len", "n_splits"])
def _fp8_merge(PO, PL, O, spo_s, spo_h, spl_s, spl_h, so_m, so_h, q_len, n_splits,
               G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_D: tl.constexpr):
    kvh = tl.program_id(0)
    mb = tl.program_id(1)
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rvalid = rows < q_len * G
    offs_d = tl.arange(0, BLOCK_D)
    mask = rvalid[:, None] & (offs_d < D)[None, :]
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for s in range(0, n_splits):
        lse = tl.load(PL + s * spl_s + kvh * spl_h + rows, mask=rvalid, other=float("-inf"))
        o = tl.load(PO + s * spo_s + kvh * spo_h + rows[:, None] * D + offs_d[None, :],
                    mask=mask, other=0.0)
        m, w_sum, acc = online_softmax.fold(m, w_sum, acc, lse, o)
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    qi = rows // G
    head = kvh * G + rows % G
    tl.store(O + qi[:, None].to(tl.int64) * so_m + head[:, None] * so_h + offs_d[None, :],
             out.to(O.dtype.element_ty), mask=mask)


_SMS: dict = {}


def _sm_count(device) -> int:
    if device.type != "cuda":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SMS:
        _SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SMS[idx]


def split_plan(kv_len: int, programs: int, *, gpu: bool, block_n: int,
               sms: int = 132, waves: int = 2) -> tuple[int, int]:
    """``(split_len, n_splits)``: key ranges (multiples of ``block_n``) so that ``programs``
    (KV heads x row blocks) times the splits fill about ``waves`` waves of ``sms`` programs,
    no range shorter than MIN_SPLIT_GPU keys on a GPU (one tile on the CPU), at most
    MAX_SPLITS."""
    want = max(1, min(MAX_SPLITS, -(-waves * sms // max(programs, 1))))
    least = MIN_SPLIT_GPU if gpu else block_n
    split_len = max(-(-kv_len // want), least)
    split_len = -(-split_len // block_n) * block_n
    return split_len, -(-kv_len // split_len)


def tiles(rows: int, gpu: bool) -> tuple[int, int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for ``rows`` = queries x group size.
    Each BLOCK_M is a kernel Triton compiles on first use (:func:`warm`). On the GPU, from
    the sweep on the H200 (lab/experiments/fp8_decode_tiles.py, 276K and 1.05M keys, 28/4
    heads of 128): 128-key tiles, 3 stages; a decode step (7 rows) 4 warps, 0.184 -> 0.155 ms
    at 276K and 0.599 -> 0.494 ms at 1.05M; 16 queries (112 rows) 8 warps, 0.51 -> 0.36 and
    1.45 -> 1.10 ms (with :func:`waves`). 32 and 64 rows were not swept (4 warps)."""
    if gpu:    # rows >= 16 for tl.dot
        block_m = 16 if rows <= 16 else (32 if rows <= 32 else (64 if rows <= 64 else 128))
        return block_m, 128, 4 if block_m <= 64 else 8, 3
    return 16, 16, 4, 1


def waves(block_m: int) -> int:
    """Waves of programs the key splits aim at: two for a few rows (more splits hide the
    merge), one for 128-row blocks, whose programs are long enough (the same sweep)."""
    return 1 if block_m >= 128 else 2


def warm_lengths(group: int, gpu: bool) -> list[int]:
    """The fewest query counts whose launches cover every tile choice of :func:`tiles` for
    a GQA group of ``group`` query heads per KV head: one per BLOCK_M."""
    seen, lengths, q = set(), [], 1
    while True:
        t = tiles(q * group, gpu)
        if t not in seen:
            seen.add(t)
            lengths.append(q)
        if t[0] == tiles(1 << 30, gpu)[0]:      # the largest tile: every longer q uses it
            return lengths
        q += 1


def warm(keys, values, k_scale, v_scale, heads: int, dtype) -> list[int]:
    """Compile every row tile before a user waits for it: one launch per
    :func:`warm_lengths` over the cache ``keys``/``values`` ``[1, Hkv, n, D]`` (FP8 with its
    scales, or the model's dtype with None) with ``heads`` query heads, read as a reader of
    a shared prefix reads it (two segments: :func:`split_attention`; one compile serves one
    segment too), and as that many readers of one prefix decoding together read it
    (:func:`shared_prefix_attention`: the same row tiles, every row after the keys).
    Measured on the H200 (Qwen2.5-VL-7B, 276K-token FP8 prefix): a follow-up whose question
    gave 9 suffix rows (BLOCK_M 64) where the warm-up and the first question had used 128
    took 1.10 s instead of 0.05 s, compiling. Returns the lengths run."""
    _, Hkv, n, D = keys.shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    done = []
    for q_len in warm_lengths(heads // Hkv, compiled_gpu(keys.is_cuda)):
        if 2 * q_len > n:
            break
        q = torch.randn(1, heads, q_len, D, generator=gen).to(keys.device, dtype)
        at = n - q_len
        split_attention(q, [(keys[:, :, :at], values[:, :, :at]),
                            (keys[:, :, at:], values[:, :, at:])], k_scale, v_scale)
        own = (keys[:, :, at:], values[:, :, at:])
        shared_prefix_attention(q.transpose(0, 2), (keys[:, :, :at], values[:, :, :at]),
                                [own] * q_len, k_scale, v_scale)
        done.append(q_len)
    return done


def available(device) -> bool:
    """Whether the Triton kernels run for tensors on ``device``."""
    return compiled_gpu(device.type == "cuda") or interpreted()


def fp8_attention(q, k, v, k_scale, v_scale, scale: float | None = None, *,
                  n_splits: int | None = None) -> torch.Tensor:
    """``q`` ``[1, H, q_len, D]`` (bf16/fp16/fp32) over the FP8 cache ``k``/``v``
    ``[1, Hkv, kv_len, D]`` (any row stride: views of a larger buffer) with per-KV-head
    fp32 scales ``k_scale``/``v_scale`` ``[Hkv]``: the last ``q_len`` of ``kv_len``
    positions, causal from the bottom right. Returns ``[1, q_len, H, D]`` in q's dtype.
    Triton where it runs (``available``), else :func:`chunked`. ``n_splits``: force the
    number of key ranges (tests)."""
    return split_attention(q, [(k, v)], k_scale, v_scale, scale, n_splits=n_splits)


def split_attention(q, segments, k_scale=None, v_scale=None, scale: float | None = None, *,
                    n_splits: int | None = None) -> torch.Tensor:
    """:func:`fp8_attention` over keys held in one or two ``segments`` ``[(k, v), ...]``
    (each ``[1, Hkv, n_i, D]``, any row stride), read as their concatenation without making
    it: a reader's own rows after a shared, read-only prefix (mminfer.models.kv.ForkKV). The
    key ranges are planned over the whole length, each range within one segment, and merged
    through their log-sum-exp as for one segment. K/V are FP8 with their per-head scales, or
    the query's dtype with no scales (each tile's conversion is then the identity and the
    scales are 1); a prefix in the query's dtype is read by PyTorch's flash attention
    (where it reads them: :func:`_flash_reads`). ``q_len`` must not exceed the last segment's length (the rows
    attended are the last ones)."""
    if len(segments) not in (1, 2):
        raise ValueError(f"one or two key segments, not {len(segments)}")
    k, v = segments[0]
    k2, v2 = segments[-1]
    # the prefix by PyTorch's flash attention (into the scratch's first slot), the own rows
    # alone by the kernel: its split-KV path reads the prefix at the GPU's bandwidth where
    # our pass over a question's hundreds of rows is compute bound
    flash = (len(segments) == 2 and k_scale is None and k.shape[2] > 0
             and _flash_reads(q, k, v))
    if k_scale is None:
        if is_fp8(k) or is_fp8(k2):
            raise ValueError("an FP8 cache needs its scales")
        k_scale = v_scale = _ones(k.shape[1], q.device)
    if not available(q.device):
        return chunked(q, None, None, k_scale, v_scale, scale, segments=segments)
    B, H, q_len, D = q.shape
    Hkv = k.shape[1]
    seg_len = k.shape[2] if len(segments) == 2 else 0
    kv_len = seg_len + k2.shape[2]
    if B != 1:
        raise ValueError(f"fp8_attention takes one sequence, not a batch of {B}")
    if H % Hkv or q_len > k2.shape[2] or q_len < 1:
        raise ValueError(f"{H} query heads, {Hkv} KV heads, {q_len} queries over {kv_len} keys")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if q.stride(-1) != 1:
        q = q.contiguous()
    sk, sv, sk2, sv2 = k.stride(), v.stride(), k2.stride(), v2.stride()
    if sk[3] != 1 or sv[3] != 1 or sk2[3] != 1 or sv2[3] != 1:
        raise ValueError("the cache's head dim must be contiguous")
    G = H // Hkv
    first = 0                       # scratch slots before the kernel's key ranges
    if flash:
        prefix, first = (k, v), 1
        k, v, sk, sv, seg_len, kv_len = k2, v2, sk2, sv2, 0, k2.shape[2]
    block_m, block_n, warps, stages, m_blocks, split_len, seg_splits, n_splits, BD = \
        _split_plan(q_len, G, Hkv, D, seg_len, kv_len, compiled_gpu(q.is_cuda),
                    _sm_count(q.device), n_splits)
    R = q_len * G
    po = torch.empty(first + n_splits, Hkv, R, D, dtype=torch.float32, device=q.device)
    pl = torch.empty(first + n_splits, Hkv, R, dtype=torch.float32, device=q.device)
    if flash:             # query j's heads as reader j's: rows j*G + g, the kernel's order
        _flash_prefix(q[0].transpose(0, 1).unsqueeze(2), *prefix, scale, po[0], pl[0])
    out = torch.empty(1, q_len, H, D, dtype=q.dtype, device=q.device)
    po_s, pl_s = po.stride(), pl.stride()
    _fp8_split_fwd[(Hkv, n_splits, m_blocks)](
        q, k, v, k2, v2, k_scale, v_scale, po[first:], pl[first:],
        q.stride(1), q.stride(2), sk[1], sk[2], sv[1], sv[2], sk2[1], sk2[2], sv2[1], sv2[2],
        po_s[0], po_s[1], pl_s[0], pl_s[1],
        q_len, kv_len, split_len, seg_len, seg_splits, G, float(scale) * LOG2E,
        D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=BD, PRECISION=dot_precision(q.dtype),
        CAUSAL=True, num_warps=warps, num_stages=stages)
    _fp8_merge[(Hkv, m_blocks)](
        po, pl, out, po_s[0], po_s[1], pl_s[0], pl_s[1],
        out.stride(1), out.stride(2), q_len, first + n_splits,
        G=G, D=D, BLOCK_M=block_m, BLOCK_D=BD, num_warps=4)
    return out


@functools.lru_cache(maxsize=256)
def _split_plan(q_len, G, Hkv, D, seg_len, kv_len, gpu, sms, n_splits):
    """The launch plan of :func:`split_attention`, which depends on the shapes alone (every
    layer of a step asks for the same one): ``(block_m, block_n, warps, stages, m_blocks,
    split_len, seg_splits, n_splits, BLOCK_D)``."""
    block_m, block_n, warps, stages = tiles(q_len * G, gpu)
    m_blocks = -(-q_len * G // block_m)
    if n_splits is None:
        split_len, _ = split_plan(kv_len, Hkv * m_blocks, gpu=gpu, block_n=block_n,
                                  sms=sms, waves=waves(block_m))
    else:
        split_len = -(-kv_len // n_splits)
    seg_splits = -(-seg_len // split_len)
    n_splits = seg_splits + -(-(kv_len - seg_len) // split_len)
    return (block_m, block_n, warps, stages, m_blocks, split_len, seg_splits, n_splits,
            max(16, triton.next_power_of_2(D)))


def shared_prefix_attention(q, prefix, owns, k_scale=None, v_scale=None,
                            scale: float | None = None, *, n_splits: int | None = None,
                            out=None):
    """One decode step of ``M`` readers of one shared prefix (cascade attention): ``q``
    ``[M, H, 1, D]`` (reader j's query), ``prefix`` ``(k, v)`` ``[1, Hkv, P, D]`` the rows
    they share, ``owns`` M ``(k, v)`` ``[1, Hkv, n_j, D]``, each reader's own rows after
    it (n_j >= 1; lengths differ). Reader j's query sees the prefix and its own rows:
    :func:`split_attention` over ``[prefix, owns[j]]`` for each j, in 3 launches instead of 2M,
    the prefix read once instead of M times. The prefix launch takes the M readers' query heads
    of a KV head as rows of one block (``M x G`` rows, GQA by index as the group's heads are),
    none of them causal there (every reader comes after the whole prefix); the own launch
    (:func:`_fp8_own_fwd`) computes for each reader what its own launch alone would, writing
    its key ranges into further slots of the same scratch, at its rows; one merge of every slot
    through the log-sum-exp writes all the outputs. FP8 K/V with the per-head scales of the
    prefix (a reader's rows are quantised with them), or the query's dtype with none. Returns
    ``[M, 1, H, D]`` in q's dtype, written into ``out`` (any strides, the last dim contiguous)
    where given. ``n_splits``: force the prefix's number of key ranges (tests)."""
    pk, pv = prefix
    M, H, q_len, D = q.shape
    Hkv = pk.shape[1]
    lengths = [k.shape[2] for k, _ in owns]
    if q_len != 1 or len(owns) != M:
        raise ValueError(f"one query per reader and one own segment each: q {tuple(q.shape)}, "
                         f"{len(owns)} segments")
    if H % Hkv or min(lengths) < 1:
        raise ValueError(f"{H} query heads, {Hkv} KV heads, own lengths {lengths}")
    if k_scale is None:
        if is_fp8(pk) or any(is_fp8(k) for k, _ in owns):
            raise ValueError("an FP8 cache needs its scales")
        k_scale = v_scale = _ones(Hkv, q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    if not available(q.device):
        got = _shared_prefix_chunked(q, prefix, owns, k_scale, v_scale, scale)
        return got if out is None else out.copy_(got)
    # each segment's (head, row) strides, read once: the launches below take them
    strides = [(k.stride(), v.stride()) for k, v in ((pk, pv), *owns)]
    if any(sk[3] != 1 or sv[3] != 1 for sk, sv in strides):
        raise ValueError("the cache's head dim must be contiguous")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty(M, 1, H, D, dtype=q.dtype, device=q.device)
    elif out.shape != (M, 1, H, D) or out.stride(-1) != 1 or out.dtype != q.dtype:
        raise ValueError(f"out must be [M, 1, H, D] in q's dtype, contiguous in D: "
                         f"{tuple(out.shape)} {out.dtype}")
    gpu = compiled_gpu(q.is_cuda)
    (block_m, block_n, warps, stages, m_blocks, split_len, n_pre,
     ob_m, ob_n, o_warps, o_stages, o_blocks, n_own, BD) = _shared_plan(
        M, H // Hkv, Hkv, D, pk.shape[2], max(lengths), gpu, _sm_count(q.device), n_splits)
    G = H // Hkv
    R = M * G
    flash = n_splits is None and _flash_reads(q, pk, pv)
    if flash:
        n_pre = 1
    po = torch.empty(n_pre + n_own, Hkv, R, D, dtype=torch.float32, device=q.device)
    pl = torch.empty(n_pre + n_own, Hkv, R, dtype=torch.float32, device=q.device)
    po_s, pl_s = po.stride(), pl.stride()
    prec = dot_precision(q.dtype)
    qk_scale = float(scale) * LOG2E
    if flash:
        _flash_prefix(q, pk, pv, scale, po[0], pl[0])
    else:
        rows = q.transpose(0, 2)             # [1, H, M, D]: reader j is query row j
        (sk, sv) = strides[0]
        _fp8_split_fwd[(Hkv, n_pre, m_blocks)](
            rows, pk, pv, pk, pv, k_scale, v_scale, po, pl,
            q.stride(1), q.stride(0), sk[1], sk[2], sv[1], sv[2], sk[1], sk[2], sv[1], sv[2],
            po_s[0], po_s[1], pl_s[0], pl_s[1],
            M, pk.shape[2], split_len, 0, 0, G, qk_scale,
            D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=BD, PRECISION=prec,
            CAUSAL=False, num_warps=warps, num_stages=stages)
    # every reader's own rows in one launch: where each one's K/V are, their strides, its
    # length and key ranges' length, in a table on the device (from pinned memory: the copy
    # does not wait for the queued kernels)
    tab = torch.tensor([[k.data_ptr(), v.data_ptr(), sk[1], sk[2], sv[1], sv[2], n,
                         -(-n // n_own)]
                        for (k, v), n, (sk, sv) in zip(owns, lengths, strides[1:])],
                       dtype=torch.int64, pin_memory=q.is_cuda)
    if q.is_cuda:
        tab = tab.to(q.device, non_blocking=True)
    _fp8_own_fwd[(Hkv, n_own, M * o_blocks)](
        q, pk, tab, k_scale, v_scale, po[n_pre:], pl[n_pre:], q.stride(0), q.stride(1),
        po_s[0], po_s[1], pl_s[0], pl_s[1], G, qk_scale,
        D=D, BLOCK_M=ob_m, BLOCK_N=ob_n, BLOCK_D=BD, PRECISION=prec, M_BLOCKS=o_blocks,
        num_warps=o_warps, num_stages=o_stages)
    _fp8_merge[(Hkv, m_blocks)](
        po, pl, out, po_s[0], po_s[1], pl_s[0], pl_s[1],
        out.stride(0), out.stride(2), M, n_pre + n_own,
        G=G, D=D, BLOCK_M=block_m, BLOCK_D=BD, num_warps=4)
    return out


def _flash_reads(q, pk, pv) -> bool:
    """Whether PyTorch's flash attention can take the prefix pass of
    :func:`shared_prefix_attention`: K/V in the queries' dtype (not FP8), a head dim it
    compiles, and on the GPU a half dtype (on the CPU its own flash kernel, any float)."""
    if is_fp8(pk) or pk.dtype != q.dtype or pv.dtype != q.dtype:
        return False
    D = q.shape[-1]
    if D % 8 or D > 256:
        return False
    return q.dtype in (torch.float16, torch.bfloat16) if q.is_cuda else True


def prefix_flash(q, pk, pv, scale):
    """M readers' decode queries ``q`` ``[M, H, 1, D]`` over one prefix ``(pk, pv)``
    ``[1, Hkv, P, D]`` (in q's dtype) by PyTorch's flash attention (CUDA's, or the CPU's): the
    readers' query heads of a KV head as the query rows of that head (``M x G``, reader j's
    head g at row ``j*G + g``), none causal, so the prefix is read once for all of them. The
    normalised output ``[1, Hkv, M*G, D]`` and its natural log-sum-exp ``[1, Hkv, M*G]``: a
    partial to merge with the readers' own rows."""
    M, H, _, D = q.shape
    Hkv = pk.shape[1]
    R = M * (H // Hkv)
    rows = q.reshape(M, Hkv, H // Hkv, D).transpose(0, 1).reshape(1, Hkv, R, D)
    if q.is_cuda:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention(
            rows, pk, pv, 0.0, False, False, scale=scale)[:2]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            rows, pk, pv, 0.0, False, scale=scale)
    return o, lse[..., :R]


def _flash_prefix(q, pk, pv, scale, po, pl):
    """The prefix pass of :func:`shared_prefix_attention` by :func:`prefix_flash`: its split-KV
    path reads the prefix at the GPU's bandwidth, where the Triton pass over the same rows
    was compute bound (677 us a layer at 56 rows x 115K keys on an H100). Writes the output
    into ``po`` ``[Hkv, R, D]`` and the base-2 log-sum-exp the merge folds into ``pl``
    ``[Hkv, R]``."""
    o, lse = prefix_flash(q, pk, pv, scale)
    po.copy_(o[0])
    torch.mul(lse[0], LOG2E, out=pl)


@functools.lru_cache(maxsize=256)
def _shared_plan(M, G, Hkv, D, P, longest, gpu, sms, n_splits):
    """The launch plan of :func:`shared_prefix_attention` (tiles, key ranges), which depends
    on the shapes alone: every layer of a batched step asks for the same one. ``(block_m,
    block_n, warps, stages, m_blocks, split_len, n_pre)`` of the prefix launch, ``(ob_m,
    ob_n, o_warps, o_stages, o_blocks, n_own)`` of the readers' own launch, ``BLOCK_D``."""
    block_m, block_n, warps, stages = tiles(M * G, gpu)
    m_blocks = -(-M * G // block_m)
    if n_splits is None:
        split_len, _ = split_plan(P, Hkv * m_blocks, gpu=gpu, block_n=block_n, sms=sms,
                                  waves=waves(block_m))
    else:
        split_len = -(-P // n_splits)
    n_pre = -(-P // split_len)
    # every reader's own rows in the same number of key ranges (a shorter one's last ranges
    # empty: the kernel writes them as nothing seen), planned for the longest
    ob_m, ob_n, o_warps, o_stages = tiles(G, gpu)
    o_blocks = -(-G // ob_m)
    n_own = split_plan(longest, Hkv * o_blocks, gpu=gpu, block_n=ob_n, sms=sms,
                       waves=waves(ob_m))[1]
    BD = max(16, triton.next_power_of_2(D))
    return (block_m, block_n, warps, stages, m_blocks, split_len, n_pre,
            ob_m, ob_n, o_warps, o_stages, o_blocks, n_own, BD)


def merge_partials(o1, l1, o2, l2):
    """Two partial attentions of the same rows over disjoint keys, each normalised over its
    own keys (``o`` ``[..., D]``, ``l`` their natural log-sum-exp ``[..., 1]``; -inf: no key
    seen), merged as one softmax over both: fp32."""
    m = torch.maximum(l1, l2)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    w1, w2 = (l1 - m).exp(), (l2 - m).exp()
    return (o1.float() * w1 + o2.float() * w2) / (w1 + w2)


def _shared_prefix_chunked(q, prefix, owns, k_scale, v_scale, scale):
    """:func:`shared_prefix_attention` in PyTorch (where Triton cannot run): the M readers'
    query heads of a KV head as rows of one pass over the prefix, each reader's own rows,
    the merge."""
    M, H, _, D = q.shape
    Hkv = prefix[0].shape[1]
    G = H // Hkv
    qf = q.float().reshape(M, Hkv, G, D) * scale
    rows = qf.transpose(0, 1).reshape(1, Hkv, M * G, D)                 # rows (reader, g)
    o1, l1 = _partials(rows, [prefix], k_scale, v_scale, None)
    own = [_partials(qf[j].unsqueeze(0), [seg], k_scale, v_scale, None)
           for j, seg in enumerate(owns)]
    o2 = torch.stack([o for o, _ in own], 2).reshape(1, Hkv, M * G, D)
    l2 = torch.stack([lse for _, lse in own], 2).reshape(1, Hkv, M * G, 1)
    out = merge_partials(o1, l1, o2, l2)                                # [1, Hkv, M*G, D]
    return out.reshape(Hkv, M, G, D).transpose(0, 1).reshape(M, 1, H, D).to(q.dtype)


_ONES: dict = {}


def _ones(n: int, device) -> torch.Tensor:
    """Unit scales ``[n]`` fp32 (K/V stored in the query's dtype), one tensor per device."""
    key = (n, device)
    t = _ONES.get(key)
    if t is None:
        t = _ONES[key] = torch.ones(n, dtype=torch.float32, device=device)
    return t


def dequantize(x, scale, dtype=torch.float32):
    """``x`` fp8 ``[B, Hkv, n, D]`` times its per-head ``scale`` ``[Hkv]``, in ``dtype``."""
    return (x.to(torch.float32) * scale.view(1, -1, 1, 1).to(torch.float32)).to(dtype)


# the most fp32 logits one chunk of chunked() holds: 16 MiB
CHUNK_LOGITS = 1 << 22


def chunked(q, k, v, k_scale, v_scale, scale: float | None = None,
            chunk: int = 8192, *, segments=None) -> torch.Tensor:
    """:func:`fp8_attention` in PyTorch: ``chunk`` keys at a time dequantised to fp32, an
    online softmax across the chunks, GQA by reshaping the query heads into their groups.
    ``segments`` (instead of ``k``/``v``): the keys in parts, as :func:`split_attention`
    takes them. ``[1, q_len, H, D]`` in q's dtype. The chunk shrinks for many rows, so the
    fp32 logits of a chunk stay within CHUNK_LOGITS elements (a long question's rows)."""
    segments = segments or [(k, v)]
    B, H, q_len, D = q.shape
    Hkv, kv_len = segments[0][0].shape[1], sum(sk.shape[2] for sk, _ in segments)
    G = H // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qf = q.float().reshape(B, Hkv, G * q_len, D) * scale                # rows: (g, qi)
    qpos = (kv_len - q_len + torch.arange(q_len, device=q.device)).repeat(G)[:, None]
    out, _ = _partials(qf, segments, k_scale, v_scale, qpos, chunk)
    return out.reshape(B, H, q_len, D).transpose(1, 2).to(q.dtype)


def _partials(rows, segments, k_scale, v_scale, qpos, chunk: int = 8192):
    """Attention of ``rows`` ``[B, Hkv, R, D]`` (fp32, the softmax scale applied) over the
    concatenated ``segments``, ``chunk`` keys at a time with an online softmax: ``(out
    [B, Hkv, R, D] fp32, lse [B, Hkv, R, 1])``, lse the natural log-sum-exp of the logits
    (-inf where a row saw no key). ``qpos`` ``[R, 1]``: each row's position (it sees the
    keys up to it), or None: every key."""
    B, Hkv, R, D = rows.shape
    chunk = max(16, min(chunk, CHUNK_LOGITS // (Hkv * R)))
    m = torch.full((B, Hkv, R, 1), float("-inf"), device=rows.device)
    l = torch.zeros_like(m)
    acc = torch.zeros(B, Hkv, R, D, device=rows.device)
    parts = []                 # (segment, its first key's position, rows [s, e) of it)
    base = 0
    for seg in segments:
        n = seg[0].shape[2]
        parts += [(seg, base, s, min(s + chunk, n)) for s in range(0, n, chunk)]
        base += n
    for (k, v), base, s, e in parts:
        kf = dequantize(k[:, :, s:e], k_scale)
        logits = rows @ kf.transpose(-1, -2)
        if qpos is not None:
            logits = logits.masked_fill(
                torch.arange(base + s, base + e, device=rows.device)[None, :] > qpos,
                float("-inf"))
        m_new = torch.maximum(m, logits.amax(-1, keepdim=True))
        m_use = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        p = torch.exp(logits - m_use)
        alpha = torch.exp(m - m_use)
        l = l * alpha + p.sum(-1, keepdim=True)
        acc = acc * alpha + p @ dequantize(v[:, :, s:e], v_scale)
        m = m_new
    seen = l > 0
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, torch.ones_like(l))),
                      torch.full_like(l, float("-inf")))
    return acc / torch.where(seen, l, torch.ones_like(l)), lse
