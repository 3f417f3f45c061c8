"""lab/experiments/elementwise.py's FP8 candidates on the CPU interpreter, with the e4m3 grid
(the interpreter's own fp8 cast is wrong, so ``HW`` is only checked on the GPU by the sweep):
several rows a program give the product's kernels' bits (SiLU·up and the standalone
quantiser exactly; add + RMSNorm within a sum's rounding)."""

import pytest
import torch
import triton

from mminfer.kernels.runtime import interpreted
from mminfer.kernels import fp8_quant

pytestmark = pytest.mark.skipif(not interpreted(), reason="needs TRITON_INTERPRET=1")

N, C = 5, 48               # N not a multiple of the rows a program; C not a power of two


def _x(seed, n=N, c=C):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, c, generator=g) * torch.logspace(-2, 1, n)[:, None]).half()


@pytest.mark.parametrize("R", [1, 2, 4])
def test_silu_rows_candidate_matches_product(R):
    from lab.experiments.elementwise import _silu_mul_quant_rows_kernel
    gu = _x(0, c=2 * C)
    gate, up = gu[:, :C], gu[:, C:]
    want = fp8_quant.silu_mul_quant(gate, up, kernels="triton")
    q = torch.empty(N, C, dtype=fp8_quant.FP8)
    s = torch.empty(N, 1)
    _silu_mul_quant_rows_kernel[(triton.cdiv(N, R),)](
        gate, up, q, s, N, C, gate.stride(0), up.stride(0), q.stride(0), BLOCK_R=R,
        BLOCK_C=64, HW=0)
    assert torch.equal(s, want.scale.view(N, 1))
    assert torch.equal(q.view(torch.uint8), want.data.view(torch.uint8))


@pytest.mark.parametrize("R", [1, 2, 4])
def test_quant_rows_candidate_matches_product(R):
    from lab.experiments.elementwise import _quant_rows_kernel
    x = _x(1)
    x[2] = 0
    want = fp8_quant.quantize_rows(x, kernels="triton")
    q = torch.empty(N, C, dtype=fp8_quant.FP8)
    s = torch.empty(N, 1)
    _quant_rows_kernel[(triton.cdiv(N, R),)](x, q, s, N, C, x.stride(0), q.stride(0),
                                             BLOCK_R=R, BLOCK_C=64, HW=0)
    assert torch.equal(s, want.scale.view(N, 1))
    assert torch.equal(q.view(torch.uint8), want.data.view(torch.uint8))


@pytest.mark.parametrize("R", [1, 2])
def test_norm_rows_candidate_matches_reference(R):
    from lab.experiments.elementwise import _rms_norm_quant_rows_kernel
    x, d = _x(2), _x(3)
    w = torch.rand(C, generator=torch.Generator().manual_seed(4)).half()
    want_x, want_q, want_s = fp8_quant.rms_norm_quant_ref(x, w, 1e-6, d)
    xc = x.clone()
    q = torch.empty(N, C, dtype=fp8_quant.FP8)
    s = torch.empty(N, 1)
    _rms_norm_quant_rows_kernel[(triton.cdiv(N, R),)](
        xc, d, w, q, s, N, C, xc.stride(0), d.stride(0), q.stride(0), 1e-6, BLOCK_R=R,
        BLOCK_C=64, HW=0)
    assert torch.equal(xc, want_x)
    torch.testing.assert_close(s, want_s.view(N, 1).float(), rtol=2e-3, atol=0)
    off = (q.float() * s - want_q.float() * want_s.view(N, 1)).abs()
    assert float(off.max()) <= float(want_s.max()) * 32      # one e4m3 step at most
