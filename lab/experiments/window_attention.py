"""The vision tower's attention layers before and after mminfer.models.window_attention, side
by side on one GPU (CUDA events, median of 20), at Qwen2.5-VL-7B's shapes: a 22-pair chunk of
40x72 patches (63,360 tokens), 16 heads of 80, window layers (45 windows of 64 tokens a pair)
and full layers (2880 tokens a pair).

* ``before``: the rotary kernel in place in the qkv buffer (mminfer.models.vision_fused),
  then SDPA per window shape (cuDNN's flash kernel on the H200), as the fused tower ran;
* the one-pass kernel in its two layouts: one head per program, or every head of a window in
  one program (``HEADS_MAX_L``), 4 or 8 warps (``HEADS_WARPS``), the latter also writing o
  in e4m3 for the FP8 tower's proj (against ``before`` plus fp8's quantisation pass).

Each kernel run is checked against ``before`` (max abs difference; FP8 dequantised). The
first sweep (tiles of the one-head layout, and that layout on the full layers: 5-14x slower
than SDPA, so full layers keep it) is in lab/NOTES.md §9.

    python lab/experiments/window_attention.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from mminfer.models import vision_fused as vf
from mminfer.models import window_attention as wa
from mminfer.models.vision import _attend, window_units


def ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    t = sorted(a.elapsed_time(b) for a, b in ev)
    return t[len(t) // 2]


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
    from mminfer.models import fp8
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
    keep = (wa.HEADS_MAX_L, wa.HEADS_WARPS)
    # (layout, warps, FP8 output): one head per program (HEADS_MAX_L = 0), or every head of
    # a window in one program, writing bf16 or e4m3
    for layout, warps, q8 in (("head", 4, False), ("window", 4, False), ("window", 8, False),
                              ("window", 4, True), ("window", 8, True)):
        wa.HEADS_MAX_L, wa.HEADS_WARPS = (0 if layout == "head" else 64), warps
        try:
            def fn():
                return wa.window_attention(qkv, cos, sin, groups, S, heads, d, scale,
                                           quantize=q8)
            out = fn()
            got = out.dequantize().float() if q8 else out.float()
            err = float((got - want).abs().max())
            t = ms(fn)
        except Exception as e:                   # a layout that does not compile or fit
            print(f"  {layout} w{warps} fp8={q8}: failed {type(e).__name__}: {e}"[:300])
            continue
        finally:
            wa.HEADS_MAX_L, wa.HEADS_WARPS = keep
        row["variants"].append({"layout": layout, "warps": warps, "fp8_out": q8, "ms": t,
                                "max_abs_diff": err})
        print(f"  {layout:6s} w{warps} {'fp8 ' if q8 else 'bf16'}: {t:.3f} ms "
              f"({t_before / t:.2f}x rotary + SDPA), max|diff| {err:.2e}", flush=True)
    row["product"] = {"heads_max_l": wa.HEADS_MAX_L, "warps": wa.HEADS_WARPS}
    res["rows"].append(row)
    # full layers (2880 tokens a pair) stay on rotary + SDPA: measured 2.67 ms against
    # 12.7-37 ms for the one-head-per-program kernel at 64-128 tiles (lab/NOTES.md §9)
    res["full_layer_before_ms"] = ms(lambda: _attend(
        *vf.rotary(work, cos, sin, S, heads, d, triton_kernels=True), cases["full"], scale))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "window_attention.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
