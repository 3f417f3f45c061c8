"""The FP8 GEMM (mminfer.kernels.fp8_gemm) against the dequantised arithmetic: fast
accumulation only for short reductions, a shape cuBLAS refuses, bf16 at the 7B's sizes."""

import pytest
import torch

from mminfer.kernels import fp8_gemm
from mminfer.kernels.fp8_quant import quantize_rows, quantize_weight

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_scaled_gemm_is_the_dequantised_arithmetic():
    """fp8_gemm (torch._scaled_mm where it runs) = the dequantised product, bias included,
    over a 3-D activation; e4m3 products are exact, so only fp32 summation order differs."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 5, 64, generator=g)
    w = torch.randn(48, 64, generator=g)
    b = torch.randn(48, generator=g)
    act = quantize_rows(x, kernels="torch")
    wq, ws = quantize_weight(w)
    got = fp8_gemm.fp8_gemm(act, wq, ws, b)
    want = fp8_gemm.scaled_mm_ref(act.data.reshape(-1, 64), act.scale.reshape(-1, 1), wq, ws,
                                  b, torch.float32).view(2, 5, 48)
    assert got.shape == (2, 5, 48) and torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_fast_accumulation_only_for_short_reductions(monkeypatch):
    """_scaled_mm runs with fast accumulation up to K = FAST_ACCUM_MAX_K (measured faster and
    as accurate there) and with fp32 promotion above it (slower and 2x the error at the LM's
    K = 18944); the product is the dequantised one either way."""
    seen, real = [], torch._scaled_mm

    def spy(*a, **kw):
        seen.append((a[0].shape[1], kw.get("use_fast_accum")))
        return real(*a, **kw)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    monkeypatch.setattr(fp8_gemm, "FAST_ACCUM_MAX_K", 64)
    g = torch.Generator().manual_seed(5)
    for K in (64, 80):
        act = quantize_rows(torch.randn(3, K, generator=g), kernels="torch")
        wq, ws = quantize_weight(torch.randn(32, K, generator=g))
        want = fp8_gemm.scaled_mm_ref(act.data, act.scale, wq, ws, None, torch.float32)
        assert torch.allclose(fp8_gemm.fp8_gemm(act, wq, ws), want, rtol=1e-5, atol=1e-5)
    assert seen == [(64, True), (80, False)]


def test_a_gemm_cublas_refuses_takes_the_dequantised_product(monkeypatch):
    """cuBLASLt refuses some shapes (on the H200: one row at N = K = 64) with
    CUBLAS_STATUS_NOT_SUPPORTED: that GEMM gets the dequantised product, the shape is
    remembered (no second try), and any other error still raises."""
    calls = []

    def refuse(*a, **kw):
        calls.append(a[0].shape)
        raise RuntimeError("CUDA error: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul")

    monkeypatch.setattr(fp8_gemm, "_UNSUPPORTED", set())
    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    g = torch.Generator().manual_seed(4)
    act = quantize_rows(torch.randn(1, 64, generator=g), kernels="torch")
    wq, ws = quantize_weight(torch.randn(64, 64, generator=g))
    want = fp8_gemm.scaled_mm_ref(act.data, act.scale, wq, ws, None, torch.float32)
    for _ in range(2):
        assert torch.equal(fp8_gemm.fp8_gemm(act, wq, ws), want)
    assert calls == [(1, 64)] and fp8_gemm._UNSUPPORTED == {(1, 64, 64)}

    def broken(*a, **kw):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "_scaled_mm", broken)
    other = quantize_rows(torch.randn(2, 64, generator=g), kernels="torch")
    with pytest.raises(RuntimeError, match="illegal memory"):
        fp8_gemm.fp8_gemm(other, wq, ws)


@needs_cuda
@pytest.mark.gpu
def test_bf16_gemm_at_7b_sizes_on_cuda():
    """The GEMM in bf16 at Qwen2-7B widths (the down projection's K = 18944: fp32
    promotion) against the dequantised product."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf, dev = torch.bfloat16, "cuda"
    N, C, I = 4096, 3584, 18944
    x = torch.randn(N, C, generator=g, device=dev).to(bf)
    wq, ws = quantize_weight(torch.randn(I, C, generator=g, device=dev).to(bf))
    act = quantize_rows(x)
    got = fp8_gemm.fp8_gemm(act, wq, ws)
    want = fp8_gemm.scaled_mm_ref(act.data, act.scale, wq, ws, None, torch.float32)
    assert got.dtype == bf
    assert float((got.float() - want).norm() / want.norm()) < 2 ** -7
