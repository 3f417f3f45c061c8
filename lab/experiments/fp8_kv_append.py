"""Appending a follow-up's rows to the FP8 KV cache: the product's two torch passes against
one Triton launch for K and V, at a follow-up suffix's size (Qwen2.5-VL-7B: 4 KV heads of
128, tens of new rows, 28 layers), side by side on one GPU.

Why: through ``Pipeline.answer`` an FP8-cache follow-up took 45 ms against bf16's 35
(BENCHMARKS.md "Decode and FP8", 89a3ba8). The suffix runs eagerly; where bf16 appends with
two ``copy_``, ``kv.SlabLayer.update`` quantises K and V with ~6 torch ops each
(``kv.quantize_into``: reciprocal, float, mul, clamp, cast, copy), ~330 launches a 28-layer
suffix. This times, per layer:

* ``product``: ``kv.quantize_into`` for K, then V (what the cache runs);
* ``fused``: ``append_fp8`` below, K and V quantised into their buffers by one kernel;

each as device time (CUDA events) and as host time a call (wall clock, no sync: what an eager
suffix pays when the GPU waits on the launches), checked bit-equal to the product.

    python lab/experiments/fp8_kv_append.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import triton
import triton.language as tl

from lab.experiments.timing import ms
from mminfer.models import kv
from mminfer.kernels.fp8_quant import _to_e4m3


@triton.jit
def _append_kernel(K, V, KB, VB, KS, VS, n, stride_kh, stride_kn, stride_vh, stride_vn,
                   stride_bh, stride_bn, at, D: tl.constexpr, BLOCK_N: tl.constexpr):
    # program (head, block of new rows): K's and V's rows of that head quantised with the
    # head's scale into the buffers at row ``at`` on
    h = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    m = (rows < n)[:, None]
    src = h * stride_kh + rows[:, None] * stride_kn + d[None, :]
    dst = h * stride_bh + (at + rows)[:, None] * stride_bn + d[None, :]
    k = tl.load(K + src, mask=m, other=0.0).to(tl.float32) * (1.0 / tl.load(KS + h))
    k = tl.minimum(tl.maximum(k, -448.0), 448.0)
    tl.store(KB + dst, _to_e4m3(k, KB.dtype.element_ty), mask=m)
    src = h * stride_vh + rows[:, None] * stride_vn + d[None, :]
    v = tl.load(V + src, mask=m, other=0.0).to(tl.float32) * (1.0 / tl.load(VS + h))
    v = tl.minimum(tl.maximum(v, -448.0), 448.0)
    tl.store(VB + dst, _to_e4m3(v, VB.dtype.element_ty), mask=m)


def append_fp8(k_buf, v_buf, k, v, k_scale, v_scale, at: int):
    """``k``/``v`` ``[1, H, n, D]`` quantised per head into ``k_buf``/``v_buf`` ``[1, H, cap,
    D]`` (fp8) at rows ``at``..``at + n``, as ``kv.quantize_into`` does for each."""
    _, H, n, D = k.shape
    BN = 16
    _append_kernel[(H, triton.cdiv(n, BN))](
        k, v, k_buf, v_buf, k_scale, v_scale, n, k.stride(1), k.stride(2), v.stride(1),
        v.stride(2), k_buf.stride(1), k_buf.stride(2), at, D=D, BLOCK_N=BN, num_warps=4)


def host_us(fn, reps: int = 200) -> float:
    """Wall-clock microseconds a call, launches only (one sync at the end)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize()
    return t / reps * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    H, D, cap, at = 4, 128, 280_000, 276_503
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for n in (1, 23, 64):
        k = torch.randn(1, H, n, D, device="cuda", generator=g).to(torch.bfloat16)
        v = torch.randn(1, H, n, D, device="cuda", generator=g).to(torch.bfloat16)
        ks, vs = kv.head_scales(k) * 2, kv.head_scales(v) * 2
        bufs = [torch.zeros(1, H, cap, D, device="cuda", dtype=kv.FP8) for _ in range(4)]

        def product():
            kv.quantize_into(bufs[0][..., at:at + n, :], k, ks)
            kv.quantize_into(bufs[1][..., at:at + n, :], v, vs)

        def fused():
            append_fp8(bufs[2], bufs[3], k, v, ks, vs, at)
        product()
        fused()
        equal = all(torch.equal(bufs[i][..., at:at + n, :].view(torch.uint8),
                                bufs[i + 2][..., at:at + n, :].view(torch.uint8))
                    for i in (0, 1))
        row = {"rows": n, "heads": H, "head_dim": D, "equal": equal,
               "product_ms": ms(product), "fused_ms": ms(fused),
               "product_host_us": host_us(product), "fused_host_us": host_us(fused)}
        rows.append(row)
        print(row, flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_kv_append.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
