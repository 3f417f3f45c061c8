"""Kernel benchmark on one GPU: our sparse kernels against cuDNN SDPA, flash SDPA (dense causal)
and FlexAttention given exactly the same block set, side by side in one run.

Qwen2.5-VL-7B attention shape: 28 query heads, 4 KV heads, head dim 128, bf16, batch 1.
Every head of a launch uses the same pattern parameters so that FlexAttention can be given
one block mask (broadcast over heads) that visits exactly the tiles our kernel visits.

    python benchmarks/kernels.py                       # table + JSON under $OUT (or ./out)
    python benchmarks/kernels.py --lengths 131072 --densities 0.1 --tune   # tile sweep

Effective TFLOP/s = 4·d·(visited tile area, all heads) / time (attention-gym's density-scaled
count); "logical" density is the exact pair set as a fraction of the causal triangle,
"physical" the visited tiles as a fraction of the tiles a dense causal pass visits. Tiles
are counted as ``plan.density()`` counts them (``kernels/density.py``: 64-key tiles, the
width every recorded figure used), for every configuration of a sweep alike, so TFLOP/s
ratios are the inverse time ratios. The kernel's own tiles (``kernels/runtime.tile_config``)
are in each row's ``config``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from mminfer.kernels import AShape, Block, Grid, SparsePlan, VerticalSlash, row_table  # noqa: E402
from mminfer.kernels import launch as L  # noqa: E402
from mminfer.kernels import masks as M  # noqa: E402
from mminfer.kernels.runtime import tile_config  # noqa: E402
from cuda_events import events_ms  # noqa: E402  (benchmarks/ is the script's folder)

HQ, HKV, D = 28, 4, 128
BM = 128


def bench(fn, rep=200):
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


# ----------------------------------------------------------------------------- patterns
def a_shape_spec(n, density):
    # logical ≈ 2(sink + window + BM/2)/N per row
    w = max(int(density * n / 2 - 128 - BM / 2) // 128 * 128, 128)
    return [AShape(list(range(HQ)), sink=128, window=w)], {"sink": 128, "window": w}


def grid_spec(n, density, start=1024):
    # columns + rows at stride s: ≈ 2/s; sink + window ≈ 2(sink + window)/N
    w = min(1024, max(int(density * n / 8) // 128 * 128, 128))
    rest = density - 2 * (128 + w + BM / 2) / n
    s = max(int(round(2 / max(rest, 1e-3))), 3)
    p = s // 3
    return ([Grid(list(range(HQ)), start=start, end=n - 256, stride=s, phase=p, lines="both",
                  sink=128, window=w)],
            {"stride": s, "phase": p, "sink": 128, "window": w, "start": start, "end": n - 256})


def vs_spec(n, density, device):
    nv, w = 1000, 1024
    ns = max(int((density * n / 2 - nv - w) / BM), 1)
    g = torch.Generator(device="cpu").manual_seed(0)
    vert = torch.randint(0, n, (1, HQ, nv), generator=g)
    vert[..., :64] = torch.arange(64)
    sl = torch.randint(w, n, (1, HQ, ns), generator=g)
    return ([VerticalSlash(list(range(HQ)), vert.to(device), sl.to(device), window=w)],
            {"n_vertical": nv, "n_slash": ns, "window": w})


def block_spec(n, density, device, block_n=128):
    table = row_table(n, BM)
    R = table.shape[0]
    nkb = (n + block_n - 1) // block_n
    kmax = max(int(density * nkb) + 1, 1)
    g = torch.Generator(device="cpu").manual_seed(0)
    r = torch.arange(R)[:, None].float()
    # per row block about density·(row blocks so far) random earlier key blocks, same for all
    # heads (FlexAttention gets one mask)
    k_r = (density * (r + 1)).ceil()
    ids = (torch.rand(R, kmax, generator=g) * (r * BM / block_n)).floor().long()
    ids = torch.where(torch.arange(kmax)[None, :] < k_r, ids, torch.full_like(ids, -1))
    kb = ids[None, None].expand(1, HQ, R, kmax).to(device)
    return [Block(list(range(HQ)), kb, window=0)], {"key_blocks_per_row": f"~{density:.0%}"}


# ----------------------------------------------------------------------------- FlexAttention
def _from_dense_blocks(partial, full, n, block):
    """BlockMask from [Rq, Rk] partial/full block booleans (full width index tensors)."""
    from torch.nn.attention.flex_attention import BlockMask

    def lists(m):
        cnt = m.sum(-1).to(torch.int32)
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return cnt[None, None].contiguous(), idx[None, None].contiguous()

    kv_num, kv_idx = lists(partial)
    full_num, full_idx = lists(full)
    return kv_num, kv_idx, full_num, full_idx


# The mask_mods are the mask functions of mminfer/kernels/masks.py (the pattern definitions,
# written from the specs; tests/kernels/test_flex_masks.py holds them to the test oracle),
# applied by FlexAttention on partial blocks. They
# live at module level and read their parameters from _FX, so the compiled flex_attention is
# not recompiled for every density (a new closure or a new Python int would each fail
# dynamo's guards).
_FX: dict = {}


def _mm_a_shape(b, h, q, k):
    return M.a_shape(_FX, b, h, q, k)


def _mm_block(b, h, q, k):
    return M.block(_FX, b, h, q, k)


def _mm_grid(b, h, q, k):
    # FlexAttention sees permuted rows and keys: map them back to original positions
    return M.grid(_FX, b, h, _FX["qperm"][q], _FX["kperm"][k])


def _oracle_params(spec, n, device):
    """The mask functions' parameters of one spec (all HQ heads, in order: slot h is head h)
    as device tensors."""
    assert list(spec.heads) == list(range(HQ))
    P = M.spec_params(spec, M.layout_tensors(n, BM, 128))
    return {key: v.to(device) if isinstance(v, torch.Tensor) else v for key, v in P.items()}


def flex_mask(kind, prm, n, device, spec):
    """Block set identical to our kernel's visit, at 128×128 blocks (BlockMask from our block
    lists), with the oracle's mask function of ``spec`` as the exact mask_mod."""
    from torch.nn.attention.flex_attention import BlockMask
    B = 128
    R = (n + B - 1) // B
    qb = torch.arange(R, device=device)[:, None]
    kbk = torch.arange(R, device=device)[None, :]
    diag = qb == kbk
    if kind == "a_shape":
        S, W = prm["sink"], prm["window"]
        lo_b = (qb * B - W).clamp(min=0) // B
        full = ((kbk < S // B) | ((kbk >= lo_b) & (kbk < qb))) & ~diag
        partial = diag
        mask_mod = _mm_a_shape
        perm = None
    elif kind == "block":
        sel = torch.zeros(R, R + 1, dtype=torch.bool, device=device)
        ids = spec.key_blocks[0, 0].long().clamp(min=-1)
        ids = torch.where(ids < 0, torch.full_like(ids, R), ids)
        sel.scatter_(1, ids, True)
        full = sel[:, :R] & (kbk < qb)
        partial = diag
        mask_mod = _mm_block
        perm = None
    else:  # grid: keys permuted as [column keys] + [other keys], rows as [others] + [lines]
        S, W, s, p = prm["sink"], prm["window"], prm["stride"], prm["phase"]
        st, en = prm["start"], prm["end"]
        pos = torch.arange(n, device=device)
        on = (pos >= st) & (pos < en) & ((pos - st) % s == p)
        kperm = torch.cat([pos[on], pos[~on]])
        qperm = torch.cat([pos[~on], pos[on]])
        n_on = int(on.sum())
        # block-level bounds of original positions
        kmin = torch.nn.functional.pad(kperm, (0, R * B - n), value=n).view(R, B).amin(1)
        kmax = torch.nn.functional.pad(kperm, (0, R * B - n), value=-1).view(R, B).amax(1)
        qmin = torch.nn.functional.pad(qperm, (0, R * B - n), value=n).view(R, B).amin(1)
        qmax = torch.nn.functional.pad(qperm, (0, R * B - n), value=-1).view(R, B).amax(1)
        kcls = torch.arange(R, device=device) * B < n_on          # block starts in column keys
        kcls_end = (torch.arange(R, device=device) + 1) * B <= n_on  # block all column keys
        rb = torch.arange(R, device=device)
        q_ord = (rb * B < n - n_on)[:, None]         # block holds ordinary rows
        q_line = ((rb + 1) * B > n - n_on)[:, None]  # block holds row-line rows
        # ordinary rows: r0(i) = (i // BM)·BM in original order
        lo_min = ((qmin // BM) * BM - W).clamp(min=0)[:, None]
        lo_max = ((qmax // BM) * BM - W).clamp(min=0)[:, None]
        any_ok = kmin[None, :] <= qmax[:, None]
        vis_ord = any_ok & (kcls[None, :] | (kmin[None, :] < S) | (kmax[None, :] >= lo_min))
        full_ord = (kmax[None, :] < qmin[:, None]) & (
            (kcls_end[None, :] & (kmax[None, :] < lo_min)) | (kmax[None, :] < S) |
            ((kmin[None, :] >= lo_max) & ~kcls[None, :]))
        vis = (q_ord & vis_ord) | (q_line & any_ok)
        full = vis & (~q_ord | full_ord) & (~q_line | (kmax[None, :] <= qmin[:, None]))
        partial = vis & ~full
        mask_mod = _mm_grid
        perm = (qperm, kperm)
    _FX.clear()
    _FX.update(_oracle_params(spec, n, device))
    if perm is not None:
        _FX.update(qperm=perm[0], kperm=perm[1])
    kv_num, kv_idx, full_num, full_idx = _from_dense_blocks(partial, full, n, B)
    bm = BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=B,
                                  mask_mod=mask_mod, seq_lengths=(n, n))
    tiles = int(partial.sum() + full.sum())
    return bm, perm, tiles


# ----------------------------------------------------------------------------- main
def run(lengths, densities, patterns, out_dir, tune, rep, json_name="kernels.json",
        flex_on=True, flash_on=True):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.flex_attention import flex_attention
    dev = torch.device("cuda")
    torch._dynamo.config.cache_size_limit = 64
    flex = torch.compile(flex_attention, dynamic=False)
    rows = []
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, torch {torch.__version__}")
    for n in lengths:
        torch.manual_seed(0)
        q = torch.randn(1, HQ, n, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(1, HKV, n, D, device=dev, dtype=torch.bfloat16)
        dense_f = L.dense_flops(n, HQ, D)
        dense = {}
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
            if (n > 262144 or not flash_on) and name == "flash":
                continue
            try:
                kk = k.repeat_interleave(HQ // HKV, 1)
                vv = v.repeat_interleave(HQ // HKV, 1)

                def f(be=be, kk=kk, vv=vv):
                    with sdpa_kernel(be):
                        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True)
                ms = bench(f, rep=rep) if n <= 262144 else events_ms(f, reps=1)
                dense[name] = ms
                rows.append({"n": n, "impl": f"{name} dense", "pattern": "causal", "ms": ms,
                             "logical": 1.0, "physical": 1.0,
                             "tflops": dense_f / ms / 1e9})
                del kk, vv
            except Exception as e:  # report, keep going
                print(f"{name} dense failed at n={n}: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
        for pat in patterns:
            for dens in densities:
                if pat == "block" and n > 262144:
                    continue
                if pat == "grid":
                    specs, prm = grid_spec(n, dens)
                elif pat == "a_shape":
                    specs, prm = a_shape_spec(n, dens)
                elif pat == "vertical_slash":
                    if n > 262144:
                        continue
                    specs, prm = vs_spec(n, dens, dev)
                else:
                    specs, prm = block_spec(n, dens, dev)
                block_n = 128 if pat == "block" else 64
                plan = SparsePlan.build(n, HQ, specs, block_m=BM, block_n=block_n, device=dev)
                den = plan.density()
                configs, labels = [None], ["default"]
                if tune:
                    # around the H200 default (128-key tiles, 8 warps, 3 stages; 2 for block)
                    configs = [None] + [{"BLOCK_N": bn, "num_warps": w, "num_stages": st}
                                        for bn, w, st in ((64, 8, 3), (128, 8, 2), (128, 4, 3),
                                                          (128, 8, 4))]
                    labels = ["default"] + [str(c) for c in configs[1:]]
                out = torch.empty_like(q)
                ref_out = None
                first = len(rows)
                for label, cfg in zip(labels, configs):
                    try:
                        ms = bench(lambda: L.sparse_attention(q, k, v, plan, out=out, config=cfg),
                                   rep=rep)
                    except Exception as e:
                        print(f"ours {pat} {label} failed: {type(e).__name__}: {str(e)[:200]}")
                        continue
                    # out holds this config's result: the same pairs as the default's, so
                    # it differs only by the order of the online softmax's tiles
                    if ref_out is None and label == "default":
                        ref_out = out.clone()
                    diff = float("nan") if ref_out is None else \
                        (out.float() - ref_out.float()).abs().max().item()
                    rows.append({"n": n, "impl": "mminfer", "pattern": pat, "density": dens,
                                 "variant": label if tune else None,
                                 "params": prm,
                                 "config": tile_config(True, pat, BM, block_n, cfg), "ms": ms,
                                 "logical": den["logical"], "physical": den["physical"],
                                 "tflops": 4 * D * den["tile_pairs"] / ms / 1e9,
                                 "vs_cudnn": dense.get("cudnn", float("nan")) / ms,
                                 "max_abs_diff_vs_default": diff})
                    _print(rows[-1])
                    _save(rows, out_dir, json_name)
                ours_rows = [r for r in rows[first:] if r["impl"] == "mminfer"]
                del ref_out
                flex_ms = float("nan")
                if pat != "vertical_slash" and not tune and flex_on:
                    try:
                        bmask, perm, tiles = flex_mask(pat, prm, n, dev, specs[0])
                        if perm is not None:
                            qperm, kperm = perm
                            qf, kf, vf = q[:, :, qperm], k[:, :, kperm], v[:, :, kperm]
                        else:
                            qf, kf, vf = q, k, v
                        of = flex(qf, kf, vf, block_mask=bmask, enable_gqa=True)
                        if perm is not None:
                            unperm = torch.empty_like(of)
                            unperm[:, :, qperm] = of
                            of = unperm
                        L.sparse_attention(q, k, v, plan, out=out)
                        diff = (of.float() - out.float()).abs().max().item()
                        del of
                        ms = bench(lambda: flex(qf, kf, vf, block_mask=bmask, enable_gqa=True),
                                   rep=rep)
                        R = (n + 127) // 128
                        ours = ours_rows[0]["ms"] if ours_rows else float("nan")
                        flex_ms = ms
                        rows.append({"n": n, "impl": "flex", "pattern": pat, "density": dens,
                                     "ms": ms, "logical": den["logical"],
                                     "physical": tiles / (R * (R + 1) / 2),
                                     "tflops": 4 * D * HQ * tiles * 128 * 128 / ms / 1e9,
                                     "vs_cudnn": dense.get("cudnn", float("nan")) / ms,
                                     "ours_speedup_vs_flex": ms / ours,
                                     "max_abs_diff_vs_ours": diff})
                        _print(rows[-1])
                        del qf, kf, vf, bmask
                    except Exception as e:
                        print(f"flex {pat} n={n} failed: {type(e).__name__}: {str(e)[:300]}")
                if tune and ours_rows:
                    _tune_table(ours_rows, flex_ms, dense.get("cudnn", float("nan")))
                    _save(rows, out_dir, json_name)
                del plan
                torch.cuda.empty_cache()
        del q, k, v
        torch.cuda.empty_cache()
    _save(rows, out_dir, json_name)
    return rows


def _tune_table(ours_rows, flex_ms, cudnn_ms):
    """One pattern's tile configurations against the default, FlexAttention and cuDNN."""
    cur = ours_rows[0]
    print(f"\n  n={cur['n']} {cur['pattern']} d={cur['density']:.2f} (TFLOP/s over the counted "
          f"tiles; Flex {flex_ms:.3f} ms, cuDNN dense {cudnn_ms:.3f} ms)")
    print(f"  {'config':>48} {'ms':>9} {'TFLOP/s':>8} {'vs default':>10} {'vs Flex':>8} "
          f"{'vs cuDNN':>8} {'|diff|':>8}")
    for r in ours_rows:
        r["vs_default"] = cur["ms"] / r["ms"]
        r["vs_flex"] = flex_ms / r["ms"]
        print(f"  {r['variant']:>48} {r['ms']:9.3f} {r['tflops']:8.1f} {r['vs_default']:9.3f}x "
              f"{r['vs_flex']:7.3f}x {cudnn_ms / r['ms']:7.2f}x "
              f"{r['max_abs_diff_vs_default']:8.2g}", flush=True)
    print()


def _save(rows, out_dir, name):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)


def _print(r):
    extra = f" vs cuDNN {r.get('vs_cudnn', float('nan')):6.2f}x"
    if "ours_speedup_vs_flex" in r:
        extra += (f"  ours/flex {r['ours_speedup_vs_flex']:5.2f}x"
                  f" |flex-ours| {r['max_abs_diff_vs_ours']:.3g}")
    impl = r['impl'] + (f"[{r['variant']}]" if r.get('variant') else '')
    print(f"n={r['n']:>8} {impl:>8} {r['pattern']:>15} d={r.get('density', 1):.2f} "
          f"logical={r['logical']:.4f} physical={r['physical']:.4f} {r['ms']:9.3f} ms "
          f"{r['tflops']:6.1f} TFLOP/s{extra} {r.get('config', '')}", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072, 262144, 1048576])
    ap.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.10, 0.25])
    ap.add_argument("--patterns", nargs="+", default=["block", "a_shape", "grid", "vertical_slash"])
    ap.add_argument("--tune", action="store_true",
                    help="tile configurations around the default, side by side")
    ap.add_argument("--no-flex", action="store_true", help="skip FlexAttention")
    ap.add_argument("--no-flash", action="store_true", help="skip flash SDPA dense")
    ap.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = ap.parse_args()
    t0 = time.time()
    tag = "_".join(map(str, a.lengths))
    run(a.lengths, a.densities, a.patterns, a.out, a.tune, a.rep,
        "kernels_tune.json" if a.tune else f"kernels_{tag}.json",
        flex_on=not a.no_flex, flash_on=not (a.no_flash or a.tune))
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
