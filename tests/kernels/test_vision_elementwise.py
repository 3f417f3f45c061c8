"""The vision block's elementwise kernels (mminfer.kernels.vision_elementwise) against their
torch versions: the residual add and RMSNorm, the 2-D rotary in place, the SiLU gate; fp32 on
the CPU interpreter, bf16 on the GPU."""

import pytest
import torch

from mminfer.kernels import vision_elementwise as vf
from mminfer.kernels.runtime import interpreted

needs_interpreter = pytest.mark.skipif(not interpreted(),
                                       reason="Triton on the CPU needs TRITON_INTERPRET=1")


@needs_interpreter
def test_kernels_equal_their_torch_versions_fp32():
    """Each Triton kernel (interpreter, fp32) against its torch version: the add written into
    x, the norm; q and k rotated by their token's position i % S, v untouched; the gate."""
    g = torch.Generator().manual_seed(0)
    x, d, w = (torch.randn(s, generator=g) for s in ((13, 40), (13, 40), (40,)))
    xt = x.clone()
    _, y = vf.add_rms_norm(xt, d, w, 1e-6, triton_kernels=True)
    xr, yr = vf.add_rms_norm(x, d, w, 1e-6, triton_kernels=False)
    assert torch.equal(xt, xr) and torch.allclose(y, yr, atol=1e-6, rtol=1e-6)
    _, y0 = vf.add_rms_norm(x.clone(), None, w, 1e-6, triton_kernels=True)
    assert torch.allclose(y0, vf.add_rms_norm(x, None, w, 1e-6, triton_kernels=False)[1],
                          atol=1e-6, rtol=1e-6)
    S, H, D = 6, 3, 16                                  # 4 pairs of 6 tokens, 3 heads of 16
    qkv = torch.randn(4 * S, 3 * H * D, generator=g)
    cos, sin = torch.randn(S, D // 2, generator=g), torch.randn(S, D // 2, generator=g)
    buf = qkv.clone()
    got = vf.rotary(buf, cos, sin, S, H, D, triton_kernels=True)
    want = vf.rotary(qkv.clone(), cos, sin, S, H, D, triton_kernels=False)
    for a, b in zip(got, want):
        assert a.shape == (4, S, H, D) and torch.allclose(a, b, atol=1e-6, rtol=1e-6)
    assert all(t._base is buf for t in got)                               # in place
    assert torch.equal(buf[:, 2 * H * D:], qkv[:, 2 * H * D:])            # v untouched
    q = qkv.view(4, S, 3, H, D)[:, :, 0]                                   # by hand: q
    lo, hi = q[..., :D // 2], q[..., D // 2:]
    c, s = cos[None, :, None], sin[None, :, None]
    by_hand = torch.cat([lo * c - hi * s, hi * c + lo * s], -1)
    assert torch.allclose(got[0], by_hand, atol=1e-6)
    gu = torch.randn(7, 2 * 48, generator=g)
    assert torch.allclose(vf.silu_mul(gu, 48, triton_kernels=True),
                          torch.nn.functional.silu(gu[:, :48]) * gu[:, 48:], atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_kernels_round_where_torch_rounds():
    """The compiled Triton kernels in bf16 against the torch ops they replace (which round
    where transformers rounds): the residual add bit-exact, the norm, rotary and gate within
    two bf16 steps (exp/rsqrt approximations and FMA contraction may flip a rounding, the
    norm rounds twice)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    N, C = 4096, 1280
    x, d = (torch.randn(N, C, generator=g, device="cuda").to(bf) for _ in range(2))
    w = torch.randn(C, generator=g, device="cuda").to(bf)
    xt = x.clone()
    _, y = vf.add_rms_norm(xt, d, w, 1e-6, triton_kernels=True)
    xr, yr = vf.add_rms_norm(x, d, w, 1e-6, triton_kernels=False)
    assert torch.equal(xt, xr)
    close = lambda a, b: bool(((a.float() - b.float()).abs()                 # noqa: E731
                               <= 2 ** -6 * b.float().abs() + 1e-6).all())
    assert close(y, yr)
    S, H, D = 2880, 16, 80
    qkv = torch.randn(2 * S, 3 * H * D, generator=g, device="cuda").to(bf)
    cos = torch.rand(S, D // 2, generator=g, device="cuda") * 2 - 1
    sin = torch.rand(S, D // 2, generator=g, device="cuda") * 2 - 1
    buf = qkv.clone()
    got = vf.rotary(buf, cos, sin, S, H, D, triton_kernels=True)
    want = vf.rotary(qkv.clone(), cos, sin, S, H, D, triton_kernels=False)
    assert close(got[0], want[0]) and close(got[1], want[1])
    assert torch.equal(buf[:, 2 * H * D:], qkv[:, 2 * H * D:])
    gu = torch.randn(N, 2 * 3456, generator=g, device="cuda").to(bf)
    assert close(vf.silu_mul(gu, 3456, triton_kernels=True),
                 vf.silu_mul(gu, 3456, triton_kernels=False))
