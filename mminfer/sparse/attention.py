"""One layer's sparse prefill attention: estimate -> plan -> sparse kernel. Whether a request
is sparse at all is decided once, elsewhere (mminfer.models.hooks.choose_attention)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Sequence

import torch

from mminfer.kernels import sparse_attention
from mminfer.kernels.reference import plan_attention

from .estimate import estimate_layer
from .modality import ModalityIndex
from .patterns import HeadPattern


def layer_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    index: ModalityIndex | None, heads: Sequence[HeadPattern], *,
                    return_plan: bool = False,
                    scale: float | None = None, out: torch.Tensor | None = None,
                    block_m: int | None = None, block_n: int | None = None, timer=None,
                    proxy: str = "auto", engine: str = "kernel", spread_q: int = 0,
                    q_start: int = 0):
    """Causal attention of one layer's prefill.

    q ``[B, Hq, N - q_start, D]``, k/v ``[B, Hkv, N, D]`` (GQA by head index): the query rows
    are positions ``[q_start, N)`` of the N keys (``q_start`` > 0: a piece appended to a
    cached prompt, planned from the piece's own last queries against every key; ``index``
    is the whole prompt's). ``heads[h]`` is the
    pattern of query head h (global heads of this rank). ``out`` (any ``[B, Hq, Nq, D]``
    view, e.g. a transposed ``[B, Nq, Hq, D]`` buffer) receives the result. ``timer`` (a
    ``StageTimer``) books estimation + plan under "index" and the kernels under "attention";
    ``proxy`` picks the estimator's proxy (``estimate.PROXIES``) and ``spread_q`` the
    queries it reads besides the last ones (``estimate_layer``). ``engine`` runs the plan:
    "kernel" (the Triton kernels) or "reference" (``kernels.reference.plan_attention``: exact
    masked attention a chunk of rows at a time, no Triton, the cost of a dense pass; for
    measuring sparse answers on a CPU at long N). Returns ``out``, or
    ``(out, plan)`` with ``return_plan`` (``plan.density()``
    counts its work from the plan's arrays, no launch).
    """
    if index is None:
        raise ValueError("sparse attention needs the request's ModalityIndex")
    Hq, D = q.shape[1], q.shape[3]
    scale = D ** -0.5 if scale is None else scale
    stage = timer if timer is not None else (lambda name: nullcontext())

    if len(heads) != Hq:
        raise ValueError(f"{len(heads)} head patterns for {Hq} query heads")
    if engine not in ("kernel", "reference"):
        raise ValueError(f"engine {engine!r} is not one of kernel, reference")
    cuda = q.is_cuda
    block_m = block_m or (128 if cuda else 16)
    block_n = block_n or (64 if cuda else 16)
    with stage("index"):
        est = estimate_layer(q, k, index, heads, block_m=block_m, block_n=block_n, scale=scale,
                             proxy=proxy, spread_q=spread_q, q_start=q_start)
        plan = est.build_plan(q.device)
    with stage("attention"):
        if engine == "reference":
            out = plan_attention(q, k, v, plan, scale=scale, out=out)
        else:
            out = sparse_attention(q, k, v, plan, scale=scale, out=out)
    return (out, plan) if return_plan else out
