"""A question's decode step over a kept bf16 video (a ForkKV) with PyTorch's flash kernel for
the shared prefix instead of the two-segment flash-decoding kernel: prepared, not measured.

Why: measured on an H100 (benchmarks/decode_step.py, Qwen2.5-VL-7B text shape, bf16, 115K
cached tokens), one answer's decode step replayed from CUDA graphs took 11.29 ms over a plain
cache (SDPA) and 15.06 ms over a ForkKV of it (+33 %), where every question about a cached
video now runs (mminfer.models.hooks.fork_attention -> the Triton kernel
mminfer.kernels.fp8_attention.split_attention). Attention alone over 28 layers: SDPA 3.20 ms,
the split kernel 4.87 ms. A single request may be at most 3 % slower than before.

What: :func:`fork_attention_flash` takes what ``fork_attention`` takes (the ForkLayer's own
rows as ``key``/``value``, carrying the prefix's views) and, for ONE query token over a cache
in the model's dtype:

1. the prefix with PyTorch's flash kernel, which also returns the log-sum-exp
   (``aten._scaled_dot_product_flash_attention`` on CUDA, ``..._for_cpu`` on the CPU); GQA
   by folding each KV head's query-head group into the query length (q ``[1, H, 1, d]`` ->
   ``[1, Hkv, H/Hkv, d]``, non-causal: exact for one decode token, every row sees the whole
   prefix; K/V keep their Hkv heads, nothing repeated);
2. the fork's own rows (question + answer so far): ``own="flash"`` the same flash call, or
   ``own="split"`` the flash-decoding kernel's partial pass (``_fp8_split_fwd``) over them
   alone, its key ranges left in a scratch for the merge;
3. the log-sum-exp merge: ``merge="triton"`` one launch (:func:`merge_flash`: the flash
   partial and any number of further partials, each KV head's group in one program), or
   ``merge="torch"`` (``merge_partials``, several small launches; ``own="flash"`` only).

Anything else (several query rows, an FP8 cache) goes to the product's ``fork_attention``.

benchmarks/decode_step.py measures it side by side with the product (its ``fork_flash*``
columns: one answer's graph step with ``decode.fork_attention`` swapped for this, and 28
layers' attention alone, split kernel vs these variants, CUDA events):

    python benchmarks/decode_step.py --lengths 115000 --batch 0 --out $OUT/decode_step.json
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from mminfer.kernels import fp8_attention as fa, online_softmax
from mminfer.kernels.runtime import compiled_gpu
from mminfer.models import hooks
from mminfer.models.kv import prefix_of, scale_of

LOG2E = 1.4426950408889634
# the product's launcher, kept before anyone swaps the name for this experiment: what
# fork_attention_flash hands every case it does not take
PRODUCT = hooks.fork_attention


def flash_partial(q, k, v, scale):
    """``q`` ``[1, Hkv, R, d]`` over all of ``k``/``v`` ``[1, Hkv, n, d]`` (non-causal):
    ``(out [1, Hkv, R, d] in q's dtype, lse [1, Hkv, R] fp32, natural log)``."""
    if q.is_cuda:
        got = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False,
                                                                 scale=scale)
        return got[0], got[1][..., :q.shape[2]]
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False,
                                                                      scale=scale)


@triton.jit(do_not_specialize=["n_slots"])
def _merge_flash(O1, L1, PO, PL, O, so1_h, so1_m, sl1_h, sl1_m, spo_s, spo_h, spo_m, spl_s,
                 spl_h, spl_m, so_h, n_slots, l2_factor, G: tl.constexpr, D: tl.constexpr,
                 BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    # program: one KV head, its G query heads as rows; the flash partial (natural-log lse)
    # then n_slots further partials (lse times l2_factor is base 2)
    kvh = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    gv = g < G
    d = tl.arange(0, BLOCK_D)
    mask = gv[:, None] & (d < D)[None, :]
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    w_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    lse = tl.load(L1 + kvh * sl1_h + g * sl1_m, mask=gv, other=float("-inf"))
    lse = lse * 1.4426950408889634                    # natural log to base 2
    o1 = tl.load(O1 + kvh * so1_h + g[:, None] * so1_m + d[None, :], mask=mask, other=0.0)
    m, w_sum, acc = online_softmax.fold(m, w_sum, acc, lse, o1.to(tl.float32))
    for s in range(0, n_slots):
        lse = tl.load(PL + s * spl_s + kvh * spl_h + g * spl_m, mask=gv, other=float("-inf"))
        o = tl.load(PO + s * spo_s + kvh * spo_h + g[:, None] * spo_m + d[None, :], mask=mask,
                    other=0.0)
        m, w_sum, acc = online_softmax.fold(m, w_sum, acc, lse * l2_factor, o.to(tl.float32))
    out = acc / tl.where(w_sum > 0, w_sum, 1.0)[:, None]
    tl.store(O + (kvh * G + g)[:, None] * so_h + d[None, :], out.to(O.dtype.element_ty),
             mask=mask)


def merge_flash(o1, l1, po, pl, slot_factor, dtype):
    """The flash partial ``o1`` ``[1, Hkv, G, d]``, ``l1`` ``[1, Hkv, G]`` (natural log)
    merged with the partials ``po`` ``[S, Hkv, G, d]``, ``pl`` ``[S, Hkv, G]`` (whose lse
    times ``slot_factor`` is base 2) in one launch: ``[1, 1, Hkv * G, d]`` in ``dtype``."""
    _, Hkv, G, D = o1.shape
    out = torch.empty(1, 1, Hkv * G, D, dtype=dtype, device=o1.device)
    if o1.stride(-1) != 1 or po.stride(-1) != 1:
        raise ValueError("the partial outputs' head dim must be contiguous")
    _merge_flash[(Hkv,)](o1, l1, po, pl, out, o1.stride(1), o1.stride(2), l1.stride(1),
                         l1.stride(2), po.stride(0), po.stride(1), po.stride(2), pl.stride(0),
                         pl.stride(1), pl.stride(2), out.stride(2), po.shape[0],
                         float(slot_factor), G=G, D=D,
                         BLOCK_G=triton.next_power_of_2(G),
                         BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=4)
    return out


def split_partials(q, k, v, scale):
    """The flash-decoding kernel's partial pass over ``k``/``v`` ``[1, Hkv, n, d]`` alone for
    the folded query ``q`` ``[1, Hkv, G, d]`` (its G rows one query of G heads): its key
    ranges' ``(po [S, Hkv, G, d], pl [S, Hkv, G])``, fp32, lse base 2, for the merge."""
    _, Hkv, G, D = q.shape
    n = k.shape[2]
    gpu = compiled_gpu(q.is_cuda)
    block_m, block_n, warps, stages = fa.tiles(G, gpu)
    m_blocks = -(-G // block_m)
    split_len, n_splits = fa.split_plan(n, Hkv * m_blocks, gpu=gpu, block_n=block_n,
                                        sms=fa._sm_count(q.device), waves=fa.waves(block_m))
    po = torch.empty(n_splits, Hkv, G, D, dtype=torch.float32, device=q.device)
    pl = torch.empty(n_splits, Hkv, G, dtype=torch.float32, device=q.device)
    ones = fa._ones(Hkv, q.device)
    qh = q.reshape(1, Hkv * G, 1, D)       # the kernel's layout: head kvh * G + g, one query
    fa._fp8_split_fwd[(Hkv, n_splits, m_blocks)](
        qh, k, v, k, v, ones, ones, po, pl,
        qh.stride(1), qh.stride(2), k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        k.stride(1), k.stride(2), v.stride(1), v.stride(2),
        po.stride(0), po.stride(1), pl.stride(0), pl.stride(1),
        1, n, split_len, 0, 0, G, float(scale) * LOG2E,
        D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(D)),
        PRECISION=fa.dot_precision(q.dtype), CAUSAL=True, num_warps=warps, num_stages=stages)
    return po, pl


def fork_attention_flash(query, key, value, scaling=None, ctx=None, *, own: str = "flash",
                         merge: str = "triton"):
    """``fork_attention`` for one query token over a fork of a cache in the model's dtype:
    the prefix by PyTorch's flash kernel (query heads folded into the query length), the
    fork's own rows by ``own`` ("flash" or "split"), merged by ``merge`` ("triton" or
    "torch"). Returns ``[1, 1, H, d]``; other cases go to the product's launcher."""
    pk, pv = prefix_of(key), prefix_of(value)
    _, H, q_len, D = query.shape
    if q_len != 1 or scale_of(key) is not None or pk is None or pk.shape[2] == 0:
        return PRODUCT(query, key, value, scaling, ctx)
    timer = ctx.timer if ctx is not None else None
    if timer is not None:
        with timer("attention"):
            return _one_token(query, (pk, pv), (key, value), scaling, own, merge)
    return _one_token(query, (pk, pv), (key, value), scaling, own, merge)


def _one_token(query, prefix, mine, scaling, own, merge):
    _, H, _, D = query.shape
    Hkv = prefix[0].shape[1]
    G = H // Hkv
    scale = scaling if scaling is not None else D ** -0.5
    q = query.reshape(1, Hkv, G, D)           # head kvh * G + g: the group's heads as rows
    if q.stride(-1) != 1:                     # the flash kernels read rows of d contiguous
        q = q.contiguous()
    o1, l1 = flash_partial(q, *prefix, scale)
    triton_ok = fa.available(query.device)
    if own == "split":
        if not triton_ok:
            raise RuntimeError("own='split' needs Triton (a GPU or TRITON_INTERPRET=1)")
        po, pl = split_partials(q, *mine, scale)
        return merge_flash(o1, l1, po, pl, 1.0, query.dtype)
    if own != "flash":
        raise ValueError(f"own is 'flash' or 'split', not {own!r}")
    o2, l2 = flash_partial(q, *mine, scale)
    if merge == "triton" and triton_ok:
        return merge_flash(o1, l1, o2, l2, LOG2E, query.dtype)   # o2 as one more slot
    if merge not in ("triton", "torch"):
        raise ValueError(f"merge is 'triton' or 'torch', not {merge!r}")
    out = fa.merge_partials(o1, l1.unsqueeze(-1), o2, l2.unsqueeze(-1))   # [1, Hkv, G, d]
    return out.reshape(1, 1, H, D).to(query.dtype)


VARIANTS = {
    "fork_flash": dict(own="flash", merge="triton"),
    "fork_flash_split": dict(own="split", merge="triton"),
    "fork_flash_torchmerge": dict(own="flash", merge="torch"),
}


def variant(name: str):
    """:func:`fork_attention_flash` with the options of ``VARIANTS[name]``, called as
    ``fork_attention`` is."""
    return functools.partial(fork_attention_flash, **VARIANTS[name])
