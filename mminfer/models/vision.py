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

The weights are transformers' own modules (patch embedding, qkv, proj, MLP, merger, the
norms' weights, the rotary frequencies). Two elementwise steps are written out instead of
calling the modules: the RMSNorm (its fp32 variance read straight from the bf16 input, the
normalisation written once in the input dtype) and the rotary embedding (fp32, two fused
multiply-adds instead of ``rotate_half``'s copies); with autograd on they fall back to the
modules' own arithmetic. Both compute what transformers computes up to fp32 rounding: the
fp32 CPU tests compare against ``get_video_features``.

A caller streams a long video through in chunks of pairs (``pairs_per_chunk``), so the
tower's working memory is set by the chunk, not by the video.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange

# Patch tokens per tower call: enough rows to keep the matmuls at full rate, few enough that
# activations stay at a few GB on the 7B tower (its MLP is 3420 wide).
CHUNK_PATCHES = 1 << 16


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
    (``model.model.visual``) over equal-sized temporal pairs."""

    def __init__(self, visual):
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
        self._layouts = {}

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
            sin_hi=sin[:, None, half:].contiguous().to(**to))

    # ------------------------------------------------------------------ forward
    def __call__(self, pixels: torch.Tensor, n_pairs: int, h: int, w: int) -> torch.Tensor:
        """``pixels [n_pairs*h*w, C*T*p*p]`` in the processor's order (one chunk of pairs of
        an h x w patch grid) -> merged features ``[n_pairs*h*w/4, out_hidden]`` in the order
        ``get_video_features`` returns them."""
        vis = self.visual
        S = h * w
        if pixels.shape[0] != n_pairs * S:
            raise ValueError(f"{pixels.shape[0]} patch rows for {n_pairs} pairs of {h}x{w}")
        lay = self.layout(h, w, pixels.device)
        weight = vis.patch_embed.proj.weight               # Conv3d with stride = kernel
        if not torch.is_autocast_enabled(pixels.device.type):
            pixels = pixels.to(weight.dtype)
        x = F.linear(pixels, weight.reshape(weight.shape[0], -1))         # [P*S, C]
        x = x.view(n_pairs, S, -1)[:, lay.perm]                            # tower order
        for i, blk in enumerate(vis.blocks):
            x = self._block(blk, x, lay, full=i in self.full)
        merged = vis.merger(x.reshape(n_pairs * S, -1)).view(n_pairs, S // self.unit, -1)
        return merged[:, lay.unit_inverse].reshape(n_pairs * S // self.unit, -1)

    def _block(self, blk, x, lay: WindowLayout, *, full: bool):
        a = blk.attn
        P, S, C = x.shape
        qkv = a.qkv(_rms_norm(blk.norm1, x)).view(P, S, 3, self.heads, self.head_dim)
        q, k, v = qkv.unbind(2)                                            # [P, S, H, d]
        q, k = _rotary(q, lay), _rotary(k, lay)
        groups = ((0, 1, S),) if full else lay.groups
        o = _attend(q, k, v, groups, a.scaling)
        x = x + a.proj(o.reshape(P, S, C))
        return x + blk.mlp(_rms_norm(blk.norm2, x))


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
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6))
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
