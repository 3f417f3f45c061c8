"""lab/experiments/window_attention.py's FP8 variants of the vision window kernel on the CPU
interpreter: the dropped one (o in e4m3 at the window's max|v| scale) within one e4m3 step of
the product's o, the candidate (quantised in the same program after a barrier) bit-equal to
the product's kernel followed by fp8.quantize_rows."""

import pytest
import torch

from mminfer.kernels.runtime import interpreted
from mminfer.models import fp8
from mminfer.models import window_attention as wa

pytestmark = pytest.mark.skipif(not interpreted(), reason="needs TRITON_INTERPRET=1")


def _case(S=64, heads=2, d=16, P=2):
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(P * S, 3 * heads * d, generator=g).to(torch.float16)
    ang = torch.arange(S).float()[:, None] * torch.rand(d // 2, generator=g)
    return qkv, ang.cos(), ang.sin(), ((0, 3, 16), (48, 1, 16)), S, heads, d


def test_requant_candidate_is_the_product_path_bit_for_bit():
    from lab.experiments.window_attention import window_attention_requant
    qkv, cos, sin, groups, S, heads, d = _case()
    want_o = wa.window_attention(qkv, cos, sin, groups, S, heads, d, 0.25)
    want_q = fp8.quantize_rows(want_o, kernels="triton")
    o, q = window_attention_requant(qkv, cos, sin, groups, S, heads, d, 0.25)
    assert torch.equal(o, want_o) and torch.equal(q.scale, want_q.scale)
    assert torch.equal(q.data.view(torch.uint8), want_q.data.view(torch.uint8))


def test_dropped_e4m3_variant_within_one_step():
    from lab.experiments.window_attention import window_attention_fp8
    qkv, cos, sin, groups, S, heads, d = _case()
    ref = wa.window_attention(qkv, cos, sin, groups, S, heads, d, 0.25).float()
    got = window_attention_fp8(qkv, cos, sin, groups, S, heads, d, 0.25)
    deq = got.data.float() * got.scale
    step = deq.abs().clamp(min=2 ** -6 * got.scale) * 2 ** -3 + 2 ** -9 * got.scale
    assert bool(((deq - ref).abs() <= step + 2e-3).all())
