"""One layer's prefill attention: dense when short, else estimate -> plan -> sparse kernel."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import torch

from .modality import ModalityIndex
from .patterns import HeadPattern


def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    index: ModalityIndex | None, heads: Sequence[HeadPattern], *,
                    min_sparse_len: int = 8192, return_plan: bool = False,
                    scale: float | None = None, out: torch.Tensor | None = None,
                    block_m: int | None = None, block_n: int | None = None, timer=None,
                    proxy: str = "auto"):
    """Causal attention of one layer's prefill.

    q ``[B, Hq, N, D]``, k/v ``[B, Hkv, N, D]`` (GQA by head index). ``heads[h]`` is the
    pattern of query head h (global heads of this rank). ``out`` (any ``[B, Hq, N, D]``
    view, e.g. a transposed ``[B, N, Hq, D]`` buffer) receives the result. ``timer`` (a
    ``StageTimer``) books estimation + plan under "index" and the kernels under "attention";
    ``proxy`` picks the estimator's proxy (``estimate.PROXIES``). Returns ``out``, or
    ``(out, plan)`` with ``return_plan`` (plan None on the dense path; ``plan.density()``
    counts its work from the plan's arrays, no launch).
    """
    B, Hq, N, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    stage = timer if timer is not None else (lambda name: nullcontext())
    if index is None or N < min_sparse_len:
        with stage("attention"):
            res = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=Hq != k.shape[1])
            if out is None:
                out = res
            else:
                out.copy_(res)
        return (out, None) if return_plan else out

    from .estimate import estimate_layer
    from mminfer.kernels import sparse_attention

    if len(heads) != Hq:
        raise ValueError(f"{len(heads)} head patterns for {Hq} query heads")
    cuda = q.is_cuda
    block_m = block_m or (128 if cuda else 16)
    block_n = block_n or (64 if cuda else 16)
    with stage("index"):
        est = estimate_layer(q, k, index, heads, block_m=block_m, block_n=block_n, scale=scale,
                             proxy=proxy)
        plan = est.build_plan(q.device)
    with stage("attention"):
        out = sparse_attention(q, k, v, plan, scale=scale, out=out)
    return (out, plan) if return_plan else out
