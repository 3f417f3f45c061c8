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
