"""The sparse kernel with and without Triton's specialisation of its plan counts, side by side.

Why: in the self-calibration run at `06c658a` on an H100
(benchmarks/results/2026-12-07-selfcal-h100-06c658a/) the server compiled `_sparse_attn_fwd`
17 more times after its warm-up, 2-8 s each, while requests waited for the calibration step
that compiled (TTFT up to 3.16x dense's). Each candidate config the calibration scores makes
plans of other counts (slots, most verticals, slashes and key blocks per slot, row blocks),
and Triton compiles a variant per integer that is 1 or a multiple of 16. The kernel now takes
those counts unspecialised (``do_not_specialize``); this measures what that costs a launch.

For each family (benchmarks/kernels.py's plans, all 28 heads, density 0.1) at ``--lengths``:
the shipped kernel (counts not specialised) and a copy of the same kernel with Triton's
default specialisation, timed alternately (``--rounds`` medians of do_bench), same inputs.

    python lab/experiments/attn_specialize.py --out $OUT/attn_specialize.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import triton

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "benchmarks")]

from mminfer.kernels import SparsePlan  # noqa: E402
from mminfer.kernels import launch as L  # noqa: E402

import kernels as KB  # noqa: E402  (benchmarks/kernels.py: the same plans)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072])
    ap.add_argument("--density", type=float, default=0.1)
    ap.add_argument("--patterns", nargs="+",
                    default=["a_shape", "grid", "vertical_slash", "block"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=100, help="do_bench time per measure (ms)")
    ap.add_argument("--out", default="out/attn_specialize.json")
    a = ap.parse_args()
    dev = "cuda"
    shipped = L._sparse_attn_fwd
    specialised = triton.jit(shipped.fn)            # Triton's default: every int specialised
    rows = []
    for n in a.lengths:
        g = torch.Generator(device=dev).manual_seed(0)
        q = torch.randn(1, KB.HQ, n, KB.D, device=dev, generator=g).bfloat16()
        k = torch.randn(1, KB.HKV, n, KB.D, device=dev, generator=g).bfloat16()
        v = torch.randn(1, KB.HKV, n, KB.D, device=dev, generator=g).bfloat16()
        out = torch.empty_like(q)
        for pat in a.patterns:
            if pat == "grid":
                specs, _ = KB.grid_spec(n, a.density)
            elif pat == "a_shape":
                specs, _ = KB.a_shape_spec(n, a.density)
            elif pat == "vertical_slash":
                specs, _ = KB.vs_spec(n, a.density, dev)
            else:
                specs, _ = KB.block_spec(n, a.density, dev)
            plan = SparsePlan.build(n, KB.HQ, specs, block_m=KB.BM,
                                    block_n=128 if pat == "block" else 64, device=dev)
            times = {"unspecialised": [], "specialised": []}
            outs = {}
            for _ in range(a.rounds):
                for name, kern in (("unspecialised", shipped), ("specialised", specialised)):
                    L._sparse_attn_fwd = kern
                    try:
                        times[name].append(KB.bench(
                            lambda: L.sparse_attention(q, k, v, plan, out=out), rep=a.rep))
                    finally:
                        L._sparse_attn_fwd = shipped
                    outs[name] = out.clone()
            same = torch.equal(outs["unspecialised"], outs["specialised"])
            med = {key: statistics.median(t) for key, t in times.items()}
            row = {"n": n, "pattern": pat, "density": plan.density(), "ms": med,
                   "all_ms": times, "ratio": med["unspecialised"] / med["specialised"],
                   "identical_output": same}
            rows.append(row)
            print(f"n={n:>8} {pat:>15}: unspecialised {med['unspecialised']:8.3f} ms, "
                  f"specialised {med['specialised']:8.3f} ms, ratio {row['ratio']:.3f}, "
                  f"identical {same}", flush=True)
            os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
            with open(a.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1,
                          default=lambda o: o.tolist())


if __name__ == "__main__":
    main()
