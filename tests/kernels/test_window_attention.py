"""The vision tower's window attention kernel (mminfer.kernels.window_attention): rotary and
non-causal attention per window in one pass, against the fp32 reference of transformers'
steps (CPU interpreter: fp32 and fp16; GPU: bf16 at the 7B's shapes, no further from fp32
than the rotary kernel + SDPA it replaces)."""

import pytest
import torch

from mminfer.kernels import vision_elementwise as vf
from mminfer.kernels.runtime import interpreted
from mminfer.kernels.window_attention import MAX_WINDOW, applies, window_attention
from mminfer.models.vision import window_units

needs_triton = pytest.mark.skipif(not (interpreted() or torch.cuda.is_available()),
                                  reason="Triton on the CPU needs TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(P, S, heads, d, dtype, seed=0, device=DEV):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(P * S, 3 * heads * d, generator=g).to(device, dtype)
    ang = torch.arange(S).float()[:, None] * torch.rand(d // 2, generator=g) * 3
    return qkv, ang.cos().to(device), ang.sin().to(device)


def reference(qkv, cos, sin, groups, S: int, heads: int, head_dim: int, scale: float):
    """The same in PyTorch fp32 from transformers' steps: rotate q and k
    (``t * cos + rotate_half(t) * sin`` in fp32, rounded to qkv's dtype), softmax attention
    per window in fp32. ``[P*S, heads*head_dim]`` in fp32."""
    P = qkv.shape[0] // S
    t = qkv.view(P, S, 3, heads, head_dim)
    emb_c = torch.cat([cos, cos], -1).view(1, S, 1, head_dim).float()
    emb_s = torch.cat([sin, sin], -1).view(1, S, 1, head_dim).float()

    def rot(u):
        f = u.float()
        half = head_dim // 2
        r = torch.cat((-f[..., half:], f[..., :half]), -1)
        return (f * emb_c + r * emb_s).to(u.dtype).float()

    q, k, v = rot(t[:, :, 0]), rot(t[:, :, 1]), t[:, :, 2].float()
    o = torch.zeros(P, S, heads, head_dim, device=qkv.device)
    for start, n, L in groups:
        sl = slice(start, start + n * L)
        qs, ks, vs = (x[:, sl].reshape(P * n, L, heads, head_dim).transpose(1, 2)
                      for x in (q, k, v))
        a = torch.softmax(qs @ ks.transpose(-1, -2) * scale, -1) @ vs
        o[:, sl] = a.transpose(1, 2).reshape(P, n * L, heads, head_dim)
    return o.reshape(P * S, heads * head_dim)


def _groups(hm, wm, ws):
    """Token groups of an hm x wm merged grid in windows of ws units (4 tokens a unit)."""
    _, unit_groups = window_units(hm, wm, ws)
    return tuple((a * 4, n, k * 4) for a, n, k in unit_groups)


@needs_triton
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float16, 2e-3)])
@pytest.mark.parametrize("hm,wm,ws,heads,d", [
    (5, 7, 2, 3, 20),      # ragged edges: four window shapes (16, 8, 8, 4 tokens)
    (4, 4, 2, 2, 16),      # windows that divide the grid
    (4, 4, 4, 2, 16),      # one window of MAX_WINDOW (64) tokens over the pair
])
def test_matches_reference(dtype, tol, hm, wm, ws, heads, d):
    S, P = hm * wm * 4, 2
    groups = _groups(hm, wm, ws)
    qkv, cos, sin = _case(P, S, heads, d, dtype, seed=hm * wm + d)
    got = window_attention(qkv, cos, sin, groups, S, heads, d, d ** -0.5)
    ref = reference(qkv, cos, sin, groups, S, heads, d, d ** -0.5)
    assert got.dtype == dtype and got.shape == (P * S, heads * d)
    err = float((got.float() - ref).abs().max())
    assert err < tol, err
    # the rotation matters here: the same attention of unrotated q and k is far off
    plain = reference(qkv, torch.ones_like(cos), torch.zeros_like(sin), groups, S, heads, d,
                      d ** -0.5)
    assert float((plain - ref).abs().max()) > 100 * tol


@needs_triton
def test_windows_do_not_see_each_other():
    """Changing one window's values changes that window's output rows only."""
    S, heads, d = 64, 2, 16
    groups = ((0, 4, 16),)
    qkv, cos, sin = _case(1, S, heads, d, torch.float32, seed=3)
    a = window_attention(qkv, cos, sin, groups, S, heads, d, 0.25)
    qkv[16:32] += 1.0
    b = window_attention(qkv, cos, sin, groups, S, heads, d, 0.25)
    changed = (a - b).abs().amax(-1) > 0
    assert changed[16:32].all() and not changed[:16].any() and not changed[32:].any()


def test_longer_windows_stay_on_rotary_and_sdpa():
    """A layer with a window over MAX_WINDOW tokens (the full layers' pairs) is not this
    kernel's: ``applies`` says no and a direct call is refused."""
    S = 5 * 7 * 4
    qkv, cos, sin = _case(1, S, 2, 16, torch.float32, device="cpu")
    assert applies(qkv, _groups(5, 7, 4)) and not applies(qkv, ((0, 1, S),))
    assert MAX_WINDOW == 64
    with pytest.raises(ValueError, match="up to 64"):
        window_attention(qkv, cos, sin, ((0, 1, S),), S, 2, 16, 0.25)


def test_rejects_bad_shapes():
    qkv, cos, sin = _case(1, 16, 2, 16, torch.float32, device="cpu")
    with pytest.raises(ValueError, match="contiguous rows"):
        window_attention(qkv, cos, sin, ((0, 1, 16),), 16, 3, 16, 0.25)
    with pytest.raises(ValueError, match="cos/sin"):
        window_attention(qkv, cos[:8], sin[:8], ((0, 1, 16),), 16, 2, 16, 0.25)
    with pytest.raises(ValueError, match="not inside a pair"):
        window_attention(qkv, cos, sin, ((8, 2, 8),), 16, 2, 16, 0.25)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hm,wm", [(20, 36), (23, 12)])     # 560x1008: windows divide; ragged
def test_bf16_7b_shapes_as_close_as_rotary_and_sdpa(hm, wm):
    """Qwen2.5-VL-7B's window layer (16 heads of 80, 4x4-unit windows) in bf16 on 3 pairs:
    the kernel is no further from the fp32 reference than the path it replaces (the rotary
    kernel in place, then SDPA per window shape)."""
    from mminfer.models.vision import _attend
    heads, d, S, P = 16, 80, hm * wm * 4, 3
    groups = _groups(hm, wm, 4)
    qkv, cos, sin = _case(P, S, heads, d, torch.bfloat16, seed=hm)
    ref = reference(qkv, cos, sin, groups, S, heads, d, d ** -0.5)
    got = window_attention(qkv, cos, sin, groups, S, heads, d, d ** -0.5)
    before = qkv.clone()
    q, k, v = vf.rotary(before, cos, sin, S, heads, d, triton_kernels=True)
    old = _attend(q, k, v, groups, d ** -0.5).reshape(P * S, heads * d)
    err, err_old = float((got.float() - ref).abs().max()), float((old.float() - ref).abs().max())
    print(f"{hm}x{wm}: kernel {err:.3e}, rotary+SDPA {err_old:.3e}")
    assert err <= 1.5 * err_old + 1e-3

