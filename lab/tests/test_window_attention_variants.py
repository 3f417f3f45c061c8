"""lab/experiments/window_attention.py's candidate for the FP8 vision tower on the CPU
interpreter: the window kernel quantising its o rows in the same program after a barrier is
bit-equal to the product's kernel followed by fp8.quantize_rows."""

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

