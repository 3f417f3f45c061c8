"""The vision tower's attention layers before and after mminfer.models.window_attention, side
by side on one GPU (CUDA events, median of 20), at Qwen2.5-VL-7B's shapes: a 22-pair chunk of
40x72 patches (63,360 tokens), 16 heads of 80, window layers (45 windows of 64 tokens a pair)
and full layers (2880 tokens a pair).

* ``before``: the rotary kernel in place in the qkv buffer (mminfer.models.vision_fused),
  then SDPA per window shape (cuDNN's flash kernel on the H200), as the fused tower ran;
* ``kernel``: the one-pass kernel, at its product tiles and at a sweep of
  (BLOCK_M, BLOCK_N, warps), which sets ``window_attention.tiles`` and ``MAX_WINDOW``.

Each kernel run is checked against ``before`` (max abs difference, bf16).

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
    product_tiles = wa.tiles
    for name, groups in cases.items():
        work = qkv.clone()

        def before():
            q, k, v = vf.rotary(work, cos, sin, S, heads, d, triton_kernels=True)
            return _attend(q, k, v, groups, scale)

        def rotary_only():
            vf.rotary(work, cos, sin, S, heads, d, triton_kernels=True)

        t_rot = ms(rotary_only)
        t_before = ms(before)
        work.copy_(qkv)
        q, k, v = vf.rotary(work, cos, sin, S, heads, d, triton_kernels=True)
        want = _attend(q, k, v, groups, scale).reshape(P * S, heads * d).float()
        L = groups[0][2]
        sweep = [(64, 64, 4), (64, 64, 2), (64, 64, 8), (32, 64, 4), (64, 32, 4)] \
            if L <= 64 else [(64, 64, 4), (128, 64, 4), (128, 64, 8), (64, 128, 4),
                             (128, 128, 8), (128, 32, 4)]
        row = {"layer": name, "window_tokens": L, "rotary_ms": t_rot, "before_ms": t_before,
               "kernel": []}
        print(f"{name} layer (windows of {L}): rotary {t_rot:.3f} ms, rotary + SDPA "
              f"{t_before:.3f} ms", flush=True)
        for bm, bn, warps in sweep:
            wa.tiles = lambda _L, t=(bm, bn, warps): t
            try:
                out = wa.window_attention(qkv, cos, sin, groups, S, heads, d, scale)
                err = float((out.float() - want).abs().max())
                t = ms(lambda: wa.window_attention(qkv, cos, sin, groups, S, heads, d, scale))
            except Exception as e:               # a tile that does not compile or fit
                print(f"  {bm}x{bn} w{warps}: failed {type(e).__name__}: {e}"[:200])
                continue
            finally:
                wa.tiles = product_tiles
            row["kernel"].append({"block_m": bm, "block_n": bn, "warps": warps, "ms": t,
                                  "max_abs_diff": err})
            print(f"  kernel {bm}x{bn} w{warps}: {t:.3f} ms ({t_before / t:.2f}x), "
                  f"max|diff| {err:.2e}", flush=True)
        row["product_tiles"] = list(product_tiles(L))
        res["rows"].append(row)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "window_attention.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
