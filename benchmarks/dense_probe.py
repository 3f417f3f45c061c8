"""Our dense prefill's cost per decoder layer, timed on the call a dense request makes.

A dense request (``Pipeline.answer(..., attention="dense")``) prefills the prompt's prefix
with ``mminfer.models.prefill.prefill`` into a fresh ``PrefixKV``. Every decoder layer but the
last runs ``_decoder_layer``: the norm and the q/k/v projections chunk by chunk, rotary into
head-major ``[1, H, N, d]`` buffers, K/V written into the slab cache and read back as its
views, then one attention call over all heads through the function registered for the model
(``mminfer.models.hooks.attention_forward``, dense: transformers' ``sdpa_attention_forward``,
torch SDPA with the GQA handling and the backend they choose), then ``o_proj`` and the MLP
chunk by chunk. The prefix's last layer writes its K/V and nothing else (``kv_only_last``),
so a dense prefix of L layers makes L - 1 attention calls.

:func:`probe_layers` runs that engine itself, ``prefill(..., layers=[i])``, on random hidden
states of the request's prefix length, into the request's cache type, headroom and storage
dtype, on the Pipeline's own modules (FP8 projections when it runs FP8), under a dense
``PrefillContext`` of the Pipeline's type whose ``StageTimer`` splits each layer into
attention and the rest as a request's timings do. One call at the same shape comes first and
is kept apart (a fused-attention library plans per shape on its first call; Triton kernels
compile), then calls timed with CUDA events; the figures are their medians.

:func:`record_sdpa` records every ``torch.nn.functional.scaled_dot_product_attention`` call
(its callers, tensors, arguments and the backend PyTorch picks for it): the probe reports the
backend of the call it timed, and the CPU test compares the probe's call with a dense
request's. :func:`cudnn_reference` times a standalone cuDNN SDPA call at the same shape.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

import torch

from mminfer.engine.timing import StageTimer
from mminfer.models.hooks import PrefillContext
from mminfer.models.kv import HEADROOM, PrefixKV
from mminfer.models.prefill import DEFAULT_CHUNK, prefill

WITHIN = 0.05           # the probe agrees with a measured dense run when within 5 %


def causal_flops(n: int, heads: int, d: int) -> float:
    """FLOPs of causal attention's forward over the triangle (two matmuls): the convention of
    ``mminfer.kernels.launch.dense_flops`` and kernels.py's cuDNN rows."""
    return 4.0 * heads * d * n * (n + 1) / 2


def tflops(n: int, heads: int, d: int, ms: float) -> float:
    return causal_flops(n, heads, d) / ms / 1e9


def spread_layers(n_layers: int, k: int) -> list[int]:
    """``k`` decoder layers spread over ``n_layers``, first and last included (4 of 28:
    0, 9, 18, 27)."""
    k = max(1, min(k, n_layers))
    if k == 1:
        return [0]
    return sorted({round(i * (n_layers - 1) / (k - 1)) for i in range(k)})


def timed_calls(picks: list[int], repeats: int) -> list[int]:
    """The layer of each timed call: every picked layer once, cycled up to ``repeats`` calls
    (one layer, 3 repeats: 0, 0, 0; four layers: each once)."""
    n = max(repeats, len(picks))
    return [picks[i % len(picks)] for i in range(n)]


def median(xs):
    xs = sorted(xs)
    return xs[(len(xs) - 1) // 2] if xs else None


def _elapsed_ms(fn, cuda: bool) -> float:
    if cuda:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e)
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def probe_layers(text_model, n_tokens: int, *, layers: int = 1, repeats: int = 3,
                 chunk: int | None = None, kv_dtype=None, headroom: int = HEADROOM,
                 context=PrefillContext, cache=None, seed: int = 0) -> dict:
    """Dense prefill of ``n_tokens`` through ``text_model``'s decoder layers, one layer per
    call, the product's engine and attention (see the module doc): ``layers`` layers spread
    over the model, each timed once (one layer: ``repeats`` times), after one untimed call at
    the same shape. ``kv_dtype`` / ``headroom`` / ``chunk`` / ``context``: what the request
    uses (``Adapter.kv_cache_dtype``, the suffix and answer rows, ``Adapter.prefill_chunk``,
    ``Pipeline.prefill_context``); ``cache``: a callable making the empty cache instead of
    the prefix's ``PrefixKV`` (``Adapter.generate`` prefills a ``DynamicCache``). Per-layer
    medians in ms: ``layer_ms`` (the whole call), ``attention_ms`` (the hook's attention
    section), ``rest_ms`` (projections, rotary, MLP, cache writes); ``attention_total_ms`` is
    the dense prefix's ``attention_calls`` x ``attention_ms``; ``first_call`` is the untimed
    call's figures."""
    p = next(text_model.parameters())
    dev, dt = p.device, p.dtype
    cuda = dev.type == "cuda"
    n_layers = len(text_model.layers)
    picks = spread_layers(n_layers, layers)
    hidden = text_model.config.hidden_size
    g = torch.Generator(device=dev).manual_seed(seed)
    h = torch.empty(1, n_tokens, hidden, device=dev, dtype=dt)

    def one(layer):
        timer = StageTimer(dev)
        ctx = context(mode="dense", timer=timer)
        h.normal_(generator=g)
        kv = PrefixKV.for_model(text_model, headroom, dtype=kv_dtype) if cache is None \
            else cache()
        ms = _elapsed_ms(lambda: prefill(text_model, h, kv, chunk=chunk or DEFAULT_CHUNK,
                                         ctx=ctx, layers=[layer]), cuda)
        attn = timer.totals_ms().get("attention", 0.0)
        if ctx.sparse:      # the decision the hook followed: never sparse here
            raise RuntimeError("the probe's prefill ran sparse")
        del kv
        return {"layer": layer, "layer_ms": round(ms, 3), "attention_ms": round(attn, 3),
                "rest_ms": round(ms - attn, 3)}

    sdpa = []
    with torch.inference_mode():
        with record_sdpa(sdpa):
            first = one(picks[0])
        calls = [one(i) for i in timed_calls(picks, repeats)]
    del h
    att = median([c["attention_ms"] for c in calls])
    attention_calls = n_layers - 1
    prefill_calls = [c for c in sdpa if c["q_len"] == c["kv_len"] == n_tokens]
    return {
        "tokens": n_tokens, "method": "product dense prefill, layer by layer",
        "layers": n_layers, "layers_timed": sorted(set(c["layer"] for c in calls)),
        "calls": calls, "first_call": first,
        "layer_ms": median([c["layer_ms"] for c in calls]), "attention_ms": att,
        "rest_ms": median([c["rest_ms"] for c in calls]),
        "attention_calls": attention_calls,
        "attention_total_ms": round(att * attention_calls, 3),
        "heads": text_model.config.num_attention_heads,
        "kv_heads": text_model.config.num_key_value_heads,
        "head_dim": getattr(text_model.layers[0].self_attn, "head_dim", None),
        "dtype": str(dt).replace("torch.", ""), "kv_dtype": None if kv_dtype is None
        else str(kv_dtype).replace("torch.", ""), "headroom": headroom,
        "sdpa": prefill_calls[0] if prefill_calls else None,
        "timing": "CUDA events" if cuda else "wall clock"}


def cudnn_reference(n_tokens: int, heads: int, kv_heads: int, d: int, *, device, dtype,
                    scale: float | None = None, repeats: int = 3) -> dict:
    """One standalone ``scaled_dot_product_attention`` call, causal, at the probe's shape,
    cuDNN's backend alone: GQA as cuDNN takes it (``enable_gqa``; where it refuses, K/V
    repeated to every query head, as kernels.py's cuDNN rows), warm, median of ``repeats``
    CUDA-event timed calls; its TFLOP/s over the causal triangle."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F
    if torch.device(device).type != "cuda":
        return {"skipped": "cuDNN SDPA runs on CUDA only"}
    g = torch.Generator(device=device).manual_seed(1)
    q = torch.randn(1, heads, n_tokens, d, device=device, dtype=dtype, generator=g)
    k = torch.randn(1, kv_heads, n_tokens, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, kv_heads, n_tokens, d, device=device, dtype=dtype, generator=g)
    gqa = "enable_gqa"

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                           enable_gqa=gqa == "enable_gqa")
    try:
        with torch.inference_mode():
            try:
                _elapsed_ms(call, True)                       # the shape's first call
            except RuntimeError:
                gqa = "K/V repeated"
                k = k.repeat_interleave(heads // kv_heads, 1)
                v = v.repeat_interleave(heads // kv_heads, 1)
                _elapsed_ms(call, True)
            times = [_elapsed_ms(call, True) for _ in range(repeats)]
    except Exception as e:      # no cuDNN attention in this build: a result too
        return {"error": f"{type(e).__name__}: {e}"[:500]}
    finally:
        q = k = v = None
        torch.cuda.empty_cache()
    ms = median(times)
    return {"tokens": n_tokens, "backend": "CUDNN_ATTENTION", "gqa": gqa, "ms": round(ms, 3),
            "calls_ms": [round(t, 3) for t in times],
            "tflops": round(tflops(n_tokens, heads, d, ms), 1)}


def versus_cudnn(probe: dict, ref: dict) -> dict | None:
    """Our dense prefill's attention (the probe's per-layer median) against cuDNN's
    standalone call at the same shape: TFLOP/s of each over the causal triangle, and ours /
    cuDNN's (>= 1 - WITHIN: at cuDNN speed)."""
    if not probe or "attention_ms" not in probe or not ref or "ms" not in ref:
        return None
    n, H, d = probe["tokens"], probe["heads"], probe["head_dim"]
    ours = tflops(n, H, d, probe["attention_ms"])
    ratio = ours / ref["tflops"]
    return {"tokens": n, "ours_ms": probe["attention_ms"], "ours_tflops": round(ours, 1),
            "ours_backend": (probe.get("sdpa") or {}).get("backend"),
            "cudnn_ms": ref["ms"], "cudnn_tflops": ref["tflops"], "cudnn_gqa": ref["gqa"],
            "ours_over_cudnn": round(ratio, 4), "at_cudnn_speed": ratio >= 1 - WITHIN}


# ---------------------------------------------------------------- what SDPA is called with
def _tensor(t):
    if t is None:
        return None
    return {"shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", ""),
            "stride": list(t.stride()), "contiguous": t.is_contiguous(),
            "device": t.device.type}


def _backend(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa):
    try:
        from torch.nn.attention import SDPBackend
        return SDPBackend(int(torch._fused_sdp_choice(
            q, k, v, mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa))).name
    except Exception as e:      # a private function: its signature may change
        return f"unknown ({type(e).__name__})"


_SPY_CODE = [None]     # the recorder's code object: its frames are not callers


def _enabled() -> list[str]:
    b = torch.backends.cuda
    flags = {"FLASH_ATTENTION": b.flash_sdp_enabled, "EFFICIENT_ATTENTION":
             b.mem_efficient_sdp_enabled, "MATH": b.math_sdp_enabled,
             "CUDNN_ATTENTION": getattr(b, "cudnn_sdp_enabled", lambda: False)}
    return [name for name, on in flags.items() if on()]


def _callers(frame, depth: int = 8) -> list[str]:
    """``module:function`` of the frames above SDPA, up to the prefill's own layer function
    (or ``depth`` frames): who made the call."""
    out = []
    while frame is not None and len(out) < depth:
        mod = frame.f_globals.get("__name__", "?")
        if frame.f_code is _SPY_CODE[0]:       # a recorder within a recorder
            frame = frame.f_back
            continue
        out.append(f"{mod}:{frame.f_code.co_name}")
        if frame.f_code.co_name in ("_decoder_layer", "_layer_kv"):
            break
        frame = frame.f_back
    return out


@contextmanager
def record_sdpa(calls: list | None = None):
    """Within the block, every ``torch.nn.functional.scaled_dot_product_attention`` call is
    appended to ``calls`` (yielded) as it is made: its callers, q/k/v (shape, dtype, strides),
    the mask, ``is_causal``, ``scale``, ``enable_gqa``, and the backend PyTorch picks for
    exactly these arguments under the backends enabled at that moment. The call itself runs
    unchanged."""
    import torch.nn.functional as F
    calls = [] if calls is None else calls
    real = F.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
            enable_gqa=False, **kw):
        # a bias object (a Tensor subclass such as causal_lower_right's) is no plain mask
        plain = attn_mask is None or type(attn_mask) in (torch.Tensor, torch.nn.Parameter)
        calls.append({
            "callers": _callers(sys._getframe(1)),
            "q": _tensor(query), "k": _tensor(key), "v": _tensor(value),
            "q_len": query.shape[-2], "kv_len": key.shape[-2],
            "attn_mask": _tensor(attn_mask) if plain else type(attn_mask).__name__,
            "dropout_p": dropout_p, "is_causal": bool(is_causal), "scale": scale,
            "enable_gqa": bool(enable_gqa), "enabled_backends": _enabled(),
            # a mask object (a causal bias) dispatches by itself: no choice to ask for
            "backend": _backend(query, key, value, attn_mask, dropout_p, is_causal, scale,
                                enable_gqa) if plain else "by the mask object"})
        if plain:
            return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kw)
        # a bias object dispatches through __torch_function__, which looks for the real
        # function under its public name
        F.scaled_dot_product_attention = real
        try:
            return real(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                        is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, **kw)
        finally:
            F.scaled_dot_product_attention = spy

    _SPY_CODE[0] = spy.__code__
    F.scaled_dot_product_attention = spy
    try:
        yield calls
    finally:
        F.scaled_dot_product_attention = real
