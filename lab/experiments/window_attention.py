"""The vision tower's attention layers before and after mminfer.models.window_attention, side
by side on one GPU (CUDA events, median of 20), at Qwen2.5-VL-7B's shapes: a 22-pair chunk of
40x72 patches (63,360 tokens), 16 heads of 80, window layers (45 windows of 64 tokens a pair)
and full layers (2880 tokens a pair).

* ``before``: the rotary kernel in place in the qkv buffer (mminfer.models.vision_fused),
  then SDPA per window shape (cuDNN's flash kernel on the H200), as the fused tower ran;
* the product's kernel (every head of a window in one program) at 4 and 8 warps
  (``window_attention.WARPS``), checked against ``before`` (max abs difference);
* a candidate for the FP8 tower, not yet measured: that kernel quantising its window's o
  rows in the same program after a barrier, against the kernel + fp8.quantize_rows (which it
  must equal bit for bit).

Dropped after earlier runs of this script (lab/NOTES.md §9; the code is in git at d1b0416):
one program per (head, window), 0.357 ms against 0.318; that layout flash-style on the full
layers, 5-14x slower than SDPA; the window kernel writing o in e4m3 at the window's max|v|
scale, 0.57-0.60 ms against 0.318 + 0.131.

    python lab/experiments/window_attention.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl

from mminfer.models import fp8
from mminfer.models import vision_fused as vf
from mminfer.models import window_attention as wa
from mminfer.models.fp8 import _e4m3_grid
from mminfer.models.vision import _attend, window_units
from lab.experiments.timing import ms
from mminfer.models.window_attention import _angles, _head


@triton.jit
def _window_heads_requant_kernel(QKV, COS, SIN, O, Q, QS, stride_t, stride_o, stride_q, S,
                                 start, n_win, L, qk_scale, H: tl.constexpr,
                                 HEAD_D: tl.constexpr, HALF: tl.constexpr,
                                 BLOCK_L: tl.constexpr, BLOCK_F: tl.constexpr,
                                 IEEE: tl.constexpr):
    # candidate, not yet measured: the product's kernel, then the window's rows
    # quantised per row in the same program (each row's amax over every head is known once
    # the head loop is done): o written in bf16 as now, read back after a barrier (from L1/L2,
    # the program wrote it) and written in e4m3: bit-equal to fp8.quantize_rows(o), without
    # that pass's launch and its read of o from DRAM
    win = tl.program_id(0)
    pos0 = start + (win % n_win) * L
    tok0 = (win // n_win).to(tl.int64) * S + pos0
    DT = QKV.dtype.element_ty
    f = tl.arange(0, BLOCK_F)
    rows = tl.arange(0, BLOCK_L)
    rmask = rows < L
    m2 = rmask[:, None] & (f < HALF)[None, :]
    c, s = _angles(COS, SIN, pos0 + rows, rmask, f, HALF)
    o_at = O + (tok0 + rows)[:, None] * stride_o + f[None, :]
    amax = tl.zeros([BLOCK_L], tl.float32)
    for h in range(H):
        o_lo, o_hi = _head(QKV, tok0, rows, rmask, f, c, s, h, stride_t, qk_scale, H, HEAD_D,
                           HALF, BLOCK_L, BLOCK_F, IEEE)
        o_lo, o_hi = o_lo.to(DT), o_hi.to(DT)
        tl.store(o_at + h * HEAD_D, o_lo, mask=m2)
        tl.store(o_at + h * HEAD_D + HALF, o_hi, mask=m2)
        amax = tl.maximum(amax, tl.max(tl.abs(o_lo.to(tl.float32)), 1))
        amax = tl.maximum(amax, tl.max(tl.abs(o_hi.to(tl.float32)), 1))
    scale = tl.maximum(amax / 448.0, 1e-12)
    tl.debug_barrier()                       # every head's o rows stored before they are read
    q_at = Q + (tok0 + rows)[:, None] * stride_q + f[None, :]
    for h in range(H):
        for part in range(2):
            x = tl.load(o_at + h * HEAD_D + part * HALF, mask=m2, other=0.0).to(tl.float32)
            v = tl.minimum(tl.maximum(x / scale[:, None], -448.0), 448.0)
            tl.store(q_at + h * HEAD_D + part * HALF, _e4m3_grid(v).to(Q.dtype.element_ty),
                     mask=m2)
    tl.store(QS + tok0 + rows, scale, mask=rmask)


def window_attention_requant(qkv, cos, sin, groups, S, heads, head_dim, scale, warps=4):
    """The candidate: ``(o in bf16, Fp8Act of o)`` from one launch per window shape."""
    N, half = qkv.shape[0], head_dim // 2
    o = qkv.new_empty(N, heads * head_dim)
    q = torch.empty(N, heads * head_dim, dtype=fp8.FP8, device=qkv.device)
    qs = torch.empty(N, 1, dtype=torch.float32, device=qkv.device)
    for start, n, L in groups:
        _window_heads_requant_kernel[(N // S * n,)](
            qkv, cos, sin, o, q, qs, qkv.stride(0), o.stride(0), q.stride(0), S, start, n, L,
            scale * wa.LOG2E, H=heads, HEAD_D=head_dim, HALF=half,
            BLOCK_L=max(16, triton.next_power_of_2(L)),
            BLOCK_F=max(16, triton.next_power_of_2(half)), IEEE=qkv.dtype == torch.float32,
            num_warps=warps)
    return o, fp8.Fp8Act(q, qs, qkv.dtype)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--pairs", type=int, default=22)
    a = ap.parse_args()
    hm, wm, heads, d, P = 20, 36, 16, 80, a.pairs
    S = hm * wm * 4
    _, ug = window_units(hm, wm, 4)
    cases = {"window": tuple((s * 4, n, k * 4) for s, n, k in ug), "full": ((0, 1, S),)}
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(P * S, 3 * heads * d, device="cuda", generator=g).to(torch.bfloat16)
    ang = torch.arange(S, device="cuda").float()[:, None] * torch.rand(d // 2, device="cuda",
                                                                       generator=g)
    cos, sin = ang.cos().contiguous(), ang.sin().contiguous()
    scale = d ** -0.5
    res = {"device": torch.cuda.get_device_name(), "pairs": P, "tokens": P * S,
           "heads": heads, "head_dim": d, "rows": []}
    groups = cases["window"]
    work = qkv.clone()

    def before():
        q, k, v = vf.rotary(work, cos, sin, S, heads, d, triton_kernels=True)
        return _attend(q, k, v, groups, scale)

    work.copy_(qkv)
    want = before().reshape(P * S, heads * d).float()
    t_rot = ms(lambda: vf.rotary(work, cos, sin, S, heads, d, triton_kernels=True))
    t_before = ms(before)
    o_bf = want.to(torch.bfloat16)
    t_quant = ms(lambda: fp8.quantize_rows(o_bf))
    row = {"layer": "window", "window_tokens": 64, "rotary_ms": t_rot, "before_ms": t_before,
           "quant_pass_ms": t_quant, "variants": []}
    print(f"window layer: rotary {t_rot:.3f} ms, rotary + SDPA {t_before:.3f} ms; the FP8 "
          f"tower's quantisation of o {t_quant:.3f} ms", flush=True)
    keep = wa.WARPS
    for warps in (4, 8):
        wa.WARPS = warps
        try:
            def fn():
                return wa.window_attention(qkv, cos, sin, groups, S, heads, d, scale)
            err = float((fn().float() - want).abs().max())
            t = ms(fn)
        finally:
            wa.WARPS = keep
        row["variants"].append({"kernel": "product", "warps": warps, "ms": t,
                                "max_abs_diff": err})
        print(f"  kernel w{warps}: {t:.3f} ms ({t_before / t:.2f}x rotary + SDPA), "
              f"max|diff| {err:.2e}", flush=True)
    # the candidate against the product's FP8 path (kernel, then fp8.quantize_rows of o)
    o_prod = wa.window_attention(qkv, cos, sin, groups, S, heads, d, scale)
    t_prod = ms(lambda: fp8.quantize_rows(wa.window_attention(qkv, cos, sin, groups, S,
                                                              heads, d, scale)))
    want_q = fp8.quantize_rows(o_prod)
    for warps in (4, 8):
        o2, q2 = window_attention_requant(qkv, cos, sin, groups, S, heads, d, scale, warps)
        equal = bool(torch.equal(o2, o_prod) and torch.equal(q2.scale, want_q.scale)
                     and torch.equal(q2.data.view(torch.uint8), want_q.data.view(torch.uint8)))
        t = ms(lambda: window_attention_requant(qkv, cos, sin, groups, S, heads, d, scale,
                                                warps))
        row["variants"].append({"kernel": "requant", "warps": warps,
                                "ms": t, "product_fp8_ms": t_prod, "bit_equal": equal})
        print(f"  requant w{warps}: {t:.3f} ms against kernel + quantize_rows "
              f"{t_prod:.3f} ms, bit-equal {equal}", flush=True)
    row["product_warps"] = wa.WARPS
    res["rows"].append(row)
    # full layers (2880 tokens a pair) stay on rotary + SDPA (lab/NOTES.md §9)
    res["full_layer_before_ms"] = ms(lambda: _attend(
        *vf.rotary(work, cos, sin, S, heads, d, triton_kernels=True), cases["full"], scale))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "window_attention.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
