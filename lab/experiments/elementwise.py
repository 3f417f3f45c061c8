"""Before/after of the prefill's elementwise kernels at the 7B sizes, side by side on one GPU
(CUDA events, median of 20 after a warm-up), each pair checked equal:

* LM rotary: transformers' ``apply_rotary_pos_emb`` on a chunk of q (28 x 128) and k
  (4 x 128) and the copy into the head-major buffers (the prefill before
  mminfer.models.rope) against ``rope.rotate_into``;
* vision rotary: the product's kernel (one program per 32 tokens x one head, 64 lanes for
  head_dim/2 = 40) against a variant over tiles of (head, f) pairs (tried, kept below:
  slower);
* SiLU·up → fp8: the two-pass kernel against the one-pass one at the vision MLP's width
  (3456) and the LM's (18944), which sets ``fp8.ONE_PASS_MAX``;
* the standalone quantiser (attention outputs): one row per program in two passes against
  several rows per program in one read, at the vision tower's 1280 and the LM's 3584, which
  sets ``fp8.QUANT_BLOCK``.

    python lab/experiments/elementwise.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton
import triton.language as tl
from transformers.models.qwen2_5_vl import modeling_qwen2_5_vl as qmod

from lab.experiments.timing import ms
from mminfer.models import fp8, rope
from mminfer.models import vision_fused as vf


@triton.jit
def _rotary_kernel_pairs(QKV, COS, SIN, N, S, stride_t, HALF, HEAD_D, PAIRS,
                         BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    # tried: program (token tile, tile of (head, f) pairs) so no lane idles on head_dim/2 =
    # 40 < 64; 2.6x slower on the H200 (0.51 -> 1.35 ms: a runtime // and % per element,
    # 80-byte runs), so the product keeps one head per program
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    p = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    f = p % HALF
    m = (toks < N)[:, None] & (p < PAIRS)[None, :]
    base = QKV + toks.to(tl.int64)[:, None] * stride_t + ((p // HALF) * HEAD_D + f)[None, :]
    lo = tl.load(base, mask=m, other=0.0).to(tl.float32)
    hi = tl.load(base + HALF, mask=m, other=0.0).to(tl.float32)
    at = (toks % S)[:, None] * HALF + f[None, :]
    c = tl.load(COS + at, mask=m, other=0.0)
    s = tl.load(SIN + at, mask=m, other=0.0)
    tl.store(base, (lo * c - hi * s).to(QKV.dtype.element_ty), mask=m)
    tl.store(base + HALF, (hi * c + lo * s).to(QKV.dtype.element_ty), mask=m)


def vision_rotary_pairs(qkv, cos, sin, S, heads, head_dim):
    N, pairs = qkv.shape[0], heads * head_dim
    BT, BK = 16, min(256, triton.next_power_of_2(pairs))
    _rotary_kernel_pairs[(triton.cdiv(N, BT), triton.cdiv(pairs, BK))](
        qkv, cos, sin, N, S, qkv.stride(0), head_dim // 2, head_dim, pairs, BLOCK_T=BT,
        BLOCK_K=BK, num_warps=4)


def lm_rope(c=16384, n=32768, H=28, Hkv=4, d=128):
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    qp = torch.randn(1, c, H * d, device="cuda", generator=g).to(bf)
    kp = torch.randn(1, c, Hkv * d, device="cuda", generator=g).to(bf)
    cos = torch.randn(1, c, d, device="cuda", generator=g).to(bf)
    sin = torch.randn(1, c, d, device="cuda", generator=g).to(bf)
    q = torch.empty(1, H, n, d, device="cuda", dtype=bf)
    k = torch.empty(1, Hkv, n, d, device="cuda", dtype=bf)
    q2, k2 = torch.empty_like(q), torch.empty_like(k)
    s = 4096

    def before():
        qc = qp.view(1, c, H, d).transpose(1, 2)
        kc = kp.view(1, c, Hkv, d).transpose(1, 2)
        qc, kc = qmod.apply_rotary_pos_emb(qc, kc, cos, sin)
        q[:, :, s:s + c], k[:, :, s:s + c] = qc, kc

    def after():
        rope.rotate_into(q2[0, :, s:s + c], qp[0], cos[0], sin[0])
        rope.rotate_into(k2[0, :, s:s + c], kp[0], cos[0], sin[0])

    before()
    after()
    same = bool(torch.equal(q[:, :, s:s + c], q2[:, :, s:s + c])
                and torch.equal(k[:, :, s:s + c], k2[:, :, s:s + c]))
    bytes_ = 2 * 2 * c * (H + Hkv) * d
    b, a = ms(before), ms(after)
    return {"tokens": c, "before_ms": b, "after_ms": a, "speedup": b / a, "equal": same,
            "after_tb_s": bytes_ / a / 1e9}


def vision_rotary(N=63360, S=2880, heads=16, d=80):
    g = torch.Generator(device="cuda").manual_seed(1)
    qkv = torch.randn(N, 3 * heads * d, device="cuda", generator=g).to(torch.bfloat16)
    cos = torch.randn(S, d // 2, device="cuda", generator=g)
    sin = torch.randn(S, d // 2, device="cuda", generator=g)
    a, b = qkv.clone(), qkv.clone()
    vf.rotary(a, cos, sin, S, heads, d, triton_kernels=True)
    vision_rotary_pairs(b, cos, sin, S, heads, d)
    same = bool(torch.equal(a, b))
    bytes_ = 2 * 2 * N * 2 * heads * d
    tp = ms(lambda: vf.rotary(a, cos, sin, S, heads, d, triton_kernels=True))
    tt = ms(lambda: vision_rotary_pairs(b, cos, sin, S, heads, d))
    return {"tokens": N, "product_ms": tp, "pairs_tiling_ms": tt, "equal": same,
            "product_tb_s": bytes_ / tp / 1e9}


def silu_quant(N, C):
    g = torch.Generator(device="cuda").manual_seed(2)
    gu = torch.randn(N, 2 * C, device="cuda", generator=g).to(torch.bfloat16)
    gate, up = gu[:, :C], gu[:, C:]
    out = {}
    for name in ("two_pass", "one_pass"):
        q = torch.empty(N, C, dtype=fp8.FP8, device="cuda")
        s = torch.empty(N, 1, dtype=torch.float32, device="cuda")
        if name == "two_pass":
            def fn():
                fp8._silu_mul_quant_kernel[(N,)](gate, up, q, s, C, gate.stride(0),
                                                 up.stride(0), q.stride(0),
                                                 BLOCK_C=fp8._tile(C), num_warps=4)
        else:
            B = triton.next_power_of_2(C)

            def fn():
                fp8._silu_mul_quant_row_kernel[(N,)](gate, up, q, s, C, gate.stride(0),
                                                     up.stride(0), q.stride(0), BLOCK_C=B,
                                                     num_warps=max(8, min(32, B // 1024)))
        t = ms(fn)
        out[name] = {"ms": t, "tb_s": N * C * 5 / t / 1e9, "q": q.view(torch.uint8).clone(),
                     "s": s.clone()}
    same = bool(torch.equal(out["two_pass"]["q"], out["one_pass"]["q"])
                and torch.equal(out["two_pass"]["s"], out["one_pass"]["s"]))
    return {"rows": N, "width": C, "equal": same,
            **{f"{k}_ms": v["ms"] for k, v in out.items()},
            **{f"{k}_tb_s": v["tb_s"] for k, v in out.items()}}


def quant(N, C):
    """The standalone per-row quantiser (the attention output before its projection): the
    two-pass, one-row-per-program kernel against the one-read multi-row kernel at a sweep of
    (elements per program, warps); equal bits required."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(N, C, device="cuda", generator=g).to(torch.bfloat16)
    q0 = torch.empty(N, C, dtype=fp8.FP8, device="cuda")
    s0 = torch.empty(N, 1, dtype=torch.float32, device="cuda")

    def two_pass():
        fp8._quant_kernel[(N,)](x, q0, s0, C, x.stride(0), q0.stride(0),
                                BLOCK_C=fp8._tile(C), num_warps=4)

    out = {"rows": N, "width": C, "two_pass_ms": ms(two_pass), "multi_row": []}
    B = triton.next_power_of_2(C)
    for block, warps in ((4096, 4), (8192, 4), (8192, 8), (16384, 8), (16384, 16)):
        R = max(1, block // B)
        q = torch.empty_like(q0)
        s = torch.empty_like(s0)

        def fn():
            fp8._quant_rows_kernel[(triton.cdiv(N, R),)](x, q, s, N, C, x.stride(0),
                                                         q.stride(0), BLOCK_R=R, BLOCK_C=B,
                                                         num_warps=warps)
        t = ms(fn)
        equal = bool(torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
                     and torch.equal(s, s0))
        out["multi_row"].append({"block": block, "rows": R, "warps": warps, "ms": t,
                                 "equal": equal, "tb_s": N * C * 3 / t / 1e9})
    out["product"] = {"block": fp8.QUANT_BLOCK, "warps": 8}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "lm_rope": lm_rope(), "vision_rotary": vision_rotary(),
           "silu_quant_vision": silu_quant(63360, 3456),
           "silu_quant_lm": silu_quant(16384, 18944),
           "quant_vision": quant(63360, 1280), "quant_lm": quant(16384, 3584)}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "elementwise.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
