"""The FP8 GEMM: ``y = (xq · Wqᵀ) * s_x * s_wᵀ + b`` for an activation quantised per row
(:class:`~.fp8_quant.Fp8Act`) and an e4m3 weight with one fp32 scale per output channel.
``torch._scaled_mm`` with row-wise scales (``scale_a [M, 1]``, ``scale_b [1, N]``), fp32
accumulation, the activation's dtype out; the same arithmetic by dequantising where cuBLAS
does not take the shapes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8_quant import FP8, Fp8Act

# torch._scaled_mm on CUDA needs both GEMM widths (in, out) to be multiples of 16.
ALIGN = 16
# (rows, N, K) that cuBLASLt refused with CUBLAS_STATUS_NOT_SUPPORTED: seen on the H200
# (torch 2.11, CUDA 13) for one row at N = K = 64, while one row at the 7B's widths runs.
# Such a GEMM takes the dequantised product from then on (the same arithmetic).
_UNSUPPORTED: set = set()
# Hopper's FP8 MMAs accumulate in reduced precision; cuBLAS promotes to fp32 every few MMAs
# unless asked for fast accumulation (what vLLM's CUTLASS FP8 kernels run). Measured on the
# H200 (lab/experiments/fp8_gemm_accum.py): up to K = 3584 fast accumulation is 1.11-1.29x
# faster with the relative error vs an fp32 product of the same operands 1.7e-3 -> 1.8-2.1e-3
# (bf16 output rounding is most of it); at the LM's down projection (K = 18944) it is slower
# (1.78 -> 2.20 ms) and doubles the error, so long reductions keep the promotion.
FAST_ACCUM_MAX_K = 4096


def scaled_mm_ref(xq, xs, wq, ws, bias, out_dtype):
    """The FP8 GEMM's arithmetic by dequantising (products of e4m3 values are exact in fp32):
    ``(xq · wqᵀ) * xs * wsᵀ (+ bias)`` → ``out_dtype``."""
    y = (xq.float() @ wq.float().t()) * xs * ws.view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def fp8_gemm(x: Fp8Act, wq: torch.Tensor, ws: torch.Tensor, bias=None, *,
             out_features: int | None = None) -> torch.Tensor:
    """``x [..., K]`` (quantised) times ``wq [N, K]`` (e4m3, scales ``ws [N]``) → ``[..., N]``
    in ``x.dtype``: ``torch._scaled_mm`` with row-wise scales (fp32 accumulation). On CUDA
    both widths must be multiples of 16: a weight padded with zero rows and columns (see
    :meth:`mminfer.models.fp8.Fp8Linear.padded`) takes a narrower ``x`` (padded here with
    zeros, which add exact zeros) and ``out_features`` keeps the first columns of the
    product."""
    lead = x.shape[:-1]
    a, sa = x.data.reshape(-1, x.shape[-1]), x.scale.reshape(-1, 1)
    N, K = wq.shape
    n_out = N if out_features is None else out_features
    out = x.dtype

    def dequantised():
        return scaled_mm_ref(a, sa, wq, ws, bias, out)[:, :n_out].reshape(*lead, n_out)

    if a.is_cuda and (K % ALIGN or N % ALIGN):
        return dequantised()
    if a.shape[1] < K:                   # zero columns of a padded weight: zero inputs
        a = F.pad(a.view(torch.uint8), (0, K - a.shape[1])).view(FP8)
    if a.is_cuda:
        # row-wise scaling on CUDA writes bf16 and fuses a bf16 bias only
        mm_out = torch.bfloat16
        fuse = bias is not None and bias.dtype == torch.bfloat16 and out == mm_out \
            and n_out == N
    else:
        mm_out, fuse = out, bias is not None and bias.dtype == out and n_out == N
    shape = (a.shape[0], N, K)
    if shape in _UNSUPPORTED:
        return dequantised()
    try:
        y = torch._scaled_mm(a.contiguous(), wq.t(), scale_a=sa.contiguous(),
                             scale_b=ws.view(1, -1), bias=bias if fuse else None,
                             out_dtype=mm_out, use_fast_accum=K <= FAST_ACCUM_MAX_K)
    except RuntimeError as e:   # refused before launch: nothing ran, the stream is clean
        if "CUBLAS_STATUS_NOT_SUPPORTED" not in str(e):
            raise
        _UNSUPPORTED.add(shape)
        return dequantised()
    if n_out != N:
        y = y[:, :n_out]
    if bias is not None and not fuse:
        y = (y.float() + bias.float()).to(out)
    return y.to(out).reshape(*lead, n_out)
