"""The language model's rotary embedding in the prefill, one pass from a projection's output
into the head-major buffer attention reads.

transformers' ``apply_rotary_pos_emb`` on a chunk of q (and k) is five kernels over
transposed views — ``q * cos``, ``rotate_half`` (a negation and a cat), ``* sin``, the sum —
and the prefill then copies the result into its ``[1, H, N, d]`` buffer: on the H200 at 276K
tokens (Qwen2.5-VL-7B) about 0.5 s of a 4-6.8 s ``llm_other`` (``benchmarks/prefill.py
--profile``). :func:`rotate_into` reads the projection's rows ``[c, H*d]`` once and writes
the rotated heads where the buffer keeps them, with transformers' arithmetic to the bit:
each product rounded to the tensor's dtype, then the sum rounded (``rotate_half``'s negation
is exact), cos and sin as the model's rotary embedding gives them (already in that dtype;
M-RoPE's sections are composed there). The torch version is that arithmetic written with
torch ops (the CPU path, and the reference the kernel is tested against).

Only transformers' standard RoPE (the Qwen2 and Qwen2.5-VL text models') is taken here:
:func:`standard` says whether a model's ``apply_rotary_pos_emb`` is that one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .runtime import use_triton

# the modules whose apply_rotary_pos_emb is q * cos + rotate_half(q) * sin over [.., d]
STANDARD_MODULES = ("transformers.models.qwen2.modeling_qwen2",
                    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl")


# the dtypes the kernel rounds like torch (bf16: the models'; fp32); others take torch ops
KERNEL_DTYPES = (torch.bfloat16, torch.float32)


def standard(apply_rope) -> bool:
    """Whether ``apply_rope`` is transformers' plain ``apply_rotary_pos_emb`` of a model this
    module reproduces (a kernel from the hub or another model's variant is not)."""
    return (getattr(apply_rope, "__name__", None) == "apply_rotary_pos_emb"
            and getattr(apply_rope, "__module__", None) in STANDARD_MODULES)


@triton.jit
def _to_bf16_grid(v):
    """fp32 ``v`` rounded to the nearest bf16 value (ties to even), kept in fp32. On the bit
    pattern: the compiler rewrites ``v.to(bf16).to(fp32)`` feeding more arithmetic into bf16
    FMAs (one rounding fewer, 1 ulp off torch; seen in the H200's PTX), integer ops it
    leaves alone."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _rope_kernel(X, COS, SIN, OUT, C, stride_xt, stride_ct, stride_st, stride_oh, stride_ot,
                 HALF: tl.constexpr, BLOCK_T: tl.constexpr):
    # program (token tile, head): both halves of every row of the tile, each product and the
    # sum rounded to the output dtype as torch's elementwise ops round them
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)   # h * stride_oh passes 2^31 at 1M tokens x 28 heads
    f = tl.arange(0, HALF)[None, :]
    m = (t < C)[:, None]
    t64 = t.to(tl.int64)[:, None]
    x = X + t64 * stride_xt + h * (2 * HALF) + f
    lo = tl.load(x, mask=m, other=0.0).to(tl.float32)
    hi = tl.load(x + HALF, mask=m, other=0.0).to(tl.float32)
    c = COS + t64 * stride_ct + f
    s = SIN + t64 * stride_st + f
    c_lo = tl.load(c, mask=m, other=0.0).to(tl.float32)
    c_hi = tl.load(c + HALF, mask=m, other=0.0).to(tl.float32)
    s_lo = tl.load(s, mask=m, other=0.0).to(tl.float32)
    s_hi = tl.load(s + HALF, mask=m, other=0.0).to(tl.float32)
    if OUT.dtype.element_ty == tl.bfloat16:
        out_lo = _to_bf16_grid(_to_bf16_grid(lo * c_lo) - _to_bf16_grid(hi * s_lo))
        out_hi = _to_bf16_grid(_to_bf16_grid(hi * c_hi) + _to_bf16_grid(lo * s_hi))
    else:   # fp32: no rounding between the steps
        out_lo = lo * c_lo - hi * s_lo
        out_hi = hi * c_hi + lo * s_hi
    o = OUT + h * stride_oh + t64 * stride_ot + f
    tl.store(o, out_lo.to(OUT.dtype.element_ty), mask=m)
    tl.store(o + HALF, out_hi.to(OUT.dtype.element_ty), mask=m)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``q * cos + rotate_half(q) * sin`` for ``x [H, c, d]``, ``cos``/``sin``
    ``[c, d]``."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rot * sin)


def rotate_into(out: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                kernels: str = "auto") -> None:
    """``out[h, t] = rope(x[t, h*d:(h+1)*d])``: ``x [c, H*d]`` (a projection's output rows),
    ``out [H, c, d]`` (e.g. ``q[0, :, s:e]`` of the prefill's head-major buffer, any strides
    with unit stride along d), ``cos``/``sin`` ``[c, d]`` in x's dtype."""
    H, c, d = out.shape
    if x.shape != (c, H * d) or cos.shape != (c, d) or sin.shape != (c, d):
        raise ValueError(f"rotate_into: x {tuple(x.shape)}, cos {tuple(cos.shape)} do not fit "
                         f"out {tuple(out.shape)}")
    half = d // 2
    if not (use_triton(x, kernels) and x.dtype in KERNEL_DTYPES and out.dtype == x.dtype
            and cos.dtype == x.dtype and sin.dtype == x.dtype and d % 2 == 0 and half >= 8 and half & (half - 1) == 0
            and x.stride(-1) == 1 and out.stride(-1) == 1 and cos.stride(-1) == 1
            and sin.stride(-1) == 1):
        out.copy_(rotate_ref(x.view(c, H, d).transpose(0, 1), cos, sin))
        return
    if c == 0:
        return
    BT = 32
    _rope_kernel[(triton.cdiv(c, BT), H)](
        x, cos, sin, out, c, x.stride(0), cos.stride(0), sin.stride(0), out.stride(0),
        out.stride(1), HALF=half, BLOCK_T=BT, num_warps=4)
