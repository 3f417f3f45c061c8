"""Before/after of the prefill's elementwise kernels at the 7B sizes, side by side on one GPU
(CUDA events, median of 20 after a warm-up), each pair checked equal:

* LM rotary: transformers' ``apply_rotary_pos_emb`` on a chunk of q (28 x 128) and k
  (4 x 128) and the copy into the head-major buffers (the prefill before
  mminfer.kernels.rope) against ``rope.rotate_into``;
* vision rotary: the product's kernel (one program per 32 tokens x one head, 64 lanes for
  head_dim/2 = 40) against a variant over tiles of (head, f) pairs (tried, kept below:
  slower);
* SiLU·up → fp8: the two-pass kernel against the one-pass one at the vision MLP's width
  (3456) and the LM's (18944), which sets ``fp8_quant.ONE_PASS_MAX``; at 3456 also several rows
  a program (``_silu_mul_quant_rows_kernel`` below) at a sweep of warps, with each e4m3
  conversion (``_fp8_of``: the fp32 grid, Triton's cast, the hardware's cvt.rn.satfinite),
  against the bf16 tower's SiLU·up;
* the e4m3 conversions against torch's cast on every rounding case and 1M random values;
* the standalone quantiser (attention outputs): the product's one row per program in two
  passes against several rows per program in one read (``_quant_rows_kernel`` below, each
  conversion), at 1280 and the LM's 3584: it sets ``fp8_quant.QUANT_BLOCK``;
* residual add + RMSNorm -> fp8 (the FP8 vision tower's norms, 1280 wide): the product's one
  row per program at 2 and 4 (product) warps and several rows per program
  (``_rms_norm_quant_rows_kernel`` below, grid or cvt), against the bf16 tower's add +
  RMSNorm kernel.

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
from mminfer.kernels import fp8_quant, rope
from mminfer.kernels import vision_elementwise as vf
from mminfer.kernels.fp8_quant import _e4m3_grid


@triton.jit
def _cvt_e4m3(v):
    """e4m3 codes (uint8) of fp32 ``v`` by the hardware's cvt.rn.satfinite.e4m3x2.f32, one
    value an instruction (it packs cvt(a) into the high byte of d, cvt(b) into the low)."""
    pair = tl.inline_asm_elementwise("cvt.rn.satfinite.e4m3x2.f32 $0, $1, $1;", "=h,r", [v],
                                     dtype=tl.int16, is_pure=True, pack=1)
    return (pair & 0xFF).to(tl.uint8)


@triton.jit
def _fp8_of(v, DT: tl.constexpr, HW: tl.constexpr):
    # v on e4m3's range -> DT: HW 0 rounds onto the e4m3 grid in fp32 first (the product
    # before 2026-12-04, and under the interpreter), 1 is Triton's own fp32 -> fp8 cast (the
    # product since), 2 the hardware's cvt.rn.satfinite by inline PTX
    if HW == 2:
        return _cvt_e4m3(v).to(DT, bitcast=True)
    if HW == 1:
        return v.to(DT)
    return _e4m3_grid(v).to(DT)


@triton.jit
def _cast_kernel(X, Q, N, HW: tl.constexpr, BLOCK: tl.constexpr):
    at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + at, mask=at < N, other=0.0)
    tl.store(Q + at, _fp8_of(x, Q.dtype.element_ty, HW), mask=at < N)


def casts():
    """How many values each e4m3 conversion rounds unlike torch's cast: every rounding case
    (a fine grid over the range and the subnormals, ties) and 1M random values."""
    x = torch.cat([torch.linspace(-448, 448, 200001), torch.linspace(-0.02, 0.02, 40001),
                   (torch.randn(1_000_000) * 30).clamp(-448, 448)]).cuda()
    want = x.to(fp8_quant.FP8).view(torch.uint8)
    out = {"values": len(x)}
    for hw, name in ((0, "grid"), (1, "triton_cast"), (2, "cvt_rn_satfinite")):
        q = torch.empty_like(want).view(fp8_quant.FP8)
        _cast_kernel[(triton.cdiv(len(x), 1024),)](x, q, len(x), HW=hw, BLOCK=1024)
        out[f"{name}_differ"] = int((q.view(torch.uint8) != want).sum())
    print(f"e4m3 conversions against torch's cast: {out}", flush=True)
    return out


@triton.jit
def _store_rows(Q, S, rows, cols, mask, N, stride_q, y, HW: tl.constexpr):
    # rows of fp32 y quantised per row: the scale, the e4m3 values by conversion HW
    scale = tl.maximum(tl.max(tl.abs(y), axis=1) / 448.0, 1e-12)
    v = tl.minimum(tl.maximum(y / scale[:, None], -448.0), 448.0)
    tl.store(Q + rows[:, None] * stride_q + cols[None, :], _fp8_of(v, Q.dtype.element_ty, HW),
             mask=mask)
    tl.store(S + rows, scale, mask=rows < N)


@triton.jit
def _quant_rows_kernel(X, Q, S, N, C, stride_x, stride_q, BLOCK_R: tl.constexpr,
                       BLOCK_C: tl.constexpr, HW: tl.constexpr = 0):
    # fp8_quant.quantize_rows's one-read kernel with a choice of conversion
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    _store_rows(Q, S, rows, cols, mask, N, stride_q, x.to(tl.float32), HW)


@triton.jit
def _silu_mul_quant_rows_kernel(G, U, Q, S, N, C, stride_g, stride_u, stride_q,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                HW: tl.constexpr):
    # candidate: fp8_quant.silu_mul_quant's one-pass kernel on BLOCK_R rows a program
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    g = tl.load(G + rows[:, None] * stride_g + cols[None, :], mask=mask, other=0.0)
    u = tl.load(U + rows[:, None] * stride_u + cols[None, :], mask=mask, other=0.0)
    gf = g.to(tl.float32)
    a = (gf / (1.0 + tl.exp(-gf))).to(G.dtype.element_ty).to(tl.float32)
    y = (a * u.to(tl.float32)).to(G.dtype.element_ty).to(tl.float32)
    _store_rows(Q, S, rows, cols, mask, N, stride_q, y, HW)


@triton.jit
def _rms_norm_quant_rows_kernel(X, D, W, Q, S, N, C, stride_x, stride_d, stride_q, eps,
                                BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                                HW: tl.constexpr):
    # candidate: fp8_quant.rms_norm_quant's kernel (residual add included), BLOCK_R rows a program
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_C)
    mask = (rows < N)[:, None] & (cols < C)[None, :]
    x_at = X + rows[:, None] * stride_x + cols[None, :]
    x = tl.load(x_at, mask=mask, other=0.0)
    d = tl.load(D + rows[:, None] * stride_d + cols[None, :], mask=mask, other=0.0)
    x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)
    tl.store(x_at, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / C
    n = (xf * tl.rsqrt(var + eps)[:, None]).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=cols < C, other=0.0).to(tl.float32)
    y = (n * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
    _store_rows(Q, S, rows, cols, mask, N, stride_q, y, HW)


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


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _codes_off(a, b) -> float:
    """The fraction of e4m3 codes that differ (a norm's sum order may move a rounding)."""
    return float((a[1] != b[1]).float().mean())


def silu_quant(N, C, sweep=False):
    """SiLU(gate) * up -> fp8: the product's two-pass and one-pass kernels; with ``sweep``
    the multi-row candidate at (rows, warps) and each e4m3 conversion (``_fp8_of``), each
    required bit-equal to the product's, and the bf16 tower's SiLU * up kernel beside them."""
    g = torch.Generator(device="cuda").manual_seed(2)
    gu = torch.randn(N, 2 * C, device="cuda", generator=g).to(torch.bfloat16)
    gate, up = gu[:, :C], gu[:, C:]
    B = triton.next_power_of_2(C)
    res = {"rows": N, "width": C, "variants": []}

    def run(name, launch, **kw):
        q = torch.empty(N, C, dtype=fp8_quant.FP8, device="cuda")
        s = torch.empty(N, 1, dtype=torch.float32, device="cuda")

        def fn():
            launch(q, s)
        fn()
        got = (q.view(torch.uint8).clone(), s.clone())
        t = ms(fn)
        ref = res.setdefault("_ref", got)
        row = {"kernel": name, **kw, "ms": t, "equal": _same(got, ref),
               "tb_s": N * C * 5 / t / 1e9}
        res["variants"].append(row)
        print(f"silu+quant {C}: {row}", flush=True)
        return t

    res["two_pass_ms"] = run("two_pass", lambda q, s: fp8_quant._silu_mul_quant_kernel[(N,)](
        gate, up, q, s, C, gate.stride(0), up.stride(0), q.stride(0), BLOCK_C=fp8_quant._tile(C),
        num_warps=4))
    res["one_pass_ms"] = run("one_pass", lambda q, s: fp8_quant._silu_mul_quant_row_kernel[(N,)](
        gate, up, q, s, C, gate.stride(0), up.stride(0), q.stride(0), BLOCK_C=B,
        num_warps=max(8, min(32, B // 1024))))
    if sweep:
        o = torch.empty(N, C, dtype=torch.bfloat16, device="cuda")
        res["bf16_silu_mul_ms"] = ms(lambda: vf._silu_mul_kernel[(triton.cdiv(N, 8),
                                                                  triton.cdiv(C, 256))](
            gu, o, N, C, gu.stride(0), o.stride(0), BLOCK_R=8, BLOCK_C=256, num_warps=4))
        for hw, R, warps in ((0, 1, 4), (1, 1, 4), (2, 1, 4), (2, 1, 8), (2, 2, 8)):
            run("rows", lambda q, s, R=R, warps=warps, hw=hw:
                _silu_mul_quant_rows_kernel[(triton.cdiv(N, R),)](
                    gate, up, q, s, N, C, gate.stride(0), up.stride(0), q.stride(0),
                    BLOCK_R=R, BLOCK_C=B, HW=hw, num_warps=warps),
                rows_per_program=R, warps=warps, conversion=hw)
    res.pop("_ref")
    return res


def quant(N, C):
    """The standalone per-row quantiser (the attention output before its projection): the
    product's two-pass, one-row-per-program kernel against the one-read multi-row candidate
    at (elements per program, warps) and each e4m3 conversion (``_fp8_of``); equal bits
    required (the product's kernels convert with cvt.rn.satfinite on the GPU)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(N, C, device="cuda", generator=g).to(torch.bfloat16)
    q0 = torch.empty(N, C, dtype=fp8_quant.FP8, device="cuda")
    s0 = torch.empty(N, 1, dtype=torch.float32, device="cuda")

    def two_pass():
        fp8_quant._quant_kernel[(N,)](x, q0, s0, C, x.stride(0), q0.stride(0),
                                BLOCK_C=fp8_quant._tile(C), num_warps=4)

    out = {"rows": N, "width": C, "two_pass_ms": ms(two_pass), "multi_row": []}
    B = triton.next_power_of_2(C)
    for hw, block, warps in ((0, 4096, 4), (1, 4096, 4), (2, 4096, 4), (2, 8192, 4),
                             (2, 8192, 8)):
        R = max(1, block // B)
        q = torch.empty_like(q0)
        s = torch.empty_like(s0)

        def fn():
            _quant_rows_kernel[(triton.cdiv(N, R),)](x, q, s, N, C, x.stride(0),
                                                     q.stride(0), BLOCK_R=R, BLOCK_C=B,
                                                     HW=hw, num_warps=warps)
        t = ms(fn)
        equal = bool(torch.equal(q.view(torch.uint8), q0.view(torch.uint8))
                     and torch.equal(s, s0))
        out["multi_row"].append({"block": block, "rows": R, "warps": warps,
                                 "conversion": hw, "ms": t, "equal": equal,
                                 "tb_s": N * C * 3 / t / 1e9})
        print(f"quant {C}: {out['multi_row'][-1]}", flush=True)
    return out


def norm_quant(N, C, eps=1e-6):
    """x += d, RMSNorm(x) * w -> fp8 rows (the FP8 vision tower's norms): the product's kernel
    at 2 and 4 (product) warps and the multi-row candidate with the e4m3 grid or the
    hardware's conversion; the fraction of codes that differ from the product's (a sum's
    order moves a rounding now and then); the bf16 tower's add + RMSNorm kernel beside them."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x0 = torch.randn(N, C, device="cuda", generator=g).to(torch.bfloat16)
    d = torch.randn(N, C, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.rand(C, device="cuda", generator=g).to(torch.bfloat16)
    B = triton.next_power_of_2(C)
    ref = None
    out = {"rows": N, "width": C, "variants": []}
    x = x0.clone()
    y = torch.empty_like(x)
    out["bf16_add_rms_norm_ms"] = ms(lambda: vf._add_rms_norm_kernel[(N,)](
        x, d, w, y, C, x.stride(0), d.stride(0), y.stride(0), eps, HAS_D=True, BLOCK_C=B,
        num_warps=4))
    # "row" is the product's kernel, converting as the product does (conversion None)
    for kind, R, warps, hw in (("row", 1, 4, None), ("row", 1, 2, None), ("rows", 1, 4, 0),
                               ("rows", 1, 4, 2), ("rows", 2, 4, 0), ("rows", 2, 4, 2),
                               ("rows", 4, 8, 2)):
        q = torch.empty(N, C, dtype=fp8_quant.FP8, device="cuda")
        s = torch.empty(N, 1, dtype=torch.float32, device="cuda")

        def fn(x):
            if kind == "row":
                fp8_quant._rms_norm_quant_kernel[(N,)](x, d, w, q, s, C, x.stride(0), d.stride(0),
                                                 q.stride(0), eps, HAS_D=True, BLOCK_C=B,
                                                 num_warps=warps)
            else:
                _rms_norm_quant_rows_kernel[(triton.cdiv(N, R),)](
                    x, d, w, q, s, N, C, x.stride(0), d.stride(0), q.stride(0), eps,
                    BLOCK_R=R, BLOCK_C=B, HW=hw, num_warps=warps)
        xc = x0.clone()
        fn(xc)
        got = (xc, q.view(torch.uint8).clone(), s.clone())
        if ref is None:
            ref = got
        xt = x0.clone()
        t = ms(lambda: fn(xt))
        out["variants"].append({"kernel": kind, "rows": R, "warps": warps, "conversion": hw,
                                "ms": t, "codes_off": _codes_off(got, ref),
                                "tb_s": N * C * 7 / t / 1e9})
        print(f"norm+quant: {out['variants'][-1]} (bf16 add+norm "
              f"{out['bf16_add_rms_norm_ms']:.3f})", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "casts": casts(),
           "lm_rope": lm_rope(), "vision_rotary": vision_rotary(),
           "silu_quant_vision": silu_quant(63360, 3456, sweep=True),
           "silu_quant_lm": silu_quant(16384, 18944),
           "quant_vision": quant(63360, 1280), "quant_lm": quant(16384, 3584),
           "norm_quant_vision": norm_quant(63360, 1280)}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "elementwise.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
