"""FP8 GEMM rates at the 7B shapes with and without cuBLAS's fast accumulation, against bf16.

Issue 34 left the Qwen vision tower at 1.26x bf16 in FP8: its GEMMs have K = 1280 and ran
only 1.05-1.36x faster than bf16 (``benchmarks/vision.py --gemms``), with
``torch._scaled_mm``'s default accumulation (Hopper's FP8 tensor cores accumulate in reduced
precision; cuBLAS promotes to fp32 every few MMAs unless ``use_fast_accum``). vLLM's CUTLASS
FP8 kernels run the fast-accumulation schedule. Here, per shape (M rows = a 22-pair vision
chunk or a 16K LM chunk), side by side (CUDA events, median of 20):

* bf16 ``F.linear``;
* FP8 row-wise scales, default accumulation (what fp8_gemm.fp8_gemm runs);
* FP8 row-wise scales, ``use_fast_accum=True``;

and each FP8 variant's relative error (Frobenius) against the fp32 product of the same
quantised operands, so the accumulation's own error shows apart from e4m3's rounding.

    python lab/experiments/fp8_gemm_accum.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from lab.experiments.timing import ms
from mminfer.kernels import fp8_quant

# (name, M, K, N): the Qwen2.5-VL-7B vision block's GEMMs at a 22-pair chunk (63,360 rows;
# MLP padded to 3456) and the LM's at a 16K chunk (hidden 3584, MLP 18944, KV 512)
SHAPES = [
    ("vision qkv", 63360, 1280, 3840),
    ("vision proj", 63360, 1280, 1280),
    ("vision gate+up", 63360, 1280, 6912),
    ("vision down", 63360, 3456, 1280),
    ("lm qkv", 16384, 3584, 4608),
    ("lm o", 16384, 3584, 3584),
    ("lm gate+up", 16384, 3584, 37888),
    ("lm down", 16384, 18944, 3584),
    # LongVILA's SigLIP (so400m at 448 px: 1024 patches a frame) at its 32-frame batch; fc2's
    # K = 4304 is just over fp8_gemm.FAST_ACCUM_MAX_K, which only the shapes above set
    ("siglip qkv", 32768, 1152, 3456),
    ("siglip out", 32768, 1152, 1152),
    ("siglip fc1", 32768, 1152, 4304),
    ("siglip fc2", 32768, 4304, 1152),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--only", default="", help="run the shapes whose name starts with this")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for name, M, K, N in SHAPES:
        if not name.startswith(a.only):
            continue
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5
        xq = fp8_quant.quantize_rows(x)
        wq, ws = fp8_quant.quantize_weight(w)
        sa, sb = xq.scale.reshape(-1, 1).contiguous(), ws.view(1, -1)
        ref = (xq.data.float() * sa) @ (wq.float() * ws.view(-1, 1)).t()

        def mm(fast):
            return torch._scaled_mm(xq.data, wq.t(), scale_a=sa, scale_b=sb,
                                    out_dtype=torch.bfloat16, use_fast_accum=fast)

        flop = 2 * M * K * N
        t_bf = ms(lambda: F.linear(x, w))
        row = {"shape": name, "M": M, "K": K, "N": N, "bf16_ms": t_bf}
        for tag, fast in (("fp8", False), ("fp8_fast", True)):
            y = mm(fast).float()
            row[f"{tag}_ms"] = ms(lambda: mm(fast))
            row[f"{tag}_rel_err"] = float((y - ref).norm() / ref.norm())
        for k in ("bf16", "fp8", "fp8_fast"):
            row[f"{k}_tflops"] = flop / row[f"{k}_ms"] / 1e9
        rows.append(row)
        print(f"{name:15s} M={M:6d} K={K:5d} N={N:5d}  bf16 {t_bf:6.3f} ms "
              f"{row['bf16_tflops']:6.0f} TF | fp8 {row['fp8_ms']:6.3f} ms "
              f"{row['fp8_tflops']:6.0f} TF err {row['fp8_rel_err']:.2e} | fast "
              f"{row['fp8_fast_ms']:6.3f} ms {row['fp8_fast_tflops']:6.0f} TF "
              f"err {row['fp8_fast_rel_err']:.2e}", flush=True)
        del x, w, xq, wq, ref
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_gemm_accum.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
