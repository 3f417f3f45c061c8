"""The vision tower's attention layers before and after mminfer.kernels.window_attention, side
by side on one GPU (CUDA events, median of 20), at Qwen2.5-VL-7B's shapes: a 22-pair chunk of
40x72 patches (63,360 tokens), 16 heads of 80, window layers (45 windows of 64 tokens a pair)
and full layers (2880 tokens a pair).

* ``before``: the rotary kernel in place in the qkv buffer (mminfer.kernels.vision_elementwise),
  then SDPA per window shape (cuDNN's flash kernel on the H200), as the fused tower ran;
* the product's kernel (every head of a window in one program) at 4 and 8 warps
  (``window_attention.WARPS``), checked against ``before`` (max abs difference);
* the FP8 tower's path after it, the kernel + fp8_quant.quantize_rows of o;
* what the output projection (1280 x 1280) costs on o: bf16 ``F.linear``, the FP8 layer as
  the tower runs it (quantisation pass + scaled GEMM), the scaled GEMM alone on o quantised.

Dropped after earlier runs of this script (lab/NOTES.md §9, §10): one program per (head,
window), 0.357 ms against 0.318; that layout flash-style on the full layers, 5-14x slower than
SDPA; the window kernel writing o in e4m3 at the window's max|v| scale, 0.57-0.60 ms against
0.318 + 0.131 (code in git at d1b0416); the kernel quantising its window's o rows itself
after a barrier, bit-equal but 0.557-0.599 ms against 0.446 for the kernel + the
quantisation pass (code in git at 08b42af).

    python lab/experiments/window_attention.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from mminfer.kernels import fp8_quant
from mminfer.kernels import vision_elementwise as vf
from mminfer.kernels import window_attention as wa
from mminfer.models import fp8
from mminfer.models.vision import _attend, window_units
from lab.experiments.timing import ms


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
    t_quant = ms(lambda: fp8_quant.quantize_rows(o_bf))
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
    # the FP8 tower's path: the kernel, then the quantisation pass over o
    o_prod = wa.window_attention(qkv, cos, sin, groups, S, heads, d, scale)
    row["product_fp8_ms"] = ms(lambda: fp8_quant.quantize_rows(
        wa.window_attention(qkv, cos, sin, groups, S, heads, d, scale)))
    print(f"  kernel + quantize_rows: {row['product_fp8_ms']:.3f} ms", flush=True)
    # the output projection that reads o, in each precision
    lin = torch.nn.Linear(heads * d, heads * d, device="cuda", dtype=torch.bfloat16)
    f8 = fp8.Fp8Linear.from_linear(lin)
    o_q = fp8_quant.quantize_rows(o_prod)
    row["proj"] = {"bf16_ms": ms(lambda: F.linear(o_prod, lin.weight, lin.bias)),
                   "fp8_with_quant_pass_ms": ms(lambda: f8(o_prod)),
                   "fp8_gemm_only_ms": ms(lambda: f8(o_q))}
    print("  proj: " + ", ".join(f"{k} {v:.3f}" for k, v in row["proj"].items()), flush=True)
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
