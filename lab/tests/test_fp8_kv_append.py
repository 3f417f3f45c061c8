"""lab/experiments/fp8_kv_append.py's one-launch append on the CPU interpreter: the same e4m3
values in the same rows as the cache's own quantize_into for K and V, nothing else written."""

import pytest
import torch

from mminfer.kernels.runtime import interpreted
from mminfer.models import kv

pytestmark = pytest.mark.skipif(not interpreted(), reason="needs TRITON_INTERPRET=1")


@pytest.mark.parametrize("n", [1, 23])
def test_fused_append_matches_quantize_into(n):
    from lab.experiments.fp8_kv_append import append_fp8
    g = torch.Generator().manual_seed(n)
    H, D, cap, at = 2, 32, 64, 5
    k = (torch.randn(1, H, n, D, generator=g) * 3).half()
    v = torch.randn(1, H, n, D, generator=g).half()
    ks, vs = kv.head_scales(k) * 0.5, kv.head_scales(v)      # K saturates at ±448 somewhere
    want_k, want_v = (torch.zeros(1, H, cap, D, dtype=kv.FP8) for _ in range(2))
    kv.quantize_into(want_k[..., at:at + n, :], k, ks)
    kv.quantize_into(want_v[..., at:at + n, :], v, vs)
    got_k, got_v = (torch.zeros(1, H, cap, D, dtype=kv.FP8) for _ in range(2))
    append_fp8(got_k, got_v, k, v, ks, vs, at)
    assert torch.equal(got_k.float(), want_k.float())
    assert torch.equal(got_v.float(), want_v.float())
