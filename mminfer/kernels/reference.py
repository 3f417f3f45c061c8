"""Pure-PyTorch reference attention: softmax over an explicit boolean mask, in fp32 or any
dtype (the masks come from ``masks.py``, written from the specs)."""

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


def plan_attention(q, k, v, plan, scale=None, *, rows: int = 1024, out=None,
                   return_lse: bool = False):
    """What the sparse kernel computes for ``plan``, done by masked attention over the plan's
    exact mask ``rows`` query rows at a time: the CPU's engine (no Triton), at any N. The
    cost is a dense pass (every pair is scored, then masked); memory is one chunk's scores.

    q ``[B, Hq, Nq, D]`` (the rows from ``plan.q_start``), k/v ``[B, Hkv, N, D]``; fp32
    arithmetic, the result in q's dtype (into ``out``, any ``[B, Hq, Nq, D]`` view, when
    given). Rows with no key give 0."""
    B, Hq, N, D = q.shape
    q0 = plan.q_start
    if out is None:
        out = torch.empty_like(q)
    lse = torch.empty(B, Hq, N, dtype=torch.float32, device=q.device) if return_lse else None
    group = Hq // k.shape[1]
    scale = D ** -0.5 if scale is None else scale
    kh = vh = None
    for r0, m in plan.mask_rows(rows):
        r0 -= q0                # the chunk's first row in q
        r1 = r0 + m.shape[2]
        m = m.to(q.device)
        if return_lse:
            o, lse[:, :, r0:r1] = masked_attention(q[:, :, r0:r1], k, v, m, scale=scale)
        else:                   # SDPA with a boolean mask: the same sums, faster on a CPU
            if kh is None:
                kh = k.float().repeat_interleave(group, dim=1)
                vh = v.float().repeat_interleave(group, dim=1)
            o = torch.nn.functional.scaled_dot_product_attention(
                q[:, :, r0:r1].float(), kh, vh, attn_mask=m, scale=scale)
        out[:, :, r0:r1] = torch.nan_to_num(o, nan=0.0).to(out.dtype)
    return (out, lse) if return_lse else out
