"""Online estimation cost against sparse attention time, one layer, on one GPU.

LongVILA-7B shape (28 query heads, 4 KV heads, d 128, bf16), 257 tokens per frame, the
layer's head patterns from ``configs/longvila_7b_1m.json``. Random q/k carry a planted grid
(keys at one phase of the frame stride attract every query, as grid heads do in real
models) so grid heads take their grid path rather than the fallback.

    python benchmarks/estimate.py --lengths 131072 262144 1048576

Per length and estimator implementation (``--impl``, all in one process, so before and
after are measured side by side): estimation + plan time, device launches per layer, the
share of sparse attention, and how the plan compares with one estimated by an fp32
brute-force proxy (the PyTorch passes on fp32 q/k): ``agree`` the share of plan entries
(verticals, slashes, grid stride/phase/fallback) that are the same, ``recall_v``/``recall_s``
the fp32 proxy mass the chosen verticals/slashes hold against what the fp32 plan's hold
(1.0: as good as exact; on random q/k most candidates are near-ties, which ``agree``
counts as misses and the recall does not). Then sparse attention time, density, and cuDNN
dense attention of the same layer (at 1M: one call, measured once).

Implementations: ``default`` what the estimator runs on a GPU (``proxy="triton"``: every
query set in one launch per pass for the heads that read it, the mass pass's layout chosen
by length), ``new`` / ``chunks`` the same with the persistent / chunked mass pass
(``kernels/proxy.TUNING["mass_layout"]``), ``torch`` the PyTorch passes (``proxy="torch"``,
the CPU's estimator). The per-run proxy that ``old`` measured (one launch pair per query
run, every head) left the package; BENCHMARKS.md section 7 has its figures.
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
    two estimates hold in common: 1.0 when ``eb`` chose exactly what ``ea`` chose."""
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


# new / chunks: the query-set proxy with one mass layout each; default: what the estimator
# runs (kernels/proxy.TUNING, the layout chosen by length); torch: the PyTorch passes
IMPLS = {"new": ("triton", {"mass_layout": "persistent"}),
         "chunks": ("triton", {"mass_layout": "chunks"}), "default": ("triton", {}),
         "torch": ("torch", {})}


def _with_impl(impl, fn):
    """Run ``fn`` with the estimator implementation ``impl`` (IMPLS)."""
    from mminfer.kernels import proxy
    _, tuning = IMPLS[impl]
    saved = dict(proxy.TUNING)
    proxy.TUNING.update(tuning)
    try:
        return fn()
    finally:
        proxy.TUNING.clear()
        proxy.TUNING.update(saved)


def _launches(fn) -> int:
    """Device work items (kernels, copies, fills) one call of ``fn`` enqueues."""
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _ref_sums(index, q, k, qgroup, kgroup, cache, last_q=64):
    """fp32 brute-force (col, diag) ``[B, Hq, N]`` of the query set a spec's groups read."""
    from mminfer.sparse.estimate import _key_groups, _proxy_stats
    key = (qgroup, kgroup)
    if key not in cache:
        n = index.n
        if qgroup == -1:
            pos = list(range(n - last_q, n))
        else:
            (qm,) = [m for m in index.modalities() if index.group_of(m) == qgroup]
            pos = index.last_positions(qm, last_q)
        kmasks = []
        if kgroup != -1:
            kg, _ = _key_groups(index, q.device)
            kmasks = [("k", kg == kgroup)]
        col, diag, dk = _proxy_stats(q, k, pos, q.shape[-1] ** -0.5, None, True, kmasks)
        cache[key] = (col, diag if kgroup == -1 else dk["k"])
    return cache[key]


def _recall(index, qf, kf, ref, got, cache):
    """(recall_v, recall_s): fp32 proxy mass on ``got``'s verticals / slashes over the mass
    on ``ref``'s (the plan of the fp32 proxy), summed over every vertical-slash spec;
    ``cache`` holds the fp32 sums per query set across calls."""
    num = {"verticals": 0.0, "slashes": 0.0}
    den = dict(num)
    for sa, sb in zip(_index_specs(ref), _index_specs(got)):
        if not hasattr(sa, "slashes"):
            continue
        col, diag = _ref_sums(index, qf, kf, int(sa.qgroup), int(sa.kgroup), cache)
        hidx = torch.as_tensor(list(sa.heads), device=qf.device)
        for name, src in (("verticals", col), ("slashes", diag)):
            vals = src[:, hidx]
            for spec, acc in ((sa, den), (sb, num)):
                ids = getattr(spec, name)
                v = vals.gather(-1, ids.clamp(min=0)) * (ids >= 0)
                acc[name] += float(v.sum())
    return tuple(num[x] / den[x] if den[x] > 0 else 1.0 for x in ("verticals", "slashes"))


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
    programs per SM; every variant checked against the default's output. One query set (the
    last 64 positions, every head). Also the cost of the diagonal sums (the same set
    without them)."""
    from mminfer.kernels.proxy import TUNING, QuerySet, proxy_sets
    lse_axis = [{"kb_per": kb, "lse_warps": w} for kb in (4, 8, 16, 32) for w in (2, 4, 8)]
    mass_axis = [{"mass_warps": w, "programs_per_sm": p} for w in (1, 2, 4, 8)
                 for p in (2, 4, 8, 16)]
    rows = []
    for n in lengths:
        index, q, k, _ = inputs(n)
        n = index.n
        heads = tuple(range(q.shape[1]))

        def sums(diag=True, config=None):
            qs = QuerySet(((n - 64, 64),), heads, tuple((None,) if diag else () for _ in heads))
            col, dg = proxy_sets(q, k, [qs], 128 ** -0.5, config=config)[0]
            return col, dg.get(None)

        ref = sums()
        base = events_ms(lambda: sums(), reps=5)
        col_only = events_ms(lambda: sums(diag=False), reps=5)
        rows.append({"n": n, "config": dict(TUNING), "ms": base, "col_only_ms": col_only})
        print(f"N={n}: default {TUNING} {base:.3f} ms, without diagonals {col_only:.3f} ms",
              flush=True)
        for c in lse_axis + mass_axis:
            got = sums(config=c)
            ok = all(torch.allclose(a, b, atol=1e-4, rtol=1e-3) for a, b in
                     ((got[0], ref[0]), (got[1], ref[1])))
            ms = events_ms(lambda: sums(config=c), reps=5)
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
    ap.add_argument("--impl", nargs="+", default=["default"], choices=list(IMPLS),
                    help="estimator implementations to measure side by side (first: baseline)")
    ap.add_argument("--no-dense", action="store_true", help="skip cuDNN dense attention")
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
        # the fp32 brute-force reference: the PyTorch proxy passes on fp32 q/k
        qf, kf = q.float(), k.float()
        ref = estimate_layer(qf, kf, index, heads, proxy="torch")
        ref_sums: dict = {}
        box = {}

        def est(impl):
            proxy, _ = IMPLS[impl]
            box["est"] = estimate_layer(q, k, index, heads, proxy=proxy)
            box["plan"] = box["est"].build_plan(q.device)

        per = {}
        for impl in a.impl:
            ms = _with_impl(impl, lambda: events_ms(lambda: est(impl)))
            launches = _with_impl(impl, lambda: _launches(lambda: est(impl)))
            rv, rs = _recall(index, qf, kf, ref, box["est"], ref_sums)
            per[impl] = {"estimate_plan_ms": ms, "launches": launches,
                         "agree_fp32": _same_plan(ref, box["est"]), "recall_v": rv,
                         "recall_s": rs}
            if a.profile:
                _with_impl(impl, lambda: _profile(lambda: est(impl), os.path.join(a.out, impl), n))
        del qf, kf, ref, ref_sums
        torch.cuda.empty_cache()
        plan, estimate = box["plan"], box["est"]
        out = torch.empty_like(q)
        attn_ms = events_ms(lambda: sparse_attention(q, k, v, plan, out=out))
        dens = plan.density()
        grids = estimate.summary()
        fell_back = sum(any(c["fallback"]) for cs in grids.values() for c in cs)
        dense_ms = float("nan")
        if not a.no_dense:
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
                dense_ms = events_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True), reps=1 if n > 300000 else 3)
        base = per[a.impl[0]]["estimate_plan_ms"]
        for impl, r in per.items():
            r.update(share=r["estimate_plan_ms"] / (r["estimate_plan_ms"] + attn_ms),
                     speedup_incl_estimation=dense_ms / (r["estimate_plan_ms"] + attn_ms),
                     vs_first=base / r["estimate_plan_ms"])
        row = {"n": index.n, "impls": per, "sparse_attention_ms": attn_ms,
               "logical": dens["logical"], "physical": dens["physical"],
               "grid_heads_fell_back": fell_back, "dense_cudnn_ms": dense_ms}
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, plan, estimate, box, out
        torch.cuda.empty_cache()
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "estimate.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "layer": a.layer, "rows": rows}, f,
                  indent=1)
    print(f"{'N':>8} {'impl':>7} {'est+plan ms':>11} {'x first':>7} {'launches':>8} "
          f"{'attn ms':>9} {'share':>6} {'density':>8} {'dense ms':>9} {'speedup':>8} "
          f"{'agree':>6} {'rec_v':>7} {'rec_s':>7}")
    for r in rows:
        for impl, x in r["impls"].items():
            print(f"{r['n']:>8} {impl:>7} {x['estimate_plan_ms']:11.2f} {x['vs_first']:6.2f}x "
                  f"{x['launches']:8d} {r['sparse_attention_ms']:9.2f} {x['share']:6.1%} "
                  f"{r['logical']:8.4f} {r['dense_cudnn_ms']:9.1f} "
                  f"{x['speedup_incl_estimation']:7.1f}x {x['agree_fp32']:6.3f} "
                  f"{x['recall_v']:7.4f} {x['recall_s']:7.4f}")

if __name__ == "__main__":
    main()
