"""Online estimation cost against sparse attention time, one layer, on one GPU.

LongVILA-7B shape (28 query heads, 4 KV heads, d 128, bf16), 257 tokens per frame, the
layer's head patterns from ``configs/longvila_7b_1m.json``. Random q/k carry a planted grid
(keys at one phase of the frame stride attract every query, as grid heads do in real
models) so grid heads take their grid path rather than the fallback.

    python benchmarks/estimate.py --lengths 131072 262144 1048576

Per length: estimation + plan time with the fused proxy kernels and with the PyTorch proxy
(same run, and how much of the two plans agrees), sparse attention time, the estimation
share, the density, and cuDNN dense attention of the same layer (at 1M: one call, measured
once).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.sparse.estimate import estimate_layer  # noqa: E402
from mminfer.kernels import Fallback, sparse_attention  # noqa: E402
from mminfer.sparse.modality import ModalityIndex  # noqa: E402
from mminfer.sparse.patterns import HeadPatternConfig  # noqa: E402
from cuda_events import events_ms  # noqa: E402  (benchmarks/ is the script's folder)

ROOT = os.path.join(os.path.dirname(__file__), "..")


def inputs(n, stride=257, phase=5, strength=4.0):
    index = ModalityIndex.from_segments([("text", 20), ("video", (n - 50) // stride, 16, 16, 1),
                                         ("text", 30)])
    n = index.n
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, 28, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, 4, n, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    u = torch.randn(128, device="cuda", generator=g)
    u = (u / u.norm() * strength * 128 ** 0.5).to(torch.bfloat16)
    vs = index.spans_of("video")[0]
    cols = torch.arange(vs.start + phase, vs.end, stride, device="cuda")
    k[:, :, cols] += u
    q += u * 0.5
    return index, q, k, v


def _index_specs(est):
    """Every spec of an estimate, a Fallback's sides included."""
    out = []
    for sp in est.specs:
        out.extend([sp.primary, *sp.alternatives] if isinstance(sp, Fallback) else [sp])
    return out


def _same_plan(ea, eb) -> float:
    """Share of the estimated index entries (verticals, slashes, blocks, grid choices) the
    two estimates hold in common: 1.0 when the fused proxy chose exactly what PyTorch chose."""
    same = total = 0
    for sa, sb in zip(_index_specs(ea), _index_specs(eb)):
        for name in ("verticals", "slashes", "key_blocks"):
            x, y = getattr(sa, name, None), getattr(sb, name, None)
            if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
                xs, ys = x.sort(-1).values, y.sort(-1).values
                same += int((xs == ys).sum())
                total += xs.numel()
    for ga, gb in zip(ea.grids, eb.grids):
        for name in ("stride", "phase", "fallback"):
            same += int((getattr(ga, name) == getattr(gb, name)).sum())
            total += getattr(ga, name).numel()
    return same / max(total, 1)


def _profile(fn, out_dir, n):
    """Where estimation time goes: the host's enqueue time (no sync) against the GPU's, the
    ops by GPU time and by host time, and the number of kernel launches."""
    import time
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    ka = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in ka)
    launches = sum(e.count for e in ka if e.self_device_time_total > 0 and
                   e.device_type == torch.autograd.DeviceType.CUDA)
    head = (f"N={n}: host enqueue {host_ms:.2f} ms, wall {wall_ms:.2f} ms, GPU busy "
            f"{gpu_us / 1e3:.2f} ms, {launches} GPU kernels\n")
    by_gpu = ka.table(sort_by="self_device_time_total", row_limit=30)
    by_cpu = ka.table(sort_by="self_cpu_time_total", row_limit=30)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"estimate_profile_{n}.txt"), "w") as f:
        f.write(head + "\nby GPU time\n" + by_gpu + "\nby host time\n" + by_cpu)
    print(head + by_gpu[:6000] + by_cpu[:6000], flush=True)


def _tune_proxy(lengths, out_dir):
    """The fused proxy's launch parameters (kernels/proxy.TUNING), one axis per kernel: the
    log-sum-exp kernel's key blocks per program and warps, then the mass kernel's warps and
    programs per SM; every variant checked against the default's output. Also the cost of
    the diagonal sums (the same call without them)."""
    from mminfer.kernels.proxy import TUNING, proxy_stats
    lse_axis = [{"kb_per": kb, "lse_warps": w} for kb in (4, 8, 16, 32) for w in (2, 4, 8)]
    mass_axis = [{"mass_warps": w, "programs_per_sm": p} for w in (1, 2, 4, 8)
                 for p in (2, 4, 8, 16)]
    rows = []
    for n in lengths:
        index, q, k, _ = inputs(n)
        n = index.n
        args = (q, k, n - 64, 64, 128 ** -0.5)
        ref = proxy_stats(*args)
        base = events_ms(lambda: proxy_stats(*args), reps=5)
        col_only = events_ms(lambda: proxy_stats(*args, diag=False), reps=5)
        rows.append({"n": n, "config": dict(TUNING), "ms": base, "col_only_ms": col_only})
        print(f"N={n}: default {TUNING} {base:.3f} ms, without diagonals {col_only:.3f} ms",
              flush=True)
        for c in lse_axis + mass_axis:
            got = proxy_stats(*args, config=c)
            ok = all(torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in
                     ((got[0], ref[0]), (got[1], ref[1])))
            ms = events_ms(lambda: proxy_stats(*args, config=c), reps=5)
            rows.append({"n": n, "config": {**TUNING, **c}, "ms": ms, "same": ok})
            print(f"  {c}: {ms:.3f} ms ({base / ms:.2f}x){'' if ok else '  OUTPUT DIFFERS'}",
                  flush=True)
        del q, k, ref
        torch.cuda.empty_cache()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "proxy_tune.json"), "w") as f:
        json.dump(rows, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[131072, 262144, 1048576])
    ap.add_argument("--layer", type=int, default=14)
    ap.add_argument("--profile", action="store_true", help="profile one estimate per length (host vs GPU time, ops)")
    ap.add_argument("--tune-proxy", action="store_true",
                    help="time the fused proxy's launch parameters instead (kernels/proxy.TUNING)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    if a.tune_proxy:
        return _tune_proxy(a.lengths, a.out)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    cfg = HeadPatternConfig.load(os.path.join(ROOT, "mminfer", "models", "configs", "longvila_7b_1m.json"))
    heads = cfg.layer(a.layer)
    rows = []
    for n in a.lengths:
        index, q, k, v = inputs(n)
        box = {}

        def est(proxy):
            box["est"] = estimate_layer(q, k, index, heads, proxy=proxy)
            box["plan"] = box["est"].build_plan(q.device)

        # A/B in one run: the proxy by PyTorch passes (before) and by the fused Triton
        # kernels (after, kernels/proxy.py); the two plans must agree.
        est_ms_torch = events_ms(lambda: est("torch"))
        est_torch = box["est"]
        est_ms = events_ms(lambda: est("triton"))
        plan, estimate = box["plan"], box["est"]
        agree = _same_plan(est_torch, estimate)
        del est_torch
        if a.profile:
            _profile(lambda: est("triton"), a.out, n)
        out = torch.empty_like(q)
        attn_ms = events_ms(lambda: sparse_attention(q, k, v, plan, out=out))
        dens = plan.density()
        grids = estimate.summary()
        fell_back = sum(any(c["fallback"]) for cs in grids.values() for c in cs)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
            dense_ms = events_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True), reps=1 if n > 300000 else 3)
        row = {"n": index.n, "estimate_plan_ms": est_ms,
               "estimate_plan_ms_torch_proxy": est_ms_torch, "plans_agree": agree,
               "sparse_attention_ms": attn_ms,
               "estimate_share": est_ms / (est_ms + attn_ms), "logical": dens["logical"],
               "physical": dens["physical"], "grid_heads_fell_back": fell_back,
               "dense_cudnn_ms": dense_ms,
               "speedup_incl_estimation": dense_ms / (est_ms + attn_ms)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, plan, estimate, box, out
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "estimate.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "layer": a.layer, "rows": rows}, f,
                  indent=1)
    print(f"{'N':>8} {'torch ms':>9} {'est+plan ms':>11} {'attn ms':>9} {'share':>6} "
          f"{'density':>8} {'dense ms':>9} {'speedup':>8} agree")
    for r in rows:
        print(f"{r['n']:>8} {r['estimate_plan_ms_torch_proxy']:9.2f} "
              f"{r['estimate_plan_ms']:11.2f} {r['sparse_attention_ms']:9.2f} "
              f"{r['estimate_share']:6.1%} {r['logical']:8.4f} {r['dense_cudnn_ms']:9.1f} "
              f"{r['speedup_incl_estimation']:7.1f}x {r['plans_agree']:.3f}")


if __name__ == "__main__":
    main()
