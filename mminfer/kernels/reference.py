"""Pure-PyTorch references: exact masks from the pattern definitions and fp32 masked attention.

Nothing here shares code with the kernel: the masks are written from the definitions in
``plan.py``'s docstring, as dense ``[N, N]`` boolean algebra, so they can serve as the oracle.
"""

from __future__ import annotations

import torch


def masked_attention(q, k, v, mask, scale=None, dtype=torch.float32):
    """softmax(q kᵀ · scale + mask) v with GQA by head index, computed in ``dtype``.

    q ``[B, Hq, N, D]``, k/v ``[B, Hkv, N, D]``, mask ``[B, Hq, N, N]`` bool. Rows with no key
    give 0. Returns ``(out [B, Hq, N, D] in dtype, lse [B, Hq, N] fp32)``.
    """
    B, Hq, N, D = q.shape
    group = Hq // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    kh = k.to(dtype).repeat_interleave(group, dim=1)
    vh = v.to(dtype).repeat_interleave(group, dim=1)
    s = torch.matmul(q.to(dtype), kh.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)
    return torch.matmul(p, vh), lse


def _rows(plan):
    n = plan.n
    t = plan.table.cpu().to(torch.int64)
    r0 = torch.empty(n, dtype=torch.int64)
    r1 = torch.empty(n, dtype=torch.int64)
    grp = torch.empty(n, dtype=torch.int64)
    blk = torch.empty(n, dtype=torch.int64)
    for r, (a, b, g) in enumerate(t.tolist()):
        r0[a:b], r1[a:b], grp[a:b], blk[a:b] = a, b, g, r
    return r0, r1, grp, blk


def plan_masks(plan) -> torch.Tensor:
    n, B, H = plan.n, plan.batch, plan.num_heads
    if n > 8192:
        raise ValueError(f"masks are for small N (got {n}); use plan.density() at long N")
    r0, r1, grp, blk = _rows(plan)
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    causal = j <= i
    kgid = plan.key_groups.cpu()[:, None, :] if plan.key_groups is not None else None
    out = torch.zeros(B, H, n, n, dtype=torch.bool)
    for name, fl in plan.launches.items():
        prm = fl.params.cpu().to(torch.int64)
        for b in range(B):
            for s in range(prm.shape[1]):
                head, qg, kg, _, _, sink, window, start, end, stride, phase, lines = \
                    prm[b, s].tolist()
                rows_in = (grp == qg) if qg >= 0 else torch.ones(n, dtype=torch.bool)
                near = j >= (r0 - window).clamp(min=0)[:, None]
                extra_rows = torch.zeros(n, dtype=torch.bool)
                if name == "a_shape":
                    far = j < sink
                elif name == "grid":
                    jj = torch.arange(n)
                    on = (jj >= start) & (jj < end) & ((jj - start) % stride == phase)
                    far = (j < sink) | ((on[None, :]) if lines & 1 else torch.zeros_like(j, dtype=torch.bool))
                    if lines & 2:
                        extra_rows = on
                elif name == "vertical_slash":
                    vv = fl.vidx.cpu()[b, s].to(torch.int64)
                    isv = torch.zeros(n + 1, dtype=torch.bool)
                    isv[vv.clamp(max=n)] = True
                    offs = fl.sidx.cpu()[b, s].to(torch.int64)
                    offs = offs[offs < n]
                    # any offset o with r0(i) - j <= o <= r1(i) - 1 - j
                    cnt = torch.zeros(2 * n + 2, dtype=torch.int64)
                    cnt[offs + 1] += 1
                    cnt = cnt.cumsum(0)  # cnt[x] = #offsets < x
                    lo_o = (r0[:, None] - j).clamp(min=0, max=n)
                    hi_o = (r1[:, None] - 1 - j + 1).clamp(min=0, max=n)
                    slash = (cnt[hi_o] - cnt[lo_o]) > 0
                    far = isv[:n][None, :] | slash
                else:  # block
                    kb = fl.bidx.cpu()[b, s].to(torch.int64)  # [R, k]
                    n_kb = (n + plan.block_n - 1) // plan.block_n
                    chosen = torch.zeros(kb.shape[0], n_kb + 1, dtype=torch.bool)
                    chosen.scatter_(1, kb.clamp(max=n_kb), True)
                    far = chosen[blk[:, None], (j // plan.block_n).expand(n, n)]
                m = causal & (near | far | extra_rows[:, None]) & rows_in[:, None]
                if kg >= 0:
                    m &= kgid[b] == kg
                out[b, head] |= m
    return out
