"""Our attention inside transformers: registered through ``AttentionInterface`` for the
language model only. Prefill (q_len == kv_len) above the length threshold goes sparse;
decode and everything else stay dense (SDPA). Per-request state (the ModalityIndex, the
head patterns, the timer, per-layer densities) lives in a context variable, so concurrent
requests in one process never see each other's layout.
"""

from __future__ import annotations

import contextvars
from contextlib import contextmanager
from dataclasses import dataclass, field

# Never put "flash" in this name: transformers treats any such name as FlashAttention.
ATTN_NAME = "mminfer_sparse"

_current: contextvars.ContextVar = contextvars.ContextVar("mminfer_prefill", default=None)


@dataclass
class PrefillContext:
    index: object = None            # mminfer.sparse.modality.ModalityIndex of this request
    patterns: object = None         # mminfer.sparse.patterns.HeadPatternConfig (or None: dense)
    mode: str = "auto"              # "sparse" | "dense" | "auto"
    min_sparse_len: int = 8192      # "auto": shorter prefills go dense
    timer: object = None            # mminfer.engine.timing.StageTimer
    keep_plans: bool = False
    densities: dict = field(default_factory=dict)  # layer -> plan (density read lazily)
    capture: dict | None = None     # calibration: layer -> (q, k, v) of the prefill, on CPU
    cancel: object = None           # callable -> bool: checked before every layer's attention


@contextmanager
def prefill_context(ctx: PrefillContext):
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def current() -> PrefillContext | None:
    return _current.get()


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """transformers attention function: q ``[B, H, q_len, D]``, k/v ``[B, Hkv, kv_len, D]``
    (already rotated and in the cache); returns ``([B, q_len, H, D], None)``."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    ctx = _current.get()
    layer = getattr(module, "layer_idx", None)
    if ctx is not None and ctx.cancel is not None and ctx.cancel():
        from mminfer.errors import Cancelled
        raise Cancelled(f"request cancelled during the prefill (layer {layer})")
    q_len, kv_len = query.shape[2], key.shape[2]
    if ctx is not None and ctx.capture is not None and layer is not None and q_len == kv_len:
        ctx.capture[layer] = tuple(t.detach().to("cpu", copy=True) for t in (query, key, value))
    sparse = (ctx is not None and layer is not None and ctx.mode != "dense"
              and ctx.patterns is not None and ctx.index is not None and q_len == kv_len
              and attention_mask is None and (ctx.mode == "sparse" or q_len >= ctx.min_sparse_len))
    timer = ctx.timer if ctx is not None else None
    if not sparse:
        if timer is not None and layer is not None:
            with timer("attention"):
                return sdpa_attention_forward(module, query, key, value, attention_mask,
                                              scaling=scaling, dropout=dropout, **kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)

    from mminfer.sparse.attention import layer_attention

    B, H, N, D = query.shape
    out = torch.empty(B, N, H, D, dtype=query.dtype, device=query.device)
    # tensor parallel: this rank holds global heads tp_rank * H + h (engine/parallel.py)
    heads = ctx.patterns.heads_for_rank(layer, getattr(module, "tp_rank", 0), H)
    res = layer_attention(query, key, value, ctx.index, heads, min_sparse_len=0,
                          return_plan=ctx.keep_plans, scale=scaling, out=out.transpose(1, 2),
                          timer=timer)
    if ctx.keep_plans:
        ctx.densities[layer] = res[1]
    return out, None


def register() -> str:
    """Register our attention under ATTN_NAME (idempotent); returns the name."""
    from transformers import AttentionInterface
    AttentionInterface.register(ATTN_NAME, attention_forward)
    return ATTN_NAME
