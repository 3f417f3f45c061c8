"""The prefill: the language model's own decoder layers run one at a time over the whole prompt,
token-wise work chunked, writing the KV cache that decode then reads.

One call of transformers' text model over N tokens materialises every intermediate at full
length: the normed input, the rotary temporaries of q and k, the MLP's three
``[N, intermediate]`` activations (at 1M tokens and Qwen2-7B's 18944 that is ≈ 38 GB each in
bf16). Here only what attention itself needs exists at length N — the residual stream, q, the
attention output, and k/v in the cache — and everything applied token by token (norms,
q/k/v/o projections, rotary, MLP) runs over ``chunk`` tokens at a time, so the rest of the
activation memory is set by the chunk, not by N.

Nothing is re-implemented: the modules are the model's (``input_layernorm``, ``self_attn``'s
projections, ``post_attention_layernorm``, ``mlp``, ``norm``, ``rotary_emb``) and so are
``apply_rotary_pos_emb`` and the attention function registered under the model's
``_attn_implementation`` (our hook in mminfer.models.hooks: sparse or dense by the request's
decision). With FP8 projections (mminfer.models.fp8) the norms and the SiLU gate before them
run as our kernels that also quantise their output per token, so no separate quantisation
pass reads the activation again. k/v go through ``cache.update`` once per layer, so the cache
holds the only copy and decode steps use it as after a one-shot prefill. Logits are computed
for the last position only. An FP8 cache (``--kv-cache-dtype fp8``, models/kv.py) stores a
quantised copy: each layer's attention then runs on the layer's own K/V (computed in the model
dtype, dropped after it), so the prefill's attention is the same as with a bf16 cache and only
one layer's K/V ever exist outside the cache.

The last decoder layer runs its attention and MLP for the last position alone: its other rows
feed nothing but logits nobody reads, while the K/V that decode needs from it come from its
input, which the layers before computed in full. That is exact (the same last row, the same
cache) and saves one layer in L of the prefill's attention and MLP (a quarter of the embedded
model's four layers, 1/28 of Qwen2-7B's). Calibration's capture keeps every row
(``PrefillContext.every_row``; the lab overrides it to measure what this saves).

It lives in models/ (not engine/) because ``Adapter.generate`` runs it and a model layer may not
import the engine; it needs nothing above the transformers modules and our hook.
"""

from __future__ import annotations

import sys
from contextlib import nullcontext

import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from mminfer.errors import Cancelled
from mminfer.kernels import rope
from mminfer.models import fp8, hooks

# Tokens per chunk of the token-wise work: ≥ 16K rows keeps every GEMM at full speed on an H200
# while the MLP's temporaries stay ≈ 1.8 GB at 7B sizes (bf16), against ≈ 57 GB of KV cache at 1M.
DEFAULT_CHUNK = 16384


def prefill(text_model, embeds: torch.Tensor, cache=None, position_ids=None, *,
            chunk: int = DEFAULT_CHUNK, ctx=None, lm_head=None, layers=None,
            kv_only_last: bool = False, append: bool = False) -> torch.Tensor | None:
    """Prefill the prompt ``embeds`` ``[1, N, hidden]`` through ``text_model`` (a transformers
    Qwen2 / Qwen2.5-VL text model) into ``cache`` (an empty ``DynamicCache``; None keeps no
    K/V, for benchmarks of the prefill alone).

    ``embeds`` becomes the residual stream and is overwritten. ``position_ids``: what the
    model's forward takes (``[3, 1, N]`` M-RoPE, ``[1, N]``; None: 0..N-1). ``ctx``
    (hooks.PrefillContext) is active during the prefill: its dense/sparse decision is made here,
    once, and its ``cancel`` is checked before every layer. ``layers``: indices of the decoder
    layers to run (default all; benchmarks warm up on a few). Returns the final-normed hidden
    state of the last position ``[1, 1, hidden]``, or its logits with ``lm_head``.
    ``kv_only_last``: a prefix that questions continue (the video cache) needs no output at
    all: its last decoder layer writes its K/V and computes nothing else; returns None.

    ``append``: the rows continue what ``cache`` holds (a live stream's next piece of video,
    mminfer.engine.streams): their K/V are written after the cached rows and each row attends
    to every cached key and causally among the new rows (the hook's continuation path: queries
    at an offset into a longer key range). ``position_ids`` are then those of the new rows
    (None: 1-D positions continuing the cache's length). Over an FP8 cache the new rows attend
    through the cache's quantised keys (the one copy of the earlier rows).
    """
    if embeds.ndim != 3 or embeds.shape[0] != 1:
        raise ValueError(f"prefill takes one prompt [1, N, hidden], got {tuple(embeds.shape)}")
    offset = cache.get_seq_length() if cache is not None else 0
    if append and cache is None:
        raise ValueError("append prefills rows after a cache's: pass the cache")
    if offset and not append:
        raise ValueError("prefill writes a fresh cache; this one already holds "
                         f"{offset} tokens (append=True continues it)")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, not {chunk}")
    n = embeds.shape[1]
    h = embeds
    spans = [(s, min(s + chunk, n)) for s in range(0, n, chunk)]
    todo = text_model.layers if layers is None else [text_model.layers[i] for i in layers]
    with torch.inference_mode(), \
            (hooks.prefill_context(ctx) if ctx is not None else nullcontext()):
        cos_sin = _rotary(text_model, h,
                          _position_ids(text_model, position_ids, n, h.device, offset), spans)
        if ctx is not None:
            ctx.decide(n)
        # only a run of every layer ends in the rows nobody reads; a captured layer is needed whole
        last_only = layers is None and not (
            ctx is not None and ctx.every_row())
        last = None
        for i, layer in enumerate(todo):
            _check_cancel(ctx, layer.self_attn.layer_idx)
            if kv_only_last and last_only and i == len(todo) - 1:
                _layer_kv(layer, h, cos_sin, spans, cache)
                if ctx is not None:       # no plan: reported as the layer that made none
                    ctx.last_row_only = layer.self_attn.layer_idx
                return None
            if last_only and i == len(todo) - 1:
                last = _decoder_layer(layer, h, cos_sin, spans, cache, last_only=True,
                                      append=bool(offset))
                if ctx is not None:
                    ctx.last_row_only = layer.self_attn.layer_idx
            else:
                _decoder_layer(layer, h, cos_sin, spans, cache, append=bool(offset))
        last = text_model.norm(h[:, -1:] if last is None else last)
        return lm_head(last) if lm_head is not None else last


def _decoder_layer(layer, h, cos_sin, spans, cache, last_only=False, append=False):
    """``layer`` (a transformers decoder layer) on the residual stream ``h``, in place:
    h += attn(input_layernorm(h)); h += mlp(post_attention_layernorm(h)).

    ``append``: ``cache`` held rows before these: the queries attend to all of its keys.

    ``last_only``: k/v of every row (into the cache), but queries, attention and MLP for the
    last row alone, returned as ``[1, 1, hidden]``; ``h`` is left as it was."""
    attn = layer.self_attn
    if getattr(attn, "sliding_window", None) is not None:   # would need its mask
        raise NotImplementedError("sliding-window attention layers are not supported")
    n = h.shape[1]
    d = attn.head_dim
    apply_rope = _module_of(attn).apply_rotary_pos_emb
    q = k = v = None
    for (s, e), (cos, sin) in zip(spans, cos_sin):
        # FP8 projections: the norm's kernel writes the quantised rows they read
        x = fp8.normed(layer.input_layernorm, h[:, s:e], attn.q_proj, attn.k_proj, attn.v_proj)
        kp, vp = attn.k_proj(x), attn.v_proj(x)                            # [1, c, Hkv*d]
        if k is None:
            k = kp.new_empty(1, kp.shape[-1] // d, n, d)
            v = vp.new_empty(1, vp.shape[-1] // d, n, d)
        _rope_rows(apply_rope, kp, k, s, cos, sin)
        v[:, :, s:e] = vp.view(1, e - s, -1, d).transpose(1, 2)
        del kp, vp
        if not last_only:
            qp = attn.q_proj(x)                                            # [1, c, H*d]
            if q is None:
                q = qp.new_empty(1, qp.shape[-1] // d, n, d)
            _rope_rows(apply_rope, qp, q, s, cos, sin)
            del qp
        elif e == n:   # rotary is elementwise per row: the last query can be rotated alone
            q = attn.q_proj(x[:, -1:]).view(1, 1, -1, d).transpose(1, 2)
            q, _ = apply_rope(q, q, cos[:, -1:], sin[:, -1:])
        del x
    if cache is not None:
        kc, vc = cache.update(k, v, attn.layer_idx)
        # the cache's copy becomes the only one: ours is dropped here. An FP8 cache
        # (models/kv.py) holds a quantised copy: this layer attends with its own K/V, the
        # one layer's worth that exists besides the cache, dropped after its attention
        # appended rows read the earlier rows from the cache, whatever it stores
        if kc.dtype == k.dtype or append:
            k, v = kc, vc
        del kc, vc
    # last_only: one query against every key is the causal prefill's last row, with no mask
    out, _ = _attention_function(attn)(attn, q, k, v, None, dropout=0.0, scaling=attn.scaling,
                                       sliding_window=None)
    del q, k, v
    if last_only:
        last = h[:, -1:] + attn.o_proj(out.reshape(1, 1, -1))
        return last + fp8.mlp(layer.mlp, layer.post_attention_layernorm, last)
    out = out.reshape(1, n, -1)                                            # [1, N, H*d]
    for s, e in spans:
        h[:, s:e] += attn.o_proj(out[:, s:e])
    del out
    for s, e in spans:
        part = h[:, s:e]
        part += fp8.mlp(layer.mlp, layer.post_attention_layernorm, part)


def _layer_kv(layer, h, cos_sin, spans, cache):
    """Only the K/V that ``layer`` writes into ``cache`` for the rows of ``h``."""
    attn = layer.self_attn
    d = attn.head_dim
    apply_rope = _module_of(attn).apply_rotary_pos_emb
    n = h.shape[1]
    k = v = None
    for (s, e), (cos, sin) in zip(spans, cos_sin):
        x = fp8.normed(layer.input_layernorm, h[:, s:e], attn.k_proj, attn.v_proj)
        kp, vp = attn.k_proj(x), attn.v_proj(x)
        if k is None:
            k = kp.new_empty(1, kp.shape[-1] // d, n, d)
            v = vp.new_empty(1, vp.shape[-1] // d, n, d)
        _rope_rows(apply_rope, kp, k, s, cos, sin)
        v[:, :, s:e] = vp.view(1, e - s, -1, d).transpose(1, 2)
        del x, kp, vp
    cache.update(k, v, attn.layer_idx)


def _rope_rows(apply_rope, proj, buf, s, cos, sin):
    """``buf[0, :, s:s+c]`` (head-major ``[1, H, N, d]``) = the rotated heads of ``proj``
    ``[1, c, H*d]`` (a projection's output): one kernel (mminfer.kernels.rope) where the model's
    RoPE is transformers' standard one, else the model's own function and a copy."""
    c, d = proj.shape[1], buf.shape[-1]
    if rope.standard(apply_rope) and cos.dim() == 3 and cos.shape[0] == 1:
        rope.rotate_into(buf[0, :, s:s + c], proj[0], cos[0], sin[0])
        return
    t = proj.view(1, c, -1, d).transpose(1, 2)
    t, _ = apply_rope(t, t, cos, sin)
    buf[:, :, s:s + c] = t


def _position_ids(text_model, position_ids, n, device, offset=0):
    """The positions the model's forward would use, in the shape its rotary embedding takes:
    ``[3, 1, N]`` for M-RoPE (a 2-D input broadcast to the three axes; transformers' packed
    4-row form drops its text row), ``[1, N]`` otherwise. None: ``offset .. offset+N-1``."""
    if position_ids is None:
        position_ids = torch.arange(offset, offset + n, device=device)[None]
    mrope = hasattr(text_model.rotary_emb, "mrope_section")
    if mrope and position_ids.ndim == 2:
        position_ids = position_ids[None].expand(3, *position_ids.shape)
    elif mrope and position_ids.ndim == 3 and position_ids.shape[0] == 4:
        position_ids = position_ids[1:]
    if position_ids.shape[-1] != n:
        raise ValueError(f"{position_ids.shape[-1]} positions for {n} tokens")
    return position_ids.to(device)


def _rotary(text_model, h, position_ids, spans):
    """(cos, sin) of every chunk from the model's rotary embedding: elementwise per position,
    so chunked equals whole and no fp32 temporaries of length N exist. Dynamic and long RoPE
    rescale their frequencies from the largest position they are shown, so they see all."""
    rotary = text_model.rotary_emb
    kind = str(getattr(rotary, "rope_type", "default"))
    if "dynamic" in kind or kind == "longrope":
        cos, sin = rotary(h, position_ids)
        return [(cos[:, s:e], sin[:, s:e]) for s, e in spans]
    return [rotary(h[:, s:e], position_ids[..., s:e]) for s, e in spans]


def _attention_function(attn):
    """The function the attention module itself would call for its config."""
    impl = attn.config._attn_implementation
    return ALL_ATTENTION_FUNCTIONS.get_interface(impl, _module_of(attn).eager_attention_forward)


def _module_of(module):
    return sys.modules[type(module).__module__]


def _check_cancel(ctx, layer):
    if ctx is not None and ctx.cancel is not None and ctx.cancel():
        raise Cancelled(f"request cancelled during the prefill (layer {layer})")
