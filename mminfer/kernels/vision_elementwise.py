"""The elementwise steps of a Qwen2.5-VL vision block, each one pass over memory.

Between its GEMMs a block does a residual add, an RMSNorm, the 2-D rotary embedding of q and
k and the SiLU gate. Written as torch ops they are 12-20 kernels per block, most of them
over fp32 copies (the norm and the rotary compute in fp32, as transformers does); at 22
pairs x 2880 patches x 1280 wide that is ~8 GB of memory traffic per block against ~3 GB
here (``benchmarks/vision.py --ops`` lists both). Three kernels instead:

* ``add_rms_norm(x, d, w, eps)``: ``x += d`` (rounded to x's dtype, as the add would be),
  then transformers' Qwen2 RMSNorm of the sum (fp32 variance and normalisation, one rounding
  to x's dtype, times the weight in that dtype); the next norm of the residual stream is
  fused into the add that ends a block's half;
* ``rotary(qkv, cos, sin, S, heads, head_dim)``: q and k rotated in place inside the qkv
  GEMM's output (fp32 arithmetic, ``t * cos + rotate_half(t) * sin``); v is not touched, and
  q, k, v stay views of that one buffer for SDPA;
* ``silu_mul(gu, inter)``: ``silu(gate) * up`` from the fused gate/up GEMM's output
  ``[N, 2 * inter]``, each rounded to the input dtype where transformers rounds.

Each has a Triton kernel (CUDA, or the CPU interpreter under ``TRITON_INTERPRET=1``, for
tests) registered as a torch custom op (so ``torch.compile`` and meta tensors see one op, not
its insides) and a torch version with transformers' own arithmetic (the CPU path, and what
``torch.compile`` fuses by itself). ``runtime.use_triton(x, choice)`` picks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


# ---------------------------------------------------------------------- Triton kernels
@triton.jit
def load_add_row(X, D, row, cols, mask, stride_x, stride_d, HAS_D: tl.constexpr):
    """One row of X; with HAS_D the residual add x + d (rounded to X's dtype, as the add
    would round it), written back to X."""
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_D:
        d = tl.load(D + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(X + row * stride_x + cols, x, mask=mask)
    return x


@triton.jit
def add_rms_norm_row(X, D, W, C, row, cols, mask, stride_x, stride_d, eps, HAS_D: tl.constexpr):
    """One row: x (+= d, written back to X), then RMSNorm(x) * w as transformers rounds it (the
    normalised row in X's dtype before the weight); fp32, in X's dtype's values. Also the
    first half of the norm-and-quantise kernel of fp8_quant."""
    x = load_add_row(X, D, row, cols, mask, stride_x, stride_d, HAS_D)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / C
    n = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    return n * w


@triton.jit
def _add_rms_norm_kernel(X, D, W, Y, C, stride_x, stride_d, stride_y, eps,
                         HAS_D: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_C)
    mask = cols < C
    y = add_rms_norm_row(X, D, W, C, row, cols, mask, stride_x, stride_d, eps, HAS_D)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rotary_halves(base, rows_mask, f, HALF: tl.constexpr):
    """The two rotary halves of each row at ``base`` (pointers to each row's head), fp32."""
    m = rows_mask[:, None] & (f < HALF)[None, :]
    lo = tl.load(base[:, None] + f[None, :], mask=m, other=0.0).to(tl.float32)
    hi = tl.load(base[:, None] + HALF + f[None, :], mask=m, other=0.0).to(tl.float32)
    return lo, hi


@triton.jit
def rotary_angles(COS, SIN, pos, rows_mask, f, HALF: tl.constexpr):
    """cos and sin ``[rows, HALF]`` of each row's rotary position ``pos``."""
    m = rows_mask[:, None] & (f < HALF)[None, :]
    at = pos[:, None] * HALF + f[None, :]
    return tl.load(COS + at, mask=m, other=0.0), tl.load(SIN + at, mask=m, other=0.0)


@triton.jit
def rotate_halves(lo, hi, c, s, DT: tl.constexpr):
    """Rotary halves in fp32, rounded to DT, as transformers rounds q and k."""
    return (lo * c - hi * s).to(DT), (hi * c + lo * s).to(DT)


@triton.jit
def _rotary_kernel(QKV, COS, SIN, N, S, stride_t, HALF: tl.constexpr, HEAD_D: tl.constexpr,
                   BLOCK_T: tl.constexpr, BLOCK_F: tl.constexpr):
    # program (token tile, head): heads 0..H-1 are q's, H..2H-1 k's, consecutive in a row;
    # HALF and HEAD_D as constants, so a half-row (40 bf16 on the 7B) loads as vectors
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    head = tl.program_id(1)
    f = tl.arange(0, BLOCK_F)
    rows = toks < N
    row_at = QKV + toks.to(tl.int64) * stride_t + head * HEAD_D
    lo, hi = rotary_halves(row_at, rows, f, HALF)
    c, s = rotary_angles(COS, SIN, toks % S, rows, f, HALF)
    lo, hi = rotate_halves(lo, hi, c, s, QKV.dtype.element_ty)
    m = rows[:, None] & (f < HALF)[None, :]
    tl.store(row_at[:, None] + f[None, :], lo, mask=m)
    tl.store(row_at[:, None] + HALF + f[None, :], hi, mask=m)


@triton.jit
def silu_rounded(g, DT: tl.constexpr):
    """SiLU of fp32 ``g`` rounded to DT (as transformers' activation rounds it), in fp32."""
    return (g / (1.0 + tl.exp(-g))).to(DT).to(tl.float32)


@triton.jit
def _silu_mul_kernel(GU, OUT, N, INTER, stride_g, stride_o,
                     BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (rows < N)[:, None] & (cols < INTER)[None, :]
    g_at = GU + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    g = tl.load(g_at, mask=m, other=0.0).to(tl.float32)
    u = tl.load(g_at + INTER, mask=m, other=0.0).to(tl.float32)
    a = silu_rounded(g, OUT.dtype.element_ty)
    out = OUT + rows.to(tl.int64)[:, None] * stride_o + cols[None, :]
    tl.store(out, (a * u).to(OUT.dtype.element_ty), mask=m)


# ---------------------------------------------------------------------- custom ops
@torch.library.custom_op("mminfer::vision_add_rms_norm", mutates_args=("x",))
def _add_rms_norm_op(x: torch.Tensor, d: torch.Tensor | None, w: torch.Tensor,
                     eps: float) -> torch.Tensor:
    N, C = x.shape
    y = torch.empty_like(x)
    if N:
        _add_rms_norm_kernel[(N,)](
            x, d if d is not None else x, w, y, C, x.stride(0),
            d.stride(0) if d is not None else 0, y.stride(0), eps, HAS_D=d is not None,
            BLOCK_C=triton.next_power_of_2(C), num_warps=4 if C <= 2048 else 8)
    return y


@_add_rms_norm_op.register_fake
def _(x, d, w, eps):
    return torch.empty_like(x)


@torch.library.custom_op("mminfer::vision_rotary_", mutates_args=("qkv",))
def _rotary_op(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, S: int, heads: int,
               head_dim: int) -> None:
    N = qkv.shape[0]
    if N:
        BT = 32
        _rotary_kernel[(triton.cdiv(N, BT), 2 * heads)](
            qkv, cos, sin, N, S, qkv.stride(0), head_dim // 2, head_dim, BLOCK_T=BT,
            BLOCK_F=max(16, triton.next_power_of_2(head_dim // 2)), num_warps=4)


@_rotary_op.register_fake
def _(qkv, cos, sin, S, heads, head_dim):
    return None


@torch.library.custom_op("mminfer::vision_silu_mul", mutates_args=())
def _silu_mul_op(gu: torch.Tensor, inter: int) -> torch.Tensor:
    N = gu.shape[0]
    out = gu.new_empty(N, inter)
    if N:
        BR, BC = 8, 256
        _silu_mul_kernel[(triton.cdiv(N, BR), triton.cdiv(inter, BC))](
            gu, out, N, inter, gu.stride(0), out.stride(0), BLOCK_R=BR, BLOCK_C=BC,
            num_warps=4)
    return out


@_silu_mul_op.register_fake
def _(gu, inter):
    return gu.new_empty(gu.shape[0], inter)


# ---------------------------------------------------------------------- the steps
def _check_rows(x, *more):
    for t in (x,) + more:
        if t is not None and (t.dim() != 2 or t.stride(-1) != 1):
            raise ValueError(f"expected [rows, width] with contiguous rows, got "
                             f"{tuple(t.shape)} strides {t.stride()}")


def add_rms_norm(x, d, w, eps: float, *, triton_kernels: bool):
    """``(x + d, rms_norm(x + d) * w)``; ``d`` may be None (the norm of x alone). The Triton
    kernel writes the sum into x; the torch version returns a new tensor."""
    if triton_kernels:
        _check_rows(x, d)
        return x, _add_rms_norm_op(x, d, w, eps)
    if d is not None:
        x = x + d
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return x, w * h.to(x.dtype)


def rotary(qkv, cos, sin, S: int, heads: int, head_dim: int, *, triton_kernels: bool):
    """q and k of ``qkv [P*S, 3*heads*head_dim]`` rotated, token i at position i % S;
    ``cos``/``sin`` ``[S, head_dim/2]`` fp32 (the table's two halves are equal). Returns
    ``(q, k, v)``, each ``[P, S, heads, head_dim]``. The Triton kernel rotates in place (all
    three are views of qkv); the torch version makes new q and k (functional: what
    ``torch.compile`` fuses best)."""
    t = qkv.view(-1, S, 3, heads, head_dim)
    if triton_kernels:
        _check_rows(qkv)
        _rotary_op(qkv, cos, sin, S, heads, head_dim)
        return t.unbind(2)
    half = head_dim // 2
    c, s = cos.view(1, S, 1, half), sin.view(1, S, 1, half)

    def rot(u):
        f = u.float()
        lo, hi = f[..., :half], f[..., half:]
        return torch.cat((lo * c - hi * s, hi * c + lo * s), -1).to(u.dtype)

    q, k, v = t.unbind(2)
    return rot(q), rot(k), v


def silu_mul(gu, inter: int, *, triton_kernels: bool):
    """``silu(gu[:, :inter]) * gu[:, inter:]`` -> ``[N, inter]``."""
    if triton_kernels:
        _check_rows(gu)
        return _silu_mul_op(gu, inter)
    return F.silu(gu[:, :inter]) * gu[:, inter:]
