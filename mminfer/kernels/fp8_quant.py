"""FP8 (e4m3) quantisation per row: the kernels that produce an activation quantise it
themselves, and the standalone pass where no producer of ours exists.

An activation row ``x`` becomes ``xq = round_e4m3(x / s_x)`` with ``s_x = amax(|x|) / 448``
of that row (448 is e4m3's largest finite value; dynamic: computed for every token); a weight
``W [out, in]`` the same way per output channel (:func:`quantize_weight`). A quantisation pass
of its own before every GEMM reads and writes the activation once more and gives back most of
what FP8 gains (0.73-1.66x instead of 1.72-1.89x), so the kernels that produce an activation
quantise it: RMSNorm (optionally after the residual add) → ``(fp8 rows, per-row scale)``,
SiLU(gate)·up → ``(fp8, scale)``, and SigLIP's LayerNorm and tanh-GELU; the result travels as
an :class:`Fp8Act` that the GEMM (:mod:`.fp8_gemm`) takes as it is. Where no producer of ours
exists (the attention output before ``o_proj``, transformers' own forwards)
:func:`quantize_rows` quantises a plain tensor with a one-pass Triton kernel (CUDA), or torch
ops.

Every kernel rounds to e4m3 the way ``tensor.to(torch.float8_e4m3fn)`` does (round to
nearest even): compiled, with Triton's cast (:func:`_to_e4m3`); under the CPU interpreter,
whose fp8 cast carries wrongly into the next binade, by rounding onto the e4m3 grid in fp32
arithmetic first (:func:`_e4m3_grid`), so its final cast is exact. The torch functions
``*_ref`` are the fp32 references the kernels are tested against, and the path where Triton
does not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .runtime import interpreted, use_triton
from .vision_elementwise import add_rms_norm_row, load_add_row, silu_rounded

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A row of zeros gets this scale (not 0: its quotient would be NaN); its fp8 values are 0.
MIN_SCALE = 1e-12
# SiLU·up rows up to this (power-of-two) width are held whole by one program and read once
# (the vision MLP's 3456); wider ones (the 7B LM's 18944) take two passes over column tiles,
# the second mostly from L2.
ONE_PASS_MAX = 8192
# The standalone quantiser reads rows up to this (power-of-two) width once, QUANT_BLOCK
# elements (whole rows) a program, 4 warps: 0.131 -> 0.070 ms on the vision tower's 63K rows
# of 1280 with the compiled e4m3 cast (H200, lab/experiments/elementwise.py;
# 8192 a program 0.068, 16384 0.080); wider rows take two passes.
QUANT_ONE_PASS_MAX = 8192
QUANT_BLOCK = 4096


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
# ALU-bound (lab/experiments/elementwise.py: the standalone quantiser 0.115 ->
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
    a = silu_rounded(gf, G.dtype.element_ty)
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
