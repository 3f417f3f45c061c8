"""Tile sweep for the FP8 cache's flash-decoding kernel (mminfer.kernels.fp8_attention), against
bf16 attention over the same keys: issue 34 left the FP8 cache's decode steps and follow-ups
slower than bf16's (12.9 vs 11.3 ms a token at 276K, 25.1 vs 22.4 at 1.05M) with the kernel's
tiles a first guess (``tiles``: BLOCK_N 64, 4 warps, 2 stages).

For each cache length and query count (1: a decode step; 16: a short question's suffix) and
each (BLOCK_N, warps, stages, target waves of programs), the kernel's time (CUDA events,
median of 30), checked against the product's configuration's output; beside it bf16 SDPA
(flash/cuDNN, what the bf16 cache's decode uses) on the dequantised cache. Qwen2-7B's
attention shape: 28 query heads, 4 KV heads, d 128. The sweep patches the module's ``tiles``
and ``split_plan`` for the run; the product keeps what wins, by hand.

    python lab/experiments/fp8_decode_tiles.py --out $OUT           # on the GPU (~1-2 min)
    TRITON_INTERPRET=1 python lab/experiments/fp8_decode_tiles.py --tiny --out /tmp/t   # CPU check
"""

from __future__ import annotations

import argparse
import itertools
import json
import os

import torch
import torch.nn.functional as F

from lab.experiments.timing import ms
from mminfer.kernels import fp8_attention as fa


DEV = "cuda"


def cache(n, Hkv=4, D=128, seed=0):
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    g = torch.Generator(device=DEV).manual_seed(seed)
    k = torch.randn(1, Hkv, n, D, device=DEV, generator=g).to(dt)
    v = torch.randn(1, Hkv, n, D, device=DEV, generator=g).to(dt)
    ks = k.float().abs().amax(dim=(0, 2, 3)) / 448
    vs = v.float().abs().amax(dim=(0, 2, 3)) / 448
    kq = (k.float() / ks.view(1, -1, 1, 1)).to(fa.FP8)
    vq = (v.float() / vs.view(1, -1, 1, 1)).to(fa.FP8)
    return k, v, kq, vq, ks, vs


def sweep(n, q_len, H=28, Hkv=4, D=128, grid=((64, 128), (4, 8), (2, 3, 4), (1, 2, 4))):
    k, v, kq, vq, ks, vs = cache(n, Hkv, D)
    q = torch.randn(1, H, q_len, D, device=DEV).to(k.dtype)
    want = fa.fp8_attention(q, kq, vq, ks, vs)
    rows = []
    orig_tiles, orig_plan = fa.tiles, fa.split_plan
    product = orig_tiles(q_len * H // Hkv, DEV == "cuda")
    try:
        for bn, warps, stages, waves in itertools.product(*grid):
            bm = product[0]

            def tiles(rows_, gpu, _c=(bm, bn, warps, stages)):
                return _c

            def plan(kv_len, programs, *, gpu, block_n, sms=132, waves=None, _w=waves):
                want_ = max(1, min(fa.MAX_SPLITS, -(-_w * sms // max(programs, 1))))
                split_len = max(-(-kv_len // want_), fa.MIN_SPLIT_GPU if gpu else block_n)
                split_len = -(-split_len // block_n) * block_n
                return split_len, -(-kv_len // split_len)

            fa.tiles, fa.split_plan = tiles, plan
            try:
                got = fa.fp8_attention(q, kq, vq, ks, vs)
                err = float((got.float() - want.float()).abs().max())
                t = ms(lambda: fa.fp8_attention(q, kq, vq, ks, vs))
            except Exception as e:   # noqa: BLE001 (a config that does not compile: a result)
                rows.append({"block_n": bn, "warps": warps, "stages": stages, "waves": waves,
                             "error": f"{type(e).__name__}: {e}"[:200]})
                continue
            finally:
                fa.tiles, fa.split_plan = orig_tiles, orig_plan
            rows.append({"block_n": bn, "warps": warps, "stages": stages, "waves": waves,
                         "ms": t, "max_abs_diff_vs_product": err})
    finally:
        fa.tiles, fa.split_plan = orig_tiles, orig_plan
    product_ms = ms(lambda: fa.fp8_attention(q, kq, vq, ks, vs))
    kk = k.repeat_interleave(H // Hkv, 1)
    vv = v.repeat_interleave(H // Hkv, 1)
    bf16_ms = ms(lambda: F.scaled_dot_product_attention(q, kk, vv, is_causal=False))
    ok = [r for r in rows if "ms" in r]
    best = min(ok, key=lambda r: r["ms"]) if ok else None
    return {"kv_len": n, "q_len": q_len, "product_tiles": list(product),
            "product_ms": product_ms, "bf16_sdpa_ms": bf16_ms, "best": best, "rows": rows}


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[276480, 1052672])
    ap.add_argument("--q-lens", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--tiny", action="store_true",
                    help="the CPU under TRITON_INTERPRET=1: 4 query / 2 KV heads of 16, two tiles")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    global DEV
    kw = {}
    if a.tiny:
        DEV, a.lengths, a.q_lens = "cpu", [300], [1]
        kw = dict(H=4, Hkv=2, D=16, grid=((16, 32), (4,), (1,), (1, 2)))
    res = {"device": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
           "torch": torch.__version__, "runs": []}
    for n in a.lengths:
        for ql in a.q_lens:
            r = sweep(n, ql, **kw)
            res["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "rows"}), flush=True)
            if DEV == "cuda":
                torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_decode_tiles.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
