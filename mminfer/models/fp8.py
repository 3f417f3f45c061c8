"""FP8 linear layers (``quantization="fp8"``): e4m3 weights with one fp32 scale per output
channel, activations quantised per token at run time, one scaled GEMM.

A weight ``W [out, in]`` is stored as ``Wq = round_e4m3(W / s_w)`` with ``s_w[o] =
amax(|W[o, :]|) / 448`` (448 is e4m3's largest finite value); an activation row ``x`` as
``xq = round_e4m3(x / s_x)`` with ``s_x = amax(|x|) / 448`` of that row (dynamic: computed for
every token). ``y = (xq · Wqᵀ) * s_x * s_wᵀ + b``: ``torch._scaled_mm`` with row-wise scales
(``scale_a [M, 1]``, ``scale_b [1, N]``), fp32 accumulation, the model's dtype out. This is
the layout of the published "FP8-Dynamic" checkpoints (compressed-tensors: channel-wise weight
scales, token-wise dynamic input scales), which :func:`load_compressed_tensors_scales` reads.

A quantisation pass of its own before every GEMM reads and writes the activation once more
and gives back most of what FP8 gains (issue 34: 0.73-1.66x instead of 1.72-1.89x), so the
kernels that produce an activation quantise it themselves: RMSNorm (optionally after the
residual add) → ``(fp8 rows, per-row scale)`` and SiLU(gate)·up → ``(fp8, scale)``; the
result travels as an :class:`Fp8Act` that :class:`Fp8Linear` takes as it is. Where no
producer of ours exists (the attention output before ``o_proj``, transformers' own forwards)
``Fp8Linear`` quantises a plain tensor with a one-pass Triton kernel (CUDA), or torch ops.

Every kernel rounds to e4m3 the way ``tensor.to(torch.float8_e4m3fn)`` does (round to
nearest even): compiled, with Triton's cast (:func:`_to_e4m3`); under the CPU interpreter,
whose fp8 cast carries wrongly into the next binade, by rounding onto the e4m3 grid in fp32
arithmetic first (:func:`_e4m3_grid`), so its final cast is exact. The torch
functions ``*_ref`` are the fp32 references the kernels are tested against.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl
from safetensors import safe_open

from mminfer.errors import ConfigError
from mminfer.kernels.runtime import interpreted
from mminfer.models.vision_fused import add_rms_norm_row, load_add_row, use_triton

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A row of zeros gets this scale (not 0: its quotient would be NaN); its fp8 values are 0.
MIN_SCALE = 1e-12
QUANTIZATIONS = (None, "fp8")
# torch._scaled_mm on CUDA needs both GEMM widths (in, out) to be multiples of 16.
ALIGN = 16
# (rows, N, K) that cuBLASLt refused with CUBLAS_STATUS_NOT_SUPPORTED: seen on the H200
# (torch 2.11, CUDA 13) for one row at N = K = 64, while one row at the 7B's widths runs.
# Such a GEMM takes the dequantised product from then on (the same arithmetic).
_UNSUPPORTED: set = set()
# SiLU·up rows up to this (power-of-two) width are held whole by one program and read once
# (the vision MLP's 3456); wider ones (the 7B LM's 18944) take two passes over column tiles,
# the second mostly from L2.
ONE_PASS_MAX = 8192
# The standalone quantiser reads rows up to this (power-of-two) width once, QUANT_BLOCK
# elements (whole rows) a program, 4 warps: 0.131 -> 0.070 ms on the vision tower's 63K rows
# of 1280 with the compiled e4m3 cast (H200, lab/experiments/elementwise.py, 2026-12-04;
# 8192 a program 0.068, 16384 0.080); wider rows take two passes.
QUANT_ONE_PASS_MAX = 8192
QUANT_BLOCK = 4096
# Hopper's FP8 MMAs accumulate in reduced precision; cuBLAS promotes to fp32 every few MMAs
# unless asked for fast accumulation (what vLLM's CUTLASS FP8 kernels run). Measured on the
# H200 (lab/experiments/fp8_gemm_accum.py): up to K = 3584 fast accumulation is 1.11-1.29x
# faster with the relative error vs an fp32 product of the same operands 1.7e-3 -> 1.8-2.1e-3
# (bf16 output rounding is most of it); at the LM's down projection (K = 18944) it is slower
# (1.78 -> 2.20 ms) and doubles the error, so long reductions keep the promotion.
FAST_ACCUM_MAX_K = 4096


# ---------------------------------------------------------------------- the activation
@dataclass
class Fp8Act:
    """An activation already quantised per row: ``data`` e4m3 ``[..., K]``, ``scale`` fp32
    ``[..., 1]`` (one per row), ``dtype`` the dtype it was quantised from (the GEMM's output
    dtype). Indexing slices rows of both (never the last dimension)."""
    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self):
        return self.data.shape

    def __getitem__(self, key):
        return Fp8Act(self.data[key], self.scale[key], self.dtype)

    def dequantize(self) -> torch.Tensor:
        return (self.data.float() * self.scale).to(self.dtype)


# ---------------------------------------------------------------------- references (fp32)
def quantize_rows_ref(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic quantisation in fp32: ``(e4m3 [..., K], fp32 scale [..., 1])``."""
    y = y.float()
    scale = (y.abs().amax(-1, keepdim=True) / FP8_MAX).clamp_(min=MIN_SCALE)
    return (y / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8), scale


def rms_norm_quant_ref(x, weight, eps: float, d=None):
    """transformers' Qwen2 RMSNorm of ``x (+ d)`` (the sum rounded to x's dtype; fp32
    variance; one rounding to x's dtype; times the weight in that dtype), then quantised per
    row: ``(sum, e4m3, scale)``."""
    if d is not None:
        x = x + d
    h = x.float()
    n = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    q, s = quantize_rows_ref(weight * n)
    return x, q, s


def silu_mul_quant_ref(g, u):
    """``silu(g) * u`` as transformers rounds it (each step to g's dtype), quantised per row."""
    return quantize_rows_ref(F.silu(g) * u)


def layer_norm_quant_ref(x, weight, bias, eps: float, d=None):
    """``nn.LayerNorm`` of ``x (+ d)`` (the sum rounded to x's dtype; fp32 statistics and
    affine, one rounding to x's dtype), then quantised per row: ``(sum, e4m3, scale)``."""
    if d is not None:
        x = x + d
    y = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)
    q, s = quantize_rows_ref(y)
    return x, q, s


def gelu_tanh_quant_ref(h):
    """``gelu(h, approximate="tanh")`` (SigLIP's activation; fp32, one rounding to h's dtype),
    quantised per row."""
    return quantize_rows_ref(F.gelu(h.float(), approximate="tanh").to(h.dtype))


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel weight quantisation: ``W [out, in]`` → ``(e4m3 [out, in], fp32
    scale [out])``."""
    q, s = quantize_rows_ref(w.detach())
    return q, s.view(-1)


def scaled_mm_ref(xq, xs, wq, ws, bias, out_dtype):
    """The FP8 GEMM's arithmetic by dequantising (products of e4m3 values are exact in fp32):
    ``(xq · wqᵀ) * xs * wsᵀ (+ bias)`` → ``out_dtype``."""
    y = (xq.float() @ wq.float().t()) * xs * ws.view(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


# ---------------------------------------------------------------------- Triton kernels
@triton.jit
def _e4m3_grid(v):
    """fp32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value (ties to even), in fp32:
    normals keep 3 mantissa bits (round on the bit pattern); below 2^-6 the grid is the
    subnormals' uniform 2^-9 (round by adding and subtracting 1.5 * 2^14)."""
    bits = v.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    sub = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


# Compiled, the kernels convert with Triton's own fp32 -> e4m3 cast: round to nearest even,
# torch's cast bit for bit on all 1.24M values checked on the H200, -0 included (the grid
# above gives +0 where a small negative value rounds to zero; equal as numbers). The grid
# costs ~10 ALU operations an element, which made the FP8 vision tower's quantising kernels
# ALU-bound (lab/experiments/elementwise.py, 2026-12-04: the standalone quantiser 0.115 ->
# 0.070 ms, SiLU·up 0.341 -> 0.268; the hardware's cvt.rn.satfinite by inline PTX, one value
# an instruction, 0.081 and 0.282). The interpreter's cast is wrong: there, the grid first.
_CAST_E4M3 = tl.constexpr(not interpreted())


@triton.jit
def _to_e4m3(v, DT: tl.constexpr):
    """fp32 ``v`` on e4m3's range as ``DT`` (float8e4nv), rounded as torch rounds."""
    if _CAST_E4M3:
        return v.to(DT)
    return _e4m3_grid(v).to(DT)


@triton.jit
def _store_fp8(Q, row, cols, mask, y, amax, stride_q):
    scale = tl.maximum(amax / 448.0, 1e-12)
    v = tl.minimum(tl.maximum(y / scale, -448.0), 448.0)
    tl.store(Q + row * stride_q + cols, _to_e4m3(v, Q.dtype.element_ty), mask=mask)
    return scale


@triton.jit
def _quant_kernel(X, Q, S, C, stride_x, stride_q, BLOCK_C: tl.constexpr):
    # one program per row, two passes over column tiles: the row's amax, then the quotients
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(X + row * stride_x + cols, mask=cols < C, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    m = tl.max(amax, axis=0)
    scale = tl.maximum(m / 448.0, 1e-12)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        x = tl.load(X + row * stride_x + cols, mask=cols < C, other=0.0).to(tl.float32)
        _store_fp8(Q, row, cols, cols < C, x, m, stride_q)
    tl.store(S + row, scale)


@triton.jit
def _quant_rows_kernel(X, Q, S, N, C, stride_x, stride_q, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    # BLOCK_R whole rows a program, read once: a 1280-wide row alone is too little work for a
    # program (the vision tower's attention output, 63K rows a chunk)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 448.0, 1e-12)
    v = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], _to_e4m3(v, Q.dtype.element_ty),
             mask=mask)
    tl.store(S + rows, scale, mask=rows < N)


@triton.jit
def _rms_norm_quant_kernel(X, D, W, Q, S, C, stride_x, stride_d, stride_q, eps,
                           HAS_D: tl.constexpr, BLOCK_C: tl.constexpr):
    # one program per row, the whole row in registers (C <= 8192 for the models served)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    y = add_rms_norm_row(X, D, W, C, row, cols, mask, stride_x, stride_d, eps, HAS_D)
    y = y.to(X.dtype.element_ty).to(tl.float32)
    amax = tl.max(tl.abs(y), axis=0)
    scale = _store_fp8(Q, row, cols, mask, y, amax, stride_q)
    tl.store(S + row, scale)


@triton.jit
def _silu_mul(G, U, row, cols, mask, stride_g, stride_u):
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(G.dtype.element_ty).to(tl.float32)
    return (a * u).to(G.dtype.element_ty).to(tl.float32)


@triton.jit
def _silu_mul_quant_kernel(G, U, Q, S, C, stride_g, stride_u, stride_q,
                           BLOCK_C: tl.constexpr):
    # one program per row, two passes (the MLP is up to 18944 wide): amax, then quotients
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_C], dtype=tl.float32)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        y = _silu_mul(G, U, row, cols, cols < C, stride_g, stride_u)
        amax = tl.maximum(amax, tl.abs(y))
    m = tl.max(amax, axis=0)
    scale = tl.maximum(m / 448.0, 1e-12)
    for c0 in range(0, C, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        y = _silu_mul(G, U, row, cols, cols < C, stride_g, stride_u)
        _store_fp8(Q, row, cols, cols < C, y, m, stride_q)
    tl.store(S + row, scale)


@triton.jit
def _silu_mul_quant_row_kernel(G, U, Q, S, C, stride_g, stride_u, stride_q,
                               BLOCK_C: tl.constexpr):
    # one program per row, the whole row in registers: G and U read once
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    y = _silu_mul(G, U, row, cols, cols < C, stride_g, stride_u)
    scale = _store_fp8(Q, row, cols, cols < C, y, tl.max(tl.abs(y), axis=0), stride_q)
    tl.store(S + row, scale)


@triton.jit
def _layer_norm_quant_kernel(X, D, W, B, Q, S, C, stride_x, stride_d, stride_q, eps,
                             HAS_D: tl.constexpr, BLOCK_C: tl.constexpr):
    # one program per row, the whole row in registers (SigLIP's 1152)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    xf = load_add_row(X, D, row, cols, mask, stride_x, stride_d, HAS_D).to(tl.float32)
    xc = tl.where(mask, xf - tl.sum(xf, axis=0) / C, 0.0)
    rstd = tl.rsqrt(tl.sum(xc * xc, axis=0) / C + eps)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)
    y = (xc * rstd * w + b).to(X.dtype.element_ty).to(tl.float32)
    scale = _store_fp8(Q, row, cols, mask, y, tl.max(tl.abs(y), axis=0), stride_q)
    tl.store(S + row, scale)


@triton.jit
def _gelu_tanh_quant_kernel(H, Q, S, C, stride_h, stride_q, BLOCK_C: tl.constexpr):
    # one program per row, the whole row in registers (SigLIP's 4304); tanh(z) as
    # 1 - 2 / (exp(2z) + 1), which saturates to +-1 without a NaN
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    h = tl.load(H + row * stride_h + cols, mask=mask, other=0.0).to(tl.float32)
    z = 0.7978845608028654 * (h + 0.044715 * h * h * h)
    y = 0.5 * h * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    y = y.to(H.dtype.element_ty).to(tl.float32)
    scale = _store_fp8(Q, row, cols, mask, y, tl.max(tl.abs(y), axis=0), stride_q)
    tl.store(S + row, scale)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, K]`` with unit stride along K (a view where it can be)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _tile(C: int, cap: int = 2048) -> int:
    return min(triton.next_power_of_2(max(C, 16)), cap)


# ---------------------------------------------------------------------- producers
def quantize_rows(x: torch.Tensor, *, kernels: str = "auto") -> Fp8Act:
    """``x [..., K]`` quantised per row (the standalone pass, where no producer fuses it)."""
    if not use_triton(x, kernels):
        q, s = quantize_rows_ref(x)
        return Fp8Act(q, s, x.dtype)
    x2 = _rows(x)
    N, C = x2.shape
    q = torch.empty(N, C, dtype=FP8, device=x.device)
    s = torch.empty(N, 1, dtype=torch.float32, device=x.device)
    B = triton.next_power_of_2(max(C, 16))
    if N and B <= QUANT_ONE_PASS_MAX:
        R = max(1, QUANT_BLOCK // B)
        _quant_rows_kernel[(triton.cdiv(N, R),)](x2, q, s, N, C, x2.stride(0), q.stride(0),
                                                 BLOCK_R=R, BLOCK_C=B, num_warps=4)
    elif N:
        _quant_kernel[(N,)](x2, q, s, C, x2.stride(0), q.stride(0), BLOCK_C=_tile(C),
                            num_warps=4)
    return Fp8Act(q.view(x.shape), s.view(*x.shape[:-1], 1), x.dtype)


def rms_norm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float, d=None, *,
                   kernels: str = "auto"):
    """RMSNorm of ``x (+ d)`` quantised per row → ``(sum, Fp8Act)``. With ``d`` the Triton
    kernel writes the sum into ``x`` (rows must be contiguous), as the vision tower's
    ``add_rms_norm``; the torch version returns a new tensor."""
    if not use_triton(x, kernels):
        x, q, s = rms_norm_quant_ref(x, weight, eps, d)
        return x, Fp8Act(q, s, x.dtype)
    x2 = x.view(-1, x.shape[-1]) if d is not None else _rows(x)
    d2 = d.reshape(-1, d.shape[-1]) if d is not None else None
    if x2.stride(-1) != 1 or (d2 is not None and d2.stride(-1) != 1):
        raise ValueError("rms_norm_quant needs rows with unit stride")
    N, C = x2.shape
    q = torch.empty(N, C, dtype=FP8, device=x.device)
    s = torch.empty(N, 1, dtype=torch.float32, device=x.device)
    if N:
        _rms_norm_quant_kernel[(N,)](
            x2, d2 if d2 is not None else x2, weight, q, s, C, x2.stride(0),
            d2.stride(0) if d2 is not None else 0, q.stride(0), float(eps),
            HAS_D=d2 is not None, BLOCK_C=triton.next_power_of_2(C),
            num_warps=4 if C <= 2048 else 8)
    return x, Fp8Act(q.view(x.shape), s.view(*x.shape[:-1], 1), x.dtype)


def silu_mul_quant(g: torch.Tensor, u: torch.Tensor, *, kernels: str = "auto") -> Fp8Act:
    """``silu(g) * u`` quantised per row (``g``, ``u`` ``[..., C]``, e.g. two column ranges
    of one gate/up GEMM output)."""
    if g.shape != u.shape:
        raise ValueError(f"gate {tuple(g.shape)} and up {tuple(u.shape)} differ")
    if not use_triton(g, kernels):
        q, s = silu_mul_quant_ref(g, u)
        return Fp8Act(q, s, g.dtype)
    g2, u2 = _rows(g), _rows(u)
    N, C = g2.shape
    q = torch.empty(N, C, dtype=FP8, device=g.device)
    s = torch.empty(N, 1, dtype=torch.float32, device=g.device)
    B = triton.next_power_of_2(C)
    if N and B <= ONE_PASS_MAX:
        # 4 warps up to 4096 wide: 0.268 ms against 0.282 at 8 on the vision MLP's 63K rows
        # of 3456 (H200, lab/experiments/elementwise.py; several rows a program: no faster)
        _silu_mul_quant_row_kernel[(N,)](g2, u2, q, s, C, g2.stride(0), u2.stride(0),
                                         q.stride(0), BLOCK_C=B,
                                         num_warps=4 if B <= 4096 else 8)
    elif N:
        _silu_mul_quant_kernel[(N,)](g2, u2, q, s, C, g2.stride(0), u2.stride(0), q.stride(0),
                                     BLOCK_C=_tile(C), num_warps=4)
    return Fp8Act(q.view(g.shape), s.view(*g.shape[:-1], 1), g.dtype)


def layer_norm_quant(x: torch.Tensor, weight, bias, eps: float, d=None, *,
                     kernels: str = "auto"):
    """LayerNorm of ``x (+ d)`` quantised per row → ``(sum, Fp8Act)``; with ``d`` the Triton
    kernel writes the sum into ``x`` (contiguous rows), the torch version returns a new
    tensor. Rows wider than ``ONE_PASS_MAX`` take the torch version."""
    C = x.shape[-1]
    if not use_triton(x, kernels) or triton.next_power_of_2(C) > ONE_PASS_MAX:
        x, q, s = layer_norm_quant_ref(x, weight, bias, eps, d)
        return x, Fp8Act(q, s, x.dtype)
    x2 = x.view(-1, C) if d is not None else _rows(x)
    d2 = d.reshape(-1, C) if d is not None else None
    if x2.stride(-1) != 1 or (d2 is not None and d2.stride(-1) != 1):
        raise ValueError("layer_norm_quant needs rows with unit stride")
    N = x2.shape[0]
    q = torch.empty(N, C, dtype=FP8, device=x.device)
    s = torch.empty(N, 1, dtype=torch.float32, device=x.device)
    if N:
        _layer_norm_quant_kernel[(N,)](
            x2, d2 if d2 is not None else x2, weight, bias, q, s, C, x2.stride(0),
            d2.stride(0) if d2 is not None else 0, q.stride(0), float(eps),
            HAS_D=d2 is not None, BLOCK_C=triton.next_power_of_2(C),
            num_warps=4 if C <= 2048 else 8)
    return x, Fp8Act(q.view(x.shape), s.view(*x.shape[:-1], 1), x.dtype)


def gelu_tanh_quant(h: torch.Tensor, *, kernels: str = "auto") -> Fp8Act:
    """``gelu(h, approximate="tanh")`` quantised per row (one read of ``h``)."""
    C = h.shape[-1]
    if not use_triton(h, kernels) or triton.next_power_of_2(C) > ONE_PASS_MAX:
        q, s = gelu_tanh_quant_ref(h)
        return Fp8Act(q, s, h.dtype)
    h2 = _rows(h)
    N = h2.shape[0]
    q = torch.empty(N, C, dtype=FP8, device=h.device)
    s = torch.empty(N, 1, dtype=torch.float32, device=h.device)
    if N:
        _gelu_tanh_quant_kernel[(N,)](h2, q, s, C, h2.stride(0), q.stride(0),
                                      BLOCK_C=triton.next_power_of_2(C), num_warps=8)
    return Fp8Act(q.view(h.shape), s.view(*h.shape[:-1], 1), h.dtype)


def concat(*layers: "Fp8Linear") -> "Fp8Linear":
    """One FP8 layer whose output is the given layers' outputs side by side (e.g. q, k, v:
    one GEMM instead of three, the input read once); the layers are left as they are."""
    w = torch.cat([m.weight.view(torch.uint8) for m in layers]).view(FP8)
    s = torch.cat([m.weight_scale for m in layers])
    biases = [m.bias for m in layers]
    if all(b is None for b in biases):
        b = None
    else:
        ref = next(b for b in biases if b is not None)
        b = torch.cat([bb.detach() if bb is not None else ref.new_zeros(m.out_features)
                       for bb, m in zip(biases, layers)])
    return Fp8Linear(w, s, b, kernels=layers[0].kernels)


# ---------------------------------------------------------------------- the GEMM
def fp8_gemm(x: Fp8Act, wq: torch.Tensor, ws: torch.Tensor, bias=None, *,
             out_features: int | None = None) -> torch.Tensor:
    """``x [..., K]`` (quantised) times ``wq [N, K]`` (e4m3, scales ``ws [N]``) → ``[..., N]``
    in ``x.dtype``: ``torch._scaled_mm`` with row-wise scales (fp32 accumulation). On CUDA
    both widths must be multiples of 16: a weight padded with zero rows and columns (see
    :meth:`Fp8Linear.padded`) takes a narrower ``x`` (padded here with zeros, which add
    exact zeros) and ``out_features`` keeps the first columns of the product."""
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


class Fp8Linear(nn.Module):
    """``nn.Linear`` with an e4m3 weight and per-output-channel scales. ``forward`` takes a
    plain activation (quantised here, per row) or an :class:`Fp8Act` (used as it is)."""

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias=None, *,
                 kernels: str = "auto"):
        super().__init__()
        if weight_fp8.dtype != FP8 or weight_fp8.dim() != 2:
            raise ValueError(f"expected an e4m3 [out, in] weight, got {weight_fp8.dtype} "
                             f"{tuple(weight_fp8.shape)}")
        self.out_features, self.in_features = weight_fp8.shape
        ws = weight_scale.detach().float().reshape(-1)
        if ws.numel() == 1:
            ws = ws.expand(self.out_features)
        if ws.numel() != self.out_features:
            raise ValueError(f"{ws.numel()} weight scales for {self.out_features} channels")
        self.register_buffer("weight", weight_fp8.detach().contiguous())
        self.register_buffer("weight_scale", ws.contiguous().to(weight_fp8.device))
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.kernels = kernels

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kw) -> "Fp8Linear":
        q, s = quantize_weight(linear.weight)
        return cls(q, s, linear.bias, **kw)

    def forward(self, x):
        if not isinstance(x, Fp8Act):
            x = quantize_rows(x, kernels=self.kernels)
        if x.data.is_cuda and (self.in_features % ALIGN or self.out_features % ALIGN):
            wq, ws = self.padded()
            return fp8_gemm(x, wq, ws, self.bias, out_features=self.out_features)
        return fp8_gemm(x, self.weight, self.weight_scale, self.bias)

    def padded(self):
        """The weight with zero rows and columns up to multiples of 16 (what ``_scaled_mm``
        takes on CUDA; e.g. the 7B vision MLP's 3420), and its scales; made once."""
        if getattr(self, "_padded", None) is None or self._padded[0].device != self.weight.device:
            N, K = self.weight.shape
            Np, Kp = -(-N // ALIGN) * ALIGN, -(-K // ALIGN) * ALIGN
            w = F.pad(self.weight.view(torch.uint8), (0, Kp - K, 0, Np - N)).view(FP8)
            ws = F.pad(self.weight_scale, (0, Np - N), value=1.0)
            self._padded = (w, ws)
        return self._padded

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fp8=e4m3 per-channel")


def is_fp8(*modules) -> bool:
    return all(isinstance(m, Fp8Linear) for m in modules)


# ---------------------------------------------------------------------- our engine's steps
def _eps(norm) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _rms_like(norm) -> bool:
    return type(norm).__name__.endswith("RMSNorm") and hasattr(norm, "weight")


def normed(norm, x, *consumers):
    """``norm(x)`` for ``consumers`` (the linear layers that read it): quantised by the norm's
    own kernel (an :class:`Fp8Act`) when they are all FP8 and ``norm`` is an RMSNorm, else
    the module's output."""
    if consumers and is_fp8(*consumers) and _rms_like(norm):
        return rms_norm_quant(x, norm.weight, _eps(norm), kernels=consumers[0].kernels)[1]
    return norm(x)


def _silu(mlp) -> bool:
    act = getattr(mlp, "act_fn", None)
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def mlp(mlp_module, norm, x):
    """``mlp_module(norm(x))``: a gated SiLU MLP of FP8 layers runs as RMSNorm→fp8, the
    gate and up GEMMs, SiLU·up→fp8 and the down GEMM (no separate quantisation pass); any
    other MLP through its module."""
    m = mlp_module
    if not (all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj")) and _silu(m)
            and is_fp8(m.gate_proj, m.up_proj, m.down_proj) and _rms_like(norm)):
        return m(norm(x))
    xq = rms_norm_quant(x, norm.weight, _eps(norm), kernels=m.gate_proj.kernels)[1]
    h = silu_mul_quant(m.gate_proj(xq), m.up_proj(xq), kernels=m.down_proj.kernels)
    return m.down_proj(h)


# ---------------------------------------------------------------------- converting a model
def convert(root: nn.Module, names, *, kernels: str = "auto") -> int:
    """Replace the ``nn.Linear`` submodules of ``root`` whose qualified names match
    ``names`` (a predicate on the name) with :class:`Fp8Linear`; returns how many."""
    todo = [(n, m) for n, m in root.named_modules()
            if type(m) is nn.Linear and names(n)]
    for name, lin in todo:
        parent, _, leaf = name.rpartition(".")
        with torch.no_grad():
            new = Fp8Linear.from_linear(lin, kernels=kernels)
        setattr(root.get_submodule(parent) if parent else root, leaf, new)
    return len(todo)


LLM_LINEARS = re.compile(r"(^|\.)layers\.\d+\."
                         r"(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)$")


# Qwen2.5-VL's vision blocks (qkv, proj, the gated MLP; not the patch embedding, not the
# merger) and SigLIP's encoder layers (q/k/v/out, fc1, fc2; not the projector).
VISION_LINEARS = re.compile(r"(^|\.)blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(gate|up|down)_proj)$"
                            r"|(^|\.)layers\.\d+\.(self_attn\.(q|k|v|out)_proj|mlp\.fc[12])$")


def is_llm_linear(name: str) -> bool:
    """A decoder layer's attention or MLP projection (not lm_head, not embeddings)."""
    return LLM_LINEARS.search(name) is not None


def is_vision_linear(name: str) -> bool:
    """A vision block's attention projection or MLP layer."""
    return VISION_LINEARS.search(name) is not None


# ---------------------------------------------------------------------- FP8 checkpoints
def checkpoint_quantization(config: dict, where: str = "config.json") -> str | None:
    """The quantization a checkpoint's ``config.json`` declares: None (none) or "fp8" (the
    compressed-tensors FP8-Dynamic layout: e4m3 weights with channel-wise (or one
    tensor-wise) scales, per-token dynamic e4m3 activations). Any other layout is a
    ConfigError that names what is not supported."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(f"{where}: quant_method {method!r} is not supported (mminfer loads "
                          f"compressed-tensors FP8-Dynamic checkpoints only)")
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise ConfigError(f"{where}: compressed-tensors format {fmt!r} is not supported "
                          f"(float-quantized FP8 only)")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise ConfigError(f"{where}: quantization_config has no config_groups")
    for name, g in groups.items():
        w, a = g.get("weights") or {}, g.get("input_activations")
        want_w = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False}
        bad = {k: w.get(k) for k, v in want_w.items() if w.get(k) != v}
        if w.get("strategy") not in ("channel", "tensor"):
            bad["strategy"] = w.get("strategy")
        if bad:
            raise ConfigError(f"{where}: config group {name!r} weights {bad} are not supported "
                              f"(FP8 e4m3, symmetric, static channel-wise scales only)")
        want_a = {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}
        bad = {k: (a or {}).get(k) for k, v in want_a.items() if (a or {}).get(k) != v}
        if bad:
            raise ConfigError(f"{where}: config group {name!r} input_activations {bad} are not "
                              f"supported (FP8 per-token dynamic only)")
    return "fp8"


def load_scales(path, rename=lambda n: n) -> dict:
    """``{module name: weight_scale}`` of every quantised layer in the checkpoint ``path``'s
    safetensors files (``<layer>.weight_scale``), names through ``rename`` (the checkpoint's
    names to the model's modules). Static input scales are a ConfigError."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{path}: an FP8 checkpoint needs its weights in .safetensors files")
    scales = {}
    for f in files:
        with safe_open(str(f), "pt") as st:
            for key in st.keys():
                if key.endswith(".input_scale"):
                    raise ConfigError(f"{f.name}: {key}: static activation scales are not "
                                      f"supported (per-token dynamic only)")
                if key.endswith(".weight_scale"):
                    scales[rename(key[:-len(".weight_scale")])] = st.get_tensor(key)
    return scales


def apply_scales(model: nn.Module, scales: dict, *, kernels: str = "auto") -> int:
    """Turn each layer named in ``scales`` (its weight loaded as e4m3 values in a wider
    dtype, which holds them exactly) into an :class:`Fp8Linear` with those scales."""
    modules = dict(model.named_modules())
    for name, s in scales.items():
        lin = modules.get(name)
        if type(lin) is not nn.Linear:
            raise ConfigError(f"the checkpoint has an FP8 scale for {name!r}, which is "
                              f"{'not in the model' if lin is None else type(lin).__name__}")
        w = lin.weight.detach()
        wq = w.to(FP8)
        if not torch.equal(wq.to(w.dtype), w):
            raise ConfigError(f"{name}: the weight of a quantised layer holds values e4m3 "
                              f"cannot represent (not an FP8 checkpoint's weight)")
        parent, _, leaf = name.rpartition(".")
        new = Fp8Linear(wq, s.float().to(w.device), lin.bias, kernels=kernels)
        setattr(model.get_submodule(parent) if parent else model, leaf, new)
    return len(scales)


def read_config(path) -> dict:
    p = Path(path) / "config.json"
    try:
        return json.loads(p.read_text()) if p.is_file() else {}
    except ValueError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from e


def check(quantization) -> str | None:
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, not {quantization!r}")
    return quantization
