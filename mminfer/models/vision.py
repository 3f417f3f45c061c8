"""Qwen2.5-VL's vision tower at the speed of its matmuls.

transformers' tower runs every video as one sequence and, with ``sdpa``, splits its
attention into one SDPA call per window (a Python loop over ~16K windows per layer at 256K
tokens). The tower's attention never crosses a temporal pair of frames, though: window
layers attend inside ``window_size``-pixel squares of one pair, full layers inside one pair.
So a chunk of P pairs runs here as a batch:

* patch tokens of a pair are put, once, in an order where every window is a contiguous run
  and windows of the same shape are adjacent: the windows that fit whole first, then the
  right column cut by the frame edge, the bottom row, the corner (at most four shapes).
  Attention is order-free inside a window or a pair (each token carries its own rotary
  angles), so this order gives the same result as transformers' window order;
* a window layer is one SDPA call over ``[P * windows, heads, window, head_dim]`` per window
  shape: one call when the patch grid divides into windows (560x1008 px on the 7B), at most
  four on a ragged edge, never a mask (masks would take SDPA off its flash kernels and pad
  every window to the largest);
* a full layer is one SDPA call over ``[P, heads, h*w, head_dim]``;
* the merger runs in that order too (it merges 2x2 units, which stay together) and its
  output goes back to the processor's order with one gather.

The fused path (the default where no gradient is wanted) runs each block as four GEMMs, its
attention and three one-pass elementwise kernels (:mod:`mminfer.kernels.vision_elementwise`;
Triton on CUDA): the residual add and the next RMSNorm in one (the last block's with the
merger's norm), the SiLU gate reading the output of one gate/up GEMM. A window layer's
rotary and attention are one kernel reading the qkv GEMM's output
(:mod:`mminfer.kernels.window_attention`); a full layer rotates q and k in place there (q,
k, v stay views of it) and calls SDPA. ``benchmarks/vision.py --ops`` lists the ops: per
window block of a 22-pair chunk, 3 elementwise kernels and 2.6 GB of non-GEMM traffic plus
0.65 GB for attention, against 26 kernels and 8.3 GB before the fused path. The MLP width
(3420 on the 7B) is padded with zeros to a multiple of ``INTER_ALIGN``: rows of 3420 bf16
values are 6840 bytes, not a multiple of 16, which cuBLAS needs for its fastest (TMA,
16-byte vector) kernels on the three MLP GEMMs, two thirds of the tower's FLOPs; zero weight
rows and columns add exact zeros. The weights are transformers' own tensors except the
stacked, padded gate/up and down copies (0.85 GB on the 7B tower), rebuilt when a source
parameter changes.

With autograd on (training), ``fused=False``, or autocast, the blocks are transformers'
modules in the batched layout, two elementwise steps written out: the RMSNorm (its fp32
variance read straight from the bf16 input, the normalisation written once in the input
dtype) and the rotary embedding (fp32, two fused multiply-adds instead of ``rotate_half``'s
copies); with autograd on they fall back to the modules' own arithmetic. Every path computes
what transformers computes up to fp32 rounding: the fp32 CPU tests compare against
``get_video_features``.

FP8 blocks (``quantization="fp8"``: qkv, proj and the MLP as mminfer.models.fp8 layers) run
the fused path with FP8 GEMMs (gate/up stacked and padded as above, in e4m3): the residual add
+ RMSNorm and the SiLU gate are fp8's kernels that write their output quantised per token for
the GEMM that reads it (the attention output is quantised by its own pass before proj; the
last norm, the merger's, stays in the dtype). They are never compiled. The modules' path
(``fused=False``) quantises through the same kernels where a norm feeds an FP8 layer.

A caller streams a long video through in chunks of pairs (``pairs_per_chunk``), so the
tower's working memory is set by the chunk, not by the video.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

from mminfer.kernels import fp8_quant, window_attention
from mminfer.kernels.runtime import KERNELS, use_triton
from mminfer.kernels.vision_elementwise import add_rms_norm, rotary, silu_mul
from mminfer.models import fp8

# Patch tokens per tower call: enough rows to keep the matmuls at full rate, few enough that
# activations stay at a few GB on the 7B tower (its MLP is 3420 wide).
CHUNK_PATCHES = 1 << 16
# The fused MLP's width is padded to a multiple of this (rows of 16-byte multiples for
# cuBLAS, whole 128-wide tiles): 3420 -> 3456 on the 7B, 1 % more MLP FLOPs.
INTER_ALIGN = 128
# torch.compile of the fused block by default (Pipeline(vision_compile=None) reads it).
COMPILE_DEFAULT = False


@dataclass(frozen=True)
class WindowLayout:
    """Token order of one pair of an h x w patch grid (see the module docstring)."""
    perm: torch.Tensor          # [h*w] processor-order patch index at each tower position
    unit_inverse: torch.Tensor  # [h*w/u] tower position of each merged unit, processor order
    groups: tuple               # ((first token, windows, tokens per window), ...) by shape
    cos: torch.Tensor           # [h*w, 1, head_dim] fp32, tower order
    sin_lo: torch.Tensor        # [h*w, 1, head_dim/2] fp32: -sin of the first half
    sin_hi: torch.Tensor        # [h*w, 1, head_dim/2] fp32:  sin of the second half
    sin: torch.Tensor           # [h*w, 1, head_dim] fp32 (the autograd path)
    cos_half: torch.Tensor      # [h*w, head_dim/2] fp32 (the fused path; the halves are equal)
    sin_half: torch.Tensor      # [h*w, head_dim/2] fp32


@dataclass(frozen=True)
class _BlockWeights:
    """One block's tensors for the fused path: the modules' own, except gate/up (stacked,
    zero-padded to ``inter`` rows each) and down (zero-padded to ``inter`` columns)."""
    norm1: torch.Tensor
    eps1: float
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    proj_w: torch.Tensor
    proj_b: torch.Tensor | None
    norm2: torch.Tensor
    eps2: float
    gu_w: torch.Tensor          # [2 * inter, C]: gate rows, then up rows
    gu_b: torch.Tensor          # [2 * inter]
    down_w: torch.Tensor        # [C, inter]
    down_b: torch.Tensor | None
    inter: int
    scale: float


def window_units(hm: int, wm: int, ws: int):
    """Merged units of an ``hm x wm`` grid (row-major ids) grouped into ``ws x ws`` windows
    anchored at the top left, as transformers' ``get_window_index`` cuts them. Returns
    ``(order [hm*wm], groups)``: windows of one shape are adjacent in ``order``, each window
    row-major inside; ``groups`` lists ``(first unit, windows, units per window)``."""
    grid = torch.arange(hm * wm).view(hm, wm)
    fh, fw = hm // ws * ws, wm // ws * ws       # the part that whole windows cover
    parts = [
        rearrange(grid[:fh, :fw], "(nh a) (nw b) -> (nh nw) (a b)", a=ws, b=ws),
        rearrange(grid[:fh, fw:], "(nh a) b -> nh (a b)", a=ws),       # right edge
        rearrange(grid[fh:, :fw], "a (nw b) -> nw (a b)", b=ws),       # bottom edge
        rearrange(grid[fh:, fw:], "a b -> 1 (a b)"),                   # corner
    ]
    order, groups, at = [], [], 0
    for p in parts:
        if p.numel():
            order.append(p.reshape(-1))
            groups.append((at, p.shape[0], p.shape[1]))
            at += p.numel()
    return torch.cat(order), tuple(groups)


class QwenVisionTower:
    """Batched forward of a transformers ``Qwen2_5_VisionTransformerPretrainedModel``
    (``model.model.visual``) over equal-sized temporal pairs.

    ``fused`` (default): the block as three GEMMs of its own weights plus the fused gate/up
    GEMM (gate and up rows stacked, the intermediate width padded with zero rows/columns to a
    multiple of ``INTER_ALIGN``), the elementwise steps as the kernels of
    :mod:`mminfer.kernels.vision_elementwise` (``kernels``: "auto" is Triton on CUDA, torch ops
    elsewhere). ``fused=False``: transformers' modules block by block (what this tower did
    before; kept to measure against). ``compile``: the fused block (torch ops) through
    ``torch.compile(dynamic=False)``; a chunk shorter than ``pad_to`` pairs is then padded
    with zero pairs up to it so every chunk of a video has one shape (pairs never attend to
    each other: the padding changes nothing in the real pairs, and is sliced off)."""

    def __init__(self, visual, *, fused: bool = True, kernels: str = "auto",
                 compile: bool = False):
        self.visual = visual
        self.merge = int(visual.spatial_merge_size)
        self.unit = self.merge * self.merge
        self.window = int(visual.window_size) // self.merge // int(visual.patch_size)
        if self.window < 1:
            raise ValueError(f"window_size {visual.window_size} is under one merged unit")
        self.full = frozenset(int(i) for i in visual.fullatt_block_indexes)
        attn = visual.blocks[0].attn
        self.heads = int(attn.num_heads)
        self.head_dim = attn.qkv.in_features // self.heads
        if kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, not {kernels!r}")
        self.fused, self.kernels, self.compile = bool(fused), kernels, bool(compile)
        # pad a short chunk up to ``pad_to`` pairs: what keeps a compiled tower at one shape
        self.pad_chunks = self.compile
        self._layouts = {}
        self._weights = None        # (key of the source parameters, [_BlockWeights])
        self._compiled = None

    def pairs_per_chunk(self, h: int, w: int, chunk_patches: int = CHUNK_PATCHES) -> int:
        return max(1, chunk_patches // (h * w))

    # ------------------------------------------------------------------ layout
    def layout(self, h: int, w: int, device) -> WindowLayout:
        key = (h, w, str(device))
        if key not in self._layouts:
            self._layouts[key] = self._build_layout(h, w, torch.device(device))
        return self._layouts[key]

    def _build_layout(self, h: int, w: int, device) -> WindowLayout:
        m, u = self.merge, self.unit
        if h % m or w % m:
            raise ValueError(f"patch grid {h}x{w} is not a multiple of the merge size {m}")
        order, unit_groups = window_units(h // m, w // m, self.window)
        perm = (order[:, None] * u + torch.arange(u)).reshape(-1)
        groups = tuple((a * u, n, k * u) for a, n, k in unit_groups)
        # rotary angles of each patch (processor order: units row-major, 2x2 inside), the
        # table transformers builds from the same inverse frequencies
        hpos = rearrange(torch.arange(h)[:, None].expand(h, w), "(hu i) (wu j) -> (hu wu i j)",
                         i=m, j=m)
        wpos = rearrange(torch.arange(w)[None, :].expand(h, w), "(hu i) (wu j) -> (hu wu i j)",
                         i=m, j=m)
        inv = self.visual.rotary_pos_emb.inv_freq.detach().float().cpu()
        freqs = torch.cat([hpos[:, None].float() * inv, wpos[:, None].float() * inv], -1)
        emb = torch.cat([freqs, freqs], -1)[perm]                        # [h*w, head_dim]
        if emb.shape[-1] != self.head_dim:
            raise ValueError(f"rotary table of width {emb.shape[-1]} for head_dim "
                             f"{self.head_dim}")
        cos, sin = emb.cos(), emb.sin()
        half = self.head_dim // 2
        to = dict(device=device)
        return WindowLayout(
            perm=perm.to(**to), unit_inverse=torch.argsort(order).to(**to), groups=groups,
            cos=cos[:, None].to(**to), sin=sin[:, None].to(**to),
            sin_lo=(-sin[:, None, :half]).contiguous().to(**to),
            sin_hi=sin[:, None, half:].contiguous().to(**to),
            cos_half=cos[:, :half].contiguous().to(**to),
            sin_half=sin[:, :half].contiguous().to(**to))

    # ------------------------------------------------------------------ forward
    def __call__(self, pixels: torch.Tensor, n_pairs: int, h: int, w: int, *,
                 pad_to: int | None = None) -> torch.Tensor:
        """``pixels [n_pairs*h*w, C*T*p*p]`` in the processor's order (one chunk of pairs of
        an h x w patch grid) -> merged features ``[n_pairs*h*w/4, out_hidden]`` in the order
        ``get_video_features`` returns them. ``pad_to``: the caller's pairs per chunk, which
        a tower with ``pad_chunks`` (a compiled one) pads a shorter chunk to."""
        S = h * w
        if pixels.shape[0] != n_pairs * S:
            raise ValueError(f"{pixels.shape[0]} patch rows for {n_pairs} pairs of {h}x{w}")
        lay = self.layout(h, w, pixels.device)
        if not self._fused_applies(pixels):
            return self._forward_modules(pixels, n_pairs, S, lay)
        P = n_pairs
        if self.pad_chunks and pad_to is not None and pad_to > n_pairs:
            P = int(pad_to)
            pixels = torch.cat([pixels, pixels.new_zeros((P - n_pairs) * S, pixels.shape[1])])
        return self._forward_fused(pixels, P, S, lay)[:n_pairs * S // self.unit]

    def _fused_applies(self, pixels) -> bool:
        """The fused path computes what the modules compute where no gradient is wanted, no
        autocast changes dtypes mid-block, and the block is the SiLU-gated one it fuses."""
        if not self.fused or _autocast(pixels):
            return False
        vis = self.visual
        weight = vis.patch_embed.proj.weight
        if torch.is_grad_enabled() and (pixels.requires_grad or weight.requires_grad):
            return False
        if self._fp8() is None:          # some layers FP8, some not: the modules' path
            return False
        act = getattr(getattr(vis, "config", None), "hidden_act", "silu")
        same = vis.blocks[0].norm1.weight.dtype == weight.dtype  # norms round to x's dtype
        return act == "silu" and same and hasattr(vis.merger, "ln_q") and \
            hasattr(vis.merger, "mlp")

    def _forward_modules(self, pixels, n_pairs, S, lay, trace=None):
        vis = self.visual
        weight = vis.patch_embed.proj.weight               # Conv3d with stride = kernel
        if not _autocast(pixels):
            pixels = pixels.to(weight.dtype)
        x = F.linear(pixels, weight.reshape(weight.shape[0], -1))         # [P*S, C]
        x = x.view(n_pairs, S, -1)[:, lay.perm]                            # tower order
        for i, blk in enumerate(vis.blocks):
            x = self._block(blk, x, lay, full=i in self.full)
            if trace is not None:
                trace(i, x)
        merged = vis.merger(x.reshape(n_pairs * S, -1)).view(n_pairs, S // self.unit, -1)
        return merged[:, lay.unit_inverse].reshape(n_pairs * S // self.unit, -1)

    def _forward_fused(self, pixels, P, S, lay, trace=None):
        """``trace(i, x)``, if given, sees the residual stream after block i (tower order)."""
        vis = self.visual
        blocks = self.block_weights()
        weight = vis.patch_embed.proj.weight
        x = F.linear(pixels.to(weight.dtype), weight.reshape(weight.shape[0], -1))
        # the one permutation to tower order: every block, window or full, works in it
        x = x.view(P, S, -1)[:, lay.perm].reshape(P * S, -1)
        q8 = self.kernels if self._fp8() else None   # FP8 blocks: never compiled
        compiled = self.compile and q8 is None
        tk = not compiled and use_triton(x, self.kernels)
        step = self._compiled_block() if compiled else fused_block
        if q8 is not None:
            _, y = fp8_quant.rms_norm_quant(x, blocks[0].norm1, blocks[0].eps1, kernels=q8)
        else:
            _, y = add_rms_norm(x, None, blocks[0].norm1, blocks[0].eps1, triton_kernels=tk)
        ln = vis.merger.ln_q
        for i, b in enumerate(blocks):
            nxt = blocks[i + 1] if i + 1 < len(blocks) else None
            x, y = step(x, y, b.qkv_w, b.qkv_b, b.proj_w, b.proj_b, b.norm2, b.gu_w, b.gu_b,
                        b.down_w, b.down_b, nxt.norm1 if nxt else ln.weight,
                        lay.cos_half, lay.sin_half, P=P, S=S, heads=self.heads,
                        head_dim=self.head_dim,
                        groups=((0, 1, S),) if i in self.full else lay.groups,
                        scale=b.scale, eps2=b.eps2, next_eps=nxt.eps1 if nxt else _eps(ln),
                        inter=b.inter, triton_kernels=tk, fp8_kernels=q8,
                        quantise_next=nxt is not None)
            if trace is not None:
                trace(i, x)
        merged = vis.merger.mlp(y.view(P * S // self.unit, -1)).view(P, S // self.unit, -1)
        return merged[:, lay.unit_inverse].reshape(P * S // self.unit, -1)

    def _fp8(self) -> bool | None:
        """True when every vision block's qkv, proj and MLP layers are FP8 (the fused path
        then quantises in its norm and SiLU kernels), False when none is, None when mixed."""
        kinds = {isinstance(m, fp8.Fp8Linear) for blk in self.visual.blocks
                 for m in _linears(blk)}
        return None if len(kinds) > 1 else kinds == {True}

    def _compiled_block(self):
        if self._compiled is None:
            self._compiled = torch.compile(fused_block, dynamic=False, fullgraph=True)
        return self._compiled

    def block_weights(self) -> list:
        """The fused path's per-block tensors, rebuilt when a source parameter was replaced
        or changed in place (its storage or version counter moved)."""
        key = tuple(_identity(t) for blk in self.visual.blocks for t in _sources(blk))
        if self._weights is None or self._weights[0] != key:
            self._weights = None                 # free the old copies before making new ones
            with torch.no_grad():
                self._weights = (key, [self._block_weights(blk) for blk in self.visual.blocks])
        return self._weights[1]

    def _block_weights(self, blk) -> _BlockWeights:
        a, m = blk.attn, blk.mlp
        inter = m.gate_proj.out_features
        pad = -(-inter // INTER_ALIGN) * INTER_ALIGN
        if fp8.is_fp8(a.qkv):
            return self._fp8_block_weights(blk, inter, pad)
        W = m.gate_proj.weight
        gu_w = W.new_zeros(2 * pad, W.shape[1])
        gu_w[:inter] = W
        gu_w[pad:pad + inter] = m.up_proj.weight
        gu_b = W.new_zeros(2 * pad)
        if m.gate_proj.bias is not None:
            gu_b[:inter] = m.gate_proj.bias
        if m.up_proj.bias is not None:
            gu_b[pad:pad + inter] = m.up_proj.bias
        D = m.down_proj.weight
        down_w = D.new_zeros(D.shape[0], pad)
        down_w[:, :inter] = D
        return _BlockWeights(
            norm1=blk.norm1.weight, eps1=_eps(blk.norm1), qkv_w=a.qkv.weight, qkv_b=a.qkv.bias,
            proj_w=a.proj.weight, proj_b=a.proj.bias, norm2=blk.norm2.weight,
            eps2=_eps(blk.norm2), gu_w=gu_w, gu_b=gu_b, down_w=down_w,
            down_b=m.down_proj.bias, inter=pad, scale=float(a.scaling))

    def _fp8_block_weights(self, blk, inter: int, pad: int) -> _BlockWeights:
        """An FP8 block's: its qkv and proj layers as they are; gate and up stacked into one
        FP8 layer (e4m3 rows, their scales; zero rows and bias up to ``pad`` each), down with
        zero columns up to ``pad``. Biases live in the layers (the ``*_b`` fields are None)."""
        a, m = blk.attn, blk.mlp
        g, u, d = m.gate_proj, m.up_proj, m.down_proj
        C = g.in_features
        gu_w = torch.zeros(2 * pad, C, dtype=fp8_quant.FP8, device=g.weight.device)
        gu_w[:inter], gu_w[pad:pad + inter] = g.weight, u.weight
        gu_s = torch.ones(2 * pad, device=g.weight.device)
        gu_s[:inter], gu_s[pad:pad + inter] = g.weight_scale, u.weight_scale
        bias = g.bias if g.bias is not None else u.bias
        gu_b = None
        if bias is not None:
            gu_b = bias.new_zeros(2 * pad)
            if g.bias is not None:
                gu_b[:inter] = g.bias
            if u.bias is not None:
                gu_b[pad:pad + inter] = u.bias
        down_w = torch.zeros(d.out_features, pad, dtype=fp8_quant.FP8, device=d.weight.device)
        down_w[:, :inter] = d.weight
        return _BlockWeights(
            norm1=blk.norm1.weight, eps1=_eps(blk.norm1), qkv_w=a.qkv, qkv_b=None,
            proj_w=a.proj, proj_b=None, norm2=blk.norm2.weight, eps2=_eps(blk.norm2),
            gu_w=fp8.Fp8Linear(gu_w, gu_s, gu_b, kernels=self.kernels), gu_b=None,
            down_w=fp8.Fp8Linear(down_w, d.weight_scale, d.bias, kernels=self.kernels),
            down_b=None, inter=pad, scale=float(a.scaling))

    def _block(self, blk, x, lay: WindowLayout, *, full: bool):
        a = blk.attn
        P, S, C = x.shape
        if fp8.is_fp8(a.qkv):      # the norms quantise what the FP8 layers read
            qkv = a.qkv(fp8.normed(blk.norm1, x, a.qkv))
        else:
            qkv = a.qkv(_rms_norm(blk.norm1, x))
        qkv = qkv.view(P, S, 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(2)                                            # [P, S, H, d]
        q, k = _rotary(q, lay), _rotary(k, lay)
        groups = ((0, 1, S),) if full else lay.groups
        o = _attend(q, k, v, groups, a.scaling)
        x = x + a.proj(o.reshape(P, S, C))
        if fp8.is_fp8(blk.mlp.gate_proj):
            return x + fp8.mlp(blk.mlp, blk.norm2, x)
        return x + blk.mlp(_rms_norm(blk.norm2, x))


def fused_block(x, y, qkv_w, qkv_b, proj_w, proj_b, norm2, gu_w, gu_b, down_w, down_b,
                next_norm, cos, sin, *, P: int, S: int, heads: int, head_dim: int, groups,
                scale: float, eps2: float, next_eps: float, inter: int,
                triton_kernels: bool, fp8_kernels: str | None = None,
                quantise_next: bool = False):
    """One vision block on ``x [P*S, C]`` (the residual stream, tower order) given ``y``, its
    norm1; returns the new stream and its next norm (the next block's norm1, or the merger's
    ln_q after the last block). Tensors as arguments, shapes as ints: ``torch.compile`` makes
    one graph for all window blocks and one for all full ones.

    ``fp8_kernels`` (FP8 blocks: the ``*_w`` are mminfer.models.fp8 layers, ``y`` is
    quantised): the norms and the SiLU gate write their output quantised for the FP8 GEMMs
    that read it, the next norm too when ``quantise_next`` (not the merger's); the attention
    output is quantised by o's own pass in ``proj``."""
    tk = triton_kernels
    qkv = _linear(y, qkv_w, qkv_b)
    if tk and window_attention.applies(qkv, groups):
        # window layers: rotary and attention in one kernel reading the qkv GEMM's output
        o = window_attention.window_attention(qkv, cos, sin, groups, S, heads, head_dim,
                                              scale)
    else:
        q, k, v = rotary(qkv, cos, sin, S, heads, head_dim, triton_kernels=tk)  # [P,S,H,d]
        o = _attend(q, k, v, groups, scale).reshape(P * S, heads * head_dim)
    if fp8_kernels is None:
        x, y = add_rms_norm(x, F.linear(o, proj_w, proj_b), norm2, eps2, triton_kernels=tk)
        h = silu_mul(F.linear(y, gu_w, gu_b), inter, triton_kernels=tk)
        return add_rms_norm(x, F.linear(h, down_w, down_b), next_norm, next_eps,
                            triton_kernels=tk)
    x, y = fp8_quant.rms_norm_quant(x, norm2, eps2, proj_w(o), kernels=fp8_kernels)
    gu = gu_w(y)
    h = fp8_quant.silu_mul_quant(gu[:, :inter], gu[:, inter:], kernels=fp8_kernels)
    if quantise_next:
        return fp8_quant.rms_norm_quant(x, next_norm, next_eps, down_w(h), kernels=fp8_kernels)
    return add_rms_norm(x, down_w(h), next_norm, next_eps, triton_kernels=tk)


def _linear(x, w, b):
    """``F.linear``, or an FP8 layer (its bias inside) on a plain or quantised input."""
    return w(x) if isinstance(w, fp8.Fp8Linear) else F.linear(x, w, b)


def _linears(blk):
    a, m = blk.attn, blk.mlp
    return (a.qkv, a.proj, m.gate_proj, m.up_proj, m.down_proj)


def _autocast(x) -> bool:
    try:
        return torch.is_autocast_enabled(x.device.type)
    except RuntimeError:                 # a device kind without autocast (meta)
        return False


def _sources(blk):
    a, m = blk.attn, blk.mlp
    return (blk.norm1.weight, a.qkv.weight, a.qkv.bias, a.proj.weight, a.proj.bias,
            blk.norm2.weight, m.gate_proj.weight, m.gate_proj.bias, m.up_proj.weight,
            m.up_proj.bias, m.down_proj.weight, m.down_proj.bias)


def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _identity(t):
    """What changes when a tensor is replaced, moved or written in place."""
    if t is None:
        return None
    try:
        version = t._version
    except RuntimeError:                 # an inference tensor: no version counter
        version = -1
    return t.data_ptr(), version, t.dtype, t.device


def _attend(q, k, v, groups, scale):
    """Non-causal attention inside runs of tokens: ``groups`` lists (first token, runs,
    tokens per run); q/k/v ``[P, S, H, d]`` -> ``[P, S, H, d]``."""
    P, S, H, d = q.shape
    out = None if len(groups) == 1 else q.new_empty(P, S, H, d)
    for start, n, L in groups:
        part = [t[:, start:start + n * L].reshape(P * n, L, H, d).transpose(1, 2)
                for t in (q, k, v)]
        o = F.scaled_dot_product_attention(*part, scale=scale)             # [P*n, H, L, d]
        o = o.transpose(1, 2).reshape(P, n * L, H, d)
        if out is None:
            return o
        out[:, start:start + n * L] = o
    return out


def _rms_norm(norm, x):
    """transformers' Qwen2 RMSNorm (fp32 variance, normalised in fp32, cast to the input
    dtype, times the weight) without its fp32 copies of x, when no gradient is needed."""
    if torch.is_grad_enabled() and (x.requires_grad or norm.weight.requires_grad):
        return norm(x)
    eps = _eps(norm)
    ss = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    scale = torch.rsqrt(ss.square_().div_(x.shape[-1]).add_(eps))
    y = torch.empty_like(x)
    torch.mul(x, scale, out=y)                 # fp32 arithmetic, one rounding to x's dtype
    return y.mul_(norm.weight) if norm.weight.dtype == y.dtype else norm.weight * y


def _rotary(t, lay: WindowLayout):
    """``t * cos + rotate_half(t) * sin`` in fp32, back in t's dtype (transformers'
    ``apply_rotary_pos_emb_vision``)."""
    if torch.is_grad_enabled() and t.requires_grad:
        tf = t.float()
        half = tf.shape[-1] // 2
        rot = torch.cat((-tf[..., half:], tf[..., :half]), -1)
        return (tf * lay.cos + rot * lay.sin).to(t.dtype)
    half = t.shape[-1] // 2
    out = t * lay.cos                                        # fp32 (type promotion)
    out[..., :half].addcmul_(t[..., half:], lay.sin_lo)
    out[..., half:].addcmul_(t[..., :half], lay.sin_hi)
    return out.to(t.dtype)


# ---------------------------------------------------------------------- feeding a tower
def frame_chunks(frames, n: int):
    """Consecutive runs of ``n`` frames of an array or of a ``VideoStream`` (anything with
    ``chunks``); the last run may be shorter."""
    if hasattr(frames, "chunks"):
        yield from frames.chunks(n)
        return
    for s in range(0, len(frames), n):
        yield frames[s:s + n]


def to_device(x, device):
    """Host frames to ``device``; through pinned memory without blocking the host, so the
    copy queues behind the device's work on the previous chunk instead of waiting for it."""
    x = torch.as_tensor(x)
    device = torch.device(device)
    if device.type == "cuda" and x.device.type == "cpu":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


@functools.lru_cache(maxsize=64)
def device_constant(values: tuple, device: str) -> torch.Tensor:
    """A small constant (normalisation mean/std) made once per device: building it per chunk
    would copy from pageable memory and stall the host behind the device's queue."""
    return torch.tensor(values, dtype=torch.float32, device=device)
