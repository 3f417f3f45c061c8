"""A decode step's attention for B answers over ragged caches, with everything that changes
from step to step on the device: the whole batched step could then be one CUDA graph.

Why (issue 41, "8 answers decoding at once >= 4x one alone"): the product's batched step
(mminfer.models.decode.BatchGraphs) replays the token-wise work from CUDA graphs but attends
on the host between the replays, per layer and per answer (``cache.update`` and a
flash-decoding launch whose lengths are Python ints). On an H100 at 115K tokens, 8 forks of
one prefix take 37.6 ms a step and 8 separate caches 64.2 ms, against 10.9 ms for one answer
alone: ~4.3 ms of weights and 3-26 ms of K/V reads, the rest host work. Here nothing of a
step is decided on the host:

- ``ptrs`` ``[L, B, 11]`` int64, per layer and answer: its cache's first segment (a kept
  prefix, or the whole cache) K and V addresses, head and row strides, its second segment's (a
  question's own rows after a shared prefix; none: 0), which segment takes the new row, and
  an FP8 cache's per-head K and V scales (its segments share them, as mminfer.models.kv's
  forks do). Fixed while no buffer moves (an answer joining, leaving or outgrowing its buffer
  rewrites its rows of the table, not the graph);
- ``lens`` ``[B, 2]`` the two segments' lengths, shared by every layer; :func:`advance`
  counts the step's new row (``lens += inc``) once before the layers;
- ``groups``: answers that share their first segment (forks of one kept prefix) read it
  once for all of them, their query heads as the rows of one block;
- per layer: ``Ragged.append`` writes the new K/V row of every answer into its segment, then
  ``Ragged.attend`` runs a static grid (groups x KV heads x key ranges of ``split`` keys,
  plus one program per member for its own rows); ranges past an answer's length are skipped
  and its merge reads only those its lengths say were written (flash-decoding).

A row's D values are contiguous; K and V of a segment share their strides (they do in
mminfer.models.kv's slabs, head-major or, a fork's own rows, row-major). The cache is in the
queries' dtype or FP8 (e4m3, the new rows quantised as kv.quantize_into does), one of the two
per launch.
Held to a pure-PyTorch fp32 oracle in lab/tests/test_ragged_decode.py; ``bench`` times one
layer in a CUDA graph against the product's per-answer launches (GPU).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl

from mminfer.kernels import online_softmax
from mminfer.kernels.fp8_quant import _to_e4m3
from mminfer.kernels.runtime import dot_precision

LOG2E = 1.4426950408889634
FP8_DT = torch.float8_e4m3fn
_TL = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
K0, V0, SH0, SR0, K1, V1, SH1, SR1, OWN, KS, VS = range(11)
W = 11                                    # the table's columns


@triton.jit
def _ptr(addr, CACHE: tl.constexpr):
    return addr.to(tl.pointer_type(CACHE))


@triton.jit
def _append_kernel(PTRS, LENS, KN, VN, skn_b, skn_h, svn_b, svn_h, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, CACHE: tl.constexpr, FP8: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    row = PTRS + b * 11
    own = tl.load(row + 8)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    if own != 0:
        at = tl.load(LENS + b * 2 + 1) - 1
        kb = _ptr(tl.load(row + 4), CACHE)
        vb = _ptr(tl.load(row + 5), CACHE)
        sh = tl.load(row + 6)
        sr = tl.load(row + 7)
    else:
        at = tl.load(LENS + b * 2) - 1
        kb = _ptr(tl.load(row + 0), CACHE)
        vb = _ptr(tl.load(row + 1), CACHE)
        sh = tl.load(row + 2)
        sr = tl.load(row + 3)
    dst = h.to(tl.int64) * sh + at.to(tl.int64) * sr + d
    k = tl.load(KN + b * skn_b + h * skn_h + d, mask=dm)
    v = tl.load(VN + b * svn_b + h * svn_h + d, mask=dm)
    if FP8:       # quantised with the cache's per-head scales, as kv.quantize_into does
        ks = tl.load(_ptr(tl.load(row + 9), tl.float32) + h)
        vs = tl.load(_ptr(tl.load(row + 10), tl.float32) + h)
        k = tl.minimum(tl.maximum(k.to(tl.float32) * (1.0 / ks), -448.0), 448.0)
        v = tl.minimum(tl.maximum(v.to(tl.float32) * (1.0 / vs), -448.0), 448.0)
        k = _to_e4m3(k, CACHE)
        v = _to_e4m3(v, CACHE)
    tl.store(kb + dst, k, mask=dm)
    tl.store(vb + dst, v, mask=dm)


@triton.jit
def _attend_kernel(Q, PTRS, LENS, GROUPS, PO, PL, sq_b, sq_h, qk_scale, SPLIT,
                   G: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr, S: tl.constexpr,
                   S0: tl.constexpr, MAXM: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
                   CACHE: tl.constexpr, FP8: tl.constexpr):
    g = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    n = tl.load(GROUPS + g * (MAXM + 1))               # the group's answers (0: none)
    r = tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    if s < S0:
        # range s of the group's shared first segment, for every member's query heads at
        # once: row r is member r // G's head h * G + r % G (the prefix read once for all)
        mv = r // G
        rv = mv < n
        ans = tl.load(GROUPS + g * (MAXM + 1) + 1 + mv, mask=rv, other=0)
        first = tl.load(GROUPS + g * (MAXM + 1) + 1)
        row = PTRS + first * 11
        kb = _ptr(tl.load(row + 0), CACHE)
        vb = _ptr(tl.load(row + 1), CACHE)
        sh = tl.load(row + 2)
        sr = tl.load(row + 3)
        lo = s * SPLIT
        hi = tl.minimum(lo + SPLIT, tl.load(LENS + first * 2))
        slot = s
    else:
        # the second segment (rows of its own) of member s - S0, whole, into its last slot
        ms = s - S0
        rv = (r < G) & (ms < n)
        ans = tl.load(GROUPS + g * (MAXM + 1) + 1 + ms + r * 0, mask=rv, other=0)
        one = tl.load(GROUPS + g * (MAXM + 1) + 1 + tl.minimum(ms, MAXM - 1))
        row = PTRS + one * 11
        kb = _ptr(tl.load(row + 4), CACHE)
        vb = _ptr(tl.load(row + 5), CACHE)
        sh = tl.load(row + 6)
        sr = tl.load(row + 7)
        lo = s * 0                      # (tensors in both branches: the same types)
        hi = tl.where(ms < n, tl.load(LENS + one * 2 + 1), 0)
        slot = s * 0 + (S - 1)
    head = h * G + r % G
    q = tl.load(Q + ans[:, None].to(tl.int64) * sq_b + head[:, None] * sq_h + d[None, :],
                mask=rv[:, None] & dm[None, :], other=0.0)
    kb = kb + h.to(tl.int64) * sh
    vb = vb + h.to(tl.int64) * sh
    scale = qk_scale
    v_scale = 1.0
    if FP8:       # a fork's rows carry its prefix's scales: one pair per program
        scale = qk_scale * tl.load(_ptr(tl.load(row + 9), tl.float32) + h)
        v_scale = tl.load(_ptr(tl.load(row + 10), tl.float32) + h)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kvalid = kpos < hi
        krow = kpos.to(tl.int64)[:, None] * sr + d[None, :]
        mask = kvalid[:, None] & dm[None, :]
        k = tl.load(kb + krow, mask=mask, other=0.0).to(q.dtype)
        qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        qk = tl.where(kvalid[None, :], qk * scale, float("-inf"))
        p, alpha, m_i, l_i = online_softmax.weights(qk, m_i, l_i)
        v = tl.load(vb + krow, mask=mask, other=0.0).to(q.dtype)
        acc = online_softmax.accumulate(acc, alpha, p, v, PRECISION)
    has = l_i > 0
    out = acc * (v_scale / tl.where(has, l_i, 1.0))[:, None]
    lse = tl.where(has, m_i + tl.math.log2(tl.where(has, l_i, 1.0)), float("-inf"))
    at = (ans.to(tl.int64) * HKV + h) * S + slot          # [BLOCK_M]: each row's answer
    tl.store(PO + (at * G + r % G)[:, None] * D + d[None, :], out,
             mask=rv[:, None] & dm[None, :])
    tl.store(PL + at * G + r % G, lse, mask=rv)


@triton.jit
def _merge_kernel(PO, PL, LENS, O, so_b, so_h, SPLIT, G: tl.constexpr, D: tl.constexpr,
                  HKV: tl.constexpr, S: tl.constexpr, BLOCK_G: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    r = tl.arange(0, BLOCK_G)
    rv = r < G
    d = tl.arange(0, BLOCK_D)
    mask = rv[:, None] & (d < D)[None, :]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    n0 = tl.cdiv(tl.load(LENS + b * 2), SPLIT)        # the first segment's ranges written
    own = tl.load(LENS + b * 2 + 1) > 0
    for s in range(0, S):
        take = (s < n0) | ((s == S - 1) & own)
        at = (b * HKV + h) * S + s
        lse = tl.load(PL + at * G + r, mask=rv & take, other=float("-inf"))
        o = tl.load(PO + (at * G + r)[:, None] * D + d[None, :], mask=mask & take, other=0.0)
        m, w_sum, acc = online_softmax.fold(m, w_sum, acc, lse, o)
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    tl.store(O + b * so_b + (h * G + r)[:, None] * so_h + d[None, :],
             out.to(O.dtype.element_ty), mask=mask)


class Ragged:
    """The scratch and the static launch shape of one batch: ``B`` answers, ``heads`` /
    ``kv_heads`` of ``dim``; a first segment of up to ``max_len`` keys split in ranges of
    ``split``, a second segment taken whole; groups of up to ``max_members`` answers sharing
    their first segment read it once for all of them."""

    def __init__(self, B, heads, kv_heads, dim, max_len, *, split=4096, max_members=8,
                 device="cpu", block_n=None, cache_dtype=None):
        self.B, self.H, self.HKV, self.D = B, heads, kv_heads, dim
        self.G = heads // kv_heads
        self.split, self.maxm = split, max_members
        self.fp8 = cache_dtype == FP8_DT     # else the cache is in the queries' dtype
        self.S0 = -(-max_len // split)
        self.S = self.S0 + 1                               # the last slot: the second segment
        self.block_m = max(16, triton.next_power_of_2(max_members * self.G))
        self.block_g = triton.next_power_of_2(self.G)
        self.block_d = triton.next_power_of_2(dim)
        cuda = torch.device(device).type == "cuda"
        self.block_n = block_n or (128 if cuda else 32)
        self.po = torch.empty(B, kv_heads, self.S, self.G, dim, dtype=torch.float32,
                              device=device)
        self.pl = torch.empty(B, kv_heads, self.S, self.G, dtype=torch.float32, device=device)

    def groups(self, sets, device):
        """``[B, max_members + 1]`` int32 from lists of answer indices that share their first
        segment (every answer in exactly one; unused rows: no members)."""
        t = torch.zeros(self.B, self.maxm + 1, dtype=torch.int32)
        assert sorted(i for s in sets for i in s) == list(range(self.B))
        for g, members in enumerate(sets):
            assert 0 < len(members) <= self.maxm
            t[g, 0] = len(members)
            t[g, 1:1 + len(members)] = torch.tensor(members)
        return t.to(device)

    def append(self, ptrs, lens, k_new, v_new):
        """Each answer's new K/V row (``[B, Hkv, D]``) into its segment, at its length - 1."""
        assert k_new.stride(-1) == 1 and v_new.stride(-1) == 1
        _append_kernel[(self.B, self.HKV)](ptrs, lens, k_new, v_new, k_new.stride(0),
                                           k_new.stride(1), v_new.stride(0), v_new.stride(1),
                                           D=self.D, BLOCK_D=self.block_d,
                                           CACHE=self._cache(k_new), FP8=self.fp8)

    def _cache(self, like):
        return tl.float8e4nv if self.fp8 else _TL[like.dtype]

    def attend(self, q, ptrs, lens, groups, scale=None, out=None):
        """``q`` ``[B, H, D]`` over each answer's two segments (``lens``): ``[B, H, D]``."""
        scale = self.D ** -0.5 if scale is None else scale
        out = torch.empty_like(q) if out is None else out
        _attend_kernel[(self.B, self.HKV, self.S0 + self.maxm)](
            q, ptrs, lens, groups, self.po, self.pl, q.stride(0), q.stride(1),
            scale * LOG2E, self.split, G=self.G, D=self.D, HKV=self.HKV, S=self.S,
            S0=self.S0, MAXM=self.maxm, BLOCK_M=self.block_m, BLOCK_N=self.block_n,
            BLOCK_D=self.block_d, PRECISION=dot_precision(q.dtype), CACHE=self._cache(q),
            FP8=self.fp8, num_warps=4, num_stages=3 if q.is_cuda else 1)
        _merge_kernel[(self.B, self.HKV)](
            self.po, self.pl, lens, out, out.stride(0), out.stride(1), self.split, G=self.G,
            D=self.D, HKV=self.HKV, S=self.S, BLOCK_G=self.block_g, BLOCK_D=self.block_d)
        return out


def advance(lens, inc):
    """One step's new row counted in each answer's writing segment (device-side)."""
    lens += inc


def table(segments, device, scales=None):
    """``[B, 11]`` int64 from each answer's ``(k0, v0, k1, v1, own)``: slabs ``[1, Hkv, cap,
    D]`` (k1/v1 None: one segment; own: the new rows go to the second); ``scales``: each
    answer's FP8 ``(k_scale, v_scale)`` ``[Hkv]`` fp32 (an FP8 cache; its segments share
    them)."""
    rows = []
    for i, (k0, v0, k1, v1, own) in enumerate(segments):
        assert k0.stride() == v0.stride() and k0.stride(-1) == 1
        r = [k0.data_ptr(), v0.data_ptr(), k0.stride(1), k0.stride(2)]
        if k1 is None:
            r += [0, 0, 0, 0]
        else:
            assert k1.stride() == v1.stride() and k1.stride(-1) == 1
            r += [k1.data_ptr(), v1.data_ptr(), k1.stride(1), k1.stride(2)]
        ks, vs = scales[i] if scales is not None else (None, None)
        rows.append(r + [int(own)] + ([ks.data_ptr(), vs.data_ptr()] if ks is not None
                                      else [0, 0]))
    return torch.tensor(rows, dtype=torch.int64, device=device)


def _time(fn, iters):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters * 1e3


def case(kind, B, n, own, *, split, dev, dt=torch.bfloat16, H=28, HKV=4, D=128, seed=0,
         fp8=False):
    """One layer of B answers at ``n`` keys: ``kind`` "each" (B caches of their own) or
    "fork" (B questions of ``own`` rows over one kept prefix). Returns ``(ours, product,
    out, kv_bytes)``: ``ours()`` writes the step's K/V rows and attends into ``out`` with
    every length on the device; ``product()`` does the same with the product's launchers
    (mminfer.kernels.fp8_attention: split_attention per answer, shared_prefix_attention for
    the forks), lengths from the host, and returns its output. ``fp8``: the caches in e4m3
    with per-head scales."""
    from mminfer.kernels.fp8_attention import shared_prefix_attention, split_attention
    from mminfer.models import kv
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, generator=gen)

    def slab(*shape):
        return rand(*shape).to(FP8_DT) if fp8 else rand(*shape)

    sc = (torch.full((HKV,), 0.05, device=dev), torch.full((HKV,), 0.07, device=dev)) \
        if fp8 else (None, None)

    if kind == "each":
        segs = [(slab(1, HKV, n + 64, D), slab(1, HKV, n + 64, D)) for _ in range(B)]
        rows, sets = [(k, v, None, None, False) for k, v in segs], [[b] for b in range(B)]
        lens = torch.tensor([[n, 0]] * B, device=dev)
    else:
        prefix = (slab(1, HKV, n, D), slab(1, HKV, n, D))
        segs = [(slab(1, HKV, own + 64, D), slab(1, HKV, own + 64, D)) for _ in range(B)]
        rows, sets = [(*prefix, k, v, True) for k, v in segs], [list(range(B))]
        lens = torch.tensor([[n, own]] * B, device=dev)
    rg = Ragged(B, H, HKV, D, n + 64, split=split, max_members=len(sets[0]), device=dev,
                cache_dtype=FP8_DT if fp8 else None)
    ptrs = table(rows, dev, scales=[sc] * B if fp8 else None)
    groups = rg.groups(sets, dev)
    q = rand(B, H, D)
    kn, vn = rand(B, HKV, D), rand(B, HKV, D)
    out = torch.empty_like(q)

    def ours():
        rg.append(ptrs, lens, kn, vn)
        rg.attend(q, ptrs, lens, groups, out=out)

    at = n - 1 if kind == "each" else own - 1
    m = n if kind == "each" else own

    def product():
        for b, (k, v) in enumerate(segs):         # the step's row, written by the host
            if fp8:
                kv.quantize_into(k[:, :, at:at + 1], kn[b].view(1, HKV, 1, D), sc[0])
                kv.quantize_into(v[:, :, at:at + 1], vn[b].view(1, HKV, 1, D), sc[1])
            else:
                k[:, :, at] = kn[b]
                v[:, :, at] = vn[b]
        if kind == "each":
            return torch.cat([split_attention(q[b:b + 1].unsqueeze(2),
                                              [(k[:, :, :m], v[:, :, :m])], *sc)
                              for b, (k, v) in enumerate(segs)]).view(B, H, D)
        return shared_prefix_attention(q.unsqueeze(2), prefix,
                                       [(k[:, :, :m], v[:, :, :m]) for k, v in segs], *sc
                                       ).view(B, H, D)

    nbytes = (B if kind == "each" else 1) * 2 * HKV * n * D * (1 if fp8 else q.element_size())
    return ours, product, out, nbytes


def bench(argv=None):
    """GPU: one layer's K/V writes and attention for B answers at ``--length`` keys, replayed
    from one CUDA graph, against the product's launches with lengths from the host (see
    :func:`case`); ``x28``: a step's attention over the 7B's 28 layers."""
    p = argparse.ArgumentParser(description=bench.__doc__)
    p.add_argument("--length", type=int, default=115000)
    p.add_argument("--own", type=int, default=40)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--split", type=int, default=4096)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    rows = []
    for B in a.batch:
        for kind, fp8 in (("each", False), ("fork", False), ("each", True), ("fork", True)):
            ours, product, out, kv = case(kind, B, a.length, a.own, split=a.split, dev="cuda",
                                          fp8=fp8)
            for _ in range(3):
                ours()
            err = (product().float() - out.float()).abs().max().item()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                ours()
            graph_ms = _time(g.replay, a.iters)
            product_ms = _time(product, a.iters)
            rows.append({"batch": B, "case": kind, "kv": "fp8" if fp8 else "bf16",
                         "length": a.length, "max_abs_err": err,
                         "graph_ms": round(graph_ms, 4), "product_ms": round(product_ms, 4),
                         "graph_GBps": round(kv / graph_ms / 1e6, 1),
                         "graph_x28_ms": round(28 * graph_ms, 2),
                         "product_x28_ms": round(28 * product_ms, 2)})
            print(json.dumps(rows[-1]), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    bench()
